"""Soft prompts: deep key/value prefixes (:mod:`.prefix`), input-embedding prompts and templates (:mod:`.shallow`),
template constants (:mod:`.templates`, no torch).

The names are imported on first use, so that ``st_prompts.prompts.templates`` stays light.
"""

from __future__ import annotations

from st_prompts.utils import lazy_exports

_LAZY = {
    "PrefixDraw": ".prefix",
    "PrefixEncoder": ".prefix",
    "draw_keep_mask": ".prefix",
    "prefix_view_mask": ".prefix",
    "ShallowPrompt": ".shallow",
    "parse_template": ".shallow",
    "place_vectors": ".shallow",
    "PROMPTBERT_TEMPLATE": ".templates",
    "SCPCSE_TEMPLATE": ".templates",
    "TEMPLATE_MODES": ".templates",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
