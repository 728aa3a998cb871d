"""Deep prompts through transformers' attention interface: ``st_prompts_sdpa`` and ``st_prompts_eager`` wrap the
backends of the same name; given a :class:`PrefixInjection` under :data:`PREFIX_KWARG` they put the layer's prefix in
front of its keys, values and mask (no key/value cache: DistilBERT and ModernBERT take none). A **gated** prefix
(LLaMA-Adapter) adds ``tanh(g) · softmax(q · K_p / sqrt(d)) · V_p`` instead, so at ``g = 0`` a layer is the backbone's.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from st_prompts.errors import ConfigurationError, UnsupportedArchitectureError
from st_prompts.prompts.prefix import PrefixDraw, prefix_concat
from st_prompts.prompts.row_exact import ROW_EXACT_ATTRIBUTE, gated_term, row_exact_attention

#: Keyword under which the model's forward carries the :class:`PrefixInjection` down to the attention functions.
PREFIX_KWARG = "st_prompts_prefix"
#: Attribute of each attention module: the prefix layers it reads, one per application (ALBERT applies one module
#: to every layer), set by :func:`st_prompts.modules.backbones.inspect_backbone`.
LAYER_ATTRIBUTE = "st_prompts_prefix_layers"
#: The attention backends a prefix can wrap, and the name each wrapper is registered under.
BACKENDS = {"sdpa": "st_prompts_sdpa", "eager": "st_prompts_eager"}


def wrapped_backend(name: str | None) -> str | None:
    """The backend (``"sdpa"``/``"eager"``) behind an attention implementation name, ours or transformers'."""
    return next((backend for backend, ours in BACKENDS.items() if name in (backend, ours)), None)


@functools.cache
def _eager_function(module_class: type):
    """The model's own eager attention (``eager_attention_forward`` of its modelling file)."""
    function = getattr(sys.modules.get(module_class.__module__), "eager_attention_forward", None)
    if function is None:
        raise UnsupportedArchitectureError(f"{module_class.__name__} has no eager attention function to wrap; load "
                                           "the backbone with attn_implementation='sdpa'.")
    return function


_observer = threading.local()


@contextmanager
def observe_attention_calls() -> Iterator[list[bool]]:
    """Within this context (this thread), each attention call appends whether it carried a prefix to the list."""
    calls: list[bool] = []
    _observer.calls = calls
    try:
        yield calls
    finally:
        _observer.calls = None


def _attention(backend: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        injection = kwargs.pop(PREFIX_KWARG, None)
        observed = getattr(_observer, "calls", None)
        if observed is not None:
            observed.append(injection is not None)
        function = sdpa_attention_forward if backend == "sdpa" else _eager_function(type(module))
        if getattr(module, ROW_EXACT_ATTRIBUTE, False):  # a quantized encoder: see st_prompts.prompts.row_exact
            exact = row_exact_attention(function, module, query, key, value, attention_mask, injection, kwargs)
            if exact is not None:
                return exact
        if injection is None:
            return function(module, query, key, value, attention_mask, **kwargs)
        if injection.gate is not None:
            return injection.gated_attention(function, module, query, key, value, attention_mask, backend, kwargs)
        key, value, attention_mask = injection.inject(module, query, key, value, attention_mask, backend, kwargs)
        return function(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = attention.__qualname__ = BACKENDS[backend]
    return attention


def register_attention_functions() -> None:
    """Register ``st_prompts_sdpa`` and ``st_prompts_eager`` with transformers' attention and mask interfaces (the
    text's mask is built exactly as for the wrapped backend). Idempotent."""
    for backend, name in BACKENDS.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _attention(backend))
            AttentionMaskInterface.register(name, sdpa_mask if backend == "sdpa" else eager_mask)


class PrefixInjection:
    """The prefix of one forward pass, handed to every attention call through the model's keyword arguments.

    Args:
        draw: the prefix keys/values (:class:`~st_prompts.prompts.prefix.PrefixDraw`, ``2L`` layers of
            ``(1 or batch, kv_heads, l, head_dim)``; keys of layer ``i`` at ``2i``, values at ``2i + 1``).
        prefix_mask: ``(batch, l)``, nonzero = attend (views of the prefix, masked padding positions), or ``None``
            when every row attends to every position.
        rows: with several prefixes stacked in ``draw`` (prompt sets), the one each row uses (``(batch,)``).
    """

    def __init__(self, draw: PrefixDraw, prefix_mask: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        self.draw = draw
        self.rows = rows
        self.prefix = draw.prefix.unbind(0)
        self.keep = draw.keep.unbind(0) if draw.keep is not None else None
        visible = None if prefix_mask is None else prefix_mask.bool()
        #: ``tanh(gate)`` per layer ``(L, 1 or sets, heads)`` of a gated prefix, else ``None``.
        self.gate = draw.gate
        # Which rows' prefix goes through the gate: every row (a gated prefix), some (stacked sets, some gated), none.
        gated_rows = None
        if self.gate is not None and draw.gated is not None:
            gated_rows = draw.gated.index_select(0, rows) if rows is not None else draw.gated.expand(draw.batch_size)
        self.all_gated = self.gate is not None and (gated_rows is None or bool(gated_rows.all()))
        self.gate_visible: torch.Tensor | None = None
        if self.gate is not None:
            length = self.prefix[0].shape[2]
            rows_visible = visible if visible is not None else torch.ones(1, length, dtype=torch.bool,
                                                                          device=self.prefix[0].device)
            if gated_rows is not None:
                self.gate_visible = rows_visible & gated_rows.view(-1, 1).to(rows_visible.device)
                visible = rows_visible & ~gated_rows.view(-1, 1).to(rows_visible.device)  # the joint softmax's part
            else:
                self.gate_visible, visible = rows_visible, None
        self.visible = visible
        # All rows attend to all positions: sdpa may then run without a mask on a bidirectional model.
        self.all_visible = self.visible is None or bool(self.visible.all())
        self._applications: dict[int, int] = {}
        self._masks: dict[tuple, tuple[Any, torch.Tensor | None]] = {}

    def layer(self, module: torch.nn.Module) -> int:
        """The prefix layer of this call of ``module``: its own, or for a module applied several times per pass
        (ALBERT's shared layers), the next of its layers in order."""
        layers = getattr(module, LAYER_ATTRIBUTE, None)
        if not layers:
            raise ConfigurationError(f"{type(module).__name__} was not inspected for deep prompts: build the "
                                     "PromptedTransformer on this backbone.")
        if len(layers) == 1:
            return layers[0]
        count = self._applications.get(id(module), 0)
        self._applications[id(module)] = count + 1
        return layers[count % len(layers)]

    def inject(self, module, query, key, value, attention_mask, backend: str, kwargs: dict, layer: int | None = None):
        """``(keys, values, mask)`` with the prefix in front, for ``module``'s attention call (``layer``: its prefix
        layer, when :meth:`layer` was already asked for this call)."""
        layer = self.layer(module) if layer is None else layer
        keys = self._concat(2 * layer, key)
        values = self._concat(2 * layer + 1, value)
        mask = self._mask(module, query, key.shape[2], attention_mask, backend, kwargs.get("is_causal"))
        return keys, values, mask

    def gated_attention(self, function, module, query, key, value, attention_mask, backend: str, kwargs: dict):
        """The text's own attention (the ungated rows' prefix in their softmax), plus each gated row's gated term."""
        layer = self.layer(module)
        if not self.all_gated:
            key, value, attention_mask = self.inject(module, query, key, value, attention_mask, backend, kwargs, layer)
        output, weights = function(module, query, key, value, attention_mask, **kwargs)
        term = self._gated_term(layer, module, query, kwargs)
        return output + term.to(output.dtype), weights

    def _gated_term(self, layer: int, module, query: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """``tanh(g) · softmax(q K_p^T · scaling) V_p`` for every row (0 for rows whose prefix is not gated), in the
        attention functions' output layout ``(batch, queries, heads, head_dim)``."""
        batch = query.shape[0]
        keys, values = (self.rows_prefix(2 * layer + i, batch) for i in (0, 1))
        gate = self.gate[layer]  # (1 or sets, kv heads)
        if self.rows is not None:
            gate = gate.index_select(0, self.rows)
        visible = self.gate_visible.to(query.device).view(self.gate_visible.shape[0], 1, 1, -1)
        return gated_term(module, query, keys, values, gate.expand(batch, -1), kwargs, visible)

    def rows_prefix(self, index: int, batch: int) -> torch.Tensor:
        """One layer's prefix keys (or values) of every row, ``(batch, kv heads, l, head_dim)``, dropout applied."""
        prefix = self.prefix[index]
        if self.rows is not None:
            prefix = prefix.index_select(0, self.rows)
        if self.keep is not None:
            prefix = prefix * self.draw.scale * self.keep[index]
        return prefix.expand(batch, -1, -1, -1)

    def _concat(self, index: int, states: torch.Tensor) -> torch.Tensor:
        prefix = self.prefix[index]
        if prefix.shape[1] != states.shape[1] or prefix.shape[-1] != states.shape[-1]:
            raise ConfigurationError(f"The prefix has {prefix.shape[1]} heads of size {prefix.shape[-1]} but the layer "
                                     f"has {states.shape[1]} of size {states.shape[-1]}.")
        prefix = prefix.to(states.dtype)
        if self.rows is not None:  # each row its own prompt set
            prefix = prefix.index_select(0, self.rows)
        keep = self.keep[index] if self.keep is not None else None
        return prefix_concat(prefix, keep, self.draw.scale, states)

    def _mask(self, module, query, text_keys: int, mask, backend: str, is_causal) -> torch.Tensor | None:
        """The text's mask with the prefix columns in front (built once per pass and mask kind, then reused)."""
        queries = query.shape[2]
        causal = False
        if mask is None and backend == "sdpa":
            # What sdpa would have done without a mask: causal attention for a causal module (a decoder).
            causal = queries > 1 and bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if mask is None and not causal and self.all_visible:
            return None
        cache_key = (id(mask), causal, queries, text_keys, backend)
        cached = self._masks.get(cache_key)
        if cached is not None and cached[0] is mask:
            return cached[1]
        device = query.device
        if mask is None:
            text = torch.ones(queries, text_keys, dtype=torch.bool, device=device)
            if causal:
                text = text.tril(text_keys - queries)
            text = text.view(1, 1, queries, text_keys)
            if backend == "eager":
                text = _additive(text, query.dtype)
        else:
            text = mask
        visible = self.visible
        if visible is None:
            visible = torch.ones(1, self.prefix[0].shape[2], dtype=torch.bool, device=device)
        visible = visible.to(device).view(visible.shape[0], 1, 1, -1)
        rows = max(visible.shape[0], text.shape[0])
        heads = text.shape[1]
        prefix_part = visible if text.dtype == torch.bool else _additive(visible, text.dtype)
        combined = torch.cat([prefix_part.expand(rows, heads, text.shape[2], -1),
                              text.expand(rows, heads, -1, -1)], dim=-1)
        self._masks[cache_key] = (mask, combined)
        return combined


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive float mask eager attention takes."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
