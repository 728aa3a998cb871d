"""The one training pipeline: load a method's data, train with model selection, save the model safely.

``st-prompts train``, the recipes and Python users take this same path::

    from st_prompts.training import train_and_save
    model, result, output = train_and_save("dcpcse", scale="cpu", data_dir="data", output="runs/dcpcse")

Saving (:func:`save_run`) goes through :func:`st_prompts.storage.replace_folder`: a folder is written under a hidden
name and renamed into place; an existing folder is replaced only if it is a model st-prompts saved (its
``st_prompts_save.json`` lists every file in it) and ``overwrite`` is given. Destinations are checked before
training starts, so a refusal costs nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from st_prompts import methods
from st_prompts.data.training_data import bundled_data_dir
from st_prompts.errors import ConfigurationError
from st_prompts.evaluation.sts import stsb_dev_evaluator
from st_prompts.modules import save_prompts_only
from st_prompts.storage import check_model_destination, save_model_folder
from st_prompts.training.run import check_finite_training, train
from st_prompts.utils import is_main_process

logger = logging.getLogger(__name__)

__all__ = ["model_destinations", "save_run", "train_and_save"]

#: Suffix of the prompts-only checkpoint written beside a run's output.
PROMPTS_SUFFIX = "-prompts"


def default_output(method_name: str, supervised: bool, scale: str) -> str:
    """``outputs/<method>-<sup|unsup>-<scale>``: where a run saves without ``output``."""
    return os.path.join("outputs", f"{method_name}-{'sup' if supervised else 'unsup'}-{scale}")


def model_destinations(method: methods.Method, settings, output: str, prompts_only: bool) -> list[str]:
    """Every folder a run writes: the model, its prompts-only checkpoint, and the method's own side outputs."""
    base = output.rstrip("/") or output
    out = [output]
    if prompts_only and method.prompts_only:
        out.append(base + PROMPTS_SUFFIX)
    out.extend(base + suffix for suffix in method.side_outputs(settings))
    return out


def save_run(model, result, output: str, prompts_only: bool = False, overwrite: bool = False) -> None:
    """Save the model (safetensors), ``train_result.json`` beside it and, optionally, a prompts-only checkpoint to
    ``OUTPUT-prompts``; each folder atomically (:func:`save_model_folder`).

    In a distributed run (``torchrun``) only the process of rank 0 writes.
    """
    if not is_main_process():
        return  # under torchrun every process holds the same model: only rank 0 writes it
    check_finite_training(model, result.best_metric)  # a diverged run is refused, the destination left as it was

    def write_full(path: Path) -> None:
        model.save(str(path))
        (path / "train_result.json").write_text(json.dumps(dataclasses.asdict(result), indent=2, default=str))

    save_model_folder(output, write_full, overwrite=overwrite)
    prompts_path = (output.rstrip("/") or output) + PROMPTS_SUFFIX
    if prompts_only:
        save_model_folder(prompts_path, lambda path: save_prompts_only(model, str(path)), overwrite=overwrite,
                          kind="prompts-only checkpoint")
    logger.info(f"Saved the model to {output}" + (f" (prompts only: {prompts_path})" if prompts_only else ""))


def train_and_save(
    method_name: str,
    *,
    supervised: bool = False,
    scale: str = "cpu",
    data_dir: str | os.PathLike | None = None,
    senteval_dir: str | os.PathLike | None = None,
    output: str | None = None,
    prompts_only: bool = False,
    limit: int | None = None,
    overwrite: bool = False,
    show_progress_bar: bool = True,
    **options: Any,
):
    """Train a registered method and save it: the path of ``st-prompts train``, the recipes and the benchmarks.

    Args:
        method_name: a name of :func:`st_prompts.methods.names`.
        supervised: NLI triplets with hard negatives (default: unsupervised).
        scale: ``"cpu"`` (packaged MiniLM, minutes) or ``"paper"`` (the paper's hyperparameters).
        data_dir: folder with ``train/wiki_sentences.txt``, ``train/nli_triplets.csv`` and ``senteval/``; default:
            the small data set bundled with st_prompts at ``scale="cpu"``, SimCSE's hub files at ``"paper"``.
        senteval_dir: SentEval folder for STS-B dev selection (default: ``data_dir/senteval``).
        output: where to save (default: ``outputs/<method>-<sup|unsup>-<scale>``).
        prompts_only: also save a prompts-only checkpoint to ``OUTPUT-prompts``.
        limit: train on a random subset of this many examples.
        overwrite: replace an existing model st-prompts saved at ``output`` (other folders are always refused).
        show_progress_bar: show the trainer's progress bar.
        **options: settings of the method (``backbone``, ``learning_rate``, ``prefix_length``, ...).

    Returns:
        ``(model, TrainResult, output)``.

    Raises:
        ConfigurationError: bad options, or a destination that may not be written (checked before training).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"limit must be a positive number of examples, got {limit!r}")
    method = methods.get(method_name)
    output = output or default_output(method_name, supervised, scale)
    settings = method.settings(supervised=supervised, scale=scale, output_dir=output, **options)
    for destination in model_destinations(method, settings, output, prompts_only):
        check_model_destination(destination, overwrite)
    if data_dir is None and scale == "cpu":
        data_dir = bundled_data_dir()
        logger.info(f"Using the small data set bundled with st_prompts ({data_dir}); pass --data-dir for your own "
                    "(train/wiki_sentences.txt, train/nli_triplets.csv, senteval/).")
    senteval_dir = senteval_dir or (Path(data_dir) / "senteval" if data_dir is not None else None)
    evaluator = stsb_dev_evaluator(senteval_dir, source="senteval" if senteval_dir else "hub")
    stages = method.stages(settings)
    datasets = {stage.name: stage.load_data(settings, data_dir, limit) for stage in stages}
    sizes = ", ".join(f"{name}: {len(ds):,} examples" for name, ds in datasets.items())
    logger.info(f"Training {method_name} ({'supervised' if settings.supervised else 'unsupervised'}, "
                f"--scale {scale}) on {sizes}.")
    model, result = train(settings, datasets if len(stages) > 1 else datasets[stages[0].name], evaluator,
                          show_progress_bar=show_progress_bar)
    if result.best_metric is not None and hasattr(model.model_card_data, "stsb_dev"):
        model.model_card_data.stsb_dev = 100 * result.best_metric  # the card states the selected checkpoint's reading
    save_run(model, result, output, prompts_only=prompts_only and method.prompts_only, overwrite=overwrite)
    if prompts_only and not method.prompts_only:
        logger.warning(f"{method_name} changes the backbone: no prompts-only checkpoint was written.")
    return model, result, output
