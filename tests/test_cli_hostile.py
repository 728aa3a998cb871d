"""Every sub-command under hostile inputs answers with one line, never a traceback: hostile numbers for every numeric
option, missing, empty, foreign and damaged paths for every command, then specific cases and ``main``'s catch-all."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import cli_error, edit_json, one_error_line, parser_walk, save_plain
from safetensors.torch import load_file, save_file

from st_prompts import cli
from st_prompts.cli import build_parser, main

FIXTURE = Path(__file__).parent / "fixtures" / "senteval"
#: Values every numeric option refuses at parse time.
#: (The one place of the suite's hostile numbers on the command line: every numeric option of every command.)
HOSTILE_NUMBERS = ("nan", "inf", "-inf", "1e30", "9" * 60, "", "abc", "1e999")
NON_FINITE = ("nan", "inf", "-inf", "1e999")
#: Values a few options refuse besides: a zero count of hits, a search breadth of 2**40.
EXTRA = {"-k": ("0", "1" + "0" * 40), "--ef-search": (str(2**40),), "--rerank": ("-1",)}
#: Options whose range includes -5 (a negative threshold is meaningful).
NEGATIVE_OK = {"--kappa-threshold"}


def _numeric_options():
    """``(path, option, action)`` of every numeric option of every leaf command."""
    cases = []
    for path, parser in parser_walk(build_parser(), ()):
        for action in parser._actions:
            if not action.option_strings or action.type is None or action.choices:
                continue
            try:
                value = action.type("5")
            except Exception:  # noqa: BLE001 - not a numeric option
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                cases.append((path, action.option_strings[0], action))
    return cases


NUMERIC = _numeric_options()
PARSER = build_parser()


def _run(argv: list[str], capsys) -> str:
    """The one error line of ``main(argv)``, asserted: exit status 2, an error st_prompts raises on purpose."""
    line = cli_error(argv, capsys)
    assert ": error: unexpected " not in line, line
    return line


def test_the_walk_covers_every_command_and_our_numbers_are_range_checked():
    """Every numeric option of train, bank, evaluate, plot, ski and demo goes through st_prompts.commands._numbers
    (a bare int or float type would take -5 or 1e30)."""
    commands = {" ".join(path[:2]) for path, _, _ in NUMERIC}
    assert {"train dcpcse", "bank train", "evaluate", "plot similarity", "ski generate", "demo",
            "index build", "index search"} <= commands
    bare = [(" ".join(path), option) for path, option, action in NUMERIC
            if path[0] in ("train", "bank", "evaluate", "plot", "ski", "demo") and action.type in (int, float)]
    assert bare == []


@pytest.mark.parametrize("path,option,action", NUMERIC, ids=[f"{' '.join(p)} {o}" for p, o, _ in NUMERIC])
def test_every_numeric_option_refuses_hostile_numbers_in_one_line(path, option, action, capsys, monkeypatch):
    """Each value is refused at parse time, in one line naming the option; a float option says that the number is not
    finite (nan, inf, -inf, 1e999)."""
    monkeypatch.setattr(cli, "build_parser", lambda: PARSER)  # one parser for the walk: parsing does not change it
    is_float = isinstance(action.type("5"), float)
    for value in HOSTILE_NUMBERS + (() if option in NEGATIVE_OK else ("-5",)) + EXTRA.get(option, ()):
        line = _run([*path, f"{option}={value}"], capsys)
        assert line.startswith(f"st-prompts {' '.join(path)}: error: argument {option}"), (value, line)
        assert not (is_float and value in NON_FINITE) or "not a finite number" in line, (value, line)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, tiny_bert):
    """Paths of the walk: missing, a folder of other files, a damaged model folder, small data files."""
    root = tmp_path_factory.mktemp("hostile")
    other = root / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a model\n")
    damaged = root / "damaged"
    shutil.copytree(tiny_bert, damaged)
    with open(damaged / "model.safetensors", "r+b") as handle:
        handle.truncate(100)
    (root / "pairs.csv").write_text("sentence1,sentence2,score\na man plays,a man plays guitar,0.9\n")
    (root / "lines.txt").write_text("a man plays guitar\n")
    runs = []
    for i, text in enumerate(["{not json", "[]", '{"log_history": 5}', '{"log_history": [7]}',
                              '{"log_history": [{"step": "x", "diffaug_delta": 1, "diffaug_kappa": 2}]}',
                              '{"log_history": [{"step": 1, "diffaug_delta": NaN, "diffaug_kappa": 2}]}']):
        (root / f"run{i}").mkdir()
        (root / f"run{i}" / "train_result.json").write_text(text)
        runs.append(str(root / f"run{i}"))
    return {"missing": str(root / "missing"), "other": str(other), "damaged": str(damaged), "root": root,
            "pairs": str(root / "pairs.csv"), "lines": str(root / "lines.txt"), "runs": runs}


def _path_cases(h: dict) -> list[list[str]]:
    m, o, d, r = h["missing"], h["other"], h["damaged"], h["root"]
    se = str(FIXTURE)
    out = str(r / "out-new")
    cases = [["demo", "--output", o]]
    for method in ("dcpcse", "simcse"):
        cases += [["train", method, "--data-dir", m, "--output", out], ["train", method, "--output", o],
                  ["train", method, "--senteval-dir", m, "--output", out]]
    for bank in (m, o, d, ""):
        cases += [["bank", "add", bank, "x", d], ["bank", "remove", bank, "x"],
                  ["bank", "roles", bank, "--default", "x"],
                  ["bank", "list", bank], ["bank", "export", bank, "x", out]]
    cases += [["bank", "create", o], ["bank", "create", out, "--backbone", m], ["bank", "create", out, "--backbone", d],
              ["bank", "create", out, "--backbone", o], ["bank", "train", out, "x", "--data", m],
              ["bank", "train", out, "x", "--data", ""], ["bank", "train", o, "x", "--data", h["pairs"]]]
    for model in (m, o, d, ""):
        cases += [["evaluate", model, "--senteval-dir", se, "--no-progress"],
                  ["plot", "similarity", model, "--senteval-dir", se, "--out", str(r / "s.png")],
                  ["plot", "align-uniform", model, "--senteval-dir", se, "--out", str(r / "a.png")],
                  ["index", "build", model, h["lines"], str(r / "idx")],
                  ["serve", model],
                  ["ski", "generate", "--llm", model, "--input", h["lines"], "--output", str(r / "ski.jsonl")]]
    cases += [["evaluate", "minilm", "--senteval-dir", m], ["evaluate", "minilm", "--senteval-dir", o]]
    for index in (m, o, d, ""):
        cases += [["index", "info", index], ["index", "search", index, "cats"], ["index", "add", index, h["lines"]],
                  ["index", "remove", index, "1"], ["index", "calibrate", index, "--target-recall", "0.9"],
                  ["index", "export", index, "--to", f"milvus:{r / 'export.db'}#c"]]
    cases += [["plot", "diffaug-stage1", run, "--out", str(r / "d.png")] for run in (m, o, *h["runs"])]
    cases += [["ski", "generate", "--llm", d, "--input", m, "--output", str(r / "ski.jsonl")]]
    return cases


def test_every_command_refuses_missing_empty_foreign_and_damaged_paths_in_one_line(hostile, capsys):
    """None of them reaches the catch-all of main: each is a specific one-line error (exit status 2)."""
    failures = []
    for argv in _path_cases(hostile):
        try:
            _run(argv, capsys)
        except AssertionError as exc:
            failures.append(f"{argv}: {str(exc)[-600:]}")
    assert failures == [], "\n".join(failures)


# ---------------------------------------------------------------------------------------------- specific cases
@pytest.fixture(scope="module")
def tiny_bank(tmp_path_factory, tiny_bert):
    """A saved bank on the tiny backbone with one gated set 'a' (the CLI loads it in a few seconds)."""
    from st_prompts.bank import bank_encoder, create_bank, save_bank

    model = create_bank(tiny_bert, pooling="mean")
    bank_encoder(model).new_prompt_set("a", prefix_length=4, prefix_gate=True)
    path = tmp_path_factory.mktemp("banks") / "bank"
    save_bank(model, path)  # with the manifest: the CLI may change it
    return path


@pytest.fixture
def bank(tiny_bank, tmp_path) -> Path:
    """A copy of ``tiny_bank`` that a test may change."""
    return Path(shutil.copytree(tiny_bank, tmp_path / "bank"))


def _prompted_config(bank: Path) -> Path:
    modules = json.loads((bank / "modules.json").read_text())
    entry = next(m for m in modules if m["type"].endswith("PromptedTransformer"))
    return bank / entry["path"] / "sentence_bert_config.json" if entry["path"] else bank / "sentence_bert_config.json"


def _source(tmp_path: Path, options: dict, state: dict | None = None) -> Path:
    """A prompts-only-like source folder: a config with ``options`` and a prompts file."""
    from st_prompts.modules.checkpoint import PROMPTS_FILE

    folder = tmp_path / "source"
    folder.mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps(options))
    save_file(state or {"prefix_encoder.embedding.weight": torch.zeros(4, 8)}, str(folder / PROMPTS_FILE))
    return folder


@pytest.mark.parametrize("length,expected", [(9_999_999, "from 1 to 16384"), (10_000, "position")])
def test_bank_add_of_a_huge_prefix_length_is_refused_before_anything_is_allocated(bank, tmp_path, capsys,
                                                                                  monkeypatch, length, expected):
    from st_prompts.prompts import prefix

    source = _source(tmp_path, {"prefix_length": length})
    built = []
    original = prefix.PrefixEncoder.__init__

    def record(self, *args, **kwargs):
        built.append(kwargs.get("prefix_length", args[0] if args else None))
        original(self, *args, **kwargs)

    monkeypatch.setattr(prefix.PrefixEncoder, "__init__", record)
    line = _run(["bank", "add", str(bank), "big", str(source)], capsys)
    assert "prefix_length" in line and expected in line, line
    assert length not in built  # refused before the prefix was built


#: Hostile sources for ``bank add``: (what is hostile, its value, a text the error line must hold).
SOURCES = [("path", kind, None) for kind in ("missing", "other", "damaged", "empty")] + [
    ("config", config, None) for config in ('{"prefix_length": 4, "prompt_sets": {"a": null}}', "[1]", "{",
                                            '{"prefix_length": 4, "prefix_projection": "yes"}',
                                            '{"prefix_length": 4, "prefix_hidden_size": 1e300}')] + [
    ("modules", modules, None) for modules in ("{", "[1, null]", '{"a": 1}', '[{"type": "x.Pooling", "path": 5}]',
                                               '[{"type": "x.Pooling", "path": "../.."}]',
                                               '[{"type": "x.Pooling", "path": "p"}]')] + [
    ("config", '{"prefix_length": 4, "prefix_dropout": 5}', "prefix_dropout must be a number in [0, 1)")]


@pytest.mark.parametrize("part,value,expected", SOURCES)
def test_bank_add_of_a_hostile_source_is_one_line(bank, hostile, tmp_path, capsys, part, value, expected):
    """A missing, foreign, damaged or empty source path, a malformed config or modules.json, a dropout of 5."""
    if part == "path":
        source = "" if value == "empty" else hostile[value]
    else:
        source = _source(tmp_path, {"prefix_length": 4})
        (source / ("sentence_bert_config.json" if part == "config" else "modules.json")).write_text(value)
        (source / "p").mkdir()
        (source / "p" / "config.json").write_text("{broken")
    line = _run(["bank", "add", str(bank), "x", str(source)], capsys)
    assert expected is None or expected in line, line


def test_bank_add_of_nan_prompts_says_the_file_holds_non_finite_values(tiny_bank, bank, tmp_path, capsys):
    from st_prompts.modules.checkpoint import PROMPTS_FILE

    config = json.loads(_prompted_config(tiny_bank).read_text())
    state = load_file(str(_prompted_config(tiny_bank).parent / PROMPTS_FILE))
    state = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    source = _source(tmp_path, {"prompt_sets": config["prompt_sets"]}, state)
    line = _run(["bank", "add", str(bank), "nan", str(source)], capsys)
    assert "non-finite values" in line and "diverged" not in line, line


@pytest.mark.parametrize("prompt_sets", [[1, 2], {"a": 3}, {"a": {"prefix_length": "x"}},
                                         {"a": {"prefix_length": 4, "exec": "rm -rf"}}, {"a": {}}])
def test_a_bank_with_malformed_prompt_sets_is_refused_in_one_line(bank, tmp_path, capsys, prompt_sets):
    edit_json(_prompted_config(bank), lambda config: {**config, "prompt_sets": prompt_sets})
    line = _run(["bank", "list", str(bank)], capsys)
    assert "unexpected" not in line, line


@pytest.mark.parametrize("option,value", [("--temperature", "0"), ("--temperature", "-0.05"),
                                          ("--prefix-length", "1e8"), ("--prefix-length", "100000000"),
                                          ("--seed", str(2**32)), ("--warmup-ratio", "5"),
                                          ("--max-encode-length", "0")])
def test_out_of_range_training_options_are_refused_at_parse_time(option, value, capsys):
    line = _run(["train", "dcpcse", option, value], capsys)
    assert f"argument {option}" in line, line


@pytest.mark.parametrize("extra,words", [(["--max-encode-length", "100000"], ("max_encode_length=100000 exceeds",)),
                                         *((["--prefix-length", "10000", gate], ("prefix_length=10000", "position"))
                                           for gate in ("--prefix-gate", "--no-prefix-gate"))])
def test_a_length_beyond_the_backbone_is_refused_before_anything_is_built(tiny_bert, data_dir, tmp_path, capsys,
                                                                          monkeypatch, extra, words):
    from st_prompts.prompts import prefix
    from st_prompts.training import run as training_run

    monkeypatch.setattr(training_run, "stage_trainer", lambda *a, **k: pytest.fail("training started"))
    if "--prefix-length" in extra:
        monkeypatch.setattr(prefix.PrefixEncoder, "__init__", lambda *a, **k: pytest.fail("the prefix was built"))
    line = _run(["train", "dcpcse", "--backbone", tiny_bert, "--data-dir", str(data_dir), "--output",
                 str(tmp_path / "m"), *extra, "--no-progress"], capsys)
    assert all(word in line for word in words), line


@pytest.mark.parametrize("argv", [["train", "dcpcse", "--max-steps", "1", "--batch-size", "4", "--no-progress"],
                                  ["bank", "create"]])
def test_a_damaged_backbone_is_one_line_naming_it(hostile, data_dir, tmp_path, capsys, argv):
    if argv[0] == "train":
        argv = [*argv, "--backbone", hostile["damaged"], "--data-dir", str(data_dir), "--output", str(tmp_path / "m")]
    else:
        argv = [*argv, str(tmp_path / "b"), "--backbone", hostile["damaged"]]
    line = _run(argv, capsys)
    assert f"cannot load the backbone {hostile['damaged']!r}" in line, line
    assert "SafetensorError" in line or "damaged" in line


def test_a_planted_lock_file_symlink_is_refused_and_its_target_untouched(bank, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / ".bank.st-prompts.lock").symlink_to(victim)
    line = _run(["bank", "roles", str(bank), "--default", "a"], capsys)
    assert "symbolic link" in line, line
    assert victim.read_text() == "precious\n"


# ------------------------------------------------------------------------------------------------ chat templates
HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def test_an_encoder_with_a_hostile_chat_template_evaluates_without_rendering_it(tiny_bert, tmp_path, capsys):
    folder = save_plain(tmp_path / "templated", tiny_bert)
    for config_file in folder.rglob("tokenizer_config.json"):
        edit_json(config_file, lambda config: {**config, "chat_template": HANG})
    start = time.perf_counter()
    status = main(["evaluate", str(folder), "--senteval-dir", str(FIXTURE), "--tasks", "STSBenchmark",
                   "--no-progress"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert time.perf_counter() - start < 120


def _module(render, causal: bool = True) -> SimpleNamespace:
    """A stand-in model module: attention (``causal`` or not), a "message" modality and a tokenizer whose template
    renders with ``render``."""
    attention = torch.nn.Module()
    attention.is_causal = causal
    tokenizer = SimpleNamespace(chat_template="{{ x }}", apply_chat_template=lambda *args, **kwargs: render())
    return SimpleNamespace(auto_model=torch.nn.Sequential(attention), modality_config={"text": {}, "message": {}},
                           tokenizer=tokenizer, processor=tokenizer)


def _hang():
    while True:
        pass


@pytest.mark.parametrize("render,expected", [(_hang, "took more than"), (lambda: 1 / 0, "ZeroDivisionError"),
                                             (lambda: "a" * 2_000_000, "2,000,000 characters")])
def test_a_decoder_chat_template_renders_within_a_time_and_size_bound(monkeypatch, render, expected):
    from st_prompts.errors import ConfigurationError
    from st_prompts.modules import chat_templates

    monkeypatch.setattr(chat_templates, "RENDER_SECONDS", 0.3)
    module = _module(render)
    chat_templates.guard_chat_templates(module)
    assert "message" in module.modality_config  # a decoder keeps its template
    with pytest.raises(ConfigurationError, match=expected):
        module.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_an_encoder_loses_its_message_modality_and_template():
    from st_prompts.modules import chat_templates

    module = chat_templates.guard_chat_templates(_module(lambda: "x", causal=False))
    assert "message" not in module.modality_config and module.tokenizer.chat_template is None


# ------------------------------------------------------------------------------------------------- the catch-all
def _explode(args):
    raise RuntimeError("kaboom \x1b[31mred\nsecond line " + "x" * 1000)


def _with_runner(monkeypatch, runner):
    original = cli.build_parser

    def build():
        parser = original()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                action.choices["demo"].set_defaults(func=runner)
        return parser

    monkeypatch.setattr(cli, "build_parser", build)


@pytest.mark.parametrize("how", ["", "flag", "env"])
def test_an_unexpected_exception_is_one_line_with_what_to_do_or_a_traceback_on_request(monkeypatch, capsys, how):
    monkeypatch.delenv("ST_PROMPTS_TRACEBACK", raising=False)
    _with_runner(monkeypatch, _explode)
    if how == "env":
        monkeypatch.setenv("ST_PROMPTS_TRACEBACK", "1")
    assert main(["--traceback", "demo"] if how == "flag" else ["demo"]) == 1
    err = capsys.readouterr().err
    if how:
        assert "Traceback (most recent call last)" in err and "_explode" in err and "\x1b" not in err
        assert err.strip().splitlines()[-1].startswith("st-prompts demo: error: unexpected RuntimeError")
        return
    line = one_error_line(err)
    assert line.startswith("st-prompts demo: error: unexpected RuntimeError in test_cli_hostile.py:")
    assert "kaboom \\x1b[31mred" in line and "second line" not in line and "x" * 400 not in line
    assert "ST_PROMPTS_TRACEBACK=1" in line and "--traceback" in line and "report it" in line


def test_keyboard_interrupt_stays_one_line(monkeypatch, capsys):
    def interrupt(args):
        raise KeyboardInterrupt

    _with_runner(monkeypatch, interrupt)
    assert main(["demo"]) == 130
    assert capsys.readouterr().err.strip() == "st-prompts demo: interrupted"


def test_the_real_entry_point_turns_an_unexpected_exception_into_one_line(tmp_path):
    """Through the installed ``st-prompts`` script: a ``sitecustomize`` makes ``bank list`` fail unexpectedly. (The
    traceback on request: in process, above.)"""
    (tmp_path / "sitecustomize.py").write_text(
        "import st_prompts.commands.bank as b\n"
        "def boom(args):\n    raise KeyError('planted')\n"
        "b.run_list = boom\n"
    )
    script = shutil.which("st-prompts") or os.path.join(os.path.dirname(sys.executable), "st-prompts")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("ST_PROMPTS_TRACEBACK", None)
    quiet = subprocess.run([script, "bank", "list", str(tmp_path)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert quiet.returncode == 1, quiet.stderr
    line = one_error_line(quiet.stderr)
    assert line.startswith("st-prompts bank: error: unexpected KeyError") and "'planted'" in line
