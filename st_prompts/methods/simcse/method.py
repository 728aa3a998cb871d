"""SimCSE's model and training stage (its settings and presets: :mod:`.config`)."""

from __future__ import annotations

from sentence_transformers.sentence_transformer.modules import Transformer

from st_prompts.methods.base import Method
from st_prompts.methods.models import assemble, seed_everything
from st_prompts.methods.simcse.config import CONFIG, SimCSESettings
from st_prompts.methods.stages import contrastive_stage
from st_prompts.utils import resolve_model_name


def build_model(settings: SimCSESettings):
    """The plain (trainable) backbone with [CLS] pooling (+ the saved MLP head for ``mlp_head="saved"``)."""
    seed_everything(settings.seed)
    encoder = Transformer(resolve_model_name(settings.backbone), max_seq_length=settings.max_seq_length)
    return assemble(settings, encoder, pooling_mode="cls")


METHOD = Method(CONFIG, build_model=build_model, stages=lambda settings: [contrastive_stage(settings)])
