"""D2CSE's objective: InfoNCE + λ · conditional replaced-token detection (CRTD), on one prompted, frozen encoder.

D2CSE (Lee, 2022) keeps DiffCSE's equivariant objective but drops its second, trainable discriminator: the same frozen
backbone with the same soft prompts encodes the sentence *and* detects replaced tokens in its corrupted copy,
conditioned on the sentence's own vector. Per training example and column (anchor, positive[, hard negative]):

1. ``h = pooler([CLS] of f(x))`` — the prompted encoder ``f`` (deep prompts, optionally a [CLS] prompt) and, in
   training only, DiffCSE's pooler: ``Linear(H, 2H) → BatchNorm → ReLU → Linear(2H, H) → BatchNorm`` (no biases, the
   last BatchNorm without affine parameters). At evaluation the embedding is the [CLS] output *before* the pooler
   (D2CSE appendix, "Pooler Design"), so the pooler lives in this loss and is never saved;
2. ``L_CL`` — SimCSE's InfoNCE over the ``h`` of the columns (τ = 0.05; hard negatives in supervised runs), computed
   by sentence-transformers' ``MultipleNegativesRankingLoss``;
3. ``x_g`` — the corrupted copy of ``x`` (30% masked, a generator's argmax, computed before training:
   :mod:`st_prompts.losses.crtd.corruption`) goes through the *same* encoder ``f`` with the input row at position 0 (the
   [CLS] embedding, or the [CLS] prompt) replaced by ``h`` (``features["cls_override"]``; not detached, so the CRTD
   gradient reaches the prompts through ``h`` too);
4. ``L_CRTD`` — a per-token ``Linear(H, 2)`` head over the last hidden states predicts replaced vs original (paper
   Eq. 2, as DiffCSE's ``electra_head``); cross-entropy averaged over the real, non-special tokens of every row (rows
   with nothing to detect, e.g. empty sentences, drop out of the mean; a batch with none gives 0, never NaN);
5. ``L = L_CL + λ · L_CRTD`` with λ = 0.005; in supervised runs CRTD runs on the anchor, the positive and the hard
   negative (the paper's ``Σ_{i ∈ {∅, +, −}} L_CRTD(x^i, x_g^i, h^i, f)``), in unsupervised runs on both dropout views
   of the sentence (as DiffCSE's code runs it on every view), each conditioned on its own ``h``. The corruption is
   computed once per distinct sentence, so both views of an unsupervised pair share one corrupted copy (DiffCSE masks
   each view afresh at every step).

Training-only parts (pooler, CRTD) follow the *model's* mode, ``self.model.training``, which
``SentenceTransformerTrainer`` switches. The CRTD head and the pooler are parameters of this loss: the trainer
optimises them with the prompts, and ``model.save`` never sees them. The forward pass returns
``{"contrastive": L_CL, "crtd": λ · L_CRTD}``; the trainer logs both parts and optimises their sum.

Differences from DiffCSE's code, on purpose: only the *selected* positions take the generator's prediction (DiffCSE
takes its argmax at every position and pins only [CLS]), special tokens are never predicted, and the CRTD mean runs
over real non-special tokens (DiffCSE averages over every position, padding included); the conditioning vector
replaces the *input* embedding row of [CLS] (where the [CLS] prompt lives), so it passes through the embedding
LayerNorm, where DiffCSE replaces the row of the embedding layer's output.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch import nn

from st_prompts.errors import ConfigurationError, CorruptionCacheError
from st_prompts.losses.crtd.corruption import crtd_labels, prepare_corruptions
from st_prompts.losses.infonce import distributed_training
from st_prompts.modules import PromptedTransformer
from st_prompts.prompts.features import CLS_OVERRIDE
from st_prompts.utils import check_finite

#: Inputs of a column the corrupted pass reuses (the rest of a features dict are the model's outputs).
_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")
#: ``condition`` values: the pooled training embedding (DiffCSE's default) or the [CLS] output before the pooler.
CONDITIONS = ("pooled", "cls")


class BatchNormMLPPooler(nn.Module):
    """DiffCSE's ``ProjectionMLP``: ``Linear(H, 2H) → BN → ReLU → Linear(2H, H) → BN(affine=False)``, no biases.

    Used in training only. The BatchNorm layers keep no running statistics (``track_running_stats=False``): they
    always normalise with the statistics of the batch at hand, and nothing of them exists to leak into inference.
    Linear weights are initialised as transformers initialises new weights (normal, ``initializer_range``), as
    DiffCSE's ``init_weights`` does.
    """

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
    """D2CSE's loss: InfoNCE + λ · conditional replaced-token detection by the same prompted frozen encoder.

    Before training, :meth:`prepare` corrupts every training sentence once (or reuses a matching cache); see
    :func:`st_prompts.losses.crtd.corruption.prepare_corruptions`. Example::

        model = st_prompts.methods.build("d2cse", backbone="bert-base-uncased")
        loss = CRTDLoss(model, generator="distilbert-base-uncased")
        loss.prepare(train_dataset)        # columns (anchor, positive[, negative]) of text
        SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss).train()

    Args:
        model: a SentenceTransformer whose first module is a :class:`~st_prompts.PromptedTransformer` (no template)
            and whose embedding is the [CLS] output.
        scale: inverse InfoNCE temperature (20 → τ = 0.05).
        crtd_weight: λ (D2CSE: 0.005); 0 trains InfoNCE with the pooler alone (no corruption needed).
        pooler: apply DiffCSE's BatchNorm MLP pooler in training (D2CSE: yes).
        condition: ``"pooled"`` — condition the corrupted pass on the pooled training embedding (DiffCSE's default);
            ``"cls"`` — on the [CLS] output before the pooler (DiffCSE's ``--before_mlp``).
        generator: the corruption's generator: ``"backbone-mlm"`` (offline fallback), a Hugging Face masked LM sharing
            the encoder's vocabulary (e.g. ``"distilbert-base-uncased"``), or a
            :class:`~st_prompts.losses.crtd.generators.MaskedLMGenerator`.
        masking_ratio, seed, cache_dir, cache_file, generator_options: see :func:`prepare_corruptions`.
        corruptions: an existing :class:`~st_prompts.losses.crtd.corruption.CorruptionCache` (then :meth:`prepare` is not
            needed).

    Raises:
        ConfigurationError: for a model the CRTD pass cannot condition (no PromptedTransformer first, a template,
            an input embedding size other than the hidden size) or invalid options.
    """

    def __init__(
        self,
        model,
        scale: float = 20.0,
        crtd_weight: float = 0.005,
        pooler: bool = True,
        condition: str = "pooled",
        generator: Any = "backbone-mlm",
        masking_ratio: float = 0.3,
        seed: int = 42,
        cache_dir: str | None = None,
        cache_file: str | None = None,
        generator_options: dict[str, Any] | None = None,
        corruptions=None,
    ) -> None:
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
                "supported."
            )
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
        self.crtd_weight = float(crtd_weight)
        self.condition = condition
        self.generator = generator
        self.masking_ratio = float(masking_ratio)
        self.seed = int(seed)
        self.cache_dir = cache_dir
        self.cache_file = cache_file
        self.generator_options = dict(generator_options or {})
        self.corruptions = corruptions
        self.corruption_report: dict[str, Any] = {}
        self.register_buffer("special_ids", torch.tensor(sorted(set(encoder.tokenizer.all_special_ids))),
                             persistent=False)
        #: Detection diagnostics of the last training batch (detached floats, as DiffCSE's ``electra_acc``).
        self.last_detection: dict[str, float] = {}

    # ------------------------------------------------------------------ corruption pre-pass
    def prepare(self, data, show_progress: bool = True) -> dict[str, Any]:
        """Corrupt every text of ``data`` once before training (or reuse a matching cache); returns the report.

        Args:
            data: a ``datasets.Dataset`` (every text column is used; ``label``/``score`` are skipped), a dict of
                column name → texts, or a list of texts.
        """
        if self.crtd_weight == 0:
            return {}
        self.corruptions, self.corruption_report = prepare_corruptions(
            self.model,
            training_texts(data),
            generator=self.generator,
            masking_ratio=self.masking_ratio,
            seed=self.seed,
            cache_dir=self.cache_dir,
            cache_file=self.cache_file,
            generator_options=self.generator_options,
            show_progress=show_progress,
        )
        return self.corruption_report

    # ------------------------------------------------------------------ forward
    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ConfigurationError(
                f"CRTDLoss needs (anchor, positive[, negative]) columns, got {len(sentence_features)} column(s)."
            )
        training = self.model.training
        with_crtd = training and self.crtd_weight > 0
        raw = [{k: f[k] for k in _INPUT_KEYS if k in f} for f in sentence_features] if with_crtd else []
        cls_embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
        embeddings = cls_embeddings
        if self.pooler is not None and training:
            # One BatchNorm batch over every column, as DiffCSE pools its (batch * num_sent) rows together.
            sizes = [e.shape[0] for e in cls_embeddings]
            embeddings = list(self.pooler(torch.cat(cls_embeddings)).split(sizes))
        self.infonce.gather_across_devices = distributed_training()  # negatives of every process (see contrastive.py)
        losses = {"contrastive": self.infonce.compute_loss_from_embeddings(embeddings, labels)}
        if with_crtd:
            conditions = embeddings if self.condition == "pooled" else cls_embeddings
            losses["crtd"] = self.crtd_weight * self.crtd_loss(raw, conditions)
        return losses

    def crtd_loss(self, columns: list[dict[str, torch.Tensor]], conditions: list[torch.Tensor]) -> torch.Tensor:
        """Mean token-level cross-entropy of replaced-token detection over every column (unweighted).

        Args:
            columns: each column's inputs (``input_ids``, ``attention_mask``[, ``token_type_ids``]) of the originals.
            conditions: each column's sentence vectors ``h`` (``(batch, hidden)``, not detached).
        """
        if self.corruptions is None:
            raise CorruptionCacheError(
                "CRTDLoss has no corrupted sentences: call loss.prepare(train_dataset) before training (the runner and "
                "'st-prompts train d2cse' do it for you)."
            )
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
            self.last_detection = {}
            return logits.sum() * 0.0
        with torch.no_grad():
            predicted = logits.argmax(-1)
            replaced = targets == 1
            self.last_detection = {
                "replaced_share": float(replaced.float().mean()),
                "accuracy": float((predicted == targets).float().mean()),
                "replaced_recall": float((predicted[replaced] == 1).float().mean()) if replaced.any() else float("nan"),
            }
        return nn.functional.cross_entropy(logits.float(), targets)

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "scale": self.infonce.scale,
            "crtd_weight": self.crtd_weight,
            "pooler": self.pooler is not None,
            "condition": self.condition,
            "generator": self.generator if isinstance(self.generator, str) else type(self.generator).__name__,
            "masking_ratio": self.masking_ratio,
        }

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
    texts: list[str] = []
    for name in columns:
        if name in ("label", "labels", "score", "scores"):
            continue
        values = data[name]
        texts.extend(v for v in values if isinstance(v, str))
    return texts
