"""One training routine shared by the recipes, the CLI and the benchmarks: :func:`train` runs a registered method's
stages one after the other with ``SentenceTransformerTrainer`` and keeps the best STS-B dev weights."""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from st_prompts import methods
from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import Stage, TrainSettings
from st_prompts.modules.lengths import (FullLengthEvaluator, backbone_encode_length, full_length_evaluator,
                                        position_capacity)
from st_prompts.training.callbacks import SyncLossParametersCallback

logger = logging.getLogger(__name__)


def build_model(settings: TrainSettings) -> SentenceTransformer:
    """The SentenceTransformer a method trains (the registered method's builder; seeds torch first)."""
    return methods.get(settings.method).build_model(settings)


def build_loss(model: SentenceTransformer, settings: TrainSettings, stage: int = 0):
    """The loss of one stage of the method (the first by default)."""
    return methods.get(settings.method).stages(settings)[stage].build_loss(model, settings)


class KeepBestCallback(TrainerCallback):
    """Keep the trainable weights of the best evaluation in memory (a few hundred kilobytes for prompt tuning, not a
    checkpoint on disk every ``eval_steps``); :meth:`restore` puts them back."""

    def __init__(self, model: torch.nn.Module, evaluator) -> None:
        self.model = model
        self.evaluator = evaluator
        self.best: float | None = None
        self.best_step: int | None = None
        #: The step of the last evaluation seen (the trainer evaluates the last step itself in some configurations).
        self.last_step: int | None = None
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
        """Offer the model's current weights with their score (e.g. a final evaluation after the last step). A score
        that is not a finite number (a diverged model) is never preferred to a finite one."""
        self.last_step = step
        greater = getattr(self.evaluator, "greater_is_better", True)
        if self.best is None or (math.isfinite(value) and (
                not math.isfinite(self.best) or (value > self.best if greater else value < self.best))):
            self.best, self.best_step = value, step
            self._state = {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()
                           if p.requires_grad}

    def restore(self) -> None:
        """Load the best weights seen back into the model."""
        if self._state is not None:
            self.model.load_state_dict(self._state, strict=False)
            logger.info(f"Restored the best weights: {self.metric}={self.best:.4f} at step {self.best_step}.")


class AnnouncedEvaluator(FullLengthEvaluator):
    """A selection evaluator that says, in one log line, what it evaluates before it runs (it may take minutes)."""

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        inner = self.__dict__["evaluator"]
        pairs = getattr(inner, "sentences1", None)
        size = f" ({len(pairs):,} pairs)" if pairs is not None else ""
        step = kwargs.get("steps", args[2] if len(args) > 2 else None)
        logger.info(f"Evaluating {getattr(inner, 'name', None) or type(inner).__name__}{size}"
                    + (f" at step {step}." if step is not None and step >= 0 else " at the end."))
        return inner(model, *args, **kwargs)


class AnnounceTrainingCallback(TrainerCallback):
    """One log line when a stage's training starts: its steps, batch size and evaluation interval."""

    def __init__(self, label: str, rows: int) -> None:
        self.label, self.rows = label, rows

    def on_train_begin(self, args, state, control, **kwargs):
        evaluating = (f", evaluating every {args.eval_steps} steps" if getattr(args.eval_strategy, "value", args.eval_strategy) == "steps"
                      else "")
        logger.info(f"Training {self.label}: {state.max_steps:,} steps of batch {args.per_device_train_batch_size} "
                    f"over {self.rows:,} examples{evaluating}.")


class StopAtStep(TrainerCallback):
    """End training after ``step`` optimizer steps (the learning-rate schedule may be planned for more)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


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
    #: What each stage's ``prepare_loss`` pre-pass reported.
    stage_reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: With ``dev_limit``: the STS-B dev pairs that selected the weights and their score there (``best_metric``: all).
    selection_pairs: int | None = None
    selection_metric: float | None = None
    #: The most tokens the trained model encodes (:func:`apply_encode_length`).
    encode_length: int | None = None


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters())


def stage_dataset(stage: Stage, train_dataset, settings: TrainSettings, index: int):
    dataset = train_dataset.get(stage.name) if isinstance(train_dataset, dict) else train_dataset
    if dataset is None:
        raise ConfigurationError(f"No training data for stage {stage.name!r} of {settings.method}; pass "
                                 f"{{'{stage.name}': dataset, ...}}.")
    expected = list(stage.columns(settings))
    columns = [c for c in dataset.column_names if c not in ("label", "score")]
    if columns != expected:
        raise ConfigurationError(f"Stage {stage.name!r} of {settings.method} needs the columns {expected} (in this "
                                 f"order), the dataset has {dataset.column_names}. Columns are matched by name: rename "
                                 "them or use the method's data loader.")
    return dataset


def train(settings: TrainSettings, train_dataset, dev_evaluator=None, model: SentenceTransformer | None = None,
          show_progress_bar: bool = True, callbacks: list[TrainerCallback] | None = None,
          ) -> tuple[SentenceTransformer, TrainResult]:
    """Train a registered method with ``SentenceTransformerTrainer``, stage after stage.

    Args:
        train_dataset: a ``datasets.Dataset`` with the stage's columns, or ``{stage name: Dataset}``.
        dev_evaluator: STS-B dev evaluator; the stages with ``select_model`` keep and restore their best weights.
        model: a model built earlier (default: the method's builder).
        callbacks: extra trainer callbacks for every stage.

    Returns the trained model (in eval mode) and a :class:`TrainResult`.
    """
    method = methods.get(settings.method)
    torch.manual_seed(settings.seed)
    if model is None:
        logger.info(f"Loading the backbone {settings.backbone} for {settings.method}.")
        from st_prompts.modules.load_errors import backbone_errors

        with backbone_errors(settings.backbone):  # a damaged backbone is one line
            model = method.build_model(settings)
    check_encode_length(model, settings)  # refused before training, not after it
    stages = method.stages(settings)
    total_steps, seconds, log_history = 0, 0.0, []
    best: KeepBestCallback | None = None
    stage_reports: dict[str, dict[str, Any]] = {}
    # The trainer's own files (evaluation CSVs, ...) go to a temporary folder of ours, never into the model's output.
    scratch = tempfile.TemporaryDirectory(prefix="st-prompts-trainer-")
    for index, stage in enumerate(stages):
        dataset = stage_dataset(stage, train_dataset, settings, index)
        schedule = None
        if stage.schedule_steps is not None:
            data = train_dataset if isinstance(train_dataset, dict) else {stage.name: train_dataset}
            schedule = stage.schedule_steps(settings, data)
        trainer, keep_best, report = stage_trainer(settings, stage, dataset, model, dev_evaluator, callbacks,
                                                   show_progress_bar, trainer_dir=scratch.name,
                                                   schedule_steps=schedule)
        if report:
            stage_reports[stage.name] = dict(report)
        if len(stages) > 1:
            logger.info(f"Stage {index + 1}/{len(stages)}: {stage.name}")
        start = time.perf_counter()
        trainer.train()
        seconds += time.perf_counter() - start
        if keep_best is not None:
            # the trainer does not always evaluate the final weights: evaluate them here unless it did
            if keep_best.last_step != trainer.state.global_step:
                final = keep_best.evaluator(model)
                keep_best.consider(final[keep_best.evaluator.primary_metric], trainer.state.global_step)
            keep_best.restore()
            best = keep_best
        total_steps += trainer.state.global_step
        log_history.extend({**entry, "stage": stage.name} for entry in trainer.state.log_history)
        steps_per_epoch = math.ceil(len(dataset) / trainer.args.per_device_train_batch_size)
        logger.info(f"{settings.method} {stage.name}: {trainer.state.global_step} steps ({steps_per_epoch} per epoch)"
                    f" in {time.perf_counter() - start:.0f}s.")
    scratch.cleanup()
    model.eval()
    encode_length = apply_encode_length(model, settings)
    trainable, total = count_parameters(model)
    result = TrainResult(
        steps=total_steps, seconds=seconds, best_metric=best.best if best else None,
        best_step=best.best_step if best else None, log_history=log_history, trainable_parameters=trainable,
        total_parameters=total, settings=asdict(settings), stage_reports=stage_reports, encode_length=encode_length,
    )
    if best is not None:
        logger.info(f"Best STS-B dev Spearman {best.best:.4f} at step {best.best_step} (restored).")
    return model, result


def check_encode_length(model: SentenceTransformer, settings: TrainSettings) -> None:
    """Refuse a ``settings.max_encode_length`` longer than ``model``'s backbone takes (before training)."""
    capacity = position_capacity(model) if getattr(model, "max_seq_length", None) is not None else None
    length = settings.max_encode_length
    if length is not None and capacity is not None and length > capacity:
        raise ConfigurationError(f"max_encode_length={length} exceeds what the backbone takes ({capacity} tokens with "
                                 f"its prefix); use at most {capacity}.")


def apply_encode_length(model: SentenceTransformer, settings: TrainSettings) -> int | None:
    """Give the trained ``model`` its encoding length: ``settings.max_encode_length``, else the backbone's own limit
    (:func:`~st_prompts.modules.lengths.backbone_encode_length`). Returns it (``None``: the model has no length);
    a ``max_encode_length`` the backbone cannot take is a ConfigurationError."""
    from st_prompts.utils import resolve_gguf, resolve_model_name

    if getattr(model, "max_seq_length", None) is None:
        return None
    check_encode_length(model, settings)
    length = settings.max_encode_length
    if length is None:
        location = resolve_gguf(resolve_model_name(str(settings.backbone)))[0]
        length = backbone_encode_length(model, location)
    if length is None:
        return model.max_seq_length
    model.max_seq_length = length
    logger.info(f"The trained model encodes up to {model.max_seq_length} tokens (it trained on {settings.max_seq_length}"
                "-token batches).")
    return model.max_seq_length


def stage_trainer(settings: TrainSettings, stage: Stage, dataset, model: SentenceTransformer, dev_evaluator=None,
                  callbacks: list[TrainerCallback] | None = None, show_progress_bar: bool = True,
                  trainer_dir: str | None = None, schedule_steps: int | None = None,
                  ) -> tuple[SentenceTransformerTrainer, KeepBestCallback | None, dict[str, Any] | None]:
    """What :func:`train` does for one stage before ``trainer.train()``: preparation, loss (and its pre-pass), training
    arguments, callbacks, collator and trainer. Returns ``(trainer, keep_best, report)``: the callback keeping the best
    STS-B dev weights (``None`` when the stage selects no model), and what the loss's pre-pass reported."""
    if stage.prepare is not None:
        stage.prepare(model, settings)
    loss = stage.build_loss(model, settings)
    report = stage.prepare_loss(loss, dataset, settings) if stage.prepare_loss is not None else None
    stage_steps = stage.max_steps(settings) if stage.max_steps is not None else None
    stop_at = None
    if schedule_steps is not None and stage_steps is not None and schedule_steps > stage_steps:
        # The linear schedule runs over schedule_steps; the stage stops after its own steps (StopAtStep below).
        stage_steps, stop_at = schedule_steps, stage_steps
    accumulation = (stage.gradient_accumulation(settings) if stage.gradient_accumulation is not None
                    else settings.gradient_accumulation_steps)
    learning_rates = stage.learning_rates(model, settings) if stage.learning_rates is not None else {}
    # Selection encodes sentences whole, as SentEval, while the batches train at settings.max_seq_length.
    evaluator = AnnouncedEvaluator(full_length_evaluator(dev_evaluator)) if stage.select_model and dev_evaluator else None
    batch_size = stage.batch_size(settings) if stage.batch_size is not None else settings.batch_size
    args = SentenceTransformerTrainingArguments(
        output_dir=trainer_dir if trainer_dir is not None else tempfile.mkdtemp(prefix="st-prompts-trainer-"),
        num_train_epochs=stage.epochs(settings) if stage.epochs is not None else settings.epochs,
        max_steps=stage_steps if stage_steps is not None else settings.max_steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        learning_rate=stage.learning_rate(settings) if stage.learning_rate is not None else settings.learning_rate,
        learning_rate_mapping=learning_rates,
        warmup_steps=settings.warmup_ratio,  # a float < 1 is a ratio of the total steps in transformers 5
        weight_decay=0.0, lr_scheduler_type="linear", seed=settings.seed,
        eval_strategy="steps" if evaluator is not None else "no", eval_steps=settings.eval_steps,
        save_strategy="no", logging_steps=settings.logging_steps, report_to="none",
        disable_tqdm=not show_progress_bar,
        use_cpu=not torch.cuda.is_available(),
        **_checkpointing_arguments(settings.gradient_checkpointing),
    )
    stage_callbacks: list[TrainerCallback] = list(stage.callbacks(loss, settings)) if stage.callbacks else []
    stage_callbacks += list(callbacks or [])
    if stop_at is not None:
        stage_callbacks.append(StopAtStep(stop_at))
    stage_callbacks.append(SyncLossParametersCallback(loss, model))  # loss-owned heads under DDP
    stage_callbacks.append(AnnounceTrainingCallback(f"{settings.method} {stage.name}", len(dataset)))
    keep_best = KeepBestCallback(model, evaluator) if evaluator is not None else None
    if keep_best is not None:
        stage_callbacks.append(keep_best)
    collator = stage.collator(model, settings) if stage.collator is not None else None
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss, evaluator=evaluator,
                                         callbacks=stage_callbacks, data_collator=collator)
    if not show_progress_bar:  # without a bar transformers prints every log dict instead: say nothing
        trainer.remove_callback(PrinterCallback)
    return trainer, keep_best, report


def _checkpointing_arguments(enabled: bool) -> dict[str, Any]:
    """The training arguments that turn activation checkpointing on, under the name this transformers uses (the old
    one warns); nothing when it is off."""
    if not enabled:
        return {}

    fields = {f.name for f in dataclasses.fields(SentenceTransformerTrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    # non-reentrant: a frozen backbone's layer inputs need no gradient, the prompts inside the layers do
    return {name: True, f"{name}_kwargs": {"use_reentrant": False}}
