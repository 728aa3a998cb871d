"""NLI cross-entropy over ``(u, v, |u − v|)`` with prefix views: over labelled pairs, or over triplets as DiffAug's
stage 1 and auxiliary loss; and a loss that adds a weighted auxiliary loss over extra columns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sentence_transformers.sentence_transformer.losses import SoftmaxLoss
from torch import nn

from st_prompts.errors import ConfigurationError
from st_prompts.losses.constants import NLI_LABELS  # noqa: E402,F401  (re-exported)
from st_prompts.losses.infonce import initialized_linear
from st_prompts.losses.views import apply_prefix_views, checked_prefix_views
from st_prompts.prompts.features import TEMPLATE_DENOISING


class PrefixViewSoftmaxLoss(SoftmaxLoss):
    """sentence-transformers' ``SoftmaxLoss`` over ``(u, v, |u − v|)``, each of the two columns attending to its own
    view of the prefix (``prefix_views``, default ``(0, 1)``: DiffAug's stage 1; ``None``: the whole prefix)."""

    def __init__(self, model, num_labels: int = 2, prefix_views: tuple[int, int] | None = (0, 1),
                 num_views: int = 2) -> None:
        super().__init__(model, model.get_embedding_dimension(), num_labels)
        self.prefix_views = checked_prefix_views(model, prefix_views, num_views, "PrefixViewSoftmaxLoss", "two")
        self.num_views = num_views

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None):
        sentence_features = list(sentence_features)
        if len(sentence_features) != 2:
            raise ConfigurationError(f"The NLI loss needs (premise, hypothesis) columns and a label, got "
                                     f"{len(sentence_features)} column(s).")
        if self.prefix_views is not None:
            apply_prefix_views(self.model, sentence_features, self.prefix_views, self.num_views)
        return super().forward(sentence_features, labels)

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "prefix_views": self.prefix_views}


class NLITripletSoftmaxLoss(nn.Module):
    """DiffAug's NLI objective over ``(premise, entailment, contradiction)`` triplets: a ``Linear(3H, 2)`` classifier
    (in the loss, not saved) sees ``(u, e, |u − e|)`` labelled 1 and ``(u, c, |u − c|)`` labelled 0; the trainer's
    labels are ignored. ``mlp`` (DiffAug's ``--mlp_train``, shared with the contrastive loss) is applied first.

    Args:
        prefix_views: the view of each of the three columns (default ``(0, 1, 1)``); ``None``: the whole prefix.
        template_denoising: for these columns (``None``: the encoder's setting; DiffAug's code: ``False``).
        initializer_range: std of the classifier's initial weights (default: the backbone's, else 0.02).
    """

    def __init__(self, model, prefix_views: tuple[int, int, int] | None = (0, 1, 1), num_views: int = 2,
                 mlp: nn.Module | None = None, template_denoising: bool | None = False,
                 initializer_range: float | None = None) -> None:
        super().__init__()
        self.model = model
        self.prefix_views = checked_prefix_views(model, prefix_views, num_views, "NLITripletSoftmaxLoss", "three")
        self.num_views = num_views
        self.mlp = mlp
        self.template_denoising = template_denoising
        self.classifier = initialized_linear(model, 3 * model.get_embedding_dimension(), 2, initializer_range)

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None = None):
        sentence_features = list(sentence_features)
        if len(sentence_features) != 3:
            raise ConfigurationError(f"The NLI triplet loss needs (premise, entailment, contradiction) columns, got "
                                     f"{len(sentence_features)}.")
        if self.prefix_views is not None:
            apply_prefix_views(self.model, sentence_features, self.prefix_views, self.num_views)
        if self.template_denoising is not None:
            for features in sentence_features:
                features[TEMPLATE_DENOISING] = self.template_denoising
        premise, entailment, contradiction = (self.model(f)["sentence_embedding"] for f in sentence_features)
        if self.mlp is not None:
            premise, entailment, contradiction = self.mlp(premise), self.mlp(entailment), self.mlp(contradiction)
        rows = torch.cat([torch.cat([premise, entailment, (premise - entailment).abs()], dim=1),
                          torch.cat([premise, contradiction, (premise - contradiction).abs()], dim=1)])
        targets = torch.cat([torch.ones(len(premise), dtype=torch.long), torch.zeros(len(premise), dtype=torch.long)])
        return nn.functional.cross_entropy(self.classifier(rows), targets.to(rows.device))

    def get_config_dict(self) -> dict[str, Any]:
        return {"prefix_views": self.prefix_views, "mlp": self.mlp is not None,
                "template_denoising": self.template_denoising}


class ColumnSplitLoss(nn.Module):
    """``main`` over the first ``main_columns`` columns (without the labels) plus ``weight · auxiliary`` over the rest
    (with them), as DiffAug's stage 2; returns the main loss's parts and ``"auxiliary"`` (already weighted)."""

    def __init__(self, model, main: nn.Module, auxiliary: nn.Module, main_columns: int, weight: float) -> None:
        super().__init__()
        if weight < 0:
            raise ConfigurationError(f"The auxiliary loss weight must be >= 0, got {weight}.")
        self.model = model  # registered first: parameter names start with ``model.``
        self.main = main
        self.auxiliary = auxiliary
        self.main_columns = main_columns
        self.weight = weight

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None):
        sentence_features = list(sentence_features)
        if len(sentence_features) <= self.main_columns:
            raise ConfigurationError(f"ColumnSplitLoss needs {self.main_columns} main column(s) and the auxiliary "
                                     f"ones; got {len(sentence_features)}.")
        main = self.main(sentence_features[: self.main_columns], None)
        parts = dict(main) if isinstance(main, dict) else {"main": main}
        parts["auxiliary"] = self.weight * self.auxiliary(sentence_features[self.main_columns :], labels)
        return parts

    def get_config_dict(self) -> dict[str, Any]:
        return {"main_columns": self.main_columns, "weight": self.weight}
