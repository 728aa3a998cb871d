"""st_prompts: prompt-based, parameter-efficient contrastive sentence embeddings for sentence-transformers.

Main entry points: :class:`PromptedTransformer` (deep and/or shallow soft prompts on a frozen backbone),
:func:`save_prompts_only`, :func:`encode_rows`, :mod:`st_prompts.methods`, :mod:`st_prompts.losses`. Names are
imported on first use, so ``import st_prompts`` does not load torch.
"""

from __future__ import annotations

from st_prompts.utils import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "MaskTokenPooling": "st_prompts.modules", "PromptedTransformer": "st_prompts.modules",
    "save_prompts_only": "st_prompts.modules", "encode_rows": "st_prompts.modules.rows",
    "load_sentence_model": "st_prompts.loading", "prefix_view_mask": "st_prompts.prompts.prefix",
    "SCPCSE_TEMPLATE": "st_prompts.prompts.templates", "PROMPTBERT_TEMPLATE": "st_prompts.prompts.templates",
}

__all__ = [*sorted(_LAZY), "__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
