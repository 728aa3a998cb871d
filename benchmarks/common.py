"""What every benchmark script shares: where this workplace keeps its data (the library itself never looks there)."""

from __future__ import annotations

from pathlib import Path

#: The repository.
REPO = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path | None:
    """``../shared/data`` beside the repository, if present (pass ``--data-dir`` elsewhere)."""
    candidate = REPO.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None
