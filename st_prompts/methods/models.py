"""Assembling a method's SentenceTransformer: encoder, pooling and SimCSE's optional saved MLP head."""

from __future__ import annotations

import os
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer

from st_prompts.errors import ConfigurationError
from st_prompts.methods import config as method_config
from st_prompts.methods.base import TrainSettings
from st_prompts.modules import MaskTokenPooling, PromptedTransformer
from st_prompts.modules.model_card import PromptsModelCardData, backbone_card_name
from st_prompts.utils import resolve_model_name


def mlp_head_module(dimension: int, initializer_range: float = 0.02):
    """SimCSE's MLP over [CLS] (``Linear(H, H) + Tanh``) as a ``Dense`` module, for ``mlp_head="saved"`` (the official
    supervised runs); initialised as the official ``MLPLayer`` (normal with ``initializer_range``, zero bias)."""
    weight = torch.empty(dimension, dimension).normal_(0.0, initializer_range)
    return Dense(dimension, dimension, activation_function=torch.nn.Tanh(), init_weight=weight,
                 init_bias=torch.zeros(dimension))


def assemble(settings: TrainSettings, encoder, pooling_mode: str = "cls"):
    """``SentenceTransformer([encoder, pooling(, Dense+Tanh)])`` for ``settings.mlp_head``.

    ``pooling_mode``: ``"cls"`` (sentence-transformers' ``Pooling``) or ``"mask"`` (:class:`MaskTokenPooling`).
    """
    dimension = encoder.get_embedding_dimension()
    pooling = MaskTokenPooling(dimension) if pooling_mode == "mask" else Pooling(dimension, pooling_mode=pooling_mode)
    modules = [encoder, pooling]
    if getattr(settings, "mlp_head", "none") == "saved":
        config = encoder.auto_model.config
        modules.append(mlp_head_module(dimension, getattr(config, "initializer_range", 0.02)))
    backbone = backbone_card_name(settings.backbone)
    try:
        described = method_config(settings.method)  # its title and paper, for the model card
    except ConfigurationError:  # a Method built in code and never registered: its card names no paper
        described = None
    card = PromptsModelCardData(method=settings.method, method_title=getattr(described, "title", None),
                                paper=getattr(described, "paper", None), paper_url=getattr(described, "paper_url", None),
                                backbone=backbone)
    if "/" in backbone and not os.path.exists(settings.backbone):
        card.base_model = backbone  # a hub id: the card links to it
    return SentenceTransformer(modules=modules, model_card_data=card)


def backbone_kwargs(settings: TrainSettings) -> dict[str, Any]:
    """An encoder's keyword arguments handing ``trust_remote_code=True`` to the backbone's loaders; none without it
    (the backbone is then checked against :mod:`st_prompts.trust` before anything of it is read)."""
    if not getattr(settings, "trust_remote_code", False):
        return {}
    return {key: {"trust_remote_code": True} for key in ("model_kwargs", "config_kwargs", "processor_kwargs")}


def prompted_encoder(settings: TrainSettings, **options: Any) -> PromptedTransformer:
    """A :class:`~st_prompts.PromptedTransformer` on ``settings.backbone`` with ``options`` (e.g. the prefix's:
    ``**settings.prefix_options()``), its ``max_seq_length`` the settings' unless ``options`` give one."""
    options.setdefault("max_seq_length", settings.max_seq_length)
    return PromptedTransformer(resolve_model_name(settings.backbone), **options, **backbone_kwargs(settings))


def plain_transformer(settings: TrainSettings) -> Transformer:
    """sentence-transformers' ``Transformer`` on ``settings.backbone`` (the trainable encoder of SimCSE and SKICSE's
    full encoder), checked and loaded like a :class:`~st_prompts.PromptedTransformer`'s backbone: nothing of it runs
    and nothing is unpickled unless ``settings.trust_remote_code``."""
    from st_prompts.loading import require_safe_backbone, safe_loading

    trusted = bool(getattr(settings, "trust_remote_code", False))
    require_safe_backbone(settings.backbone, trusted)
    kwargs = backbone_kwargs(settings)
    with safe_loading(trusted) as safe:
        kwargs["model_kwargs"] = {**safe, **kwargs.get("model_kwargs", {})}
        return Transformer(resolve_model_name(settings.backbone), max_seq_length=settings.max_seq_length, **kwargs)


def seed_everything(seed: int) -> None:
    """Seed torch before building a model, so the prompts' (and heads') random initialisation is reproducible."""
    torch.manual_seed(seed)
