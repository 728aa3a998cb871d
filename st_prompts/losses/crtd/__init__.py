"""D2CSE's conditional replaced-token detection (CRTD): the loss (:mod:`.loss`) and its machinery, the replaced-token
corruption of the training sentences (:mod:`.corruption`) and the masked-LM generators that fill the masks
(:mod:`.generators`). They live with the loss, not with the D2CSE method, because the loss is public: it plugs into
any prompted model, and it needs them."""

from st_prompts.losses.crtd.loss import CONDITIONS, BatchNormMLPPooler, CRTDLoss, training_texts

__all__ = ["CONDITIONS", "BatchNormMLPPooler", "CRTDLoss", "training_texts"]
