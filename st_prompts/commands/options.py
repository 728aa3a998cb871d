"""Options shared by several commands (standard library only, so that ``--help`` stays fast)."""

from __future__ import annotations

import argparse
import re
import sys


def add_trust_remote_code_argument(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code`` (``args.trust_remote_code``: ``True`` when given, else ``None``, i.e. decided by
    :func:`st_prompts.loading.load_sentence_model`)."""
    parser.add_argument("--trust-remote-code", action="store_true", default=None, help="let the model run code that "
                        "ships with it or its backbone (a custom class in its modules.json, an auto_map in a "
                        "config.json or tokenizer_config.json, a custom Dense activation). Without it, such a model is "
                        "refused before anything of it runs. Only use it for models whose code you trust")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` (``args.dtype``): the precision a model runs in (:mod:`st_prompts.precision`)."""
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="precision of every module at inference (default float32). bfloat16/float16 halve the "
                        "memory and run several times faster on a GPU; on a CPU without AVX512-BF16/AMX they are "
                        "emulated and slower (a warning says so). Not with --quantize int8 (docs/serving.md)")


def add_no_progress_argument(parser: argparse.ArgumentParser) -> None:
    """``--no-progress`` (``args.no_progress``): hide progress bars."""
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def show_progress(args: argparse.Namespace) -> bool:
    """Whether a command shows progress bars: not with ``--no-progress``, and only on a terminal (never into a
    redirected log)."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def cli_text(text: str) -> str:
    """A docstring as command-line help text: reStructuredText's double backquotes (````x````) become single ones
    and Sphinx roles (``:func:`x```) plain names, so that ``--help`` shows no markup."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def missing_subcommand(parser: argparse.ArgumentParser) -> int:
    """What a command given without its sub-command does: print its help to stderr, exit status 2."""
    parser.print_help(sys.stderr)
    return 2
