"""SimCSE's InfoNCE for prompted encoders, with DCPCSE's optional auxiliary MLM and SimCSE's training-only MLP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.util.distributed import get_world_size
from torch import nn

from st_prompts.errors import ConfigurationError
from st_prompts.losses.mlm import MLMHead, TokenMasker, mlm_weight
from st_prompts.losses.views import apply_prefix_views, checked_prefix_views
from st_prompts.modules import PromptedTransformer
from st_prompts.prompts.features import PREFIX_VALUES as PREFIX_VALUES_KEY
from st_prompts.prompts.features import DENOISING_POSITIONS, TEMPLATE_DENOISING
from st_prompts.utils import check_finite

#: A column's inputs, which a second pass over it (MLM, CRTD) reuses (the rest of its features are the model's outputs).
INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class PromptContrastiveLoss(nn.Module):
    """SimCSE's InfoNCE over ``(anchor, positive[, negative])`` columns (sentence-transformers'
    ``MultipleNegativesRankingLoss``, ``τ = 1 / scale``) plus DCPCSE's auxiliary MLM objective.

    Training-only parts (MLP, MLM term, step count) follow ``self.model.training``. ``forward`` returns
    ``{"contrastive": ..., "mlm": ...}`` (MLM already weighted; its step from a registered :class:`LossStepCallback`,
    else the loss's own count of training passes).

    Args:
        model: a SentenceTransformer (the MLM term needs a :class:`~st_prompts.PromptedTransformer` first module).
        mlp: SimCSE's training-only ``Linear(H, H) + Tanh`` over the embedding, never saved (``True``: a new one,
            :func:`simcse_mlp`; or a module, e.g. shared with another loss).
        mlm_weight: initial weight of the auxiliary MLM loss (DCPCSE: 0.1; 0 disables it); it decays as
            ``mlm_decay ** (step / mlm_decay_steps)``. ``mlm_head_source``: default the encoder's backbone.
        prefix_views: one prefix view per column (e.g. DiffAug's ``(0, 1, 1)``; :func:`apply_prefix_views`);
            ``None``: every column attends to the whole prefix.
        template_denoising: subtract the template-only ``[MASK]`` state from this loss's embeddings, whatever the
            encoder's own setting: ``True``/``"exact"``, or ``"official"`` as DiffAug's code
            (:data:`~st_prompts.prompts.features.DENOISING_POSITIONS`).
    """

    def __init__(self, model, scale: float = 20.0, mlp: bool | nn.Module = False, mlm_weight: float = 0.0,
                 mlm_decay: float = 0.95, mlm_decay_steps: int = 100, mlm_probability: float = 0.15,
                 mlm_head_source: str | None = None, prefix_views: tuple[int, ...] | None = None, num_views: int = 2,
                 template_denoising: bool | str = False) -> None:
        super().__init__()
        check_finite(scale=scale, mlm_weight=mlm_weight, mlm_decay=mlm_decay, mlm_probability=mlm_probability)
        self.model = model
        if isinstance(template_denoising, str) and template_denoising not in DENOISING_POSITIONS:
            raise ConfigurationError(f"template_denoising must be a bool or one of {', '.join(DENOISING_POSITIONS)}, "
                                     f"got {template_denoising!r}.")
        self.template_denoising: bool | str = (template_denoising if isinstance(template_denoising, str)
                                               else bool(template_denoising))
        self.prefix_views = checked_prefix_views(model, prefix_views, num_views)
        self.num_views = num_views
        self.infonce = MultipleNegativesRankingLoss(model, scale=scale)
        self.mlp = mlp if isinstance(mlp, nn.Module) else (simcse_mlp(model) if mlp else None)
        if mlm_weight < 0:
            raise ConfigurationError(f"mlm_weight must be >= 0, got {mlm_weight}.")
        self.mlm_weight, self.mlm_decay, self.mlm_decay_steps = mlm_weight, mlm_decay, mlm_decay_steps
        self.global_step: int | None = None
        self.training_calls = 0
        self.mlm_head = None
        if mlm_weight > 0:
            encoder = model[0]
            if not isinstance(encoder, PromptedTransformer):
                raise ConfigurationError("The auxiliary MLM loss needs a PromptedTransformer as the model's first module.")
            if encoder.template is not None:
                raise ConfigurationError("The auxiliary MLM loss is not supported together with a template.")
            self.mlm_head = MLMHead(encoder, source=mlm_head_source)
            self.masker = TokenMasker(encoder.tokenizer, mlm_probability=mlm_probability)

    @property
    def step(self) -> int:
        """The optimisation step the MLM weight schedule is at."""
        return self.global_step if self.global_step is not None else self.training_calls

    def current_mlm_weight(self) -> float:
        return mlm_weight(self.step, self.mlm_weight, self.mlm_decay, self.mlm_decay_steps)

    def forward(self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ConfigurationError(f"PromptContrastiveLoss needs (anchor, positive[, negative]) columns, got "
                                     f"{len(sentence_features)} column(s).")
        if self.prefix_views is not None:
            apply_prefix_views(self.model, sentence_features, self.prefix_views, self.num_views)
        if self.template_denoising:
            for features in sentence_features:
                features[TEMPLATE_DENOISING] = self.template_denoising
        training = self.model.training
        with_mlm = self.mlm_head is not None and training
        # Keep each column's raw inputs before the model adds its outputs to the features dict.
        raw = [{k: v for k, v in f.items() if k in INPUT_KEYS} for f in sentence_features] if with_mlm else []
        outputs = [self.model(features) for features in sentence_features]
        embeddings = [out["sentence_embedding"] for out in outputs]
        if self.mlp is not None and training:
            embeddings = [self.mlp(e) for e in embeddings]
        # Under DDP every process uses the other processes' rows as negatives too (SimCSE's official code gathers
        # them as well), so N processes of batch B train like one process of batch N*B.
        self.infonce.gather_across_devices = distributed_training()
        losses = {"contrastive": self.infonce.compute_loss_from_embeddings(embeddings, labels)}
        if with_mlm:
            reuse = [out.get(PREFIX_VALUES_KEY) for out in outputs]
            losses["mlm"] = self.current_mlm_weight() * self._mlm_loss(raw, reuse)
        if training and self.global_step is None:
            self.training_calls += 1
        return losses

    def _mlm_loss(self, columns: list[dict[str, torch.Tensor]], prefix_values: list) -> torch.Tensor:
        """Cross-entropy over the masked tokens of every column (one encoder pass per column, as the official code
        runs the masked ``(batch * num_sent)`` rows through the encoder with the contrastive pass's prefix)."""
        hidden_rows, label_rows = [], []
        for inputs, values in zip(columns, prefix_values):
            masked_ids, labels = self.masker(inputs["input_ids"], inputs["attention_mask"])
            features = {**inputs, "input_ids": masked_ids}
            if values is not None:
                features[PREFIX_VALUES_KEY] = values
            hidden = self.model[0](features)["token_embeddings"]
            selected = labels != -100
            hidden_rows.append(hidden[selected])
            label_rows.append(labels[selected])
        hidden, labels = torch.cat(hidden_rows), torch.cat(label_rows)
        if labels.numel() == 0:
            return hidden.sum() * 0.0
        logits = self.mlm_head(hidden)
        return nn.functional.cross_entropy(logits.float(), labels)

    def get_config_dict(self) -> dict[str, Any]:
        return {"scale": self.infonce.scale, "mlp": self.mlp is not None, "mlm_weight": self.mlm_weight,
                "mlm_decay": self.mlm_decay, "mlm_decay_steps": self.mlm_decay_steps,
                "prefix_views": self.prefix_views, "template_denoising": self.template_denoising}

    @property
    def citation(self) -> str:
        return """@article{jiang2022dcpcse,
    title = {Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings},
    author = {Jiang, Yuxin and Wang, Wei},
    journal = {arXiv preprint arXiv:2203.06875},
    year = {2022},
}"""


def simcse_mlp(model) -> nn.Sequential:
    """SimCSE's ``MLPLayer``: ``Linear(H, H) + Tanh``, initialised as SimCSE does (:func:`initialized_linear`)."""
    dim = model.get_embedding_dimension()
    return nn.Sequential(initialized_linear(model, dim, dim), nn.Tanh())


def initialized_linear(model, in_features: int, out_features: int, std: float | None = None) -> nn.Linear:
    """``Linear(in_features, out_features)``, its weight ~ N(0, ``std``: default the backbone's ``initializer_range``,
    else 0.02) and its bias zero, as SimCSE and DiffAug initialise theirs."""
    if std is None:
        config = getattr(getattr(model[0] if len(model) else None, "auto_model", None), "config", None)
        std = float(getattr(config, "initializer_range", None) or 0.02)
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.normal_(0.0, std)
        linear.bias.zero_()
    return linear


def distributed_training() -> bool:
    """Whether this process is one of several of a ``torch.distributed`` run (e.g. ``torchrun``, the trainer's DDP)."""
    return get_world_size() > 1
