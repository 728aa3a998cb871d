"""Losses for prompt-based contrastive learning (they return dicts of named parts, which the trainer logs)."""

from st_prompts.losses.contrastive import PromptContrastiveLoss
from st_prompts.losses.crtd import BatchNormMLPPooler, CRTDLoss
from st_prompts.losses.mlm import MLMHead, TokenMasker, mlm_weight

__all__ = ["BatchNormMLPPooler", "CRTDLoss", "MLMHead", "PromptContrastiveLoss", "TokenMasker", "mlm_weight"]
