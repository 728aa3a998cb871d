"""Every sub-command's --help reads as plain text: no reStructuredText markup, and every argument says what it is."""

from __future__ import annotations

import argparse

from conftest import parser_walk

from st_prompts.cli import build_parser
from st_prompts.commands.options import cli_text


def test_the_walk_reaches_every_nested_sub_command():
    assert {"st-prompts bank list", "st-prompts index info", "st-prompts train dcpcse", "st-prompts ski generate",
            "st-prompts demo", "st-prompts serve"} <= {" ".join(path) for path, _ in parser_walk(build_parser())}


def test_help_texts_are_plain_and_complete():
    problems = []
    for path, parser in parser_walk(build_parser()):
        where = " ".join(path)
        for text in (parser.description, parser.epilog, parser.usage):
            if text and "``" in text:
                problems.append(f"{where}: description shows ``")
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if not choice.help or "``" in choice.help:
                        problems.append(f"{where} {choice.dest}: no plain help")
                continue
            name = "/".join(action.option_strings) or action.dest
            if not (action.help or "").strip():
                problems.append(f"{where} {name}: no help")
            elif "``" in action.help:
                problems.append(f"{where} {name}: help shows ``")
    assert problems == []


def test_cli_text_removes_rst_markup():
    assert cli_text("``st-prompts bank``: see :func:`st_prompts.bank.create_bank` and :mod:`~st_prompts.search`") \
        == "`st-prompts bank`: see `st_prompts.bank.create_bank` and `st_prompts.search`"
