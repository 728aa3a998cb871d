"""Backwards-compatible access to the methods' presets; the presets now live in each method file.

``preset(method, supervised, scale, backbone, **overrides)`` is :func:`st_prompts.methods.settings`. The paper values
are in ``st_prompts/methods/<method>.py`` (DCPCSE appendix tables 3 and 4, SCPCSE, SimCSE); the CPU setting trains the
packaged all-MiniLM-L6-v2 with batch 64, one epoch and STS-B dev every 50 steps.
"""

from __future__ import annotations

from st_prompts.methods import SCALES, TrainSettings
from st_prompts.methods import settings as _settings

__all__ = ["SCALES", "preset"]


def preset(method: str, supervised: bool = False, scale: str = "paper", backbone: str | None = None,
           **overrides) -> TrainSettings:
    """The settings of ``method`` at ``scale`` (``paper`` or ``cpu``); ``overrides`` replace fields (``None`` is
    ignored)."""
    return _settings(method, supervised=supervised, scale=scale, backbone=backbone, **overrides)
