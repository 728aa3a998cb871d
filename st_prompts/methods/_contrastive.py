"""Building blocks shared by the contrastive methods (DCPCSE, SCPCSE, SimCSE): model assembly, the SimCSE stage.

Imports of torch / sentence-transformers happen inside the functions, so that the registry stays light.
"""

from __future__ import annotations

from typing import Any

from st_prompts.methods.base import Stage, TrainSettings


def mlp_head_module(dimension: int, initializer_range: float = 0.02):
    """SimCSE's MLP over [CLS] (``Linear(H, H) + Tanh``) as a sentence-transformers ``Dense`` module.

    Used for ``mlp_head="saved"``: a real module of the saved model, applied at training and inference, as in the
    official supervised SimCSE/DCPCSE runs (``--pooler_type cls`` without ``--mlp_only_train``). Initialised like
    transformers initialises new weights (normal with the backbone's ``initializer_range``, zero bias), as the
    official ``MLPLayer`` is.
    """
    import torch
    from sentence_transformers.sentence_transformer.modules import Dense

    weight = torch.empty(dimension, dimension).normal_(0.0, initializer_range)
    return Dense(dimension, dimension, activation_function=torch.nn.Tanh(), init_weight=weight,
                 init_bias=torch.zeros(dimension))


def assemble(settings: TrainSettings, encoder, pooling_mode: str = "cls"):
    """``SentenceTransformer([encoder, pooling(, Dense+Tanh)])`` for ``settings.mlp_head``.

    ``pooling_mode``: ``"cls"`` (sentence-transformers' ``Pooling``) or ``"mask"`` (:class:`MaskTokenPooling`).
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from st_prompts.modules import MaskTokenPooling

    dimension = encoder.get_embedding_dimension()
    pooling = MaskTokenPooling(dimension) if pooling_mode == "mask" else Pooling(dimension, pooling_mode=pooling_mode)
    modules = [encoder, pooling]
    if getattr(settings, "mlp_head", "none") == "saved":
        config = encoder.auto_model.config
        modules.append(mlp_head_module(dimension, getattr(config, "initializer_range", 0.02)))
    return SentenceTransformer(modules=modules)


def seed_everything(seed: int) -> None:
    """Seed torch before building a model, so the prompts' (and heads') random initialisation is reproducible."""
    import torch

    torch.manual_seed(seed)


def contrastive_columns(settings: TrainSettings) -> tuple[str, ...]:
    """SimCSE's columns: (anchor, positive) unsupervised, (anchor, positive, negative) supervised."""
    return ("anchor", "positive", "negative") if settings.supervised else ("anchor", "positive")


def contrastive_data(settings: TrainSettings, data_dir, limit: int | None):
    """SimCSE-format training data (Wikipedia sentences or NLI triplets) from ``data_dir`` or the hub."""
    from st_prompts.data.training_data import load_training_dataset

    return load_training_dataset(settings.supervised, data_dir, limit=limit, seed=settings.seed)


def contrastive_loss(model, settings: TrainSettings):
    """:class:`PromptContrastiveLoss` from the settings (τ, train-only MLP, auxiliary MLM)."""
    from st_prompts.losses import PromptContrastiveLoss

    return PromptContrastiveLoss(
        model,
        scale=1.0 / settings.temperature,
        mlp=getattr(settings, "mlp_head", "none") == "train_only",
        mlm_weight=getattr(settings, "mlm_weight", 0.0),
        mlm_decay=getattr(settings, "mlm_decay", 0.95),
        mlm_decay_steps=getattr(settings, "mlm_decay_steps", 100),
    )


def step_callbacks(loss, settings: TrainSettings) -> list:
    """Tell the loss the trainer's optimisation step (for DCPCSE's MLM weight decay)."""
    from st_prompts.training.callbacks import LossStepCallback

    return [LossStepCallback(loss)]


def head_learning_rates(model, settings: TrainSettings) -> dict[str, float]:
    """A separate learning rate for the MLP head (saved ``Dense`` or train-only MLP) when ``head_learning_rate`` is set.

    Keys are regular expressions over the loss's parameter names (sentence-transformers' ``learning_rate_mapping``).
    """
    rate = getattr(settings, "head_learning_rate", None)
    if rate is None or getattr(settings, "mlp_head", "none") == "none":
        return {}
    if settings.mlp_head == "saved":
        index = len(model) - 1  # the Dense module is the model's last module
        return {rf"^model\.{index}\.": rate}
    return {r"^mlp\.": rate}


def contrastive_stage(settings: TrainSettings, name: str = "train", **changes: Any) -> Stage:
    """The single SimCSE-style stage (InfoNCE + optional MLP/MLM) most methods train with."""
    values: dict[str, Any] = dict(
        name=name,
        build_loss=contrastive_loss,
        columns=contrastive_columns,
        load_data=contrastive_data,
        callbacks=step_callbacks,
        learning_rates=head_learning_rates,
    )
    values.update(changes)
    return Stage(**values)
