"""DCPCSE's model and training stage (its settings and presets: :mod:`.config`)."""

from __future__ import annotations

from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import Method
from st_prompts.methods.dcpcse.config import CONFIG, DCPCSESettings
from st_prompts.methods.models import assemble, prompted_encoder, seed_everything
from st_prompts.methods.stages import contrastive_stage


def build_model(settings: DCPCSESettings):
    """Frozen backbone + deep prefix, [CLS] pooling (or ``settings.pooling``; + the saved MLP head for
    ``mlp_head="saved"``)."""
    seed_everything(settings.seed)
    encoder = prompted_encoder(settings, **settings.prefix_options(),
                               prefix_dropout_shared=settings.prefix_dropout_shared)
    if settings.pooling == "cls" and encoder.backbone_plan.causal:
        raise ConfigurationError(f"{settings.backbone!r} is a causal decoder: it has no [CLS] to pool; use "
                                 "--pooling lasttoken or --pooling mean.")
    return assemble(settings, encoder, pooling_mode=settings.pooling)


METHOD = Method(CONFIG, build_model=build_model, stages=lambda settings: [contrastive_stage(settings)])
