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

Any other exception (a bug, or a failure st_prompts did not foresee) is one line too: the command, the exception's
type and the first line of its message, where it was raised, and what to do; exit status 1, so that a script can
tell it from a usage error (2). ``st-prompts --traceback COMMAND ...`` or ``ST_PROMPTS_TRACEBACK=1`` prints the
traceback before that line, for a bug report.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import NoReturn

from st_prompts.errors import StPromptsError, printable

# Sub-command modules, in the order they appear in ``st-prompts --help``.
COMMAND_MODULES = ("demo", "train", "bank", "evaluate", "plot", "index", "embed", "serve", "replicas", "ski")
_handler: logging.Handler | None = None
#: The root logger's level before :func:`configure_output` changed it (restored by :func:`reset_output`).
_root_level: int = logging.WARNING
TRACEBACK_VARIABLE = "ST_PROMPTS_TRACEBACK"
_MESSAGE_CHARS = 300  # an unexpected exception's message is cut to this many characters


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
    parser.add_argument("--traceback", action="store_true",
                        help=f"on an error, also print the traceback (for a bug report; or set {TRACEBACK_VARIABLE}=1)")
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
    # torch's OpenMP threads sleep while they wait for work instead of spinning (read when torch loads; a value the
    # user set is kept). Beside other busy processes spinning threads burn the cores those need: MiniLM encoding on
    # two threads beside one busy core took 14.3 s and 17.5 s of CPU spinning, 10.5 s and 10.7 s sleeping; on a quiet
    # machine the same (median ratio 0.995 over 5 rounds; benchmarks/results/omp_wait.md).
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


def _show_traceback(args: argparse.Namespace | None) -> bool:
    """Whether ``--traceback`` or ``ST_PROMPTS_TRACEBACK`` (any value but empty, ``0``, ``false``, ``no``) asks for
    tracebacks."""
    if args is not None and getattr(args, "traceback", False):
        return True
    return os.environ.get(TRACEBACK_VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")


def _print_traceback(exc: BaseException) -> None:
    """``exc``'s traceback on stderr, its control characters escaped (line breaks kept)."""
    print(printable("".join(traceback.format_exception(exc)), one_line=False), end="", file=sys.stderr)


def _where(exc: BaseException) -> str:
    """``file.py:LINE`` of the innermost frame of ``exc``'s traceback (where it was raised), or ``""``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def unexpected_error_line(command: str, exc: BaseException) -> str:
    """The one line an unexpected exception becomes: the command, the exception's type and the first line of its
    message (made printable, cut to a few hundred characters), where it was raised, and what to do."""
    lines = str(exc).strip().splitlines()
    message = printable(lines[0] if lines else "")
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "..."
    if isinstance(exc, OSError) and exc.filename is not None and printable(exc.filename) not in message:
        message += f" ({printable(exc.filename)})"
    kind = type(exc).__qualname__
    where = _where(exc)
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
        if _show_traceback(args):
            _print_traceback(exc)
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
        if _show_traceback(args):
            _print_traceback(exc)
        print(unexpected_error_line(command, exc), file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
