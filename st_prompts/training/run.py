"""One training routine shared by the recipes, the CLI and the benchmarks.

A method is (module options, loss, callbacks, data): :class:`TrainSettings` names them, :func:`build_model` and
:func:`build_loss` turn them into sentence-transformers objects, :func:`train` runs ``SentenceTransformerTrainer``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
from transformers import TrainerCallback

from st_prompts.errors import ConfigurationError
from st_prompts.losses import PromptContrastiveLoss
from st_prompts.modules import MaskTokenPooling, PromptedTransformer
from st_prompts.prompts.shallow import SCPCSE_TEMPLATE
from st_prompts.training.callbacks import LossStepCallback
from st_prompts.utils import resolve_model_name

logger = logging.getLogger(__name__)

METHODS = ("dcpcse", "scpcse", "simcse")


@dataclass
class TrainSettings:
    """Everything that defines a training run.

    ``method``: ``dcpcse`` (deep prompts, frozen backbone), ``scpcse`` (shallow template prompts, frozen backbone),
    ``simcse`` (plain full fine-tuning baseline). Learning rates etc. default to DCPCSE's unsupervised BERT-base row.
    """

    method: str = "dcpcse"
    supervised: bool = False
    backbone: str = "bert-base-uncased"
    prefix_length: int = 16
    prefix_projection: bool = False
    template: str = SCPCSE_TEMPLATE
    learning_rate: float = 3e-2
    batch_size: int = 256
    epochs: float = 1.0
    max_steps: int = -1
    max_seq_length: int = 32
    temperature: float = 0.05
    mlp: bool = True
    mlm_weight: float = 0.0
    eval_steps: int = 125
    warmup_ratio: float = 0.0
    seed: int = 42
    output_dir: str = "outputs/run"
    logging_steps: int = 10
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigurationError(f"Unknown method {self.method!r}; choose one of {', '.join(METHODS)}.")
        if self.batch_size < 2:
            raise ConfigurationError("In-batch negatives need batch_size >= 2.")


def build_model(settings: TrainSettings) -> SentenceTransformer:
    """The SentenceTransformer a method trains: prompted (frozen) encoder or plain backbone, with its pooling.

    Seeds torch with ``settings.seed`` first, so the prompts' random initialisation is reproducible.
    """
    torch.manual_seed(settings.seed)
    backbone = resolve_model_name(settings.backbone)
    if settings.method == "simcse":
        encoder = Transformer(backbone, max_seq_length=settings.max_seq_length)
        pooling = Pooling(encoder.get_embedding_dimension(), pooling_mode="cls")
    elif settings.method == "dcpcse":
        encoder = PromptedTransformer(
            backbone,
            prefix_length=settings.prefix_length,
            prefix_projection=settings.prefix_projection,
            max_seq_length=settings.max_seq_length,
        )
        pooling = Pooling(encoder.get_embedding_dimension(), pooling_mode="cls")
    else:  # scpcse
        encoder = PromptedTransformer(
            backbone, prefix_length=None, template=settings.template, max_seq_length=settings.max_seq_length
        )
        pooling = MaskTokenPooling(encoder.get_embedding_dimension())
    return SentenceTransformer(modules=[encoder, pooling])


def build_loss(model: SentenceTransformer, settings: TrainSettings) -> PromptContrastiveLoss:
    """SimCSE InfoNCE (τ from the settings), training-only MLP, optional DCPCSE auxiliary MLM."""
    return PromptContrastiveLoss(
        model, scale=1.0 / settings.temperature, mlp=settings.mlp, mlm_weight=settings.mlm_weight
    )


class KeepBestCallback(TrainerCallback):
    """Keep the trainable weights of the best evaluation in memory; :meth:`restore` puts them back.

    For prompt tuning this is a few hundred kilobytes instead of a checkpoint of the whole model on disk every
    ``eval_steps`` (what ``load_best_model_at_end`` would write).
    """

    def __init__(self, model: torch.nn.Module, evaluator) -> None:
        self.model = model
        self.evaluator = evaluator
        self.best: float | None = None
        self.best_step: int | None = None
        self._state: dict[str, torch.Tensor] | None = None

    @property
    def metric(self) -> str:
        # An evaluator's primary metric is only known (and name-prefixed) once it has run.
        return f"eval_{self.evaluator.primary_metric}"

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = (metrics or {}).get(self.metric)
        if value is not None:
            self.consider(value, state.global_step)

    def consider(self, value: float, step: int) -> None:
        """Offer the model's current weights with their score (e.g. a final evaluation after the last step)."""
        greater = getattr(self.evaluator, "greater_is_better", True)
        if self.best is None or (value > self.best if greater else value < self.best):
            self.best, self.best_step = value, step
            self._state = {
                name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters() if p.requires_grad
            }

    def restore(self) -> None:
        """Load the best weights seen back into the model."""
        if self._state is not None:
            self.model.load_state_dict(self._state, strict=False)
            logger.info(f"Restored the best weights: {self.metric}={self.best:.4f} at step {self.best_step}.")


@dataclass
class TrainResult:
    """What :func:`train` returns besides the trained model."""

    steps: int
    seconds: float
    best_metric: float | None
    best_step: int | None
    log_history: list[dict[str, Any]]
    trainable_parameters: int
    total_parameters: int
    settings: dict[str, Any]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def train(
    settings: TrainSettings,
    train_dataset,
    dev_evaluator=None,
    model: SentenceTransformer | None = None,
    show_progress_bar: bool = True,
) -> tuple[SentenceTransformer, TrainResult]:
    """Train a method with ``SentenceTransformerTrainer``; select the best STS-B dev checkpoint if an evaluator is given.

    Returns the trained model (best dev weights restored) and a :class:`TrainResult`.
    """
    torch.manual_seed(settings.seed)
    model = model if model is not None else build_model(settings)
    loss = build_loss(model, settings)
    steps_per_epoch = math.ceil(len(train_dataset) / settings.batch_size)
    args = SentenceTransformerTrainingArguments(
        output_dir=settings.output_dir,
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        warmup_steps=settings.warmup_ratio,  # a float < 1 is a ratio of the total steps in transformers 5
        weight_decay=0.0,
        lr_scheduler_type="linear",
        seed=settings.seed,
        eval_strategy="steps" if dev_evaluator is not None else "no",
        eval_steps=settings.eval_steps,
        save_strategy="no",
        logging_steps=settings.logging_steps,
        report_to="none",
        disable_tqdm=not show_progress_bar,
        use_cpu=not torch.cuda.is_available(),
    )
    callbacks: list[TrainerCallback] = [LossStepCallback(loss)]
    keep_best = None
    if dev_evaluator is not None:
        keep_best = KeepBestCallback(model, dev_evaluator)
        callbacks.append(keep_best)
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        loss=loss,
        evaluator=dev_evaluator,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    if dev_evaluator is not None and keep_best is not None:
        # The final weights are not evaluated by the trainer unless the last step is a multiple of eval_steps.
        if trainer.state.global_step % settings.eval_steps:
            final = dev_evaluator(model)
            keep_best.consider(final[dev_evaluator.primary_metric], trainer.state.global_step)
        keep_best.restore()
    model.eval()
    trainable, total = count_parameters(model)
    result = TrainResult(
        steps=trainer.state.global_step,
        seconds=seconds,
        best_metric=keep_best.best if keep_best else None,
        best_step=keep_best.best_step if keep_best else None,
        log_history=list(trainer.state.log_history),
        trainable_parameters=trainable,
        total_parameters=total,
        settings=asdict(settings),
    )
    logger.info(
        f"Trained {settings.method} for {result.steps} steps ({steps_per_epoch} per epoch) in {seconds:.0f}s; "
        f"best dev {result.best_metric} at step {result.best_step}."
    )
    return model, result
