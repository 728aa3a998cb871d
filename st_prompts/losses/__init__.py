"""Losses for prompt-based contrastive learning (they return dicts of named parts, which the trainer logs)."""

from st_prompts.losses.contrastive import PromptContrastiveLoss
from st_prompts.losses.contrastive import apply_prefix_views
from st_prompts.losses.crtd import BatchNormMLPPooler, CRTDLoss
from st_prompts.losses.mlm import MLMHead, TokenMasker, mlm_weight
from st_prompts.losses.multi_positive import (
    SUPERVISED_READINGS,
    InfoNCETerm,
    MultiPositiveInfoNCELoss,
    skicse_supervised_terms,
    skicse_unsupervised_terms,
)
from st_prompts.losses.nli import NLI_LABELS, AuxiliaryLoss, NLITripletSoftmaxLoss, PrefixViewSoftmaxLoss

__all__ = ["NLI_LABELS", "SUPERVISED_READINGS", "AuxiliaryLoss", "BatchNormMLPPooler", "CRTDLoss", "InfoNCETerm",
           "MLMHead", "MultiPositiveInfoNCELoss", "NLITripletSoftmaxLoss", "PrefixViewSoftmaxLoss",
           "PromptContrastiveLoss", "TokenMasker", "apply_prefix_views", "mlm_weight", "skicse_supervised_terms",
           "skicse_unsupervised_terms"]
