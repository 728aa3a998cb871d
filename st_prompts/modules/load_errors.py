"""One line for a backbone that cannot be loaded (damaged weights, a malformed config, a missing file): whatever the
loaders raise becomes one :class:`~st_prompts.errors.DataFormatError`; st_prompts' own refusals pass unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from st_prompts.errors import DataFormatError, StPromptsError, printable

_CAUSE_CHARS = 300


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (printable, cut to a few hundred characters)."""
    lines = str(exc).strip().splitlines()
    first = printable(lines[0] if lines else "")
    if len(first) > _CAUSE_CHARS:
        first = first[:_CAUSE_CHARS] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextmanager
def backbone_errors(backbone: object, what: str = "the backbone") -> Iterator[None]:
    """Within this context, an unexpected exception while loading ``backbone`` becomes one
    :class:`~st_prompts.errors.DataFormatError` (``cannot load the backbone 'X': ... (Type: message)``)."""
    try:
        yield
    except StPromptsError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the loaders on a damaged folder
        raise DataFormatError(f"cannot load {what} {str(backbone)!r}: it is damaged, incomplete or not a model "
                              f"({describe(exc)}).") from exc
