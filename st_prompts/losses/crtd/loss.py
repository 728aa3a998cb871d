"""D2CSE's objective: InfoNCE + λ · conditional replaced-token detection (CRTD), on one prompted, frozen encoder.

Per column, ``h = pooler([CLS] of f(x))`` (DiffCSE's BatchNorm MLP pooler, training only, never saved); ``L_CL``:
InfoNCE over the ``h``; the corrupted copy goes through the *same* encoder with its position-0 input row replaced by
``h`` (not detached); ``L_CRTD``: a ``Linear(H, 2)`` head's cross-entropy over the real, non-special tokens. Unlike
DiffCSE's code, only the selected positions are replaced and the mean skips padding."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch import nn

from st_prompts.errors import ConfigurationError, CorruptionCacheError
from st_prompts.losses.crtd.corruption import crtd_labels, prepare_corruptions
from st_prompts.losses.infonce import INPUT_KEYS, distributed_training
from st_prompts.modules import PromptedTransformer
from st_prompts.prompts.features import CLS_OVERRIDE
from st_prompts.utils import check_finite

#: ``condition`` values: the pooled training embedding (DiffCSE's default) or the [CLS] output before the pooler.
CONDITIONS = ("pooled", "cls")


class BatchNormMLPPooler(nn.Module):
    """DiffCSE's ``ProjectionMLP``: ``Linear(H, 2H) → BN → ReLU → Linear(2H, H) → BN(affine=False)``, no biases; for
    training only (no running statistics kept), the linear weights ~ N(0, ``initializer_range``) as in DiffCSE."""

    def __init__(self, dimension: int, initializer_range: float = 0.02) -> None:
        super().__init__()
        hidden = 2 * dimension
        self.net = nn.Sequential(
            nn.Linear(dimension, hidden, bias=False),
            nn.BatchNorm1d(hidden, track_running_stats=False),
            nn.ReLU(),
            nn.Linear(hidden, dimension, bias=False),
            nn.BatchNorm1d(dimension, affine=False, track_running_stats=False),
        )
        for module in self.net:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=initializer_range)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.net(embeddings)


class CRTDLoss(nn.Module):
    """D2CSE's loss: InfoNCE + λ · conditional replaced-token detection by the same prompted frozen encoder. Call
    :meth:`prepare` on the training data before training (it corrupts every sentence once, or reuses a cache).

    Args:
        model: its first module a :class:`~st_prompts.PromptedTransformer` (no template), its embedding [CLS].
        crtd_weight: λ (D2CSE: 0.005); 0 trains InfoNCE with the pooler alone (no corruption needed).
        pooler: apply DiffCSE's BatchNorm MLP pooler in training (D2CSE: yes).
        condition: ``"pooled"`` (the pooled training embedding, DiffCSE's default) or ``"cls"`` (before the pooler).
        generator: ``"backbone-mlm"`` (offline fallback), a Hugging Face masked LM sharing the encoder's vocabulary,
            or a :class:`~st_prompts.losses.crtd.generators.MaskedLMGenerator`.
        masking_ratio, seed, cache_dir, cache_file, generator_options: see :func:`prepare_corruptions`.
        corruptions: an existing :class:`~st_prompts.losses.crtd.corruption.CorruptionCache` (no :meth:`prepare`).
    """

    def __init__(self, model, scale: float = 20.0, crtd_weight: float = 0.005, pooler: bool = True,
                 condition: str = "pooled", generator: Any = "backbone-mlm", masking_ratio: float = 0.3, seed: int = 42,
                 cache_dir: str | None = None, cache_file: str | None = None,
                 generator_options: dict[str, Any] | None = None, corruptions=None) -> None:
        super().__init__()
        check_finite(scale=scale, crtd_weight=crtd_weight, masking_ratio=masking_ratio)
        encoder = model[0]
        if not isinstance(encoder, PromptedTransformer):
            raise ConfigurationError("CRTDLoss needs a PromptedTransformer as the model's first module.")
        if encoder.template is not None:
            raise ConfigurationError("CRTDLoss conditions the [CLS] row of a plain sentence; templates are not supported.")
        config = encoder.auto_model.config
        input_size = encoder.auto_model.get_input_embeddings().weight.shape[1]
        if input_size != config.hidden_size:
            raise ConfigurationError(
                f"CRTD puts the sentence vector (size {config.hidden_size}) in place of the [CLS] input embedding (size "
                f"{input_size}); backbones whose input embeddings have another size than their hidden states are not "
                "supported.")
        if crtd_weight < 0:
            raise ConfigurationError(f"crtd_weight must be >= 0, got {crtd_weight}.")
        if condition not in CONDITIONS:
            raise ConfigurationError(f"condition must be one of {', '.join(CONDITIONS)}, got {condition!r}.")
        self.model = model
        self.infonce = MultipleNegativesRankingLoss(model, scale=scale)
        dimension = model.get_embedding_dimension()
        initializer_range = getattr(config, "initializer_range", 0.02)
        self.pooler = BatchNormMLPPooler(dimension, initializer_range) if pooler else None
        self.crtd_head = nn.Linear(config.hidden_size, 2)
        self.crtd_weight, self.condition, self.generator = float(crtd_weight), condition, generator
        self.masking_ratio, self.seed = float(masking_ratio), int(seed)
        self.cache_dir, self.cache_file = cache_dir, cache_file
        self.generator_options = dict(generator_options or {})
        self.corruptions = corruptions
        self.corruption_report: dict[str, Any] = {}
        self.register_buffer("special_ids", torch.tensor(sorted(set(encoder.tokenizer.all_special_ids))),
                             persistent=False)

    def prepare(self, data, show_progress: bool = True) -> dict[str, Any]:
        """Corrupt every text of ``data`` (a dataset, a dict of columns or a list of texts) once, or reuse a matching
        cache; returns the report."""
        if self.crtd_weight == 0:
            return {}
        self.corruptions, self.corruption_report = prepare_corruptions(
            self.model, training_texts(data), generator=self.generator, masking_ratio=self.masking_ratio,
            seed=self.seed, cache_dir=self.cache_dir, cache_file=self.cache_file,
            generator_options=self.generator_options, show_progress=show_progress)
        return self.corruption_report

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ConfigurationError(f"CRTDLoss needs (anchor, positive[, negative]) columns, got "
                                     f"{len(sentence_features)} column(s).")
        training = self.model.training
        with_crtd = training and self.crtd_weight > 0
        raw = [{k: f[k] for k in INPUT_KEYS if k in f} for f in sentence_features] if with_crtd else []
        cls_embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
        embeddings = cls_embeddings
        if self.pooler is not None and training:
            # One BatchNorm batch over every column, as DiffCSE pools its (batch * num_sent) rows together.
            sizes = [e.shape[0] for e in cls_embeddings]
            embeddings = list(self.pooler(torch.cat(cls_embeddings)).split(sizes))
        self.infonce.gather_across_devices = distributed_training()  # negatives of every process (see infonce.py)
        losses = {"contrastive": self.infonce.compute_loss_from_embeddings(embeddings, labels)}
        if with_crtd:
            conditions = embeddings if self.condition == "pooled" else cls_embeddings
            losses["crtd"] = self.crtd_weight * self.crtd_loss(raw, conditions)
        return losses

    def crtd_loss(self, columns: list[dict[str, torch.Tensor]], conditions: list[torch.Tensor]) -> torch.Tensor:
        """Mean token-level cross-entropy of replaced-token detection over every column (unweighted), from each
        column's original inputs and sentence vectors ``h``."""
        if self.corruptions is None:
            raise CorruptionCacheError(
                "CRTDLoss has no corrupted sentences: call loss.prepare(train_dataset) before training (the runner and "
                "'st-prompts train d2cse' do it for you).")
        logits_rows, label_rows = [], []
        for inputs, h in zip(columns, conditions):
            original, attention = inputs["input_ids"], inputs["attention_mask"]
            corrupted = self.corruptions.corrupt(original, attention)
            targets, detect = crtd_labels(original, corrupted, attention, self.special_ids)
            features = {**inputs, "input_ids": corrupted, CLS_OVERRIDE: h}
            hidden = self.model[0](features)["token_embeddings"]
            logits_rows.append(self.crtd_head(hidden[detect]))
            label_rows.append(targets[detect])
        logits, targets = torch.cat(logits_rows), torch.cat(label_rows)
        if targets.numel() == 0:  # nothing to detect in the whole batch (e.g. only empty sentences)
            return logits.sum() * 0.0
        return nn.functional.cross_entropy(logits.float(), targets)

    def get_config_dict(self) -> dict[str, Any]:
        generator = self.generator if isinstance(self.generator, str) else type(self.generator).__name__
        return {"scale": self.infonce.scale, "crtd_weight": self.crtd_weight, "pooler": self.pooler is not None,
                "condition": self.condition, "generator": generator, "masking_ratio": self.masking_ratio}

    @property
    def citation(self) -> str:
        return """@article{lee2022d2cse,
    title = {D2CSE: Difference-aware Deep continuous prompts for Contrastive Sentence Embeddings},
    author = {Lee, Hyunjae},
    note = {Samsung SDS},
}"""


def training_texts(data) -> list[str]:
    """Every text of a training set: all string columns of a ``datasets.Dataset`` (or a dict of columns) except
    ``label``/``score``, or the items of a list of texts."""
    if isinstance(data, (list, tuple)):
        return [str(t) for t in data]
    columns = data.column_names if hasattr(data, "column_names") else list(data)
    return [v for name in columns if name not in ("label", "labels", "score", "scores")
            for v in data[name] if isinstance(v, str)]
