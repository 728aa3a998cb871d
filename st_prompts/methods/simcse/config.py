"""SimCSE's settings and presets (no torch import; the model and stages are in :mod:`.method`)."""

from __future__ import annotations

from dataclasses import dataclass

from st_prompts.methods.base import MLP_HEAD_MODES, MethodConfig, TrainSettings, option


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


CONFIG = MethodConfig(
    name="simcse", title="SimCSE", citation="Gao et al. 2021", settings_class=SimCSESettings, presets=presets,
    prompts_only=False,
    paper="SimCSE: Simple Contrastive Learning of Sentence Embeddings (Gao et al., 2021)",
    paper_url="https://arxiv.org/abs/2104.08821",
    description="full fine-tuning with InfoNCE: the baseline",
    summary="SimCSE full fine-tuning baseline (Gao et al. 2021)",
)
