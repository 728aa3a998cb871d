"""SimCSE's InfoNCE for prompted encoders, with DCPCSE's optional auxiliary MLM and SimCSE's training-only MLP.

(Named ``infonce`` rather than ``contrastive``: sentence-transformers' ``ContrastiveLoss`` is another loss.)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.util.distributed import get_world_size
from torch import nn

from st_prompts.errors import ConfigurationError
from st_prompts.losses.mlm import MLMHead, TokenMasker, mlm_weight
from st_prompts.losses.views import apply_prefix_views, check_prefix_views
from st_prompts.modules import PromptedTransformer
from st_prompts.prompts.features import PREFIX_VALUES as PREFIX_VALUES_KEY
from st_prompts.prompts.features import DENOISING_POSITIONS, TEMPLATE_DENOISING
from st_prompts.utils import check_finite

#: Inputs the MLM pass needs from a column's features (the rest are the model's outputs).
_MLM_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class PromptContrastiveLoss(nn.Module):
    """SimCSE's InfoNCE (unsupervised or supervised with hard negatives) plus DCPCSE's auxiliary MLM objective.

    * Columns: ``(anchor, positive)`` — for unsupervised SimCSE the same sentence twice (dropout makes the two views
      differ) — or ``(anchor, positive, negative)`` for supervised NLI with the contradiction as hard negative.
    * InfoNCE with temperature ``τ = 1 / scale`` (0.05) is sentence-transformers' ``MultipleNegativesRankingLoss``;
      this class only adds the parts around it.
    * ``mlp=True`` puts SimCSE's ``Linear(H, H) + Tanh`` over the sentence embedding during training only
      (``mlp_only_train``); the MLP lives in the loss, so it is optimised but never saved with the model. For the MLP
      that is kept at inference (official supervised runs), put a ``Dense`` module into the model instead (see
      :func:`st_prompts.methods.models.mlp_head_module`, ``mlp_head="saved"``).
    * ``mlm_weight > 0`` adds ``mlm_weight · mlm_decay^(step / mlm_decay_steps) · L_MLM`` as the official DCPCSE code
      does (see :mod:`st_prompts.losses.mlm`): every column is masked (15%, 80/10/10) and run through the same
      prompted encoder with the prefix draw of its contrastive pass, and the checkpoint's MLM head trains with the
      prompts.

    Training-only parts (the MLP, the MLM term, the step counter) follow the *model's* mode, ``self.model.training``,
    which ``SentenceTransformerTrainer`` switches (it never calls ``loss.train()``/``loss.eval()``): evaluation
    loops see the plain InfoNCE and never move the MLM schedule.

    The forward pass returns a dict ``{"contrastive": ..., "mlm": ...}`` (the MLM part already weighted); the
    sentence-transformers trainer logs each part and optimises their sum.

    The optimisation step used by the MLM schedule is taken from :class:`~st_prompts.training.LossStepCallback` when it
    is registered with the trainer (exact with gradient accumulation); otherwise the loss counts its own training
    forward passes (exact for ``gradient_accumulation_steps=1``, e.g. with ``model.fit``).

    Args:
        model: a SentenceTransformer (the MLM term needs a :class:`~st_prompts.PromptedTransformer` first module).
        mlp: apply a training-only MLP over the sentence embedding (``True``: a new one, :func:`simcse_mlp`; or the
            module to apply, e.g. one shared with another loss).
        mlm_weight: initial weight of the auxiliary MLM loss (DCPCSE: 0.1; 0 disables it).
        mlm_decay, mlm_decay_steps: the weight decays as ``mlm_decay ** (step / mlm_decay_steps)``.
        mlm_head_source: where to take the MLM head from (default: the encoder's ``backbone_name_or_path``).
        prefix_views: one prefix view per column (e.g. ``(0, 1, 1)``: the anchor attends to the first half of the
            prefix, the positive and the hard negative to the second half, as DiffAug does); ``None``: every column
            attends to the whole prefix (``num_views``: how many the prefix is cut into; :func:`apply_prefix_views`).
        template_denoising: subtract the template-only ``[MASK]`` state from this loss's embeddings (PromptBERT's
            template denoising, which DiffAug applies in its contrastive loss only), whatever the encoder's own
            ``template_denoising`` (what inference does). ``True``/``"exact"``: the template alone at the positions of
            the full input, same prefix draw; ``"official"``: as DiffAug's official code
            (:data:`~st_prompts.prompts.features.DENOISING_POSITIONS`).
    """

    def __init__(
        self,
        model,
        scale: float = 20.0,
        mlp: bool | nn.Module = False,
        mlm_weight: float = 0.0,
        mlm_decay: float = 0.95,
        mlm_decay_steps: int = 100,
        mlm_probability: float = 0.15,
        mlm_head_source: str | None = None,
        prefix_views: tuple[int, ...] | None = None,
        num_views: int = 2,
        template_denoising: bool | str = False,
    ) -> None:
        super().__init__()
        check_finite(scale=scale, mlm_weight=mlm_weight, mlm_decay=mlm_decay, mlm_probability=mlm_probability)
        self.model = model
        if isinstance(template_denoising, str) and template_denoising not in DENOISING_POSITIONS:
            raise ConfigurationError(f"template_denoising must be a bool or one of {', '.join(DENOISING_POSITIONS)}, "
                                     f"got {template_denoising!r}.")
        self.template_denoising: bool | str = (template_denoising if isinstance(template_denoising, str)
                                               else bool(template_denoising))
        self.prefix_views = tuple(prefix_views) if prefix_views is not None else None
        self.num_views = num_views
        if self.prefix_views is not None:
            check_prefix_views(model, self.prefix_views, num_views)
        self.infonce = MultipleNegativesRankingLoss(model, scale=scale)
        self.mlp = mlp if isinstance(mlp, nn.Module) else (simcse_mlp(model) if mlp else None)
        if mlm_weight < 0:
            raise ConfigurationError(f"mlm_weight must be >= 0, got {mlm_weight}.")
        self.mlm_weight = mlm_weight
        self.mlm_decay = mlm_decay
        self.mlm_decay_steps = mlm_decay_steps
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
            raise ConfigurationError(
                f"PromptContrastiveLoss needs (anchor, positive[, negative]) columns, got {len(sentence_features)} column(s)."
            )
        if self.prefix_views is not None:
            apply_prefix_views(self.model, sentence_features, self.prefix_views, self.num_views)
        if self.template_denoising:
            for features in sentence_features:
                features[TEMPLATE_DENOISING] = self.template_denoising
        training = self.model.training
        with_mlm = self.mlm_head is not None and training
        # Keep each column's raw inputs before the model adds its outputs to the features dict.
        raw = [{k: v for k, v in f.items() if k in _MLM_INPUT_KEYS} for f in sentence_features] if with_mlm else []
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
        return {
            "scale": self.infonce.scale,
            "mlp": self.mlp is not None,
            "mlm_weight": self.mlm_weight,
            "mlm_decay": self.mlm_decay,
            "mlm_decay_steps": self.mlm_decay_steps,
            "prefix_views": self.prefix_views,
            "template_denoising": self.template_denoising,
        }

    @property
    def citation(self) -> str:
        return """@article{jiang2022dcpcse,
    title = {Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings},
    author = {Jiang, Yuxin and Wang, Wei},
    journal = {arXiv preprint arXiv:2203.06875},
    year = {2022},
}"""


def simcse_mlp(model) -> nn.Sequential:
    """SimCSE's ``MLPLayer`` over the sentence embedding: ``Linear(H, H) + Tanh``, its weight ~ N(0,
    ``initializer_range`` of the backbone, 0.02 by default) and its bias zero, as SimCSE's ``cl_init`` gets it from
    transformers' ``init_weights()`` (torch's default would be a uniform Kaiming initialisation)."""
    dim = model.get_embedding_dimension()
    std = 0.02
    first = model[0] if len(model) else None
    config = getattr(getattr(first, "auto_model", None), "config", None)
    if config is not None and getattr(config, "initializer_range", None):
        std = float(config.initializer_range)
    linear = nn.Linear(dim, dim)
    with torch.no_grad():
        linear.weight.normal_(0.0, std)
        linear.bias.zero_()
    return nn.Sequential(linear, nn.Tanh())


def distributed_training() -> bool:
    """Whether this process is one of several of a ``torch.distributed`` run (e.g. ``torchrun``, the trainer's DDP)."""
    return get_world_size() > 1
