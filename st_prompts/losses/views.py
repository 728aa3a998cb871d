"""Prefix views of loss columns: each column's rows attend to one block of the prefix (DiffAug's two prefixes)."""

from __future__ import annotations

import torch

from st_prompts.errors import ConfigurationError
from st_prompts.modules import PromptedTransformer
from st_prompts.prompts.prefix import prefix_view_mask


def check_prefix_views(model, views: tuple[int, ...], num_views: int) -> None:
    """Refuse prefix views on a model without a prefix, or views outside ``[0, num_views)``."""
    encoder = model[0]
    if not isinstance(encoder, PromptedTransformer) or encoder.prefix_encoder is None:
        raise ConfigurationError("prefix_views need a PromptedTransformer with a prefix as the model's first module.")
    if not 1 <= num_views <= encoder.prefix_length:
        raise ConfigurationError(f"num_views={num_views} does not fit a prefix of {encoder.prefix_length} positions.")
    if any(not 0 <= v < num_views for v in views):
        raise ConfigurationError(f"prefix_views {views} must lie in [0, {num_views}).")


def checked_prefix_views(model, views, num_views: int, owner: str = "", columns: str = "") -> tuple[int, ...] | None:
    """``views`` as a tuple checked by :func:`check_prefix_views` (and, given ``columns``, e.g. ``"two"``, their count
    for the loss ``owner``), or ``None``."""
    if views is None:
        return None
    views = tuple(views)
    if columns and len(views) != {"two": 2, "three": 3}[columns]:
        raise ConfigurationError(f"{owner} takes {columns} columns, got views {views}.")
    check_prefix_views(model, views, num_views)
    return views


def apply_prefix_views(model, sentence_features: list[dict[str, torch.Tensor]], views: tuple[int, ...],
                       num_views: int = 2) -> None:
    """Set ``features["prefix_attention_mask"]`` of column ``i`` to view ``views[i]`` of the prefix (in place): its
    rows attend to their view's block only, at the positions of inference."""
    if len(views) != len(sentence_features):
        raise ConfigurationError(f"{len(views)} prefix view(s) for {len(sentence_features)} column(s).")
    prefix_length = model[0].prefix_length
    for features, view in zip(sentence_features, views):
        input_ids = features["input_ids"]
        features["prefix_attention_mask"] = prefix_view_mask(input_ids.shape[0], prefix_length, view, num_views,
                                                             device=input_ids.device)
