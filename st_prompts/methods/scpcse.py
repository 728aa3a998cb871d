"""SCPCSE: DCPCSE's shallow-prompt ablation — trainable template embeddings on a frozen backbone, [MASK] pooling.

The template ``This sentence : "[X]" means [MASK] .`` (DCPCSE appendix A) is tokenised once; its tokens become
trainable input vectors initialised from their word embeddings; the sentence embedding is the last hidden state at
``[MASK]``. Paper setting: batch 256, lr 1e-3, 5 epochs.
"""

from __future__ import annotations

from dataclasses import dataclass

from st_prompts.methods._contrastive import assemble, contrastive_stage, seed_everything
from st_prompts.methods.base import MLP_HEAD_MODES, Method, TrainSettings, option

#: The SCPCSE template of the DCPCSE paper (appendix A); equal to ``st_prompts.prompts.shallow.SCPCSE_TEMPLATE``
#: (repeated here so that listing the methods does not import torch; a test checks they agree).
SCPCSE_TEMPLATE = 'This sentence : "[X]" means [MASK] .'


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


def build_model(settings: SCPCSESettings):
    """Frozen backbone with soft template tokens, [MASK] pooling."""
    from st_prompts.modules import PromptedTransformer
    from st_prompts.utils import resolve_model_name

    seed_everything(settings.seed)
    encoder = PromptedTransformer(resolve_model_name(settings.backbone), prefix_length=None, template=settings.template,
                                  max_seq_length=settings.max_seq_length)
    return assemble(settings, encoder, pooling_mode="mask")


METHOD = Method(
    name="scpcse",
    summary="shallow (template) soft prompts on a frozen backbone, DCPCSE's ablation",
    settings_class=SCPCSESettings,
    presets=presets,
    build_model=build_model,
    stages=lambda settings: [contrastive_stage(settings)],
)
