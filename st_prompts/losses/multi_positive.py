"""Weighted multi-positive InfoNCE: several InfoNCE terms over named columns, summed with weights (SKICSE).

A term names its anchor column, its positive column and its candidate columns (the denominator: every row of each)::

    ℓ_i = −s(a_i, p_i)/τ + log Σ_{c ∈ candidates} Σ_j exp(s(a_i, c_j)/τ)

Columns are addressed by name, so an extra column never silently becomes a hard negative. ``labels`` may flag (0/1)
rows whose ``presence_column`` has no real text: such a row leaves the terms that use it as anchor or positive (the
others are scaled up to the full weight) and every denominator; it is counted in ``missing_rows``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from st_prompts.errors import ConfigurationError
from st_prompts.losses.constants import SUPERVISED_READINGS
from st_prompts.losses.infonce import simcse_mlp


@dataclass(frozen=True)
class InfoNCETerm:
    """One weighted InfoNCE term: ``weight · InfoNCE(anchor; positive | candidates)``, columns by name."""

    name: str
    anchor: str
    positive: str
    candidates: tuple[str, ...]
    weight: float

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ConfigurationError(f"Term {self.name!r} has no candidate column.")
        if self.weight < 0:
            raise ConfigurationError(f"Term {self.name!r} has a negative weight {self.weight}.")
        object.__setattr__(self, "candidates", tuple(self.candidates))

    def uses(self, column: str) -> bool:
        return column in (self.anchor, self.positive) or column in self.candidates


def skicse_unsupervised_terms(ski_weight: float = 0.15) -> list[InfoNCETerm]:
    """Eq. 1–3 over columns ``(anchor, positive, ski)``: ``(1−λ)·InfoNCE(x; x′) + λ·InfoNCE(x; x_ski)``."""
    if not 0 <= ski_weight <= 1:
        raise ConfigurationError(f"The SKI weight λ must be in [0, 1], got {ski_weight}.")
    return [InfoNCETerm("simcse", "anchor", "positive", ("positive",), 1.0 - ski_weight),
            InfoNCETerm("ski", "anchor", "ski", ("ski",), ski_weight)]


def skicse_supervised_terms(ski_weight_1: float = 0.1, ski_weight_2: float = 0.3,
                            reading: str = "text") -> list[InfoNCETerm]:
    """Eq. 4–7 over columns ``(anchor, positive, negative, ski)`` in one of :data:`SUPERVISED_READINGS` (why
    ``text`` is the default: ``docs/methods/skicse.md``)."""
    if reading not in SUPERVISED_READINGS:
        raise ConfigurationError(f"Unknown reading {reading!r}; choose one of {', '.join(SUPERVISED_READINGS)}.")
    if ski_weight_1 < 0 or ski_weight_2 < 0 or ski_weight_1 + ski_weight_2 > 1:
        raise ConfigurationError(f"Need λ1, λ2 >= 0 and λ1 + λ2 <= 1, got {ski_weight_1}, {ski_weight_2}.")
    both = ("positive", "negative")
    if reading == "printed":
        ski_anchor = InfoNCETerm("ski_anchor", "ski", "negative", both, ski_weight_1)
        ski_positive = InfoNCETerm("ski_positive", "anchor", "ski", both, ski_weight_2)
    else:
        ski_anchor = InfoNCETerm("ski_anchor", "ski", "positive", both, ski_weight_1)
        ski_positive = InfoNCETerm("ski_positive", "anchor", "ski", ("ski", "negative"), ski_weight_2)
    return [InfoNCETerm("simcse", "anchor", "positive", both, 1.0 - ski_weight_1 - ski_weight_2), ski_anchor,
            ski_positive]


class MultiPositiveInfoNCELoss(nn.Module):
    """A weighted sum of InfoNCE terms over named columns (see the module docstring); ``forward`` returns
    ``{term name: weighted part}``.

    Args:
        columns: the dataset's text columns, in order (not ``label``); each must be used by a term.
        scale: inverse temperature (20 → τ = 0.05).
        presence_column: the column whose rows may be missing, flagged by ``labels`` (1 present, 0 missing).
        mlp: SimCSE's training-only ``Linear(H, H) + Tanh`` over the embeddings (optimised, never saved).
    """

    def __init__(self, model, columns: Sequence[str], terms: Iterable[InfoNCETerm], scale: float = 20.0,
                 presence_column: str | None = None, mlp: bool = False) -> None:
        super().__init__()
        self.model = model
        self.columns = tuple(columns)
        self.terms = list(terms)
        self.scale = scale
        self.presence_column = presence_column
        if len(set(self.columns)) != len(self.columns):
            raise ConfigurationError(f"Duplicate column names in {self.columns}.")
        if not self.terms:
            raise ConfigurationError("MultiPositiveInfoNCELoss needs at least one term.")
        if len({t.name for t in self.terms}) != len(self.terms):
            raise ConfigurationError("Term names must be unique.")
        for term in self.terms:
            unknown = [c for c in (term.anchor, term.positive, *term.candidates) if c not in self.columns]
            if unknown:
                raise ConfigurationError(f"Term {term.name!r} names column(s) {unknown} that are not among the "
                                         f"loss's columns {list(self.columns)}.")
        unused = [c for c in self.columns if not any(t.uses(c) for t in self.terms)]
        if unused:
            raise ConfigurationError(f"Column(s) {unused} are used by no term: remove them from the dataset, or say "
                                     "what they are in a term (they never become negatives by position).")
        if presence_column is not None and presence_column not in self.columns:
            raise ConfigurationError(f"presence_column {presence_column!r} is not among {list(self.columns)}.")
        self.mlp = simcse_mlp(model) if mlp else None
        self.rows = self.missing_rows = 0

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]],
                labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
        sentence_features = list(sentence_features)
        if len(sentence_features) != len(self.columns):
            raise ConfigurationError(
                f"MultiPositiveInfoNCELoss expects the columns {list(self.columns)} ({len(self.columns)}), the batch "
                f"has {len(sentence_features)}: the dataset's columns must be exactly these names, in this order.")
        embeddings = {}
        for column, features in zip(self.columns, sentence_features):
            embedding = self.model(features)["sentence_embedding"]
            if self.mlp is not None and self.model.training:
                embedding = self.mlp(embedding)
            embeddings[column] = nn.functional.normalize(embedding, dim=-1)
        return self.compute_loss_from_embeddings(embeddings, labels)

    def compute_loss_from_embeddings(self, embeddings: dict[str, torch.Tensor],
                                     labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The parts from L2-normalised embeddings ``{column: (batch, dim)}`` and the presence flags."""
        anchor = embeddings[self.columns[0]]
        batch, device = anchor.shape[0], anchor.device
        present = torch.ones(batch, dtype=torch.bool, device=device)
        if self.presence_column is not None and labels is not None:
            present = labels.to(device).reshape(-1).bool()
        if self.model.training:
            self.rows += batch
            self.missing_rows += int((~present).sum())
        # Per-row availability of each term, then weights rescaled so that every row has the full total weight.
        available = torch.stack([self._available(t, present) for t in self.terms])  # (terms, batch)
        weights = torch.tensor([t.weight for t in self.terms], device=device, dtype=anchor.dtype)
        kept = (weights[:, None] * available).sum(0)
        total = sum(t.weight for t in self.terms)
        factor = torch.where(kept > 0, total / kept.clamp_min(1e-12), torch.zeros_like(kept))
        parts = {}
        for index, term in enumerate(self.terms):
            row_weight = weights[index] * available[index] * factor
            if term.weight == 0 or not bool(available[index].any()):
                parts[term.name] = anchor.sum() * 0.0
                continue
            losses = self._term_losses(term, embeddings, present)
            losses = torch.where(available[index].bool(), losses, torch.zeros_like(losses))
            parts[term.name] = (row_weight * losses).sum() / batch
        return parts

    def _available(self, term: InfoNCETerm, present: torch.Tensor) -> torch.Tensor:
        if self.presence_column is None or self.presence_column not in (term.anchor, term.positive):
            return torch.ones_like(present, dtype=torch.float32)
        return present.float()

    def _term_losses(self, term: InfoNCETerm, embeddings: dict[str, torch.Tensor],
                     present: torch.Tensor) -> torch.Tensor:
        a = embeddings[term.anchor]
        positive_scores = (a * embeddings[term.positive]).sum(-1) * self.scale
        blocks = []
        for column in term.candidates:
            scores = a @ embeddings[column].T * self.scale
            if column == self.presence_column:
                scores = scores.masked_fill(~present[None, :], float("-inf"))
            blocks.append(scores)
        return torch.logsumexp(torch.cat(blocks, dim=1), dim=1) - positive_scores

    def get_config_dict(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "scale": self.scale, "presence_column": self.presence_column,
                "mlp": self.mlp is not None,
                "terms": [{"name": t.name, "anchor": t.anchor, "positive": t.positive,
                           "candidates": list(t.candidates), "weight": t.weight} for t in self.terms]}
