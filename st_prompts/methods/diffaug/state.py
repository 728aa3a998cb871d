"""What the two stages of one DiffAug run share: the NLI loss (its classifier) and the training-only MLP."""

from __future__ import annotations

import weakref

from torch import nn

from st_prompts.losses import NLITripletSoftmaxLoss, simcse_mlp
from st_prompts.methods.diffaug.config import DiffAugSettings

#: model -> {"nli_loss": the NLI loss shared by stage 1 and the auxiliary loss, "mlp": the training-only MLP,
#: "stage1_done": bool, "stage1_steps": int}
_RUN_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_state(model) -> dict:
    """The state a DiffAug run keeps for ``model`` (kept as long as the model lives)."""
    return _RUN_STATE.setdefault(model, {})


def training_mlp(model, settings: DiffAugSettings) -> nn.Module | None:
    """The training-only MLP shared by every loss of the run (``None`` without ``mlp_train``)."""
    if not settings.mlp_train:
        return None
    state = run_state(model)
    if "mlp" not in state:  # a model built elsewhere than build_model
        state["mlp"] = simcse_mlp(model)
    return state["mlp"]


def nli_loss(model, settings: DiffAugSettings):
    """The NLI triplet loss (one per model: stage 2's auxiliary loss reuses stage 1's classifier and MLP)."""
    state = run_state(model)
    if "nli_loss" not in state:
        views = None if settings.same_prefix else (0, 1, 1)
        state["nli_loss"] = NLITripletSoftmaxLoss(model, prefix_views=views, num_views=2,
                                                  mlp=training_mlp(model, settings), template_denoising=False)
    return state["nli_loss"]
