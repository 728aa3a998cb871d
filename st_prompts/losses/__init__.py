"""Losses for prompt-based contrastive learning (they return dicts of named parts, which the trainer logs)."""

from st_prompts.losses.contrastive import PromptContrastiveLoss
from st_prompts.losses.contrastive import apply_prefix_views
from st_prompts.losses.mlm import MLMHead, TokenMasker, mlm_weight
from st_prompts.losses.nli import NLI_LABELS, AuxiliaryLoss, PrefixViewSoftmaxLoss

__all__ = ["NLI_LABELS", "AuxiliaryLoss", "MLMHead", "PrefixViewSoftmaxLoss", "PromptContrastiveLoss",
           "TokenMasker", "apply_prefix_views", "mlm_weight"]
