"""``st-prompts train METHOD``: a sub-command per registered method, its options generated from the fields of the
method's settings class, next to those every run has. The recipes in ``recipes/`` use the same parser."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from st_prompts import methods
from st_prompts.commands import _numbers as n
from st_prompts.commands.options import show_progress
from st_prompts.methods.base import SCALES, cli_fields
from st_prompts.prompts.spec import MAX_PREFIX_HIDDEN_SIZE, MAX_PREFIX_LENGTH

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_MAX_TOKENS = 1 << 20  # token lengths: refused against the backbone before training; this bounds the parse
_RATE = n.positive_float(10.0)
_WEIGHT = n.finite_float(0.0, 1e6)
#: The range of each numeric settings field on the command line (checked by argparse, before anything loads); a
#: field not listed takes a non-negative whole number (int) or a finite number (float).
FIELD_RANGES = {
    "learning_rate": _RATE, "head_learning_rate": _RATE, "generator_learning_rate": _RATE,
    "stage1_learning_rate": _RATE, "backbone_learning_rate": _RATE,
    "batch_size": n.positive_int(1 << 20), "stage1_batch_size": n.positive_int(1 << 20),
    "epochs": n.positive_float(1e6), "temperature": n.positive_float(1e3),
    "max_steps": n.int_range(-1), "seed": n.seed,
    "max_seq_length": n.positive_int(_MAX_TOKENS), "ski_max_seq_length": n.positive_int(_MAX_TOKENS),
    "max_encode_length": n.int_range(2, _MAX_TOKENS),
    "prefix_length": n.positive_int(MAX_PREFIX_LENGTH), "prefix_hidden_size": n.positive_int(MAX_PREFIX_HIDDEN_SIZE),
    "prefix_init_std": n.positive_float(10.0),
    "kappa_threshold": n.finite_float(-1e3, 1e3),
    "warmup_ratio": n.fraction, "masking_ratio": n.fraction, "label_fraction": n.fraction, "mlm_decay": n.fraction,
    "crtd_weight": _WEIGHT, "mlm_weight": _WEIGHT, "aux_weight": _WEIGHT, "ski_weight": _WEIGHT,
    "ski_weight_1": _WEIGHT, "ski_weight_2": _WEIGHT,
    **{name: n.positive_int() for name in ("gradient_accumulation_steps", "eval_steps", "logging_steps",
                                           "mlm_decay_steps", "diagnostics_steps", "diagnostics_samples",
                                           "generator_steps", "stage1_steps")},
}


def _field_type(f: dataclasses.Field):
    """The argparse ``type`` of a settings field: its range (:data:`FIELD_RANGES`) for a number, else its kind."""
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    kind = next((_TYPES[part] for part in str(annotation).replace(" ", "").split("|") if part in _TYPES), None)
    if kind is None:
        kind = type(f.default) if f.default is not None else str
    if kind is int:
        return FIELD_RANGES.get(f.name, n.non_negative_int())
    if kind is float:
        return FIELD_RANGES.get(f.name, n.finite_float())
    return kind


def add_run_options(parser: argparse.ArgumentParser, method: methods.MethodConfig | None = None) -> None:
    """Options every training run has: supervision, scale, data, output."""
    if method is None or len(method.supervision) > 1:
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
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it holds a model saved by "
                        "st-prompts (a folder holding anything else is always refused)")
    parser.add_argument("--prompts-only", action="store_true", help="also save a prompts-only checkpoint to OUTPUT-prompts")
    parser.add_argument("--limit", type=n.positive_int(), help="use a random subset of this many training examples")
    parser.add_argument("--dev-limit", type=n.positive_int(), metavar="N", help="select the weights during training on "
                        "N STS-B dev pairs (evenly spaced) instead of all 1,500, then evaluate the selected weights on "
                        "the whole dev set once; for slow backbones (e.g. a decoder LLM on a CPU). Default: the whole "
                        "dev set at every evaluation (the papers' protocol)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_settings_options(parser: argparse.ArgumentParser, method: methods.MethodConfig) -> None:
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
            group.add_argument(*names, dest=f.name, type=kind, choices=f.metadata.get("choices"),
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
        method = methods.config(name)
        sub = method_parsers.add_parser(name, help=method.summary, description=method.summary)
        add_run_options(sub, method)
        add_settings_options(sub, method)
        sub.set_defaults(func=run)


def method_parser(method_name: str, description: str) -> argparse.ArgumentParser:
    """The parser of one method's recipe script (the same options as ``st-prompts train METHOD``)."""
    method = methods.config(method_name)
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="show library logs")
    add_run_options(parser, method)
    add_settings_options(parser, method)
    return parser


def run(args: argparse.Namespace) -> int:
    model, result, output = run_training(args.method, args)
    print(json.dumps({"output": output, "steps": result.steps, "seconds": round(result.seconds, 1),
                      "best_dev_spearman": result.best_metric, "best_step": result.best_step,
                      **({"selection_dev_pairs": result.selection_pairs,
                          "selection_dev_spearman": result.selection_metric} if result.selection_pairs else {}),
                      "trainable_parameters": result.trainable_parameters}, indent=2))
    return 0


def run_training(method_name: str, args: argparse.Namespace):
    """Call :func:`st_prompts.training.pipeline.train_and_save` with the parsed options; returns what it returns."""
    from st_prompts.training.pipeline import train_and_save

    method = methods.config(method_name)
    options: dict[str, Any] = {f.name: getattr(args, f.name, None) for f in cli_fields(method.settings_class)}
    return train_and_save(
        method_name, supervised=getattr(args, "supervised", False), scale=args.scale, data_dir=args.data_dir,
        senteval_dir=args.senteval_dir, output=args.output, prompts_only=args.prompts_only, limit=args.limit,
        overwrite=args.overwrite, show_progress_bar=show_progress(args),
        dev_limit=getattr(args, "dev_limit", None), **options,
    )
