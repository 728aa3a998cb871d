"""The ``st-prompts`` command line: each sub-command's module under :mod:`st_prompts.commands` has ``add_parser`` and a
runner (heavy imports inside it, so ``--help`` answers at once). Errors are one printable line: ours and usage errors
exit 2, anything unforeseen exits 1 (``--traceback`` or ``ST_PROMPTS_TRACEBACK=1`` prints the traceback too)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import NoReturn

from st_prompts.errors import TRACEBACK_VARIABLE, StPromptsError, first_line, printable, tracebacks_asked

# Sub-command modules, in the order they appear in ``st-prompts --help``.
COMMAND_MODULES = ("demo", "train", "bank", "evaluate", "plot", "index", "embed", "serve", "replicas", "ski")
_handler: logging.Handler | None = None
#: The root logger's level before :func:`configure_output` changed it (restored by :func:`reset_output`).
_root_level: int = logging.WARNING
_MESSAGE_CHARS = 300  # an unexpected exception's message is cut to this many characters


class CommandParser(argparse.ArgumentParser):
    """The parser of ``st-prompts`` and its sub-commands: a usage error is one printable line, not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {printable(message)} (see {self.prog} --help)\n")


class _PrintableFormatter(logging.Formatter):
    """Log records with their control characters escaped (line breaks and tabs kept)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), one_line=False)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="st-prompts",
                           description="Prompt-based contrastive sentence embeddings for sentence-transformers.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show library logs (-v: INFO, -vv: DEBUG); default: st_prompts' own messages only")
    parser.add_argument("--traceback", action="store_true",
                        help=f"on an error, also print the traceback (for a bug report; or set {TRACEBACK_VARIABLE}=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"st_prompts.commands.{name}").add_parser(subparsers)
    return parser


def configure_output(verbose: int = 0, progress: bool | None = None) -> None:
    """Logging and progress bars for a command-line run: st_prompts' messages at INFO, other libraries' at ERROR
    (``verbose``: more), bars only on a terminal. Must run before transformers and sentence-transformers are imported
    (they read the environment)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        os.environ["TQDM_DISABLE"] = "1"  # every tqdm bar (sentence-transformers, datasets, the trainer)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' and huggingface_hub's bars
    if verbose == 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no load reports, no advice
        os.environ.setdefault("DATASETS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torch's OpenMP threads sleep while they wait instead of spinning, which burns the cores of other busy processes
    # (as fast on a quiet machine; benchmarks/results/omp_wait.md)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    global _handler, _root_level
    root = logging.getLogger()
    if _handler is not None:  # called again in the same process (tests): replace our handler, keep the others
        root.removeHandler(_handler)
    else:
        _root_level = root.level
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
        logging.getLogger().setLevel(_root_level)  # the root's level as it was before, or later warnings are lost
        logging.getLogger("st_prompts").setLevel(logging.NOTSET)


def _print_traceback(args: argparse.Namespace | None, exc: BaseException) -> None:
    """``exc``'s traceback on stderr (control characters escaped) when ``--traceback`` or ``ST_PROMPTS_TRACEBACK``
    asks for it."""
    if args is not None and getattr(args, "traceback", False) or tracebacks_asked():
        print(printable("".join(traceback.format_exception(exc)), one_line=False), end="", file=sys.stderr)


def unexpected_error_line(command: str, exc: BaseException) -> str:
    """The one line an unexpected exception becomes: the command, its type, where it was raised, the first line of its
    message (printable, cut), and what to do."""
    message = first_line(exc, _MESSAGE_CHARS) if str(exc).strip() else ""
    if isinstance(exc, OSError) and exc.filename is not None and printable(exc.filename) not in message:
        message += f" ({printable(exc.filename)})"
    kind = type(exc).__qualname__
    frames = traceback.extract_tb(exc.__traceback__)  # the innermost: where it was raised
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return (f"st-prompts {command}: error: unexpected {kind}{f' in {where}' if where else ''}"
            f"{f': {message}' if message else ''}; re-run with {TRACEBACK_VARIABLE}=1 (or st-prompts --traceback "
            f"{command} ...) to see the traceback, and report it")


def main(argv: list[str] | None = None) -> int:
    """Run ``st-prompts`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status: 0, 1 for an
    unexpected exception (a bug), 2 for an error st_prompts raised on purpose or a usage error, 130 for ``Ctrl-C``."""
    args: argparse.Namespace | None = None
    command = "st-prompts"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        command = args.command
        configure_output(args.verbose, progress=False if getattr(args, "no_progress", False) else None)
        return int(args.func(args) or 0)
    except StPromptsError as exc:
        # Errors we raise on purpose are meant for the user: print the message, not a traceback.
        _print_traceback(args, exc)
        print(f"st-prompts {command}: error: {printable(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Models and indexes are written to a temporary name and renamed at the end: nothing half-written is left.
        print(f"st-prompts {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (``st-prompts ... | head``): nothing more to say, and nobody to say it to.
        try:  # Python flushes stdout at exit: point it at /dev/null so that the flush does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1
    except Exception as exc:  # noqa: BLE001 - the boundary: any other exception is one line (see the docstring)
        _print_traceback(args, exc)
        print(unexpected_error_line(command, exc), file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
