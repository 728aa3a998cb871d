"""st_prompts: prompt-based, parameter-efficient contrastive sentence embeddings for sentence-transformers.

Main entry points:

* :class:`PromptedTransformer` — a sentence-transformers module with deep (prefix) and/or shallow (template) soft
  prompts on a frozen backbone;
* :class:`MaskTokenPooling` — pooling at a template's ``[MASK]`` slot;
* :func:`save_prompts_only` — a kilobyte-sized checkpoint holding only the prompts and a backbone reference;
* :func:`encode_rows` — sentence embeddings with a task (prompt set) per row, in shared forward passes;
* :mod:`st_prompts.methods` — the registered methods (``methods.build("dcpcse", backbone=...)``);
* :mod:`st_prompts.losses`, :mod:`st_prompts.training`, :mod:`st_prompts.evaluation` — losses, callbacks, evaluators.

The names above are imported on first use, so ``import st_prompts`` (and ``st-prompts --help``) does not load torch.
"""

from __future__ import annotations

from st_prompts.utils import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "MaskTokenPooling": "st_prompts.modules",
    "PromptedTransformer": "st_prompts.modules",
    "save_prompts_only": "st_prompts.modules",
    "encode_rows": "st_prompts.modules.rows",
    "load_sentence_model": "st_prompts.loading",
    "SCPCSE_TEMPLATE": "st_prompts.prompts.templates",
    "PROMPTBERT_TEMPLATE": "st_prompts.prompts.templates",
    "prefix_view_mask": "st_prompts.prompts.prefix",
}

__all__ = [*sorted(_LAZY), "__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
