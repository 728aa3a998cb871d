"""``type=`` helpers for numeric command-line options: argparse refuses a value that is not a number, not finite
(``nan``, ``1e999``), not whole where needed (``2.5``) or out of range with one line, before any model loads. Standard
library only, so that ``--help`` stays fast."""

from __future__ import annotations

import argparse
import math
from typing import Callable

#: The largest seed numpy, torch and Python's ``random`` all accept (``numpy.random.seed`` takes ``0 .. 2**32 - 1``).
MAX_SEED = 2**32 - 1
#: A generous upper bound for counts (sizes, steps, limits): far above any real run, small enough for every library.
MAX_COUNT = 2**31 - 1
_MAX_DIGITS = 40  # an integer option longer than this is refused before int() converts it (no huge-int parsing)


def _show(text: str) -> str:
    """The user's text for an error message, cut short (the parser makes it printable)."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _parse_int(text: str) -> int:
    stripped = text.strip().replace("_", "")
    if len(stripped) > _MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"not a whole number in range: {_show(text)}")
    try:
        return int(stripped)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {_show(text)}") from None


def parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {_show(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {_show(text)}")
    return value


def int_range(minimum: int, maximum: int = MAX_COUNT) -> Callable[[str], int]:
    """A whole number in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        value = _parse_int(text)
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be a whole number from {minimum} to {maximum}, got {_show(text)}")
        return value

    return parse


def positive_int(maximum: int = MAX_COUNT) -> Callable[[str], int]:
    """A whole number in ``[1, maximum]`` (sizes, counts, lengths)."""
    return int_range(1, maximum)


def non_negative_int(maximum: int = MAX_COUNT) -> Callable[[str], int]:
    """A whole number in ``[0, maximum]``."""
    return int_range(0, maximum)


def finite_float(minimum: float | None = None, maximum: float | None = None, *, min_inclusive: bool = True,
                 max_inclusive: bool = True) -> Callable[[str], float]:
    """A finite number, optionally bounded (``min_inclusive=False``: strictly above ``minimum``)."""

    def parse(text: str) -> float:
        value = parse_float(text)
        low_ok = minimum is None or (value >= minimum if min_inclusive else value > minimum)
        high_ok = maximum is None or (value <= maximum if max_inclusive else value < maximum)
        if not (low_ok and high_ok):
            low = "" if minimum is None else f"{'at least' if min_inclusive else 'above'} {minimum:g}"
            high = "" if maximum is None else f"{'at most' if max_inclusive else 'below'} {maximum:g}"
            raise argparse.ArgumentTypeError(f"must be {' and '.join(p for p in (low, high) if p)}, got {_show(text)}")
        return value

    return parse


def positive_float(maximum: float | None = None) -> Callable[[str], float]:
    """A finite number above 0 (learning rates, temperatures, epochs)."""
    return finite_float(0.0, maximum, min_inclusive=False)


#: A finite number in ``[0, 1]`` (ratios, probabilities, dropout).
fraction = finite_float(0.0, 1.0)

#: A seed for numpy, torch and ``random``: a whole number in ``[0, 2**32 - 1]``.
seed = int_range(0, MAX_SEED)
