"""The SimCSE-style training stage most methods train with (InfoNCE + optional MLP / MLM), and its parts."""

from __future__ import annotations

from typing import Any

from st_prompts.data.training_data import load_training_dataset
from st_prompts.losses import LossStepCallback, PromptContrastiveLoss
from st_prompts.methods.base import Stage, TrainSettings


def contrastive_columns(settings: TrainSettings) -> tuple[str, ...]:
    """SimCSE's columns: (anchor, positive) unsupervised, (anchor, positive, negative) supervised."""
    return ("anchor", "positive", "negative") if settings.supervised else ("anchor", "positive")


def contrastive_data(settings: TrainSettings, data_dir, limit: int | None):
    """SimCSE-format training data (Wikipedia sentences or NLI triplets) from ``data_dir`` or the hub."""
    return load_training_dataset(settings.supervised, data_dir, limit=limit, seed=settings.seed)


def contrastive_loss(model, settings: TrainSettings):
    """:class:`PromptContrastiveLoss` from the settings (τ, train-only MLP, auxiliary MLM)."""
    return PromptContrastiveLoss(model, scale=1.0 / settings.temperature,
                                 mlp=getattr(settings, "mlp_head", "none") == "train_only",
                                 mlm_weight=getattr(settings, "mlm_weight", 0.0),
                                 mlm_decay=getattr(settings, "mlm_decay", 0.95),
                                 mlm_decay_steps=getattr(settings, "mlm_decay_steps", 100))


def step_callbacks(loss, settings: TrainSettings) -> list:
    """Tell the loss the trainer's optimisation step (for DCPCSE's MLM weight decay)."""
    return [LossStepCallback(loss)]


def head_learning_rates(model, settings: TrainSettings) -> dict[str, float]:
    """A learning rate of its own for the MLP head (saved ``Dense`` or train-only MLP) when ``head_learning_rate`` is
    set; keys are regular expressions over the loss's parameter names (``learning_rate_mapping``)."""
    rate = getattr(settings, "head_learning_rate", None)
    if rate is None or getattr(settings, "mlp_head", "none") == "none":
        return {}
    if settings.mlp_head == "saved":
        index = len(model) - 1  # the Dense module is the model's last module
        return {rf"^model\.{index}\.": rate}
    return {r"^mlp\.": rate}


def contrastive_stage(settings: TrainSettings, name: str = "train", **changes: Any) -> Stage:
    """The single SimCSE-style stage (InfoNCE + optional MLP/MLM) most methods train with."""
    values: dict[str, Any] = dict(name=name, build_loss=contrastive_loss, columns=contrastive_columns,
                                  load_data=contrastive_data, callbacks=step_callbacks,
                                  learning_rates=head_learning_rates)
    return Stage(**{**values, **changes})
