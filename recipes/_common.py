"""Shared command line of the recipes: a recipe is (method, supervision) + the options of ``st-prompts train METHOD``."""

from __future__ import annotations

import json
import sys

from st_prompts.cli import configure_output
from st_prompts.commands.train import method_parser, run_training
from st_prompts.errors import StPromptsError


def main(method: str, supervised: bool | None, description: str) -> None:
    """Parse the method's options, force the recipe's supervision (``None`` = let ``--supervised`` decide), train, save."""
    parser = method_parser(method, description)
    args = parser.parse_args()
    if supervised is not None:
        args.supervised = supervised
    configure_output(args.verbose, progress=False if args.no_progress else None)
    try:
        _, result, output = run_training(method, args)
    except StPromptsError as exc:
        sys.exit(f"{method}: error: {exc}")
    except KeyboardInterrupt:
        sys.exit(f"{method}: interrupted")
    print(json.dumps({"output": output, "steps": result.steps, "best_dev_spearman": result.best_metric,
                      "trainable_parameters": result.trainable_parameters}, indent=2))
