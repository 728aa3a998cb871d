"""Which backbones can carry deep prompts, and how the prompts get into them.

A backbone is *inspected*, not looked up in a list: :func:`inspect_backbone` runs it once on two tokens with this
package's attention functions and records every attention call (prefix layers, key/value heads and head size,
causality, learned absolute or rotary positions). A backbone whose attention bypasses the interface is refused.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from st_prompts.errors import ConfigurationError, UnsupportedArchitectureError, first_line
from st_prompts.prompts.injection import (BACKENDS, LAYER_ATTRIBUTE, PREFIX_KWARG, PrefixInjection,
                                          observe_attention_calls, register_attention_functions, wrapped_backend)
from st_prompts.prompts.prefix import PrefixDraw

logger = logging.getLogger(__name__)

#: Model types tested with deep prompts; others whose attention takes them are accepted with a warning.
SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "electra", "camembert", "distilbert", "albert",
                         "modernbert", "llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_SUPPORTED = f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
#: How the prefix gets into the backbone (the removed ``"cache"`` loads as ``"attention"``, with the same outputs).
INJECTIONS = ("attention",)


@dataclass(frozen=True)
class BackbonePlan:
    """What :func:`inspect_backbone` found out about a backbone.

    Attributes:
        backend: the attention backend the prefix wraps (``"sdpa"`` or ``"eager"``).
        layers: prefix layers, one per attention call of a forward pass.
        kv_heads: key/value heads per layer (query heads in BERT-style models, fewer in grouped-query decoders).
        head_dim: size of one head.
        shared: some attention module runs more than once per pass (ALBERT).
        causal: a causal decoder (every token attends to the prefix and to the tokens before it).
        absolute_positions: learned absolute position embeddings: the text's positions start after the prefix.
        forward_arguments: the keyword arguments the backbone's forward takes.
    """

    backend: str
    layers: int
    kv_heads: int
    head_dim: int
    shared: bool
    causal: bool
    absolute_positions: bool
    forward_arguments: frozenset[str]


class _Recorder(PrefixInjection):
    """A prefix injection that injects nothing and records each attention call (module, key shape, causality)."""

    gate = None  # never gated: it only records

    def __init__(self) -> None:
        self.calls: list[tuple[torch.nn.Module, int, int, bool]] = []

    def inject(self, module, query, key, value, attention_mask, backend, kwargs):
        is_causal = kwargs.get("is_causal")
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        self.calls.append((module, key.shape[1], key.shape[-1], causal))
        return key, value, attention_mask


def forward_arguments(model: torch.nn.Module) -> frozenset[str]:
    """The named parameters of ``model.forward`` (through torch.compile's wrapper)."""
    return _forward_arguments(type(getattr(model, "_orig_mod", model)))


@functools.cache
def _forward_arguments(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def _probe(model: torch.nn.Module, injection: PrefixInjection) -> torch.Tensor:
    """``model``'s last hidden states on two tokens, in eval mode and without gradient, ``injection`` passed on."""
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = torch.tensor([[1 % vocab, 2 % vocab]], device=next(model.parameters()).device)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), PREFIX_KWARG: injection}
    if "use_cache" in forward_arguments(model):
        inputs["use_cache"] = False
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(**inputs).last_hidden_state
    finally:
        model.train(was_training)


def inspect_backbone(model: torch.nn.Module) -> BackbonePlan:
    """Switch ``model`` to this package's attention functions (without a prefix: the backend's exact outputs), mark
    each attention module with the prefix layers it reads, and find out how it takes a prefix.

    Raises:
        UnsupportedArchitectureError: the attention bypasses the interface or drops the model's keyword arguments,
            the prefix does not change the output, or flash or flex attention.
    """
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    backend = wrapped_backend(getattr(config, "_attn_implementation", None))
    if backend is None:
        raise UnsupportedArchitectureError(f"Deep prompts wrap the 'sdpa' or 'eager' attention; this {model_type} "
                                           f"backbone uses {config._attn_implementation!r}: load it with "
                                           "model_kwargs={'attn_implementation': 'sdpa'}.")
    register_attention_functions()
    try:
        model.set_attn_implementation(BACKENDS[backend])
    except (ValueError, KeyError) as exc:
        raise UnsupportedArchitectureError(f"The {model_type} backbone cannot switch its attention function "
                                           f"({first_line(exc)}). {_SUPPORTED}") from exc
    for module in model.modules():
        if hasattr(module, LAYER_ATTRIBUTE):
            delattr(module, LAYER_ATTRIBUTE)

    recorder = _Recorder()
    try:
        with observe_attention_calls() as calls:
            plain = _probe(model, recorder)
    except TypeError as exc:  # a forward without **kwargs
        raise UnsupportedArchitectureError(f"The {model_type} backbone takes no extra arguments to its attention "
                                           f"({first_line(exc)}). {_SUPPORTED}") from exc
    if not recorder.calls:
        raise UnsupportedArchitectureError(f"The {model_type} backbone computes attention itself, not through "
                                           f"transformers' attention interface: deep prompts cannot reach it. "
                                           f"{_SUPPORTED}")
    if len(calls) != len(recorder.calls):
        raise UnsupportedArchitectureError(f"The {model_type} backbone does not pass its arguments down to every "
                                           f"attention layer ({len(recorder.calls)} of {len(calls)} calls): deep "
                                           f"prompts cannot reach them all. {_SUPPORTED}")
    shapes = {(heads, size) for _, heads, size, _ in recorder.calls}
    if len(shapes) != 1:
        raise UnsupportedArchitectureError(f"The {model_type} backbone's layers differ in heads or head size "
                                           f"({sorted(shapes)}): one prefix shape cannot fit them. {_SUPPORTED}")
    (kv_heads, head_dim), = shapes
    applications: dict[torch.nn.Module, list[int]] = {}
    for index, (module, *_rest) in enumerate(recorder.calls):
        applications.setdefault(module, []).append(index)
    for module, layers in applications.items():
        setattr(module, LAYER_ATTRIBUTE, tuple(layers))
    embeddings = getattr(model, "embeddings", None)
    plan = BackbonePlan(
        backend=backend, layers=len(recorder.calls), kv_heads=kv_heads, head_dim=head_dim,
        shared=any(len(layers) > 1 for layers in applications.values()),
        causal=any(call[3] for call in recorder.calls),
        absolute_positions=isinstance(getattr(embeddings, "position_embeddings", None), torch.nn.Embedding),
        forward_arguments=forward_arguments(model),
    )
    _check_prefix_takes_effect(model, plan, plain, model_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        logger.warning(f"Deep prompts on {model_type!r}: its attention takes them, but this type is not among the "
                       f"tested ones ({', '.join(SUPPORTED_MODEL_TYPES)}).")
    return plan


def _check_prefix_takes_effect(model, plan: BackbonePlan, plain: torch.Tensor, model_type: str) -> None:
    """Guard against a silent no-op: a random one-position prefix must change the output."""
    device = plain.device
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randn(2 * plan.layers, 1, plan.kv_heads, 1, plan.head_dim, generator=generator).to(device)
    prompted = _probe(model, PrefixInjection(PrefixDraw(prefix, 1), None))
    if torch.allclose(plain.float(), prompted.float()):
        raise UnsupportedArchitectureError(f"The {model_type} backbone ignores the deep prompts (its output does not "
                                           f"change). {_SUPPORTED}")


def check_injection(injection: str) -> str:
    """The injection to use: ``"attention"`` (``"cache"``, removed, becomes it with a warning); else refused."""
    if injection == "cache":
        logger.warning("prefix_injection='cache' was removed (measured neither faster nor lighter than the attention "
                       "path, which gives the same outputs): using 'attention'.")
        return "attention"
    if injection not in INJECTIONS:
        raise UnsupportedArchitectureError(f"prefix_injection must be {' or '.join(map(repr, INJECTIONS))}, got "
                                           f"{injection!r}.")
    return injection


#: Prefix dropout for a backbone whose config names no hidden dropout (decoders such as Llama have none): BERT's.
DEFAULT_PREFIX_DROPOUT = 0.1


def backbone_dropout(config) -> float:
    """The backbone's hidden dropout (``hidden_dropout_prob``, ``dropout``), else :data:`DEFAULT_PREFIX_DROPOUT`."""
    for name in ("hidden_dropout_prob", "dropout"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return DEFAULT_PREFIX_DROPOUT


def check_checkpointing(encoder) -> None:
    """Refuse activation checkpointing where a recomputed layer would read the wrong prefix."""
    model = encoder.auto_model
    # transformers 5.23 renamed the property (the old name warns); earlier 5.x releases only know the old one
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else (
        "is_gradient_checkpointing")
    if encoder.training and getattr(model, name, False) and encoder.backbone_plan.shared:
        raise ConfigurationError("Gradient checkpointing cannot recompute a shared layer (ALBERT) with its own "
                                 "prefix: train this backbone without it.")
