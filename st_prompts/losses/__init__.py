"""Losses for prompt-based contrastive learning (they return dicts of named parts, which the trainer logs); names are
imported on first use (``st_prompts.losses.constants`` holds the torch-free option names)."""

from __future__ import annotations

from st_prompts.utils import lazy_exports

_LAZY = {
    "PromptContrastiveLoss": ".infonce", "simcse_mlp": ".infonce",
    "apply_prefix_views": ".views",
    "BatchNormMLPPooler": ".crtd", "CRTDLoss": ".crtd",
    "MLMHead": ".mlm", "TokenMasker": ".mlm", "mlm_weight": ".mlm",
    "InfoNCETerm": ".multi_positive", "MultiPositiveInfoNCELoss": ".multi_positive",
    "skicse_supervised_terms": ".multi_positive", "skicse_unsupervised_terms": ".multi_positive",
    "ColumnSplitLoss": ".nli", "NLITripletSoftmaxLoss": ".nli", "PrefixViewSoftmaxLoss": ".nli",
    "LossStepCallback": ".steps",
    "NLI_LABELS": ".constants", "SUPERVISED_READINGS": ".constants",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
