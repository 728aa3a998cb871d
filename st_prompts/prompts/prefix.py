"""Deep continuous prompts: trainable per-layer key/value prefixes (P-tuning v2 / prefix tuning, as in DCPCSE).

The layout follows the official DCPCSE implementation (and PEFT's ``PrefixEncoder``): one row of ``2·L·H`` numbers per
prefix position, viewed as ``(l, 2L, heads, head_dim)``. Not PEFT itself: sentence-transformers needs the backbone to
stay a plain ``transformers`` model, and DiffAug needs *views* of one prefix, which PEFT does not offer (the tests use
PEFT as the independent reference for the attention arithmetic).
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
            (Li & Liang's reparameterisation, DCPCSE's ``--prefix_projection``); otherwise a plain ``Embedding(l, 2·L·H)``.
        projection_hidden_size: ``P`` above (DCPCSE: 512).
        dropout: dropout applied to the keys/values in training (DCPCSE: the backbone's hidden dropout probability).
        shared_dropout: draw one dropout mask per forward pass for the whole batch instead of one per example (DCPCSE
            draws one per example). Saves materialising the prefix once per row: ``2L·batch·l·H`` numbers per pass.
        init_std: std of the normal initialisation of every weight (biases zero). The official code builds the prefix
            before transformers' ``init_weights()``, so it gets the backbone's ``initializer_range`` (0.02 for BERT),
            the default of :class:`~st_prompts.PromptedTransformer`. ``None``: torch's defaults (N(0, 1), 50x larger).
        gate: a zero-initialised gate per layer and key/value head (LLaMA-Adapter): the prefix is softmaxed on its
            own and added through ``tanh(gate)``, takes no positions, and at zero the encoder is its backbone
            (:mod:`st_prompts.prompts.injection`).
    """

    def __init__(
        self,
        prefix_length: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        projection: bool = False,
        projection_hidden_size: int = 512,
        dropout: float = 0.1,
        shared_dropout: bool = False,
        init_std: float | None = 0.02,
        gate: bool = False,
    ) -> None:
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
            self.transform = nn.Sequential(
                nn.Linear(hidden_size, projection_hidden_size),
                nn.Tanh(),
                nn.Linear(projection_hidden_size, out_size),
            )
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
        """Positions the prefix takes from the text with learned absolute positions: its length, or 0 with a gate
        (a gated prefix has no position, so the text keeps the backbone's own)."""
        return 0 if self.gated else self.prefix_length

    def gate_values(self) -> torch.Tensor | None:
        """``tanh(gate)`` as ``(L, 1, heads)`` (what scales each layer's prefix output), or ``None``."""
        return None if self.gate is None else torch.tanh(self.gate).unsqueeze(1)

    def reset_parameters(self, std: float) -> None:
        """Every ``Embedding`` / ``Linear`` weight ~ N(0, ``std``), biases 0: transformers' ``_init_weights`` for BERT,
        which the official code applies to its prefix encoder."""
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
        (``projection=False``) prefix encoder of the same shape, gate included.

        A reparameterised prefix's MLP reads a fixed embedding table, so its output *is* the prefix: storing it
        instead of the table and the MLP (2,567,168 numbers for a 16-position MiniLM prefix with ``P = 512``) is
        exact and takes ``l · 2L · H`` numbers (73,728 there). The MLP has no dropout; it is run without gradient.
        A plain prefix's state dict is returned as it is."""
        state = self.state_dict()
        if self.transform is None:
            return state
        with torch.no_grad():
            values = self.key_values().reshape(self.prefix_length, -1).detach().clone()
        stored = {"embedding.weight": values}
        if self.gate is not None:
            stored["gate"] = state["gate"]
        return stored

    def trainable_parameter_count(self) -> int:
        """Parameters training updates: the embedding table, the MLP with ``projection`` and the gate."""
        return sum(p.numel() for p in self.parameters())

    def stored_parameter_count(self) -> int:
        """Numbers a checkpoint stores (:meth:`stored_state_dict`): ``l · 2L · H`` (plus the gate), MLP or not."""
        gate = self.gate.numel() if self.gate is not None else 0
        return self.prefix_length * 2 * self.num_layers * self.num_heads * self.head_dim + gate

    def values(self, batch_size: int) -> PrefixDraw:
        """The prefix keys/values for a batch, with this pass's dropout draw in training (see :class:`PrefixDraw`).
        Several passes given one draw (``features["prefix_values"]``) share its dropout, as the official DCPCSE code's
        contrastive and MLM passes share one ``past_key_values``."""
        values = self.key_values()  # (l, 2L, heads, hd)
        values = values.permute(1, 2, 0, 3).unsqueeze(1)  # (2L, 1, heads, l, hd)
        gate = self.gate_values()
        if not (self.training and self.dropout.p > 0):
            return PrefixDraw(values, batch_size, gate=gate)
        if self.shared_dropout:
            # one mask for the batch; broadcast, never copied
            return PrefixDraw(self.dropout(values), batch_size, gate=gate)
        # One mask per example, kept as a boolean mask (a quarter of the float noise nn.Dropout keeps for its
        # backward); the dropped-out prefix itself is never stored: each layer writes its rows straight into its
        # key/value concatenation (see PrefixDraw). The mask is drawn 16 bits at a time (see draw_keep_mask).
        keep, keep_probability = draw_keep_mask(values.expand(-1, batch_size, -1, -1, -1).shape, self.dropout.p,
                                                device=values.device)
        scale = torch.full((), 1.0 / keep_probability if keep_probability > 0 else 0.0, dtype=values.dtype,
                           device=values.device)
        return PrefixDraw(values, batch_size, keep, scale, gate=gate)

    def forward(self, batch_size: int) -> PrefixDraw:
        """The prefix keys/values for a batch (:meth:`values`): a new dropout draw per example in training (one for
        the batch with ``shared_dropout``), broadcast without a copy otherwise. Which prefix positions a row attends
        to is decided by the attention mask (see :func:`prefix_view_mask`), not here."""
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

    Drawn from torch's random number generator (so ``torch.manual_seed`` makes it reproducible) 16 bits at a time:
    one 64-bit random word gives four entries, each kept when its 16-bit lane is at least ``round(p · 2**16)`` above
    the lane's minimum. The drop probability is therefore ``p`` rounded to a multiple of ``2**-16`` (0.1 becomes
    0.1000061); it is returned as ``1 - keep_probability``, so that callers scale the kept entries by
    ``1 / keep_probability`` and keep the expectation exact.

    Why not ``torch.bernoulli_``: on the CPU it spends one random number per entry, and DCPCSE's per-example prefix
    dropout draws ``2L · batch · l · H`` of them every pass (9.4M per MiniLM step at batch 128): 44 ms of a 0.9 s step
    against 12 ms here, on two cores (``benchmarks/efficiency.py`` times both). No torch op draws Bernoulli numbers
    from fewer random bits, hence this function.

    Returns ``(keep, keep_probability)``: a ``bool`` tensor of ``shape`` and the exact probability of ``True``
    (``generator``: default torch's global one). ``p`` outside ``[0, 1]`` is a ConfigurationError.
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


def prefix_view_mask(
    batch_size: int,
    prefix_length: int,
    view: int | Sequence[int] | torch.Tensor | None,
    num_views: int = 2,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A prefix attention mask (``1`` = attend) that lets each row see one *view* of the prefix.

    The ``prefix_length`` positions are cut into ``num_views`` contiguous, nearly equal blocks (position ``p`` belongs
    to view ``p * num_views // prefix_length``; with ``prefix_length = 2l`` and two views: the first and the second
    half). Pass the result as ``features["prefix_attention_mask"]``: positions are never shifted, so a row attending to
    view 1 has exactly the positions it has at inference, where all prefix positions are attended.

    ``view``: the view every row attends to (an ``int``), one view per row (a sequence or 1-D tensor of ``batch_size``
    ints, so rows with different views share one forward pass), or ``None`` for all positions. Returns a ``long``
    tensor of shape ``(batch_size, prefix_length)``.

    Example::

        # DiffAug: the anchor attends to the first half of the prefix, the positive to the second half
        anchor["prefix_attention_mask"] = prefix_view_mask(len(texts), encoder.prefix_length, view=0)
        positive["prefix_attention_mask"] = prefix_view_mask(len(texts), encoder.prefix_length, view=1)

    Raises:
        ConfigurationError: for ``num_views`` outside ``[1, prefix_length]``, a view outside ``[0, num_views)``, or a
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
    """How many masked-out prefix positions make ``prefix_length + token_length`` keys a multiple of ``multiple``.

    Why: torch's CPU attention kernel (``scaled_dot_product_attention``'s flash path) runs at its full speed only
    when the number of keys is a multiple of 16; between two multiples it is up to twice as slow (measured on MiniLM's
    shapes, batch 128 and 32 queries: 32 keys 1.9 ms, 44 keys 4.6 ms, 48 keys 2.7 ms). A prefix adds ``l`` keys to
    every sentence, so without padding a 12-position prefix on 32-token batches cost 9 % of the plain backbone's
    encode throughput. The padded keys are zeros that the attention mask excludes: the output does not change.
    """
    return -(prefix_length + token_length) % multiple


def pad_prefix(values: PrefixDraw | torch.Tensor, positions: int) -> PrefixDraw:
    """``values`` (without a per-example dropout mask) with ``positions`` zero positions appended to the prefix of
    every layer (mask them out of attention; see :func:`key_padding`)."""
    if isinstance(values, torch.Tensor):
        values = PrefixDraw(values, values.shape[1])
    if values.keep is not None:
        raise ConfigurationError("a prefix with a dropout mask per example cannot be padded.")
    if positions == 0:
        return values
    prefix = torch.nn.functional.pad(values.prefix, (0, 0, 0, positions))  # (2L, 1 or batch, heads, l + pad, hd)
    return PrefixDraw(prefix, values.batch_size, gate=values.gate, gated=values.gated)


class PrefixDraw:
    """The prefix keys/values of one forward pass, kept factorised rather than as a dense per-row tensor.

    Attributes:
        prefix: ``(2L, 1, heads, l, head_dim)``, the prefix every row starts from (a graph node over the trainable
            parameters; with a shared dropout mask, already dropped out), or a dense ``(2L, batch, ...)`` tensor.
        keep: with a dropout mask per example (training), the draw: a boolean ``(2L, batch, heads, l, head_dim)``
            mask; ``None`` otherwise.
        scale: ``1 / P(keep)`` as a 0-d tensor, with ``keep`` (``P(keep) = 1 - p`` up to ``2**-16``, see
            :func:`draw_keep_mask`).
        gate: with a gated prefix, ``tanh(gate)`` as ``(L, 1 or sets, heads)`` (``None``: no gate; the prefix joins
            the text's softmax).
        gated: with stacked prompt sets of which only some are gated, which ones (``(sets,)`` bool); ``None`` when
            every set is (``gate`` given) or none is.

    Why not simply ``dropout(prefix.expand(batch, ...))`` (what the official DCPCSE code does): on the CPU, nn.Dropout
    keeps a float noise tensor and the dropped-out prefix, ``2L·batch·l·H`` numbers each (36 MiB each for MiniLM,
    batch 128 and 16 positions), alive until the backward pass. Here each layer writes its rows into the
    concatenation with the real tokens' keys/values, which attention needs anyway, and only the boolean mask is kept:
    the same values and gradients as ``prefix * keep * scale`` then torch.cat (``tests/test_prompted_transformer.py``
    checks them bit for bit), a fraction of the memory.
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
    """One layer's prefix keys (or values) in front of the sequence's: ``torch.cat([prefix, states], dim=-2)``, with
    the per-example dropout draw ``keep`` (scaled by ``scale``) applied on the way when there is one (shapes: see
    :class:`_DroppedPrefixCat`)."""
    if keep is None:
        return torch.cat([prefix.expand(states.shape[0], -1, -1, -1), states], dim=-2)
    return _DroppedPrefixCat.apply(prefix, keep, scale, states)


class _DroppedPrefixCat(torch.autograd.Function):
    """``torch.cat([dropout(prefix.expand(batch, ...)), states], dim=-2)`` with a given per-example draw, writing the
    dropped-out prefix straight into the result and keeping only the boolean mask for the backward pass.

    Written by hand because no torch op fuses a masked broadcast into a concatenation. Value for value what dropout
    (kept entries times ``scale``) and torch.cat compute, forward and backward; the gradient of a broadcast prefix is
    summed over the batch here, in one masked pass, instead of by autograd's ``expand`` backward after a second one.

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
        # dropout: input * noise, noise in {0, scale}. The mask is read as uint8 (the same bytes): torch multiplies a
        # float by uint8 about 1.5x faster than by bool on the CPU (measured), with identical results.
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
