"""Numbers as users and JSON files give them, checked in one place: a bool is never a number here (``True == 1``)."""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any

from st_prompts.errors import ConfigurationError


def whole(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """Whether ``value`` is a Python ``int`` (not a bool) in ``[low, high]``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def real(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """Whether ``value`` is a finite ``int``/``float`` (not a bool) in ``[low, high]``."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def positive_int(value: Any, name: str, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is a positive integer (numpy's too, never a bool) of at most ``maximum``, else
    :class:`ConfigurationError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not 1 <= value <= (maximum or math.inf):
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}" if maximum is None else
                                 f"{name} must be a positive integer of at most {maximum}, got {str(value)[:40]}")
    return int(value)
