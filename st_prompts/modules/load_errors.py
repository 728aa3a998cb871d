"""One line for a backbone that cannot be loaded (damaged weights, a malformed config, a missing file): whatever the
loaders raise becomes one :class:`~st_prompts.errors.DataFormatError`; st_prompts' own refusals pass unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from st_prompts.errors import DataFormatError, StPromptsError, first_line

_CAUSE_CHARS = 300


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (printable, cut to a few hundred characters)."""
    first = first_line(exc, _CAUSE_CHARS)  # the type's name for an empty message
    return f"{type(exc).__name__}: {first}" if str(exc).strip() else first


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
