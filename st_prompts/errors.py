"""Exceptions raised by st_prompts for user errors: all derive from :class:`StPromptsError` (one line in the CLI) and
from the built-in exception a Python user would expect. :func:`printable` makes text safe to show."""

from __future__ import annotations

import os
import re

# C0 and C1 control characters (ESC starts every ANSI escape sequence), DEL, and the bidirectional marks, embeddings,
# overrides and isolates that make a terminal show text in another order than it is.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object, *, one_line: bool = True) -> str:
    """``str(text)`` safe to print on a terminal or into a log: control characters and bidirectional overrides are
    shown as escapes (``\\x1b``). ``one_line``: line breaks and tabs are escaped too; otherwise they are kept."""
    text = str(text)

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        if not one_line and char in "\n\t":
            return char
        return char.encode("unicode_escape").decode("ascii")

    return _CONTROL.sub(escape, text)


def shorten(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a one-line message, printable and cut to about ``limit`` characters (long containers: their
    kind and size)."""
    if isinstance(value, str) and len(value) > limit:
        return printable(f"{value[:limit]!r}... ({len(value):,} characters)")
    if isinstance(value, (bytes, bytearray)) and len(value) > limit:
        return printable(f"{bytes(value[:limit])!r}... ({len(value):,} bytes)")
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 20:
        return f"{type(value).__name__} of {len(value):,} items"
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return f"<a {type(value).__name__} too long to show>"
    return printable(text if len(text) <= limit else text[:limit] + "...")


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (else its type's name), printable, cut at ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = printable(lines[0]) if lines else type(exc).__name__
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


class StPromptsError(Exception):
    """Base class of every error st_prompts raises on purpose."""


class ConfigurationError(StPromptsError, ValueError):
    """An invalid option or an unsupported combination of options (e.g. ``prefix_length=0``)."""


class UnsupportedArchitectureError(StPromptsError, ValueError):
    """The backbone cannot carry deep prompts (it does not accept, or silently ignores, a key/value cache)."""


class BackboneMismatchError(StPromptsError, ValueError):
    """Weights or a model do not match what a saved artefact was made with (a prompts-only checkpoint's backbone, a
    search index's encoder)."""


class DataFormatError(StPromptsError, ValueError):
    """A data file or directory is missing pieces or has the wrong format (e.g. a SentEval directory)."""


class DataNotFoundError(StPromptsError, FileNotFoundError):
    """A file or directory the user pointed to does not exist."""


class UntrustedCodeError(StPromptsError, ValueError):
    """A model needs code from outside sentence-transformers and st_prompts and was loaded without
    ``trust_remote_code``: pass it only for a model whose code you trust."""


class SKICacheMismatchError(StPromptsError, ValueError):
    """A SKI cache file was generated with other settings than the run that would extend (or read) it."""


class VocabularyMismatchError(StPromptsError, ValueError):
    """A model that must share the encoder's vocabulary (e.g. a replaced-token generator) does not."""


class TrainingDivergedError(StPromptsError, ValueError):
    """Training ended with weights or a selection score that are not finite: the model is not saved."""


class CorruptionCacheError(StPromptsError, ValueError):
    """A replaced-token corruption cache does not fit the run (another identity, or a sentence missing from it)."""


class ReplicasDisagreeError(StPromptsError, RuntimeError):
    """Serving replicas that should serve the same sets do not: a client's vectors would depend on the replica."""


#: Set (not to empty, ``0``, ``false``, ``no`` or ``off``) to print tracebacks besides the one-line errors.
TRACEBACK_VARIABLE = "ST_PROMPTS_TRACEBACK"


def tracebacks_asked() -> bool:
    """Whether :data:`TRACEBACK_VARIABLE` asks for tracebacks (the commands' and the server's)."""
    return os.environ.get(TRACEBACK_VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")
