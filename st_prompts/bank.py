"""Many tasks on one frozen backbone: a bank of named prompt sets.

A :class:`~st_prompts.PromptedTransformer` holds named prompt sets (deep prefixes) on one frozen backbone; choose a set
per call (``task="sts"``) or per row (``task=["sts", "nli", ...]``), train one with any loss (:func:`train_prompt_set`).
A walk-through: ``docs/multitask.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling
from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
from transformers.trainer_callback import PrinterCallback

from st_prompts import utils
from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError, DataNotFoundError, first_line
from st_prompts.loading import load_sentence_model
from st_prompts.modules import PromptedTransformer, backbone_fingerprint, save_prompts_only
from st_prompts.modules.lengths import full_length_evaluator
from st_prompts.modules.load_errors import backbone_errors
from st_prompts.modules.prompt_sets import BACKBONE_TASK
from st_prompts.modules.rows import encode_rows
from st_prompts.storage import check_model_destination, contained_path, save_model_folder
from st_prompts.training.run import KeepBestCallback

logger = logging.getLogger(__name__)

#: The kind a bank's manifest records (what ``bank add/remove/roles/train`` replace).
BANK_KIND = "prompt bank"
#: The kind an exported set's manifest records.
SET_KIND = "prompt set"

__all__ = ["BACKBONE_TASK", "encode_rows", "create_bank", "bank_encoder", "add_prompt_set",
           "remove_prompt_set", "prompt_set_model", "export_prompt_set", "save_bank", "training_prompt_set",
           "train_prompt_set", "TrainedSet"]


def create_bank(backbone: str = "minilm", *, pooling: str | None = None, normalize: bool | None = None,
                max_seq_length: int | None = None, default_task: str | None = None, **encoder_kwargs: Any
                ) -> SentenceTransformer:
    """An empty bank on ``backbone`` (no task: the plain backbone). A sentence-embedding model's own pooling and
    normalisation are kept (read from its JSON files), so the bank without a task encodes as it does; otherwise
    ``pooling`` (default ``"mean"``)."""
    location = utils.resolve_model_name(str(backbone))
    with backbone_errors(backbone):  # a damaged backbone is one line, not the loaders' traceback
        shipped_pooling, shipped_normalize = _shipped_pooling(location)
        if max_seq_length is None:  # the shipped model's own (all-MiniLM-L6-v2: 256, where its tokenizer says 512)
            max_seq_length = _shipped_max_seq_length(location)
        pooling = pooling or (shipped_pooling or {}).get("pooling_mode") or "mean"
        normalize = shipped_normalize if normalize is None else normalize
        encoder = PromptedTransformer(backbone, prefix_length=None, prompt_sets={}, default_task=default_task,
                                      max_seq_length=max_seq_length, **encoder_kwargs)
    if shipped_pooling and shipped_pooling.get("pooling_mode") == pooling:
        pool = Pooling(**shipped_pooling)
    else:
        pool = Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)
    modules = [encoder, pool] + ([Normalize()] if normalize else [])
    return SentenceTransformer(modules=modules, device="cpu" if not torch.cuda.is_available() else None)


def _shipped_pooling(location: str) -> tuple[dict[str, Any] | None, bool]:
    """The pooling configuration of a saved sentence-transformers model, and whether a ``Normalize`` follows."""
    modules_file = os.path.join(location, "modules.json")
    entries = _read_json(modules_file)
    pooling, normalize = None, False
    for entry in entries if isinstance(entries, list) else []:
        kind = str(entry.get("type", "")) if isinstance(entry, dict) else ""
        if kind.endswith(".Pooling"):
            path = entry.get("path")
            folder = contained_path(location, path, modules_file) if isinstance(path, str) and path else location
            raw = _read_json(os.path.join(folder, "config.json"))
            if raw is not None:
                pooling = _pooling_options(raw) if isinstance(raw, dict) else None
        elif kind.endswith(".Normalize"):
            normalize = True
    return pooling, normalize


def _read_json(path: str) -> Any:
    """The JSON of ``path`` (``None`` if it is no file); unreadable or not JSON: :class:`DataFormatError`."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise DataFormatError(f"{path} cannot be read as JSON ({first_line(exc)})") from exc


def _shipped_max_seq_length(location: str) -> int | None:
    raw = _read_json(os.path.join(location, "sentence_bert_config.json"))
    value = raw.get("max_seq_length") if isinstance(raw, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


def _pooling_options(raw: dict[str, Any]) -> dict[str, Any]:
    """sentence-transformers' Pooling arguments from its saved config (older files list each mode as a flag)."""
    if "pooling_mode" in raw and "embedding_dimension" in raw:
        return {"embedding_dimension": raw["embedding_dimension"], "pooling_mode": raw["pooling_mode"]}
    modes = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
             "pooling_mode_lasttoken": "lasttoken"}
    mode = next((name for key, name in modes.items() if raw.get(key)), "mean")
    dimension = raw.get("word_embedding_dimension") or raw.get("embedding_dimension")
    return {"embedding_dimension": dimension, "pooling_mode": mode}


def bank_encoder(model: SentenceTransformer) -> PromptedTransformer:
    """The :class:`~st_prompts.PromptedTransformer` of a model (its first module)."""
    encoder = model[0]
    if not isinstance(encoder, PromptedTransformer):
        raise ConfigurationError(f"A prompt bank needs a PromptedTransformer first module, found "
                                 f"{type(encoder).__name__}.")
    return encoder


def add_prompt_set(model: SentenceTransformer, name: str, source: Any, *, internal: bool = False) -> None:
    """Add a trained prompt set (a saved model folder, a prompts-only checkpoint or a model) under ``name``; a source
    that pools otherwise than the bank is refused (:func:`check_pooling`)."""
    if isinstance(source, (str, os.PathLike)):
        check_pooling(model, source)
    bank_encoder(model).add_prompt_set(name, source, internal=internal)


def check_pooling(model: SentenceTransformer, source: str | os.PathLike) -> None:
    """Raise :class:`ConfigurationError` when the saved model folder ``source`` pools otherwise than the bank
    ``model`` (its prompts were trained for another sentence vector)."""
    theirs, _ = _shipped_pooling(str(source))
    ours = next((module.pooling_mode for module in model if isinstance(module, Pooling)), None)
    if theirs is not None and ours is not None and theirs.get("pooling_mode") != ours:
        mode = theirs.get("pooling_mode")
        raise ConfigurationError(
            f"{str(source)!r} pools {mode!r} but this bank pools {ours!r}: its prompts were trained for another "
            f"sentence vector. Add it to a bank that pools {mode!r} (st-prompts bank create NEW --backbone "
            f"{bank_encoder(model).backbone_reference} --pooling {mode}; bank.create_bank(..., pooling={mode!r})).")


def remove_prompt_set(model: SentenceTransformer, name: str) -> None:
    """Remove the prompt set ``name``."""
    bank_encoder(model).remove_prompt_set(name)


def prompt_set_model(model: SentenceTransformer, name: str) -> SentenceTransformer:
    """The prompt set ``name`` of a bank alone: a model with that set as its own (stored) prefix, on the bank's
    backbone with its other modules; it encodes as ``model.encode(texts, task=name)``. Raises ConfigurationError (no
    bank, no set ``name``), BackboneMismatchError (the weights at the bank's backbone reference are not the bank's),
    DataNotFoundError (that backbone cannot be loaded here)."""
    encoder = bank_encoder(model)
    if name not in encoder.prompt_sets:
        raise ConfigurationError(f"No prompt set {name!r} ({encoder.sets.known()}).")
    options = encoder.prompt_set_options()[name]
    trust = {key: {"trust_remote_code": True} for key in ("model_kwargs", "config_kwargs", "processor_kwargs")
             } if encoder.trust_remote_code else {}
    try:
        single = PromptedTransformer(encoder.backbone_name_or_path, prefix_length=options["prefix_length"],
                                     prefix_dropout=options["prefix_dropout"], prefix_gate=options["prefix_gate"],
                                     max_seq_length=encoder.max_seq_length, **trust)
    except OSError as exc:
        raise DataNotFoundError(f"the bank's backbone {encoder.backbone_reference!r} cannot be loaded here "
                                f"({first_line(exc)}).") from exc
    if backbone_fingerprint(single.auto_model) != encoder.fingerprint:
        raise BackboneMismatchError(f"the weights at {encoder.backbone_reference!r} are not the bank's backbone: a "
                                    f"checkpoint of the set {name!r} referring to them would encode otherwise.")
    single.prefix_encoder.load_state_dict(encoder.prompt_sets[name].stored_state_dict())
    return SentenceTransformer(modules=[single, *list(model)[1:]], device=str(model.device))


def export_prompt_set(model_or_path: SentenceTransformer | str | os.PathLike, name: str, out: str | os.PathLike, *,
                      overwrite: bool = False, trust_remote_code: bool = False) -> Path:
    """Write the prompt set ``name`` of a bank (a model or a saved bank's folder) as a prompts-only checkpoint at
    ``out``, atomically, and return its absolute path: it loads alone and joins another bank on the same backbone.
    An existing ``out`` is replaced only with ``overwrite`` and only if st-prompts saved it (else
    :class:`ConfigurationError`, as for a missing set)."""
    if isinstance(model_or_path, (str, os.PathLike)) and _same_folder(model_or_path, out):
        raise ConfigurationError(f"refusing to export to {out}: it is the bank itself (the export would replace the "
                                 "bank by one of its sets); give a new folder")
    check_model_destination(out, overwrite, kind=SET_KIND)  # before any loading: a bank, a model, an index refused
    model = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        model = load_sentence_model(str(model_or_path), trust_remote_code=trust_remote_code)
    single = prompt_set_model(model, name)
    return save_model_folder(out, lambda folder: save_prompts_only(single, str(folder)), overwrite=overwrite,
                             kind=SET_KIND)


def save_bank(model: SentenceTransformer, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Save the bank ``model`` at ``path`` as ``model.save`` would, atomically and with st-prompts' manifest (so that
    ``st-prompts bank`` commands may change it later); return its absolute path. An existing ``path`` is replaced
    only with ``overwrite`` and only if it is a bank st-prompts saved (else :class:`ConfigurationError`)."""
    bank_encoder(model)
    return save_model_folder(path, lambda folder: model.save(str(folder)), overwrite=overwrite, kind=BANK_KIND)


def _same_folder(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    return os.path.realpath(os.path.expanduser(first)) == os.path.realpath(os.path.expanduser(second))


@contextmanager
def training_prompt_set(model: SentenceTransformer, name: str, **new_set: Any) -> Iterator[torch.nn.Module]:
    """Within this context the model trains the prompt set ``name`` alone (around any sentence-transformers training):
    it is the default task, its parameters are the only trainable ones, and the model is restored afterwards. A
    missing set is created first (``new_set``: options of :meth:`~st_prompts.PromptedTransformer.new_prompt_set`),
    gated by default: it encodes exactly as the backbone until it trains."""
    encoder = bank_encoder(model)
    if name not in encoder.prompt_sets:
        new_set.setdefault("prefix_gate", True)  # every new set starts as the backbone
        encoder.new_prompt_set(name, **new_set)
    elif new_set:
        raise ConfigurationError(f"The prompt set {name!r} exists; options {sorted(new_set)} apply to new sets only.")
    trained = encoder.prompt_sets[name]
    saved = {id(p): p.requires_grad for p in model.parameters()}
    default = encoder.default_task
    try:
        model.requires_grad_(False)
        trained.requires_grad_(True)
        encoder.default_task = name
        yield trained
    finally:
        encoder.default_task = default
        for parameter in model.parameters():
            parameter.requires_grad = saved.get(id(parameter), True)


@dataclass
class TrainedSet:
    """What :func:`train_prompt_set` returns."""

    name: str
    steps: int
    best_metric: float | None
    best_step: int | None
    trainable_parameters: int
    seconds: float


def train_prompt_set(model: SentenceTransformer, name: str, train_dataset, loss, *, evaluator=None,
                     learning_rate: float = 1e-1, epochs: float = 1.0, batch_size: int = 32,
                     eval_steps: int | None = None, max_steps: int = -1, warmup_ratio: float = 0.0, seed: int = 42,
                     show_progress_bar: bool = True, **new_set: Any) -> TrainedSet:
    """Train the prompt set ``name`` (created if missing: ``new_set`` options) with any sentence-transformers loss,
    the backbone and the other sets frozen (:func:`training_prompt_set`), with ``SentenceTransformerTrainer``.

    An ``evaluator`` runs at step 0, every ``eval_steps`` (default: a tenth of the steps) and at the end; the best
    weights are kept (in memory). A new set is gated by default, so the kept set is never below the backbone on the
    evaluator's set; an ungated set wants a learning rate of 1e-2 to 3e-2 (docs/multitask.md).
    """
    if isinstance(loss, type):
        raise ConfigurationError("Pass a loss object built on the model, e.g. CoSENTLoss(model).")
    utils.check_finite(learning_rate=learning_rate, epochs=epochs, warmup_ratio=warmup_ratio)
    if not learning_rate > 0:
        raise ConfigurationError(f"learning_rate must be positive, got {learning_rate!r}.")
    given_evaluator = evaluator
    evaluator = full_length_evaluator(evaluator)  # selection sees whole sentences, as SentEval
    encoder = bank_encoder(model)  # a new set is gated by default (training_prompt_set): it starts as the backbone
    with training_prompt_set(model, name, **new_set) as trained, tempfile.TemporaryDirectory() as scratch:
        steps = max_steps if max_steps > 0 else None
        if eval_steps is None:
            per_epoch = max(1, -(-len(train_dataset) // batch_size))
            eval_steps = max(1, int((steps or per_epoch * epochs) // 10))
        args = SentenceTransformerTrainingArguments(
            output_dir=scratch, num_train_epochs=epochs, max_steps=max_steps, per_device_train_batch_size=batch_size,
            learning_rate=learning_rate, warmup_steps=warmup_ratio, weight_decay=0.0, lr_scheduler_type="linear",
            seed=seed, eval_strategy="steps" if evaluator is not None else "no", eval_steps=eval_steps,
            save_strategy="no", logging_steps=max(1, eval_steps), report_to="none",
            disable_tqdm=not show_progress_bar, use_cpu=not torch.cuda.is_available(),
        )
        keep = KeepBestCallback(model, evaluator) if evaluator is not None else None
        start_score = None
        if keep is not None:  # step 0: the start may be the best (a gated set starts as the backbone)
            model.eval()
            start_score = evaluator(model)[evaluator.primary_metric]
            keep.consider(start_score, 0)
        torch.manual_seed(seed)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss,
                                             evaluator=evaluator, callbacks=[keep] if keep else [])
        if not show_progress_bar:  # without a bar transformers prints every log dict instead: say nothing
            trainer.remove_callback(PrinterCallback)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        if keep is not None:
            if keep.last_step != trainer.state.global_step:
                keep.consider(evaluator(model)[evaluator.primary_metric], trainer.state.global_step)
            keep.restore()
        count = sum(p.numel() for p in trained.parameters())
    model.eval()
    gated = bool(encoder.prompt_set_options()[name].get("prefix_gate"))
    encoder.record_prompt_set(
        name, rows=_rows(train_dataset), loss=type(loss).__name__, evaluator=_evaluator_label(given_evaluator),
        metric=evaluator.primary_metric if keep is not None else None, steps=trainer.state.global_step,
        best_score=_number(keep.best) if keep else None, best_step=keep.best_step if keep else None,
        start_score=_number(start_score),
        # a gated set starts as the backbone itself: its step-0 score is the backbone's (the shipped model's)
        backbone_score=_number(start_score) if gated else None,
    )
    return TrainedSet(name=name, steps=trainer.state.global_step, best_metric=keep.best if keep else None,
                      best_step=keep.best_step if keep else None, trainable_parameters=count, seconds=seconds)


def _rows(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an iterable dataset
        return None


def _number(value: Any) -> float | None:
    """A finite score as a plain float (what JSON holds), else ``None``."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _evaluator_label(evaluator: Any) -> str | None:
    """``"EmbeddingSimilarityEvaluator 'sts-dev' (1,500 pairs)"``: what selected a set, for its record."""
    if evaluator is None:
        return None
    inner = getattr(evaluator, "evaluator", evaluator) if getattr(evaluator, "encodes_full_length", False) else evaluator
    label = type(inner).__name__
    name = getattr(inner, "name", None)
    if name:
        label += f" {name!r}"
    pairs = getattr(inner, "sentences1", None)
    if pairs is not None:
        label += f" ({len(pairs):,} pairs)"
    return label
