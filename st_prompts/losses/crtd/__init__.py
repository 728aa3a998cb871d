"""D2CSE's conditional replaced-token detection (CRTD): the public loss and its machinery (corruption, generators)."""

from st_prompts.losses.crtd.loss import CONDITIONS, BatchNormMLPPooler, CRTDLoss, training_texts

__all__ = ["CONDITIONS", "BatchNormMLPPooler", "CRTDLoss", "training_texts"]
