"""SCPCSE's model and training stage (its settings and presets: :mod:`.config`)."""

from __future__ import annotations

from st_prompts.methods.base import Method
from st_prompts.methods.models import assemble, prompted_encoder, seed_everything
from st_prompts.methods.scpcse.config import CONFIG, SCPCSESettings
from st_prompts.methods.stages import contrastive_stage


def build_model(settings: SCPCSESettings):
    """Frozen backbone with soft template tokens, [MASK] pooling."""
    seed_everything(settings.seed)
    encoder = prompted_encoder(settings, prefix_length=None, template=settings.template)
    return assemble(settings, encoder, pooling_mode="mask")


METHOD = Method(CONFIG, build_model=build_model, stages=lambda settings: [contrastive_stage(settings)])
