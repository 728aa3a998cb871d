"""Warnings that point at the caller's code, not at the line of st_prompts.search that raised them."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str) -> None:
    """``warnings.warn(message, UserWarning)`` attributed to the first frame outside :mod:`st_prompts.search`."""
    frame = sys._getframe(1)  # our caller, at stacklevel 2
    level = 2
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame = frame.f_back
        level += 1
    warnings.warn(message, UserWarning, stacklevel=level)
