"""st_prompts: prompt-based, parameter-efficient contrastive sentence embeddings for sentence-transformers.

Main entry points:

* :class:`PromptedTransformer` — a sentence-transformers module with deep (prefix) and/or shallow (template) soft
  prompts on a frozen backbone;
* :class:`MaskTokenPooling` — pooling at a template's ``[MASK]`` slot;
* :func:`save_prompts_only` — a kilobyte-sized checkpoint holding only the prompts and a backbone reference;
* :mod:`st_prompts.methods` — the registered methods (``methods.build("dcpcse", backbone=...)``);
* :mod:`st_prompts.losses`, :mod:`st_prompts.training`, :mod:`st_prompts.evaluation` — losses, callbacks, evaluators.

The names above are imported on first use, so ``import st_prompts`` (and ``st-prompts --help``) does not load torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "MaskTokenPooling": "st_prompts.modules",
    "PromptedTransformer": "st_prompts.modules",
    "save_prompts_only": "st_prompts.modules",
    "SCPCSE_TEMPLATE": "st_prompts.prompts.shallow",
    "PROMPTBERT_TEMPLATE": "st_prompts.prompts.shallow",
    "prefix_view_mask": "st_prompts.prompts.prefix",
}

__all__ = ["MaskTokenPooling", "PROMPTBERT_TEMPLATE", "PromptedTransformer", "SCPCSE_TEMPLATE", "prefix_view_mask",
           "save_prompts_only", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'st_prompts' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
