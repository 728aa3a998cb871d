"""The ``st-prompts`` command line.

Every sub-command lives in its own module under :mod:`st_prompts.commands` and exposes two functions:
``add_parser(subparsers)`` (registers the sub-command and its options, and sets ``func`` to its runner)
and the runner itself, which receives the parsed ``argparse.Namespace`` and returns an exit code.

Command modules import only light modules at import time (torch, transformers and sentence-transformers are imported
inside the runners), so ``st-prompts --help`` and argument errors answer at once.

Output policy: st_prompts' own messages are logged at INFO without timestamps; other libraries only speak at ERROR
(``-v`` shows everything at INFO, ``-vv`` at DEBUG); progress bars are shown on a terminal only (never written into a
redirected log), and ``Ctrl-C`` ends a command with one line. Errors (ours and argparse's) are one line
``st-prompts COMMAND: error: ...``, exit status 2; control characters of any text shown in an error or a log line
(ANSI escape sequences from a file name, a column name, a document) are printed as escapes
(:func:`st_prompts.errors.printable`), never sent to the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

from st_prompts.errors import StPromptsError, printable

# Sub-command modules, in the order they appear in ``st-prompts --help``.
COMMAND_MODULES = ("demo", "train", "bank", "evaluate", "plot", "index", "serve", "ski")
_handler: logging.Handler | None = None


class CommandParser(argparse.ArgumentParser):
    """The parser of ``st-prompts`` and of every sub-command (argparse gives sub-parsers their parent's class): a
    usage error is one line, with the user's text made printable, instead of the usage block and the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {printable(message)} (see {self.prog} --help)\n")


class _PrintableFormatter(logging.Formatter):
    """Log records with their control characters escaped (line breaks and tabs kept)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), one_line=False)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="st-prompts",
        description="Prompt-based contrastive sentence embeddings for sentence-transformers.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show library logs (-v: INFO, -vv: DEBUG); default: st_prompts' own messages only")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"st_prompts.commands.{name}").add_parser(subparsers)
    return parser


def configure_output(verbose: int = 0, progress: bool | None = None) -> None:
    """Logging and progress bars for a command-line run (see the module docstring).

    Must run before transformers / sentence-transformers are imported: they read their settings from the environment.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        os.environ["TQDM_DISABLE"] = "1"  # every tqdm bar (sentence-transformers, datasets, the trainer)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' and huggingface_hub's bars
    if verbose == 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no load reports, no advice
        os.environ.setdefault("DATASETS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    global _handler
    root = logging.getLogger()
    if _handler is not None:  # called again in the same process (tests): replace our handler, keep the others
        root.removeHandler(_handler)
    handler = _handler = logging.StreamHandler(sys.stderr)
    if verbose:
        handler.setFormatter(_PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
        root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    else:
        handler.setFormatter(_PrintableFormatter("%(message)s"))
        root.setLevel(logging.ERROR)
    root.addHandler(handler)
    logging.getLogger("st_prompts").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


def reset_output() -> None:
    """Detach the log handler :func:`configure_output` added (e.g. between tests that run the CLI in one process)."""
    global _handler
    if _handler is not None:
        logging.getLogger().removeHandler(_handler)
        _handler = None
        logging.getLogger("st_prompts").setLevel(logging.NOTSET)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    configure_output(args.verbose, progress=False if getattr(args, "no_progress", False) else None)
    try:
        return int(args.func(args) or 0)
    except StPromptsError as exc:
        # Errors we raise on purpose are meant for the user: print the message, not a traceback.
        print(f"st-prompts {args.command}: error: {printable(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Models and indexes are written to a temporary name and renamed at the end: nothing half-written is left.
        print(f"st-prompts {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
