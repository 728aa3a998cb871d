"""``st-prompts train METHOD``: train a registered method with the paper or CPU hyperparameters.

Every method of :mod:`st_prompts.methods` gets a sub-command; its options are generated from the fields of the
method's settings class (``--prefix-length``, ``--mlp-head``, ...), next to the options every run has (data, output,
scale). The recipes in ``recipes/`` use the same parser (:func:`method_parser`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from st_prompts import methods
from st_prompts.methods.base import SCALES, cli_fields

logger = logging.getLogger(__name__)

#: Options of every run that are not settings fields.
RUN_OPTIONS = ("supervised", "scale", "data_dir", "senteval_dir", "output", "prompts_only", "limit", "no_progress")
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _field_type(f: dataclasses.Field) -> type:
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    for part in str(annotation).replace(" ", "").split("|"):
        if part in _TYPES:
            return _TYPES[part]
    return type(f.default) if f.default is not None else str


def add_run_options(parser: argparse.ArgumentParser, method: methods.Method | None = None) -> None:
    """Options every training run has: supervision, scale, data, output."""
    if method is None or len(method.settings_supported) > 1:
        parser.add_argument("--supervised", action="store_true",
                            help="NLI triplets with hard negatives (default: unsupervised)")
    parser.add_argument("--scale", choices=SCALES, default="cpu",
                        help="cpu (default): packaged all-MiniLM-L6-v2, batch 64, minutes on a CPU; paper: the "
                        "paper's hyperparameters on a hub backbone (bert-base-uncased unless --backbone)")
    parser.add_argument("--data-dir", help="directory with train/wiki_sentences.txt, train/nli_triplets.csv and "
                        "senteval/ (default: the small data set bundled with st_prompts at --scale cpu; SimCSE's full "
                        "files from the Hugging Face hub at --scale paper)")
    parser.add_argument("--senteval-dir", help="SentEval directory for STS-B dev model selection "
                        "(default: DATA_DIR/senteval; the hub copy at --scale paper without --data-dir)")
    parser.add_argument("--output", help="where to save the trained model (default: outputs/<method>-<sup|unsup>-<scale>)")
    parser.add_argument("--prompts-only", action="store_true", help="also save a prompts-only checkpoint to OUTPUT-prompts")
    parser.add_argument("--limit", type=int, help="use a random subset of this many training examples")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_settings_options(parser: argparse.ArgumentParser, method: methods.Method) -> None:
    """One ``--option`` per settings field of the method (defaults come from the preset, so they are not shown)."""
    group = parser.add_argument_group(f"{method.name} settings (default: the preset of --scale)")
    for f in cli_fields(method.settings_class):
        flag = "--" + f.name.replace("_", "-")
        names = [flag, "--lr"] if f.name == "learning_rate" else [flag]
        kind = _field_type(f)
        help_text = f.metadata.get("help", "")
        if kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(*names, dest=f.name, type=kind, default=None, choices=f.metadata.get("choices"),
                               help=help_text)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a method (" + ", ".join(methods.names()) + ")",
        description="Train a method and save the model; STS-B dev selects the best weights. "
        "'st-prompts train METHOD --help' lists the method's options.",
    )
    method_parsers = parser.add_subparsers(dest="method", metavar="METHOD", required=True)
    for name in methods.names():
        method = methods.get(name)
        sub = method_parsers.add_parser(name, help=method.summary, description=method.summary)
        add_run_options(sub, method)
        add_settings_options(sub, method)
        sub.set_defaults(func=run)


def method_parser(method_name: str, description: str) -> argparse.ArgumentParser:
    """The parser of one method's recipe script (the same options as ``st-prompts train METHOD``)."""
    method = methods.get(method_name)
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="show library logs")
    add_run_options(parser, method)
    add_settings_options(parser, method)
    return parser


def run(args: argparse.Namespace) -> int:
    model, result, output = run_training(args.method, args)
    print(json.dumps({"output": output, "steps": result.steps, "seconds": round(result.seconds, 1),
                      "best_dev_spearman": result.best_metric, "best_step": result.best_step,
                      "trainable_parameters": result.trainable_parameters}, indent=2))
    return 0


def settings_from_args(method_name: str, args: argparse.Namespace):
    """The run's settings: the method's preset for (scale, supervision, backbone), then the options given."""
    method = methods.get(method_name)
    overrides: dict[str, Any] = {f.name: getattr(args, f.name, None) for f in cli_fields(method.settings_class)}
    backbone = overrides.pop("backbone", None)
    kind = "sup" if getattr(args, "supervised", False) else "unsup"
    output = args.output or os.path.join("outputs", f"{method_name}-{kind}-{args.scale}")
    return method.settings(supervised=getattr(args, "supervised", False), scale=args.scale, backbone=backbone,
                           output_dir=output, **overrides)


def run_training(method_name: str, args: argparse.Namespace):
    """Resolve data and settings from parsed options, train, save; returns (model, TrainResult, output dir)."""
    from st_prompts.data.training_data import bundled_data_dir
    from st_prompts.evaluation.sts import stsb_dev_evaluator
    from st_prompts.training.run import train

    method = methods.get(method_name)
    settings = settings_from_args(method_name, args)
    data_dir = args.data_dir
    if data_dir is None and args.scale == "cpu":
        data_dir = bundled_data_dir()
        logger.info(f"Using the small data set bundled with st_prompts ({data_dir}); pass --data-dir for your own "
                    "(train/wiki_sentences.txt, train/nli_triplets.csv, senteval/).")
    senteval_dir = args.senteval_dir or (Path(data_dir) / "senteval" if data_dir is not None else None)
    evaluator = stsb_dev_evaluator(senteval_dir, source="senteval" if senteval_dir else "hub")
    stages = method.stages(settings)
    datasets = {stage.name: stage.load_data(settings, data_dir, args.limit) for stage in stages}
    sizes = ", ".join(f"{name}: {len(ds):,} examples" for name, ds in datasets.items())
    logger.info(f"Training {method_name} ({'supervised' if settings.supervised else 'unsupervised'}, "
                f"--scale {args.scale}) on {sizes}.")
    model, result = train(settings, datasets if len(stages) > 1 else datasets[stages[0].name], evaluator,
                          show_progress_bar=not args.no_progress)
    save_run(model, result, settings.output_dir, prompts_only=args.prompts_only and method.prompts_only)
    if args.prompts_only and not method.prompts_only:
        logger.warning(f"{method_name} changes the backbone: no prompts-only checkpoint was written.")
    return model, result, settings.output_dir


def save_run(model, result, output: str, prompts_only: bool = False) -> None:
    """Save the model (safetensors) and ``train_result.json`` next to it; optionally a prompts-only checkpoint.

    In a distributed run (``torchrun``) only the process of rank 0 writes.

    Each folder is written under a temporary name beside its destination and renamed when complete, so an
    interrupted save never leaves a half-written model (an existing folder of that name is replaced).
    """
    from st_prompts.modules import save_prompts_only
    from st_prompts.utils import is_main_process

    if not is_main_process():
        return  # under torchrun every process holds the same model: only rank 0 writes it

    def atomic(destination: str, write) -> None:
        destination = destination.rstrip("/") or destination
        parent = os.path.dirname(os.path.abspath(destination))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        try:
            write(staging)
            if os.path.isdir(destination):
                shutil.rmtree(destination)
            os.replace(staging, destination)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def write_full(path: str) -> None:
        model.save(path)
        with open(os.path.join(path, "train_result.json"), "w") as f:
            json.dump(dataclasses.asdict(result), f, indent=2, default=str)

    atomic(output, write_full)
    if prompts_only:
        atomic(output.rstrip("/") + "-prompts", lambda path: save_prompts_only(model, path))
    logger.info(f"Saved the model to {output}" + (f" (prompts only: {output.rstrip('/')}-prompts)" if prompts_only else ""))
