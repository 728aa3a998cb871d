"""Soft prompts: deep key/value prefixes (:mod:`.prefix`) and input-embedding prompts and templates (:mod:`.shallow`)."""

from st_prompts.prompts.prefix import PrefixCache, PrefixDraw, PrefixEncoder, draw_keep_mask, prefix_view_mask
from st_prompts.prompts.shallow import (
    PROMPTBERT_TEMPLATE,
    SCPCSE_TEMPLATE,
    TEMPLATE_MODES,
    ShallowPrompt,
    parse_template,
    place_vectors,
)

__all__ = [
    "PROMPTBERT_TEMPLATE",
    "SCPCSE_TEMPLATE",
    "TEMPLATE_MODES",
    "PrefixCache",
    "PrefixDraw",
    "PrefixEncoder",
    "ShallowPrompt",
    "draw_keep_mask",
    "parse_template",
    "place_vectors",
    "prefix_view_mask",
]
