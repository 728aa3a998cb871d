"""What every benchmark script shares: where this workplace keeps its data (the library itself never looks there) and
which CPU a run had."""

from __future__ import annotations

import os
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


#: The libraries whose versions every run file records (a run made with other versions is another experiment).
RECORDED_LIBRARIES = ("torch", "transformers", "sentence-transformers", "peft", "datasets", "tokenizers")


def library_versions() -> dict[str, str | None]:
    """The installed versions of :data:`RECORDED_LIBRARIES` (``None`` for one that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for name in RECORDED_LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def run_environment() -> dict:
    """What a run file records about where it ran: library versions, the device (GPU name or CPU model), the CPU
    count and the load average (1, 5, 15 minutes) when the record is written."""
    import platform

    import torch

    from st_prompts.precision import cpu_summary

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"versions": library_versions(), "device": gpu or f"CPU: {cpu_model()}",
            "cpu_instructions": cpu_summary(),  # a goal tied to an instruction set is judged on a CPU that has it
            "cpus": os.cpu_count(), "platform": platform.platform(), "load_average": list(os.getloadavg())}
