"""SCPCSE's settings and presets (no torch import; the model and stages are in :mod:`.method`)."""

from __future__ import annotations

from dataclasses import dataclass

from st_prompts.methods.base import MLP_HEAD_MODES, MethodConfig, TrainSettings, option
from st_prompts.prompts.templates import SCPCSE_TEMPLATE


@dataclass
class SCPCSESettings(TrainSettings):
    """SCPCSE's options."""

    template: str = option(SCPCSE_TEMPLATE, "template with one [X] (sentence) and one [MASK] (pooled position)")
    mlp_head: str = option("train_only", "SimCSE MLP over the embedding: train_only, saved or none", MLP_HEAD_MODES)
    head_learning_rate: float | None = option(None, "learning rate of the MLP head (default: --learning-rate)")


def presets(scale: str, supervised: bool, backbone: str | None) -> dict:
    if scale == "cpu":
        return dict(backbone="minilm", batch_size=64, learning_rate=1e-3, epochs=1.0, eval_steps=50)
    return dict(backbone=backbone or "bert-base-uncased", batch_size=256, learning_rate=1e-3, epochs=5.0,
                eval_steps=125, mlp_head="saved" if supervised else "train_only")


CONFIG = MethodConfig(
    name="scpcse", title="SCPCSE", citation="Jiang & Wang 2022", settings_class=SCPCSESettings, presets=presets,
    paper=("Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings (Jiang & Wang, 2022), its "
           "shallow-prompt ablation"),
    paper_url="https://arxiv.org/abs/2203.06875",
    description="DCPCSE's shallow-prompt ablation: trainable template embeddings, [MASK] pooling",
    summary="shallow (template) soft prompts on a frozen backbone, DCPCSE's ablation",
)
