"""Shared command line of the recipes: every recipe is (method, supervision) + the options of ``st-prompts train``."""

from __future__ import annotations

import argparse
import json
import logging

from st_prompts.commands.train import add_training_options, run_training


def main(method: str, supervised: bool | None, description: str) -> None:
    """Parse the shared options, force the recipe's supervision (``None`` = let ``--supervised`` decide), train, save."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_options(parser)
    args = parser.parse_args()
    if supervised is not None:
        args.supervised = supervised
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _, result, output = run_training(method, args)
    print(json.dumps({"output": output, "steps": result.steps, "best_dev_spearman": result.best_metric,
                      "trainable_parameters": result.trainable_parameters}, indent=2))
