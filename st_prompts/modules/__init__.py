"""sentence-transformers modules provided by st_prompts."""

from st_prompts.modules.pooling import MaskTokenPooling
from st_prompts.modules.prompted_transformer import (
    PROMPTS_FILE,
    SUPPORTED_MODEL_TYPES,
    PromptedTransformer,
    backbone_fingerprint,
    save_prompts_only,
)

__all__ = [
    "PROMPTS_FILE",
    "SUPPORTED_MODEL_TYPES",
    "MaskTokenPooling",
    "PromptedTransformer",
    "backbone_fingerprint",
    "save_prompts_only",
]
