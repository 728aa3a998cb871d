"""Deep continuous prompts: trainable per-layer key/value prefixes (P-tuning v2 / prefix tuning, as in DCPCSE).

The layout follows the official DCPCSE implementation (and PEFT's ``PrefixEncoder``): one row of ``2·L·H`` numbers per
prefix position, viewed as ``(l, 2L, heads, head_dim)`` and split into a key and a value tensor per layer. We write
this small module ourselves rather than wrapping the backbone in a PEFT model because sentence-transformers needs the
backbone to stay a plain ``transformers`` model inside its ``Transformer`` module (tokenisation, saving, hub loading),
and because DiffAug needs *views* of one prefix (its two halves), which PEFT does not offer. PEFT is used in the tests
as the independent reference for the attention arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PrefixEncoder(nn.Module):
    """Trainable key/value prefixes for every self-attention layer of a backbone.

    Args:
        prefix_length: number of prefix positions ``l`` (virtual tokens) prepended in every layer.
        num_layers: number of transformer layers ``L`` of the backbone.
        num_heads: attention heads per layer.
        head_dim: size of one head (``hidden_size // num_heads``).
        projection: reparameterise the prefix as ``Embedding(l, H) → Linear(H, P) → Tanh → Linear(P, 2·L·H)``
            (Li & Liang's reparameterisation, DCPCSE's ``--prefix_projection``); otherwise a plain ``Embedding(l, 2·L·H)``.
        projection_hidden_size: ``P`` above (DCPCSE: 512).
        dropout: dropout applied to the keys/values in training (DCPCSE: the backbone's hidden dropout probability).
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
        self.register_buffer("prefix_tokens", torch.arange(prefix_length), persistent=False)

    def key_values(self, positions: slice | None = None) -> torch.Tensor:
        """The (batch-independent) prefix as one tensor of shape ``(l', 2L, heads, head_dim)``.

        Args:
            positions: optional slice of prefix positions to use (a *view* of the prefix, e.g. one half of it).
        """
        tokens = self.prefix_tokens if positions is None else self.prefix_tokens[positions]
        values = self.embedding(tokens)
        if self.transform is not None:
            values = self.transform(values)
        return values.view(len(tokens), 2 * self.num_layers, self.num_heads, self.head_dim)

    def forward(self, batch_size: int, positions: slice | None = None) -> PrefixCache:
        """Build a fresh key/value cache holding the prefix for a batch.

        A new cache is needed for every forward pass: transformers appends the real tokens' keys/values to it in place.
        Dropout (in training mode) is drawn independently for every example, as in DCPCSE; without dropout the prefix
        is broadcast over the batch without a copy.
        """
        values = self.key_values(positions)  # (l, 2L, heads, hd)
        values = values.permute(1, 2, 0, 3).unsqueeze(1)  # (2L, 1, heads, l, hd)
        values = values.expand(-1, batch_size, -1, -1, -1)
        if self.training and self.dropout.p > 0:
            values = self.dropout(values)
        return PrefixCache([(values[2 * i], values[2 * i + 1]) for i in range(self.num_layers)])

    def extra_repr(self) -> str:
        return (
            f"prefix_length={self.prefix_length}, num_layers={self.num_layers}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, projection={self.projection}"
        )


class PrefixCache(DynamicCache):
    """A ``DynamicCache`` pre-filled with the prefix keys/values of every layer, without copying them.

    ``DynamicCache(ddp_cache_data)`` would concatenate every layer's prefix onto an empty tensor (one copy per key and
    value tensor, per layer, per forward pass); here each layer starts out holding the (possibly batch-broadcast)
    prefix tensors themselves, and the only copy left is the one transformers makes when it appends the real tokens.
    """

    def __init__(self, key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.layers = [_PrefilledLayer(keys, values) for keys, values in key_values]


class _PrefilledLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
