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
from st_prompts.losses.views import apply_prefix_views, check_prefix_views
from st_prompts.prompts.features import TEMPLATE_DENOISING


class PrefixViewSoftmaxLoss(SoftmaxLoss):
    """sentence-transformers' ``SoftmaxLoss`` (``Linear(3H, num_labels)`` over ``(u, v, |u − v|)``), with each of
    the two columns attending to its own view of the prefix.

    DiffAug's stage 1: the premise sees the first half of a ``2l`` prefix (``θ1``), the hypothesis the second
    (``θ2``), labels entailment = 1 and contradiction = 0. The classifier lives in the loss: it trains but is not
    saved with the model.

    ``prefix_views``: the view of each column (default ``(0, 1)``); ``None`` attends to the whole prefix.
    """

    def __init__(self, model, num_labels: int = 2, prefix_views: tuple[int, int] | None = (0, 1),
                 num_views: int = 2) -> None:
        super().__init__(model, model.get_embedding_dimension(), num_labels)
        self.prefix_views = tuple(prefix_views) if prefix_views is not None else None
        self.num_views = num_views
        if self.prefix_views is not None:
            if len(self.prefix_views) != 2:
                raise ConfigurationError(f"PrefixViewSoftmaxLoss takes two columns, got views {self.prefix_views}.")
            check_prefix_views(model, self.prefix_views, num_views)

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None):
        sentence_features = list(sentence_features)
        if len(sentence_features) != 2:
            raise ConfigurationError(
                f"The NLI loss needs (premise, hypothesis) columns and a label, got {len(sentence_features)} column(s)."
            )
        if self.prefix_views is not None:
            apply_prefix_views(self.model, sentence_features, self.prefix_views, self.num_views)
        return super().forward(sentence_features, labels)

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "prefix_views": self.prefix_views}


class NLITripletSoftmaxLoss(nn.Module):
    """DiffAug's NLI objective over ``(premise, entailment, contradiction)`` triplets: each premise is encoded once,
    and a ``Linear(3H, 2)`` classifier sees two rows per triplet, ``(u, e, |u − e|)`` labelled 1 and
    ``(u, c, |u − c|)`` labelled 0: ``2 · batch`` classifier rows per step (the official stage 1 and auxiliary loss).

    With prefix views ``(0, 1, 1)``, the premise attends to the first half of a ``2l`` prefix and both hypotheses to
    the second. ``mlp`` (DiffAug's ``--mlp_train``) is applied to the three sentence embeddings before the classifier;
    it is a module shared with the contrastive loss (frozen in stage 1, trained in stage 2). The classifier starts as
    the official one does (weights ~ N(0, ``initializer_range``), bias 0) and lives in the loss: it trains but is not
    saved with the model. The labels the trainer passes are ignored: the columns say which row is which.

    Args:
        prefix_views: the view of each of the three columns (default ``(0, 1, 1)``); ``None``: the whole prefix.
        template_denoising: ask the encoder for template denoising of these columns (``None``: the encoder's
            setting; DiffAug's official code denoises neither in stage 1 nor in the auxiliary loss: ``False``).
        initializer_range: std of the classifier's initial weights (default: the backbone's, else 0.02).
    """

    def __init__(self, model, prefix_views: tuple[int, int, int] | None = (0, 1, 1), num_views: int = 2,
                 mlp: nn.Module | None = None, template_denoising: bool | None = False,
                 initializer_range: float | None = None) -> None:
        super().__init__()
        self.model = model
        self.prefix_views = tuple(prefix_views) if prefix_views is not None else None
        self.num_views = num_views
        if self.prefix_views is not None:
            if len(self.prefix_views) != 3:
                raise ConfigurationError(f"NLITripletSoftmaxLoss takes three columns, got views {self.prefix_views}.")
            check_prefix_views(model, self.prefix_views, num_views)
        self.mlp = mlp
        self.template_denoising = template_denoising
        if initializer_range is None:
            config = getattr(getattr(model[0], "auto_model", None), "config", None)
            initializer_range = float(getattr(config, "initializer_range", None) or 0.02)
        dimension = model.get_embedding_dimension()
        self.classifier = nn.Linear(3 * dimension, 2)
        with torch.no_grad():
            self.classifier.weight.normal_(0.0, initializer_range)
            self.classifier.bias.zero_()

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None = None):
        sentence_features = list(sentence_features)
        if len(sentence_features) != 3:
            raise ConfigurationError(
                f"The NLI triplet loss needs (premise, entailment, contradiction) columns, got {len(sentence_features)}."
            )
        if self.prefix_views is not None:
            apply_prefix_views(self.model, sentence_features, self.prefix_views, self.num_views)
        if self.template_denoising is not None:
            for features in sentence_features:
                features[TEMPLATE_DENOISING] = self.template_denoising
        premise, entailment, contradiction = (self.model(f)["sentence_embedding"] for f in sentence_features)
        if self.mlp is not None:
            premise, entailment, contradiction = self.mlp(premise), self.mlp(entailment), self.mlp(contradiction)
        rows = torch.cat([
            torch.cat([premise, entailment, (premise - entailment).abs()], dim=1),
            torch.cat([premise, contradiction, (premise - contradiction).abs()], dim=1),
        ])
        targets = torch.cat([torch.ones(len(premise), dtype=torch.long), torch.zeros(len(premise), dtype=torch.long)])
        return nn.functional.cross_entropy(self.classifier(rows), targets.to(rows.device))

    def get_config_dict(self) -> dict[str, Any]:
        return {"prefix_views": self.prefix_views, "mlp": self.mlp is not None,
                "template_denoising": self.template_denoising}


class ColumnSplitLoss(nn.Module):
    """``main`` over the first ``main_columns`` columns plus ``weight · auxiliary`` over the rest (with the labels).

    DiffAug's semi-supervised stage 2: InfoNCE over (sentence, sentence) with two prefix views, plus ``1e-3`` times
    the NLI cross-entropy over (premise, hypothesis, label) rows of the same batch. Returns a dict with the main
    loss's parts and ``"auxiliary"`` (already weighted), which the trainer logs separately and sums.

    ``model`` is registered first, so parameter names start with ``model.``; ``main`` is not passed the labels.
    """

    def __init__(self, model, main: nn.Module, auxiliary: nn.Module, main_columns: int, weight: float) -> None:
        super().__init__()
        if weight < 0:
            raise ConfigurationError(f"The auxiliary loss weight must be >= 0, got {weight}.")
        self.model = model
        self.main = main
        self.auxiliary = auxiliary
        self.main_columns = main_columns
        self.weight = weight

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None):
        sentence_features = list(sentence_features)
        if len(sentence_features) <= self.main_columns:
            raise ConfigurationError(
                f"ColumnSplitLoss needs {self.main_columns} main column(s) and the auxiliary ones; got "
                f"{len(sentence_features)}."
            )
        main = self.main(sentence_features[: self.main_columns], None)
        parts = dict(main) if isinstance(main, dict) else {"main": main}
        parts["auxiliary"] = self.weight * self.auxiliary(sentence_features[self.main_columns :], labels)
        return parts

    def get_config_dict(self) -> dict[str, Any]:
        return {"main_columns": self.main_columns, "weight": self.weight}
