"""The one training pipeline: load a method's data, train with model selection, save the model safely (atomically,
replacing only a model st-prompts saved; destinations are checked before training starts). ``st-prompts train``, the
recipes and Python users take this path: ``train_and_save("dcpcse", scale="cpu", output="runs/dcpcse")``."""

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
from st_prompts.modules.set_checks import check_finite_training
from st_prompts.numbers import whole
from st_prompts.storage import check_model_destination, save_model_folder
from st_prompts.training.run import train
from st_prompts.utils import is_main_process

logger = logging.getLogger(__name__)

__all__ = ["dev_subset", "model_destinations", "save_run", "train_and_save"]

#: Suffix of the prompts-only checkpoint written beside a run's output.
PROMPTS_SUFFIX = "-prompts"
#: The kind a prompts-only checkpoint's manifest records.
PROMPTS_KIND = "prompts-only checkpoint"


def dev_subset(evaluator, pairs: int):
    """The STS-B dev evaluator on ``pairs`` of its pairs, evenly spaced (the set is ordered by genre), with the same
    name and metric keys; the whole evaluator when it has no more pairs than that."""
    from st_prompts.evaluation.sts import FullLengthEmbeddingSimilarityEvaluator

    total = len(evaluator.sentences1)
    if pairs >= total:
        return evaluator
    rows = [i * total // pairs for i in range(pairs)]
    return FullLengthEmbeddingSimilarityEvaluator(
        [evaluator.sentences1[i] for i in rows], [evaluator.sentences2[i] for i in rows],
        [evaluator.scores[i] for i in rows], batch_size=evaluator.batch_size, main_similarity="cosine",
        name=evaluator.name)


def default_output(method_name: str, supervised: bool, scale: str) -> str:
    """``outputs/<method>-<sup|unsup>-<scale>``: where a run saves without ``output``."""
    return os.path.join("outputs", f"{method_name}-{'sup' if supervised else 'unsup'}-{scale}")


def model_destinations(method: methods.Method, settings, output: str, prompts_only: bool) -> list[tuple[str, str]]:
    """Every folder a run writes and its manifest's kind: the model, its prompts-only checkpoint, side outputs."""
    base = output.rstrip("/") or output
    out = [(output, "model")]
    if prompts_only and method.prompts_only:
        out.append((base + PROMPTS_SUFFIX, PROMPTS_KIND))
    out.extend((base + suffix, kind) for suffix, kind in method.side_outputs(settings))
    return out


def save_run(model, result, output: str, prompts_only: bool = False, overwrite: bool = False) -> None:
    """Save the model (safetensors), ``train_result.json`` beside it and, optionally, a prompts-only checkpoint to
    ``OUTPUT-prompts``; each folder atomically. In a distributed run only rank 0 writes."""
    if not is_main_process():
        return  # under torchrun every process holds the same model: only rank 0 writes it
    check_finite_training(model, result.best_metric)  # a diverged run is refused, the destination left as it was
    logger.info(f"Saving the model to {output}.")

    def write_full(path: Path) -> None:
        model.save(str(path))
        (path / "train_result.json").write_text(json.dumps(dataclasses.asdict(result), indent=2, default=str))

    save_model_folder(output, write_full, overwrite=overwrite)
    prompts_path = (output.rstrip("/") or output) + PROMPTS_SUFFIX
    if prompts_only:
        save_model_folder(prompts_path, lambda path: save_prompts_only(model, str(path)), overwrite=overwrite,
                          kind=PROMPTS_KIND)
        logger.info(f"Saved the prompts-only checkpoint to {prompts_path}.")


def train_and_save(method_name: str, *, supervised: bool = False, scale: str = "cpu",
                   data_dir: str | os.PathLike | None = None, senteval_dir: str | os.PathLike | None = None,
                   output: str | None = None, prompts_only: bool = False, limit: int | None = None,
                   overwrite: bool = False, show_progress_bar: bool = True, dev_limit: int | None = None,
                   **options: Any):
    """Train a registered method and save it: the path of ``st-prompts train``, the recipes and the benchmarks.

    Args:
        scale: ``"cpu"`` (packaged MiniLM, minutes) or ``"paper"`` (the paper's hyperparameters).
        data_dir: folder with ``train/`` and ``senteval/``; default: the bundled small data set at ``scale="cpu"``,
            SimCSE's hub files at ``"paper"``.
        senteval_dir: SentEval folder for STS-B dev selection (default: ``data_dir/senteval``).
        output: where to save (default: ``outputs/<method>-<sup|unsup>-<scale>``).
        prompts_only: also save a prompts-only checkpoint to ``OUTPUT-prompts``.
        limit: train on a random subset of this many examples.
        dev_limit: select the weights on this many STS-B dev pairs (evenly spaced) instead of all 1,500, then
            evaluate them on the whole dev set once (the reported ``best_metric``); for slow backbones.
        **options: settings of the method (``backbone``, ``learning_rate``, ``prefix_length``, ...).

    Returns ``(model, TrainResult, output)``.
    """
    if limit is not None and not whole(limit, 1):
        raise ConfigurationError(f"limit must be a positive number of examples, got {limit!r}")
    if dev_limit is not None and not whole(dev_limit, 2):
        raise ConfigurationError(f"dev_limit must be a number of STS-B dev pairs of at least 2, got {dev_limit!r}")
    method = methods.get(method_name)
    output = output or default_output(method_name, supervised, scale)
    settings = method.settings(supervised=supervised, scale=scale, output_dir=output, **options)
    for destination, kind in model_destinations(method, settings, output, prompts_only):
        check_model_destination(destination, overwrite, kind=kind)
    if data_dir is None and scale == "cpu":
        data_dir = bundled_data_dir()
        logger.info(f"Using the small data set bundled with st_prompts ({data_dir}); pass --data-dir for your own "
                    "(train/wiki_sentences.txt, train/nli_triplets.csv, senteval/).")
    senteval_dir = senteval_dir or (Path(data_dir) / "senteval" if data_dir is not None else None)
    full_dev = stsb_dev_evaluator(senteval_dir, source="senteval" if senteval_dir else "hub")
    evaluator = dev_subset(full_dev, dev_limit) if dev_limit is not None else full_dev
    stages = method.stages(settings)
    datasets = {stage.name: stage.load_data(settings, data_dir, limit) for stage in stages}
    sizes = ", ".join(f"{name}: {len(ds):,} examples" for name, ds in datasets.items())
    selection = (f"STS-B dev, {len(evaluator.sentences1):,} of {len(full_dev.sentences1):,} pairs"
                 if evaluator is not full_dev else f"STS-B dev, {len(full_dev.sentences1):,} pairs")
    logger.info(f"Read the data of {method_name} ({'supervised' if settings.supervised else 'unsupervised'}, "
                f"--scale {scale}): {sizes}; selection on {selection}.")
    model, result = train(settings, datasets if len(stages) > 1 else datasets[stages[0].name], evaluator,
                          show_progress_bar=show_progress_bar)
    if evaluator is not full_dev and result.best_metric is not None:
        # selected on a subset: the number reported (and on the card) is the selected weights' on the whole dev set
        logger.info(f"Evaluating the selected weights on the whole STS-B dev ({len(full_dev.sentences1):,} pairs).")
        result.selection_pairs, result.selection_metric = len(evaluator.sentences1), result.best_metric
        result.best_metric = full_dev(model)[full_dev.primary_metric]
        logger.info(f"STS-B dev Spearman of the selected weights: {result.best_metric:.4f} on all pairs "
                    f"({result.selection_metric:.4f} on the {result.selection_pairs:,} selection pairs).")
    if result.best_metric is not None and hasattr(model.model_card_data, "stsb_dev"):
        model.model_card_data.stsb_dev = 100 * result.best_metric  # the card states the selected checkpoint's reading
    save_run(model, result, output, prompts_only=prompts_only and method.prompts_only, overwrite=overwrite)
    if prompts_only and not method.prompts_only:
        logger.warning(f"{method_name} changes the backbone: no prompts-only checkpoint was written.")
    return model, result, output
