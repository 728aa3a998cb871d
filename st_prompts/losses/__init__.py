"""Losses for prompt-based contrastive learning (they return dicts of named parts, which the trainer logs).

The public loss family, as sentence-transformers users look for it: ``from st_prompts.losses import CRTDLoss``.
Names are imported on first use (``st_prompts.losses.constants`` holds the torch-free option names).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "PromptContrastiveLoss": "infonce",
    "simcse_mlp": "infonce",
    "apply_prefix_views": "views",
    "BatchNormMLPPooler": "crtd",
    "CRTDLoss": "crtd",
    "MLMHead": "mlm",
    "TokenMasker": "mlm",
    "mlm_weight": "mlm",
    "InfoNCETerm": "multi_positive",
    "MultiPositiveInfoNCELoss": "multi_positive",
    "skicse_supervised_terms": "multi_positive",
    "skicse_unsupervised_terms": "multi_positive",
    "ColumnSplitLoss": "nli",
    "NLITripletSoftmaxLoss": "nli",
    "PrefixViewSoftmaxLoss": "nli",
    "LossStepCallback": "steps",
    "NLI_LABELS": "constants",
    "SUPERVISED_READINGS": "constants",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
