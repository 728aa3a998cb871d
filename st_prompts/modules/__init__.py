"""sentence-transformers modules provided by st_prompts."""

from st_prompts.modules.pooling import MaskTokenPooling
from st_prompts.modules.prompted_transformer import (
    CLS_OVERRIDE,
    POSITION_IDS,
    PREFIX_ATTENTION_MASK,
    PROMPTS_FILE,
    SUPPORTED_MODEL_TYPES,
    PromptedTransformer,
    backbone_fingerprint,
    save_prompts_only,
)
from st_prompts.prompts.prefix import prefix_view_mask

__all__ = [
    "CLS_OVERRIDE",
    "POSITION_IDS",
    "PREFIX_ATTENTION_MASK",
    "PROMPTS_FILE",
    "SUPPORTED_MODEL_TYPES",
    "MaskTokenPooling",
    "PromptedTransformer",
    "backbone_fingerprint",
    "prefix_view_mask",
    "save_prompts_only",
]
