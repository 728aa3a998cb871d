"""Row-exact attention: each row's attention computed over its own positions only, so that a row's output does not
depend on the other rows of its batch, to the last bit. An int8 model quantizes each linear layer's input per token,
so the 1e-7 that padding changes in fp32 attention can move a row's embedding by 1e-2: a quantized encoder marks its
attention modules (:data:`ROW_EXACT_ATTRIBUTE`). Only bidirectional self-attention is handled, else ``None``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["ROW_EXACT_ATTRIBUTE", "gated_term", "row_exact_attention"]

#: Attribute set (True) on the modules of a backbone whose attention is computed row by row.
ROW_EXACT_ATTRIBUTE = "st_prompts_row_exact"

# The grouping of the pass in progress (one per thread: the server's forward thread, a training thread), reused by
# every layer: the same mask and prefix objects are handed to each layer's attention call.
_plans = threading.local()
#: Masks of one pass whose groups are kept (a model alternates at most a few: ModernBERT's global and sliding ones).
_MASKS_KEPT = 4


class _Group:
    """Rows that attend over the same positions: their index, real token positions, joint and gated prefix ones, and
    the mask among their tokens where it is not all-visible (a sliding window), prefix columns in front."""

    __slots__ = ("rows", "tokens", "joint", "gated", "mask")

    def __init__(self, rows: list[int], key: tuple, text_mask: torch.Tensor | None, device: torch.device) -> None:
        tokens, joint, gated, _ = key
        self.rows = torch.tensor(rows, device=device)
        self.tokens = torch.tensor(tokens, device=device, dtype=torch.long)
        self.joint = torch.tensor(joint, device=device, dtype=torch.long) if joint else None
        self.gated = torch.tensor(gated, device=device, dtype=torch.long) if gated else None
        self.mask = None
        if text_mask is not None:  # one row's (tokens, tokens) block of the model's mask, in its format
            if joint:
                visible = (torch.ones if text_mask.dtype == torch.bool else torch.zeros)(
                    len(tokens), len(joint), dtype=text_mask.dtype, device=device)
                text_mask = torch.cat([visible, text_mask], dim=-1)
            self.mask = text_mask.view(1, 1, *text_mask.shape)


def _allowed(mask: torch.Tensor | None, batch: int, keys: int, device) -> torch.Tensor | None:
    """``(batch, queries, keys)``: the text positions each query attends, or ``None`` for a mask not read here."""
    if mask is None:
        return torch.ones(1, 1, keys, dtype=torch.bool, device=device).expand(batch, -1, -1)
    if mask.dim() != 4 or mask.shape[-1] != keys:
        return None
    if mask.dtype != torch.bool:  # eager's additive mask: 0 where attended, the dtype's minimum elsewhere
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[:, 0].expand(batch, -1, -1)


def _positions(row: torch.Tensor) -> tuple[int, ...]:
    return tuple(row.nonzero().flatten().tolist())


def _plan(batch: int, queries: int, keys: int, mask, injection, device) -> list[_Group] | None:
    """The groups of this pass for this mask (layers may alternate masks), computed once per pass and mask."""
    state = getattr(_plans, "state", None)
    if state is None or state[0] is not injection or state[1] != (batch, queries, keys):
        state = _plans.state = (injection, (batch, queries, keys), {})
    cached = state[2].get(id(mask))
    if cached is not None and cached[0] is mask:
        return cached[1]
    allowed = _allowed(mask, batch, keys, device)
    groups: list[_Group] | None = None
    if allowed is not None:
        real = allowed.any(dim=1)  # a position some query attends is a real token (padding is attended by none)
        joint = gated = None
        if injection is not None:
            if injection.gate is None or not injection.all_gated:
                joint = injection.visible if injection.visible is not None else torch.ones(
                    1, injection.prefix[0].shape[2], dtype=torch.bool, device=device)
                joint = joint.to(device).expand(batch, -1)
            if injection.gate is not None:
                gated = injection.gate_visible.to(device).expand(batch, -1)
        members: dict[tuple, list[int]] = {}
        blocks: dict[tuple, torch.Tensor | None] = {}
        for row in range(batch):
            tokens = _positions(real[row])
            index = torch.tensor(tokens, dtype=torch.long, device=device)
            block = None if mask is None else allowed[row].index_select(0, index).index_select(1, index)
            full = block is None or bool(block.all())
            key = (tokens, _positions(joint[row]) if joint is not None else (),
                   _positions(gated[row]) if gated is not None else (),
                   None if full else block.cpu().numpy().tobytes())
            if key not in members:
                blocks[key] = None if full else mask[row if mask.shape[0] > 1 else 0, 0].index_select(
                    0, index).index_select(1, index)
            members.setdefault(key, []).append(row)
        groups = [_Group(rows, key, blocks[key], device) for key, rows in members.items()]
    masks = state[2]
    masks[id(mask)] = (mask, groups)
    while len(masks) > _MASKS_KEPT:  # a plain backbone's passes share the state (no prefix object): keep it bounded
        del masks[next(iter(masks))]
    return groups


def row_exact_attention(function, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, injection: Any, kwargs: dict) -> tuple | None:
    """``module``'s attention output ``(batch, queries, heads, head_dim)``, each group of rows computed on its own
    positions by ``function`` (the wrapped backend), padding left at zero; ``None`` where this does not apply.
    ``injection`` (the pass's :class:`~st_prompts.prompts.injection.PrefixInjection` or ``None``): each row's visible
    prefix joins its keys and values, or adds its gated term, as for the whole batch."""
    batch, heads, queries, _ = query.shape
    keys = key.shape[2]
    if queries != keys or getattr(module, "is_causal", False) or kwargs.get("is_causal"):
        return None
    plan = _plan(batch, queries, keys, attention_mask, injection, query.device)
    if plan is None:
        return None
    prefix_keys = prefix_values = gate = None
    if injection is not None:
        layer = injection.layer(module)
        prefix_keys, prefix_values = (injection.rows_prefix(2 * layer + i, batch).to(key.dtype) for i in (0, 1))
        if injection.gate is not None:
            gate = injection.gate[layer]  # (1 or sets, kv heads)
            gate = (gate.index_select(0, injection.rows) if injection.rows is not None else gate).expand(batch, -1)
    output = None
    for group in plan:
        rows, tokens = group.rows, group.tokens
        q = query.index_select(0, rows).index_select(2, tokens)
        k = key.index_select(0, rows).index_select(2, tokens)
        v = value.index_select(0, rows).index_select(2, tokens)
        if group.joint is not None:
            k = torch.cat([prefix_keys.index_select(0, rows).index_select(2, group.joint), k], dim=2)
            v = torch.cat([prefix_values.index_select(0, rows).index_select(2, group.joint), v], dim=2)
        out, _ = function(module, q, k, v, group.mask, **kwargs)  # (rows, tokens, heads, head_dim)
        if group.gated is not None:
            out = out + gated_term(module, q, prefix_keys.index_select(0, rows).index_select(2, group.gated),
                                    prefix_values.index_select(0, rows).index_select(2, group.gated),
                                    gate.index_select(0, rows), kwargs).to(out.dtype)
        if output is None:
            output = out.new_zeros(batch, queries, *out.shape[2:])
        output.index_put_((rows.view(-1, 1), tokens.view(1, -1)), out)
    return output, None


def gated_term(module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gate: torch.Tensor,
               kwargs: dict, visible: torch.Tensor | None = None) -> torch.Tensor:
    """``tanh(g) · softmax(q K_p^T · scaling) V_p`` per row, in the attention functions' output layout
    ``(rows, queries, heads, head_dim)``: ``keys``/``values`` ``(rows, kv heads, l, head_dim)``, ``gate`` ``tanh(g)``
    ``(rows, kv heads)``, ``visible`` ``(rows or 1, 1, 1, l)`` (True = attend; ``None``: every position)."""
    rows, heads = query.shape[0], query.shape[1]
    repeats = heads // keys.shape[1]  # grouped-query attention: each key/value head serves several queries
    if repeats > 1:
        keys, values = keys.repeat_interleave(repeats, dim=1), values.repeat_interleave(repeats, dim=1)
        gate = gate.repeat_interleave(repeats, dim=1)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or keys.shape[-1] ** -0.5
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling  # (rows, heads, q, l)
    if visible is None:
        probabilities = torch.softmax(scores, dim=-1)
    else:
        # a finite fill, not -inf: a row with no visible position (not gated, or the plain backbone) gets a finite
        # uniform softmax that `any` below zeroes, so no NaN reaches the backward pass
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        probabilities = torch.softmax(scores, dim=-1) * visible.any(dim=-1, keepdim=True)
    term = torch.matmul(probabilities.to(values.dtype), values)  # (rows, heads, q, head_dim)
    term = term * gate.to(term.dtype).view(rows, heads, 1, 1)
    return term.transpose(1, 2)
