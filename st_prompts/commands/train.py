"""``st-prompts train METHOD``: train DCPCSE, SCPCSE or the SimCSE baseline with the paper or CPU hyperparameters."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from st_prompts.data.training_data import load_training_dataset
from st_prompts.errors import ConfigurationError
from st_prompts.evaluation.sts import stsb_dev_evaluator
from st_prompts.modules import save_prompts_only
from st_prompts.training.presets import SCALES, preset
from st_prompts.training.run import METHODS, TrainResult, train
from st_prompts.utils import default_data_dir

logger = logging.getLogger(__name__)


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``st-prompts train`` and the scripts in ``recipes/``."""
    parser.add_argument("--supervised", action="store_true", help="NLI triplets with hard negatives (default: unsupervised)")
    parser.add_argument("--scale", choices=SCALES, default="cpu",
                        help="paper: hub backbone and the paper's hyperparameters; cpu: packaged MiniLM, batch 64")
    parser.add_argument("--backbone", help="backbone name or path (default: bert-base-uncased at paper scale, MiniLM at cpu)")
    parser.add_argument("--data-dir", help="directory with train/wiki_sentences.txt, train/nli_triplets.csv and senteval/ "
                        "(default at cpu scale: ../shared/data if present; at paper scale: SimCSE's files from the hub)")
    parser.add_argument("--senteval-dir", help="SentEval directory for STS-B dev model selection (default: DATA_DIR/senteval)")
    parser.add_argument("--output", help="where to save the trained model (default: outputs/<method>-<sup|unsup>-<scale>)")
    parser.add_argument("--prompts-only", action="store_true", help="also save a prompts-only checkpoint to OUTPUT-prompts")
    parser.add_argument("--limit", type=int, help="use a random subset of this many training examples")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimisation steps")
    parser.add_argument("--epochs", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float, dest="learning_rate")
    parser.add_argument("--prefix-length", type=int)
    parser.add_argument("--prefix-projection", action="store_true", default=None)
    parser.add_argument("--mlm-weight", type=float, help="initial weight of the auxiliary MLM loss (DCPCSE: 0.1)")
    parser.add_argument("--eval-steps", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train DCPCSE / SCPCSE / the SimCSE baseline",
        description="Train a method and save the model (STS-B dev selects the best checkpoint).",
    )
    parser.add_argument("method", choices=METHODS)
    add_training_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model, result, output = run_training(args.method, args)
    print(json.dumps({"output": output, "steps": result.steps, "seconds": round(result.seconds, 1),
                      "best_dev_spearman": result.best_metric, "best_step": result.best_step,
                      "trainable_parameters": result.trainable_parameters}, indent=2))
    return 0


def run_training(method: str, args: argparse.Namespace):
    """Resolve data and settings from parsed options, train, save; returns (model, TrainResult, output dir)."""
    data_dir = args.data_dir
    if data_dir is None and args.scale == "cpu":
        data_dir = default_data_dir()
        if data_dir is None:
            raise ConfigurationError("--scale cpu needs --data-dir (a directory with train/ and senteval/).")
    senteval_dir = args.senteval_dir or (Path(data_dir) / "senteval" if data_dir is not None else None)
    kind = "sup" if args.supervised else "unsup"
    output = args.output or os.path.join("outputs", f"{method}-{kind}-{args.scale}")
    settings = preset(
        method, args.supervised, args.scale, backbone=args.backbone, output_dir=output, max_steps=args.max_steps,
        epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
        prefix_length=args.prefix_length, prefix_projection=args.prefix_projection, mlm_weight=args.mlm_weight,
        eval_steps=args.eval_steps, seed=args.seed,
    )
    evaluator = stsb_dev_evaluator(senteval_dir, source="senteval" if senteval_dir else "hub")
    dataset = load_training_dataset(args.supervised, data_dir, limit=args.limit, seed=settings.seed)
    logger.info(f"Training {method} ({kind}) on {len(dataset)} examples: {settings}")
    model, result = train(settings, dataset, evaluator, show_progress_bar=not args.no_progress)
    save_run(model, result, output, prompts_only=args.prompts_only and method != "simcse")
    return model, result, output


def save_run(model, result: TrainResult, output: str, prompts_only: bool = False) -> None:
    """Save the model (safetensors) and ``train_result.json`` next to it; optionally a prompts-only checkpoint."""
    model.save(output)
    with open(os.path.join(output, "train_result.json"), "w") as f:
        json.dump(asdict(result), f, indent=2, default=str)
    if prompts_only:
        save_prompts_only(model, output.rstrip("/") + "-prompts")
    logger.info(f"Saved the model to {output}")
