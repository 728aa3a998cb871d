"""SimCSE (Gao et al., 2021): full fine-tuning with InfoNCE — the baseline every prompt method is compared with.

Paper settings (BERT-base): unsupervised batch 64, lr 3e-5, 1 epoch, MLP in training only; supervised batch 512,
lr 5e-5, 3 epochs, MLP kept at inference.
"""

from __future__ import annotations

from dataclasses import dataclass

from st_prompts.methods._contrastive import assemble, contrastive_stage, seed_everything
from st_prompts.methods.base import MLP_HEAD_MODES, Method, TrainSettings, option


@dataclass
class SimCSESettings(TrainSettings):
    """SimCSE's options."""

    mlp_head: str = option("train_only", "MLP over [CLS]: train_only, saved (kept at inference) or none", MLP_HEAD_MODES)
    head_learning_rate: float | None = option(None, "learning rate of the MLP head (default: --learning-rate)")


def presets(scale: str, supervised: bool, backbone: str | None) -> dict:
    if scale == "cpu":
        return dict(backbone="minilm", batch_size=64, learning_rate=5e-5 if supervised else 3e-5, epochs=1.0,
                    eval_steps=50, mlp_head="train_only")
    return dict(backbone=backbone or "bert-base-uncased", batch_size=512 if supervised else 64,
                learning_rate=5e-5 if supervised else 3e-5, epochs=3.0 if supervised else 1.0, eval_steps=125,
                mlp_head="saved" if supervised else "train_only")


def build_model(settings: SimCSESettings):
    """The plain (trainable) backbone with [CLS] pooling (+ the saved MLP head for ``mlp_head="saved"``)."""
    from sentence_transformers.sentence_transformer.modules import Transformer

    from st_prompts.utils import resolve_model_name

    seed_everything(settings.seed)
    encoder = Transformer(resolve_model_name(settings.backbone), max_seq_length=settings.max_seq_length)
    return assemble(settings, encoder, pooling_mode="cls")


METHOD = Method(
    name="simcse",
    summary="SimCSE full fine-tuning baseline (Gao et al. 2021)",
    settings_class=SimCSESettings,
    presets=presets,
    build_model=build_model,
    stages=lambda settings: [contrastive_stage(settings)],
    prompts_only=False,
)
