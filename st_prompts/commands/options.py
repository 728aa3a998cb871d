"""Options shared by several commands (standard library only, so that ``--help`` stays fast)."""

from __future__ import annotations

import argparse


def add_trust_remote_code_argument(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code`` (``args.trust_remote_code``: ``True`` when given, else ``None``, i.e. decided by
    :func:`st_prompts.loading.load_sentence_model`)."""
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="let the model run code from outside sentence-transformers and st_prompts (a custom class in its "
        "modules.json, custom modelling code in its config.json). Without it, such a model is refused. Only use it "
        "for models whose code you trust",
    )


def add_no_progress_argument(parser: argparse.ArgumentParser) -> None:
    """``--no-progress`` (``args.no_progress``): hide progress bars."""
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
