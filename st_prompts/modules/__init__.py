"""sentence-transformers modules provided by st_prompts."""

from st_prompts.modules.pooling import MaskTokenPooling
from st_prompts.modules.prompted_transformer import (
    CLS_OVERRIDE,
    MIN_TEXT_TOKENS,
    POSITION_IDS,
    PREFIX_ATTENTION_MASK,
    PREFIX_VALUES,
    PROMPTS_FILE,
    SUPPORTED_MODEL_TYPES,
    TEMPLATE_DENOISING,
    TEMPLATE_MASK_INDEX,
    TEMPLATE_TOKEN_EMBEDDINGS,
    PromptedTransformer,
    backbone_fingerprint,
    cache_argument,
    portable_backbone_reference,
    save_prompts_only,
)
from st_prompts.prompts.prefix import prefix_view_mask

__all__ = [
    "CLS_OVERRIDE",
    "MIN_TEXT_TOKENS",
    "POSITION_IDS",
    "PREFIX_ATTENTION_MASK",
    "PREFIX_VALUES",
    "PROMPTS_FILE",
    "SUPPORTED_MODEL_TYPES",
    "TEMPLATE_DENOISING",
    "TEMPLATE_MASK_INDEX",
    "TEMPLATE_TOKEN_EMBEDDINGS",
    "MaskTokenPooling",
    "PromptedTransformer",
    "backbone_fingerprint",
    "cache_argument",
    "portable_backbone_reference",
    "prefix_view_mask",
    "save_prompts_only",
]
