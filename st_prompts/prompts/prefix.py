"""Deep continuous prompts: trainable per-layer key/value prefixes (P-tuning v2 / prefix tuning, as in DCPCSE).

The layout follows the official DCPCSE code (and PEFT's ``PrefixEncoder``): one row of ``2·L·H`` numbers per prefix
position, viewed as ``(l, 2L, heads, head_dim)``. Not PEFT itself: it wraps the backbone and has no views of a prefix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from st_prompts.errors import ConfigurationError


class PrefixEncoder(nn.Module):
    """Trainable key/value prefixes for every self-attention layer of a backbone.

    Args:
        prefix_length, num_layers, num_heads, head_dim: ``l`` prefix positions in each of ``L`` layers, their heads.
        projection: reparameterise the prefix as ``Embedding(l, H) → Linear(H, P) → Tanh → Linear(P, 2·L·H)``
            (DCPCSE's ``--prefix_projection``); otherwise a plain ``Embedding(l, 2·L·H)``.
        projection_hidden_size: ``P`` above (DCPCSE: 512).
        dropout: dropout on the keys/values in training (DCPCSE: the backbone's hidden dropout probability).
        shared_dropout: one dropout mask per forward pass for the whole batch instead of one per example (DCPCSE's).
        init_std: std of the normal initialisation of every weight (biases zero); ``None``: torch's defaults.
        gate: a zero-initialised gate per layer and key/value head (LLaMA-Adapter): at zero the encoder is its
            backbone (:mod:`st_prompts.prompts.injection`).
    """

    def __init__(self, prefix_length: int, num_layers: int, num_heads: int, head_dim: int, projection: bool = False,
                 projection_hidden_size: int = 512, dropout: float = 0.1, shared_dropout: bool = False,
                 init_std: float | None = 0.02, gate: bool = False) -> None:
        super().__init__()
        self.prefix_length = prefix_length
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.projection = projection
        hidden_size = num_heads * head_dim
        out_size = 2 * num_layers * hidden_size
        if projection:
            self.embedding = nn.Embedding(prefix_length, hidden_size)
            self.transform = nn.Sequential(nn.Linear(hidden_size, projection_hidden_size), nn.Tanh(),
                                           nn.Linear(projection_hidden_size, out_size))
        else:
            self.embedding = nn.Embedding(prefix_length, out_size)
            self.transform = None
        self.dropout = nn.Dropout(dropout)
        self.shared_dropout = shared_dropout
        self.register_buffer("prefix_tokens", torch.arange(prefix_length), persistent=False)
        #: The gate of each layer and key/value head (``(L, heads)``, zero at the start), or ``None`` without a gate.
        self.gate = nn.Parameter(torch.zeros(num_layers, num_heads)) if gate else None
        if init_std is not None:
            self.reset_parameters(init_std)

    @property
    def gated(self) -> bool:
        """Whether the prefix reaches attention through a gate (:attr:`gate`)."""
        return self.gate is not None

    @property
    def position_length(self) -> int:
        """Positions the prefix takes from the text with learned absolute positions: its length, 0 with a gate."""
        return 0 if self.gated else self.prefix_length

    def gate_values(self) -> torch.Tensor | None:
        """``tanh(gate)`` as ``(L, 1, heads)`` (what scales each layer's prefix output), or ``None``."""
        return None if self.gate is None else torch.tanh(self.gate).unsqueeze(1)

    def reset_parameters(self, std: float) -> None:
        """Every ``Embedding`` / ``Linear`` weight ~ N(0, ``std``), biases 0 (BERT's ``_init_weights``, as officially)."""
        if not std > 0:
            raise ConfigurationError(f"init_std must be positive, got {std!r}.")
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Embedding, nn.Linear)):
                    module.weight.normal_(0.0, std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()

    def key_values(self) -> torch.Tensor:
        """The (batch-independent) prefix as one tensor of shape ``(l, 2L, heads, head_dim)``."""
        values = self.embedding(self.prefix_tokens)
        if self.transform is not None:
            values = self.transform(values)
        return values.view(self.prefix_length, 2 * self.num_layers, self.num_heads, self.head_dim)

    def stored_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores of this prefix: the prefix it computes, as the state dict of a plain
        (``projection=False``) prefix encoder of the same shape, gate included. Exact: the MLP reads a fixed table."""
        if self.transform is None:
            return self.state_dict()
        with torch.no_grad():
            stored = {"embedding.weight": self.key_values().reshape(self.prefix_length, -1).detach().clone()}
        if self.gate is not None:
            stored["gate"] = self.state_dict()["gate"]
        return stored

    def trainable_parameter_count(self) -> int:
        """Parameters training updates: the embedding table, the MLP with ``projection`` and the gate."""
        return sum(p.numel() for p in self.parameters())

    def stored_parameter_count(self) -> int:
        """Numbers a checkpoint stores (:meth:`stored_state_dict`): ``l · 2L · H`` (plus the gate), MLP or not."""
        gate = self.gate.numel() if self.gate is not None else 0
        return self.prefix_length * 2 * self.num_layers * self.num_heads * self.head_dim + gate

    def values(self, batch_size: int) -> PrefixDraw:
        """The prefix keys/values for a batch, with this pass's dropout draw in training (see :class:`PrefixDraw`)."""
        values = self.key_values().permute(1, 2, 0, 3).unsqueeze(1)  # (l, 2L, heads, hd) -> (2L, 1, heads, l, hd)
        gate = self.gate_values()
        if not (self.training and self.dropout.p > 0):
            return PrefixDraw(values, batch_size, gate=gate)
        if self.shared_dropout:
            # one mask for the batch; broadcast, never copied
            return PrefixDraw(self.dropout(values), batch_size, gate=gate)
        # One mask per example, kept as booleans; the dropped-out prefix itself is never stored (see PrefixDraw).
        keep, keep_probability = draw_keep_mask(values.expand(-1, batch_size, -1, -1, -1).shape, self.dropout.p,
                                                device=values.device)
        scale = torch.full((), 1.0 / keep_probability if keep_probability > 0 else 0.0, dtype=values.dtype,
                           device=values.device)
        return PrefixDraw(values, batch_size, keep, scale, gate=gate)

    def forward(self, batch_size: int) -> PrefixDraw:
        """The prefix keys/values for a batch (:meth:`values`)."""
        return self.values(batch_size)

    def extra_repr(self) -> str:
        return (
            f"prefix_length={self.prefix_length}, num_layers={self.num_layers}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, projection={self.projection}, shared_dropout={self.shared_dropout}, "
            f"gate={self.gated}"
        )


#: Resolution of :func:`draw_keep_mask`: a drop probability is rounded to a multiple of ``1 / 2**16``.
KEEP_MASK_LEVELS = 1 << 16


def draw_keep_mask(shape: Sequence[int], p: float, device: torch.device | str | None = None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """A dropout keep mask: every entry independently ``False`` (dropped) with probability ``p``.

    Drawn from torch's generator 16 bits at a time (one 64-bit word gives four entries; ``torch.bernoulli_`` spends a
    random number per entry, several times slower here), so ``p`` is rounded to a multiple of ``2**-16``. Returns
    ``(keep, keep_probability)``, the exact probability of ``True``: scale kept entries by its inverse.
    ``p`` outside ``[0, 1]`` is a ConfigurationError.
    """
    if not 0.0 <= p <= 1.0:
        raise ConfigurationError(f"dropout probability must be in [0, 1], got {p!r}.")
    drop_levels = round(p * KEEP_MASK_LEVELS)
    count = math.prod(shape)
    if drop_levels == KEEP_MASK_LEVELS:  # p = 1 (or within 2**-17 of it): drop everything, as nn.Dropout(1) does
        return torch.zeros(tuple(shape), dtype=torch.bool, device=device), 0.0
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)  # every 64-bit pattern equally likely
    lanes = words.view(torch.int16)[:count].view(tuple(shape))  # four uniform 16-bit lanes per word
    keep = lanes >= drop_levels - KEEP_MASK_LEVELS // 2
    return keep, 1.0 - drop_levels / KEEP_MASK_LEVELS


def prefix_view_mask(batch_size: int, prefix_length: int, view: int | Sequence[int] | torch.Tensor | None,
                     num_views: int = 2, device: torch.device | str | None = None) -> torch.Tensor:
    """A prefix attention mask (``1`` = attend, ``(batch_size, prefix_length)``, long) that lets each row see one
    *view* of the prefix, for ``features["prefix_attention_mask"]``.

    The positions are cut into ``num_views`` contiguous, nearly equal blocks (two views of ``2l``: the two halves);
    positions are never shifted. ``view``: the view of every row (an ``int``), one per row (a sequence or 1-D
    tensor), or ``None`` for all positions. E.g. DiffAug: ``view=0`` for the anchor, ``view=1`` for the positive.

    Raises:
        ConfigurationError: ``num_views`` outside ``[1, prefix_length]``, a view outside ``[0, num_views)``, or a
            per-row view list whose length is not ``batch_size``.
    """
    if not isinstance(num_views, int) or not 1 <= num_views <= prefix_length:
        raise ConfigurationError(f"num_views must be an integer in [1, prefix_length={prefix_length}], got {num_views!r}.")
    if view is None:
        return torch.ones(batch_size, prefix_length, dtype=torch.long, device=device)
    views = torch.as_tensor(view, dtype=torch.long, device=device)
    if views.dim() == 0:
        views = views.expand(batch_size)
    if views.shape != (batch_size,):
        raise ConfigurationError(f"view must be an int or one int per row ({batch_size}), got shape {tuple(views.shape)}.")
    if views.numel() and (views.min() < 0 or views.max() >= num_views):
        raise ConfigurationError(f"views must be in [0, {num_views}), got {views.tolist()}.")
    owner = torch.arange(prefix_length, device=views.device) * num_views // prefix_length  # view of each position
    return (owner.unsqueeze(0) == views.unsqueeze(1)).long()


#: At inference the prefix is padded with masked-out positions so that ``prefix + tokens`` is a multiple of this.
KEY_LENGTH_MULTIPLE = 16


def key_padding(prefix_length: int, token_length: int, multiple: int = KEY_LENGTH_MULTIPLE) -> int:
    """How many masked-out prefix positions make ``prefix_length + token_length`` keys a multiple of ``multiple``:
    torch's CPU flash attention is up to twice as slow between two multiples of 16 keys. The output does not change."""
    return -(prefix_length + token_length) % multiple


def pad_prefix(values: PrefixDraw, positions: int) -> PrefixDraw:
    """``values`` (without a per-example dropout mask) with ``positions`` zero positions appended to the prefix of
    every layer (mask them out of attention; see :func:`key_padding`)."""
    if values.keep is not None:
        raise ConfigurationError("a prefix with a dropout mask per example cannot be padded.")
    prefix = torch.nn.functional.pad(values.prefix, (0, 0, 0, positions))  # (2L, 1 or batch, heads, l + pad, hd)
    return PrefixDraw(prefix, values.batch_size, gate=values.gate, gated=values.gated)


class PrefixDraw:
    """The prefix keys/values of one forward pass, kept factorised rather than as a dense per-row tensor.

    Attributes:
        prefix: ``(2L, 1, heads, l, head_dim)``, the prefix every row starts from (with a shared dropout mask,
            already dropped out), or a dense ``(2L, batch, ...)`` tensor.
        keep: with a dropout mask per example, the boolean ``(2L, batch, heads, l, head_dim)`` draw, else ``None``.
        scale: ``1 / P(keep)`` as a 0-d tensor, with ``keep``.
        gate: with a gated prefix, ``tanh(gate)`` as ``(L, 1 or sets, heads)``, else ``None``.
        gated: with stacked prompt sets of which only some are gated, which ones (``(sets,)`` bool).

    Not ``dropout(prefix.expand(batch, ...))`` (the official code): that keeps a float noise tensor and the dropped-out
    prefix alive until the backward pass. Here each layer writes its rows into its key/value concatenation and only
    the boolean mask is kept: the same values and gradients, a fraction of the memory.
    """

    __slots__ = ("prefix", "batch_size", "keep", "scale", "gate", "gated")

    def __init__(self, prefix: torch.Tensor, batch_size: int, keep: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                 gated: torch.Tensor | None = None) -> None:
        if prefix.dim() != 5 or prefix.shape[1] not in (1, batch_size):
            raise ConfigurationError(f"prefix values must have shape (2L, 1 or batch={batch_size}, heads, length, "
                                     f"head_dim), got {tuple(prefix.shape)}.")
        self.prefix, self.batch_size, self.keep, self.scale = prefix, int(batch_size), keep, scale
        self.gate, self.gated = gate, gated

    @property
    def shape(self) -> torch.Size:
        """``(2L, batch, heads, l, head_dim)``, the shape of :meth:`dense`."""
        two_layers, _, heads, length, head_dim = self.prefix.shape
        return torch.Size((two_layers, self.batch_size, heads, length, head_dim))

    def dense(self) -> torch.Tensor:
        """The keys/values every row sees, ``(2L, batch, heads, l, head_dim)``: materialised with a mask per example,
        a broadcast view of the prefix otherwise (for inspection; the forward pass never builds it)."""
        values = self.prefix.expand(-1, self.batch_size, -1, -1, -1)
        return values if self.keep is None else values * self.scale * self.keep


def prefix_concat(prefix: torch.Tensor, keep: torch.Tensor | None, scale: torch.Tensor | None,
                  states: torch.Tensor) -> torch.Tensor:
    """One layer's prefix keys (or values) in front of the sequence's (``torch.cat([prefix, states], dim=-2)``), with
    the per-example dropout draw ``keep`` (scaled by ``scale``) applied on the way when there is one."""
    if keep is None:
        return torch.cat([prefix.expand(states.shape[0], -1, -1, -1), states], dim=-2)
    return _DroppedPrefixCat.apply(prefix, keep, scale, states)


class _DroppedPrefixCat(torch.autograd.Function):
    """``torch.cat([dropout(prefix.expand(batch, ...)), states], dim=-2)`` with a given per-example draw, writing the
    dropped-out prefix straight into the result and keeping only the boolean mask for the backward pass (no torch op
    fuses a masked broadcast into a concatenation). Value for value what dropout and torch.cat compute.

    prefix: ``(1 or batch, heads, l, hd)``; keep: ``(batch, heads, l, hd)``, bool; scale: 0-d; states:
    ``(batch, heads, length, hd)``.
    """

    @staticmethod
    def forward(ctx, prefix, keep, scale, states):
        batch, heads, length, head_dim = states.shape
        prefix_length = prefix.shape[-2]
        out = states.new_empty(batch, heads, prefix_length + length, head_dim,
                               dtype=torch.promote_types(prefix.dtype, states.dtype))
        rows = prefix[:1] if prefix.stride(0) == 0 else prefix  # one row of a broadcast view is enough
        # the mask read as uint8 (the same bytes): torch multiplies by uint8 faster than by bool on the CPU
        torch.mul(rows * scale, keep.view(torch.uint8), out=out[:, :, :prefix_length])
        out[:, :, prefix_length:] = states
        ctx.save_for_backward(keep, scale)
        ctx.prefix_length = prefix_length
        ctx.broadcast = prefix.shape[0] != batch  # one prefix row for the whole batch
        return out

    @staticmethod
    def backward(ctx, grad):
        keep, scale = ctx.saved_tensors
        length = ctx.prefix_length
        grad_prefix = grad[:, :, :length] * keep.view(torch.uint8)
        if ctx.broadcast:  # sum the rows' gradients into the one prefix row
            grad_prefix = grad_prefix.sum(0, keepdim=True)
        return grad_prefix.mul_(scale), None, None, grad[:, :, length:]
