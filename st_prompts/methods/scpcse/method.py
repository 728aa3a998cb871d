"""SCPCSE's model and training stage (its settings and presets: :mod:`.config`)."""

from __future__ import annotations

from st_prompts.methods.base import Method
from st_prompts.methods.models import assemble, backbone_kwargs, seed_everything
from st_prompts.methods.scpcse.config import CONFIG, SCPCSESettings
from st_prompts.methods.stages import contrastive_stage
from st_prompts.modules import PromptedTransformer
from st_prompts.utils import resolve_model_name


def build_model(settings: SCPCSESettings):
    """Frozen backbone with soft template tokens, [MASK] pooling."""
    seed_everything(settings.seed)
    encoder = PromptedTransformer(resolve_model_name(settings.backbone), prefix_length=None, template=settings.template,
                                  max_seq_length=settings.max_seq_length, **backbone_kwargs(settings))
    return assemble(settings, encoder, pooling_mode="mask")


METHOD = Method(CONFIG, build_model=build_model, stages=lambda settings: [contrastive_stage(settings)])
