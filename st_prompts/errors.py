"""Exceptions raised by st_prompts for user errors (bad input, missing files, mismatched checkpoints).

All of them derive from :class:`StPromptsError`, which the CLI prints as a one-line message instead of a traceback.
They also derive from the built-in exception a Python user would expect (``ValueError`` or ``FileNotFoundError``).
:func:`printable` makes text from users and files safe to show in a message or a log line.
"""

from __future__ import annotations

import re

# C0 and C1 control characters (ESC starts every ANSI escape sequence), DEL, and the bidirectional marks, embeddings,
# overrides and isolates that make a terminal show text in another order than it is.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object, *, one_line: bool = True) -> str:
    """``str(text)`` safe to print on a terminal or into a log: every control character (ANSI escape sequences
    included) and bidirectional override is shown as its escape (``\\x1b``, ``\\u202e``) instead of acting on the
    terminal. ``one_line``: line breaks and tabs are escaped too (an error message stays on one line); otherwise they
    are kept (a multi-line log record, a traceback)."""
    text = str(text)

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        if not one_line and char in "\n\t":
            return char
        return char.encode("unicode_escape").decode("ascii")

    return _CONTROL.sub(escape, text)


def shorten(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a one-line message, printable and cut to about ``limit`` characters: a long string or
    bytes value shows its start and its length, a long list or dict its kind and size, an integer too long to print
    its kind."""
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
    """The first line of ``exc``'s message (its type's name when it has none), printable, cut at ``limit``
    characters: what a one-line error says of the exception behind it."""
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
    """Weights or a model do not match what a saved artefact was made with: a prompts-only checkpoint put on a
    backbone whose weights differ from the one its prompts were trained on, or a search index queried with a model
    (or dimension) other than the one that encoded its corpus."""


class DataFormatError(StPromptsError, ValueError):
    """A data file or directory is missing pieces or has the wrong format (e.g. a SentEval directory)."""


class DataNotFoundError(StPromptsError, FileNotFoundError):
    """A file or directory the user pointed to does not exist."""


class UntrustedCodeError(StPromptsError, ValueError):
    """A model needs code from outside sentence-transformers and st_prompts (a foreign class in its ``modules.json``,
    or custom modelling code in a ``config.json``), it was loaded without ``trust_remote_code``, and
    sentence-transformers or transformers refused to import that code. Pass ``--trust-remote-code`` (or
    ``trust_remote_code=True``) only for a model whose code you trust."""


class SKICacheMismatchError(StPromptsError, ValueError):
    """A SKI cache file was generated with another model, prompt template or generation settings than the run that
    would extend (or read) it: its rows must not be mixed with new ones."""


class VocabularyMismatchError(StPromptsError, ValueError):
    """A model that must share the encoder's vocabulary does not: e.g. a replaced-token generator whose tokenizer maps
    tokens to other ids than the encoder's (replaced-token detection compares token ids position by position)."""


class TrainingDivergedError(StPromptsError, ValueError):
    """Training ended with weights or a model-selection score that are not finite numbers (NaN or infinite): the
    model is not saved. A smaller learning rate usually helps."""


class CorruptionCacheError(StPromptsError, ValueError):
    """A replaced-token corruption cache does not fit the run: it was made with another generator, masking ratio or
    tokenizer, or a training sentence has no corrupted copy in it (the pre-pass was not run over the training data)."""


class ReplicasDisagreeError(StPromptsError, RuntimeError):
    """Serving replicas that should serve the same sets do not (after ``st-prompts replicas add-set`` reached some of
    them only, or replicas started on different bank folders): a client's vectors would depend on the replica."""
