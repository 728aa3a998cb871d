"""SimCSE's model and training stage (its settings and presets: :mod:`.config`)."""

from __future__ import annotations

from st_prompts.methods.base import Method
from st_prompts.methods.models import assemble, plain_transformer, seed_everything
from st_prompts.methods.simcse.config import CONFIG, SimCSESettings
from st_prompts.methods.stages import contrastive_stage


def build_model(settings: SimCSESettings):
    """The plain (trainable) backbone with [CLS] pooling (+ the saved MLP head for ``mlp_head="saved"``)."""
    seed_everything(settings.seed)
    return assemble(settings, plain_transformer(settings), pooling_mode="cls")


METHOD = Method(CONFIG, build_model=build_model, stages=lambda settings: [contrastive_stage(settings)])
