"""The one grammar of a prompt set's name, checked wherever a name enters (no torch).

Names end up on command lines, in configs, logs, ``/metrics`` labels and file names, so they are plain ASCII (see
:data:`SET_NAME_RULE`); :data:`BACKBONE_TASK` is reserved for the plain backbone.
"""

from __future__ import annotations

import re
from typing import Any

from st_prompts.errors import ConfigurationError, shorten

__all__ = ["BACKBONE_TASK", "MAX_SET_NAME_LENGTH", "SET_NAME_RULE", "check_set_name", "internal_name",
           "is_internal_name", "set_name_problem"]

#: The task name that selects the plain backbone (no prefix), in a call or for one row; no set may take it.
BACKBONE_TASK = "backbone"
#: The longest name a prompt set may have.
MAX_SET_NAME_LENGTH = 64
#: The grammar, in words (every refusal says it).
SET_NAME_RULE = (f"1-{MAX_SET_NAME_LENGTH} ASCII letters, digits, '_' or '-', starting with a letter or digit, "
                 f"not {BACKBONE_TASK!r}")
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_SET_NAME_LENGTH - 1}}}")


def set_name_problem(name: Any) -> str | None:
    """``None`` if ``name`` is a valid prompt-set name, else why not (one line, the name shown safely)."""
    if isinstance(name, str) and _NAME.fullmatch(name) and name != BACKBONE_TASK:
        return None
    return f"a prompt set's name is {SET_NAME_RULE}; got {shorten(name, 40) if isinstance(name, str) else type(name).__name__}"


def internal_name(name: str, generation: int) -> str:
    """``name@generation``: a server's internal name for a set added again while the old one still answers requests
    in flight; outside the grammar, so only code that asks for it (``internal=True``) adds one."""
    return f"{check_set_name(name)}@{int(generation)}"


def is_internal_name(name: Any) -> bool:
    """Whether ``name`` is an :func:`internal_name`."""
    if not isinstance(name, str) or name.count("@") != 1:
        return False
    base, generation = name.split("@")
    return set_name_problem(base) is None and generation.isascii() and generation.isdigit()


def check_set_name(name: Any, where: str = "") -> str:
    """``name`` if it is a valid prompt-set name (:func:`set_name_problem`), else a one-line
    :class:`~st_prompts.errors.ConfigurationError` (prefixed with ``where``, e.g. the file it was read from)."""
    problem = set_name_problem(name)
    if problem is not None:
        raise ConfigurationError(f"{where}: {problem}." if where else problem[0].upper() + problem[1:] + ".")
    return name
