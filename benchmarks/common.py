"""What every benchmark script shares: where this workplace keeps its data (the library itself never looks there) and
which CPU a run had."""

from __future__ import annotations

from pathlib import Path

#: The repository.
REPO = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path | None:
    """``../shared/data`` beside the repository, if present (pass ``--data-dir`` elsewhere)."""
    candidate = REPO.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or "unknown CPU": runs on two hosts of one VM image can differ in
    their last bits (other kernels for other instruction sets), which a chaotic training run can magnify."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"
