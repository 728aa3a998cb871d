"""The ``st-prompts`` command line.

Every sub-command lives in its own module under :mod:`st_prompts.commands` and exposes two functions:
``add_parser(subparsers)`` (registers the sub-command and its options, and sets ``func`` to its runner)
and the runner itself, which receives the parsed ``argparse.Namespace`` and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from st_prompts.errors import StPromptsError

# Sub-command modules, in the order they appear in ``st-prompts --help``. A module that is missing is skipped so
# that the CLI keeps working while a command is being developed.
COMMAND_MODULES = ("demo", "train", "evaluate", "plot", "index")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="st-prompts",
        description="Prompt-based contrastive sentence embeddings for sentence-transformers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug information")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"st_prompts.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"st_prompts.commands.{name}":
                continue
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except StPromptsError as exc:
        # Errors we raise on purpose are meant for the user: print the message, not a traceback.
        print(f"st-prompts {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
