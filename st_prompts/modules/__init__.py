"""sentence-transformers modules provided by st_prompts: the prompted encoder, [MASK] pooling, prompts-only
checkpoints, and the ``features`` keys that steer a prompted call."""

from st_prompts.modules.backbones import SUPPORTED_MODEL_TYPES
from st_prompts.modules.checkpoint import (PROMPTS_FILE, backbone_fingerprint, portable_backbone_reference,
                                           save_prompts_only)
from st_prompts.modules.checks import MIN_TEXT_TOKENS
from st_prompts.modules.pooling import MaskTokenPooling
from st_prompts.modules.prompted_transformer import PromptedTransformer
from st_prompts.prompts.features import (CLS_OVERRIDE, POSITION_IDS, PREFIX_ATTENTION_MASK, PREFIX_VALUES,
                                         SOFT_PROMPT_POSITIONS, TEMPLATE_DENOISING, TEMPLATE_MASK_INDEX,
                                         TEMPLATE_TOKEN_EMBEDDINGS)
from st_prompts.prompts.prefix import prefix_view_mask

__all__ = [
    "CLS_OVERRIDE", "MIN_TEXT_TOKENS", "POSITION_IDS", "PREFIX_ATTENTION_MASK", "PREFIX_VALUES", "PROMPTS_FILE",
    "SOFT_PROMPT_POSITIONS", "SUPPORTED_MODEL_TYPES", "TEMPLATE_DENOISING", "TEMPLATE_MASK_INDEX",
    "TEMPLATE_TOKEN_EMBEDDINGS", "MaskTokenPooling", "PromptedTransformer", "backbone_fingerprint",
    "portable_backbone_reference", "prefix_view_mask", "save_prompts_only",
]
