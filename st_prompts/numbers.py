"""Numbers as users and JSON files give them, checked in one place: a bool is never a number here (``True == 1``)."""

from __future__ import annotations

import math
from typing import Any


def whole(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """Whether ``value`` is a Python ``int`` (not a bool) in ``[low, high]``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def real(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """Whether ``value`` is a finite ``int``/``float`` (not a bool) in ``[low, high]``."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)
