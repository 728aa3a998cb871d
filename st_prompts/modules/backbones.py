"""Which backbones can carry deep prompts, and how the prompts get into them (the key/value cache)."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from st_prompts.errors import UnsupportedArchitectureError
from st_prompts.prompts.prefix import PrefixEncoder

#: Backbones whose self-attention accepts a key/value cache in encoder mode (checked with transformers 5.23).
#: ALBERT accepts a cache and ignores it, DistilBERT, DeBERTa-v2 and ModernBERT take none: they are refused.
SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "electra", "camembert")


def verify_prefix_takes_effect(model: torch.nn.Module, tokenizer, prefix_encoder: PrefixEncoder) -> None:
    """Guard against backbones that accept a cache and silently ignore it (as ALBERT does)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = [tokenizer.cls_token_id or 0, tokenizer.sep_token_id or 0]
            device = next(model.parameters()).device
            input_ids = torch.tensor([ids], device=device)
            mask = torch.ones_like(input_ids)
            plain = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            probe = PrefixEncoder(1, prefix_encoder.num_layers, prefix_encoder.num_heads,
                                  prefix_encoder.head_dim, dropout=0.0, init_std=1.0).to(device)
            cache = probe(1)
            mask = torch.ones(1, 3, dtype=torch.long, device=device)
            prompted = model(input_ids=input_ids, attention_mask=mask,
                             **{cache_argument(model): cache}).last_hidden_state
    except Exception as exc:  # the architecture rejects a cache
        raise UnsupportedArchitectureError(
            f"The backbone {type(model).__name__} rejected the deep-prompt key/value cache ({exc}). "
            f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        ) from exc
    finally:
        model.train(was_training)
    if torch.allclose(plain.float(), prompted.float()):
        raise UnsupportedArchitectureError(
            f"The backbone {type(model).__name__} ignores the deep-prompt cache (its output does not change). "
            f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` takes the key/value cache that carries the deep prompts.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` on the encoders (the old name is deprecated and goes in
    5.40); earlier 5.x releases only know ``past_key_values``. Read off the signature (through the deprecation
    wrapper) once per model class.
    """
    return _cache_argument(type(getattr(model, "_orig_mod", model)))  # torch.compile's wrapper: the model's own


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def allow_checkpointing_with_prefix(model: torch.nn.Module) -> None:
    """Keep the deep prompts when activation (gradient) checkpointing is on.

    transformers' checkpointed layers drop ``past_key_values`` (silently, apart from a log line) unless the layer
    declares that it only reads the cache, because a recomputed layer would append to a stateful cache a second time.
    The prefix cache is read-only (:class:`~st_prompts.prompts.prefix.PrefixCache`), so the layers of a prompted
    backbone may keep it: ``model.gradient_checkpointing_enable()`` (or the trainer's ``gradient_checkpointing=True``)
    then trades compute for activation memory without losing the prompts.
    """
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True


def check_architecture(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"Soft prompts are not supported on {config.model_type!r} backbones. Supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (ALBERT accepts deep prompts but silently ignores them; DistilBERT, "
            f"DeBERTa-v2 and ModernBERT cannot take them)."
        )
    if getattr(config, "is_decoder", False):
        raise UnsupportedArchitectureError("PromptedTransformer needs an encoder (config.is_decoder must be False).")
