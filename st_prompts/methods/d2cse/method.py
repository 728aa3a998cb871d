"""D2CSE's model, loss and training stage (its settings and presets: :mod:`.config`)."""

from __future__ import annotations

from st_prompts.losses import CRTDLoss
from st_prompts.methods.base import Method, Stage
from st_prompts.methods.d2cse.config import CONFIG, D2CSESettings
from st_prompts.methods.models import assemble, prompted_encoder, seed_everything
from st_prompts.methods.stages import contrastive_columns, contrastive_data


def build_model(settings: D2CSESettings):
    """Frozen backbone + deep prefix (+ [CLS] prompt), [CLS] pooling; nothing else is saved."""
    seed_everything(settings.seed)
    encoder = prompted_encoder(settings, **settings.prefix_options(), cls_prompt=settings.cls_prompt)
    return assemble(settings, encoder, pooling_mode="cls")


def build_loss(model, settings: D2CSESettings):
    """:class:`~st_prompts.losses.CRTDLoss` (InfoNCE + λ · CRTD, training-only BatchNorm pooler and CRTD head)."""
    return CRTDLoss(model, scale=1.0 / settings.temperature, crtd_weight=settings.crtd_weight,
                    generator=settings.generator, masking_ratio=settings.masking_ratio, seed=settings.seed,
                    cache_dir=settings.corruption_cache,
                    generator_options={"steps": settings.generator_steps,
                                       "learning_rate": settings.generator_learning_rate})


def stages(settings: D2CSESettings) -> list[Stage]:
    return [Stage(name="train", build_loss=build_loss, columns=contrastive_columns, load_data=contrastive_data,
                  prepare_loss=lambda loss, dataset, settings: loss.prepare(dataset))]  # the cached corruption


METHOD = Method(CONFIG, build_model=build_model, stages=stages)
