"""Nothing lost in the bank workflow, through the real command line: an export never replaces its source, another
bank, a model or an index, nor writes inside a folder st-prompts saved (through a link neither); one grammar for a set's
name wherever it enters; the refusals say how to go on."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import encode, random_bank

from st_prompts import bank, cli
from st_prompts.errors import ConfigurationError
from st_prompts.loading import load_sentence_model
from st_prompts.prompts.names import MAX_SET_NAME_LENGTH, check_set_name, set_name_problem
from st_prompts.storage import MANIFEST_FILE

TEXTS = ["the man plays guitar .", "a dog runs in the park", "the cat"]


def files(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` and its bytes: what "nothing lost" compares."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def two_banks(tiny_bert, tmp_path):
    """Two banks saved by the command line (with the manifest), ``a`` with sets p and q, ``b`` with r."""
    a, b = tmp_path / "a", tmp_path / "b"
    bank.save_bank(random_bank(tiny_bert, p=3, q=3), a)
    bank.save_bank(random_bank(tiny_bert, r=3), b)
    return a, b


def run(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    status = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err, captured.err
    return status, (lines[-1] if lines else "")


@pytest.mark.parametrize("target", ["source", "source-spelled-otherwise", "other-bank"])
def test_bank_export_never_replaces_a_bank(target, two_banks, tmp_path, capsys):
    a, b = two_banks
    before = {a: files(a), b: files(b)}
    out = {"source": a, "source-spelled-otherwise": tmp_path / "x" / ".." / "a", "other-bank": b}[target]
    (tmp_path / "x").mkdir()
    status, line = run(["bank", "export", a, "p", out, "--overwrite"], capsys)
    assert status == 2 and "error:" in line, line
    assert ("the bank itself" in line) if target != "other-bank" else ("a prompt bank saved by st-prompts, not a "
                                                                        "prompt set" in line), line
    if target == "source":  # in Python too
        with pytest.raises(ConfigurationError, match="the bank itself"):
            bank.export_prompt_set(str(a), "p", a, overwrite=True)
    assert {a: files(a), b: files(b)} == before  # every set and the backbone still there
    assert load_sentence_model(str(a))[0].prompt_set_names == ["p", "q"]


def test_bank_export_never_writes_inside_a_bank_nor_through_a_link_into_one(two_banks, tmp_path, capsys):
    a, b = two_banks
    before = {a: files(a), b: files(b)}
    status, line = run(["bank", "export", a, "p", a / "inner"], capsys)
    assert status == 2 and f"inside {a}" in line and "prompt bank" in line, line
    (tmp_path / "link").symlink_to(b, target_is_directory=True)
    status, line = run(["bank", "export", a, "p", tmp_path / "link" / "inner"], capsys)
    assert status == 2 and f"inside {b}" in line, line
    status, line = run(["bank", "export", a, "p", tmp_path / "link"], capsys)  # the link itself
    assert status == 2 and "symbolic link" in line, line
    assert {a: files(a), b: files(b)} == before
    assert not (a / "inner").exists() and not (b / "inner").exists()
    # and a bank still takes later changes (nothing was put into it)
    assert run(["bank", "roles", a, "--default", "q"], capsys)[0] == 0


def test_an_export_replaces_only_an_exported_set_and_a_bank_only_a_bank(two_banks, tmp_path, capsys):
    a, b = two_banks
    out = tmp_path / "p-set"
    assert run(["bank", "export", a, "p", out], capsys)[0] == 0
    assert json.loads((out / MANIFEST_FILE).read_text())["kind"] == "prompt set"
    assert run(["bank", "export", a, "q", out, "--overwrite"], capsys)[0] == 0  # a set replaces a set
    expected = encode(load_sentence_model(str(a)), TEXTS, task="q")
    torch.testing.assert_close(encode(load_sentence_model(str(out)), TEXTS), expected, atol=1e-6, rtol=0)
    before = files(out)
    status, line = run(["bank", "create", out, "--overwrite", "--backbone", a], capsys)  # a bank never replaces a set
    assert status == 2 and "a prompt set saved by st-prompts, not a prompt bank" in line, line
    assert files(out) == before


# ---------------------------------------------------------------------------------------------- one grammar
BAD_NAMES = ["x\ny", "x\x1b[31m", "x@1", "a/b", "a.b", " sts", "sts ", "s" * 5000, "ѕts", "", "backbone", "-x",
             "a b"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_set_name_outside_the_grammar_is_refused_everywhere_it_enters(name, tiny_bert, two_banks, tmp_path, capsys):
    a, _ = two_banks
    assert set_name_problem(name) is not None
    with pytest.raises(ConfigurationError, match="prompt set's name is 1-64 ASCII letters"):
        check_set_name(name)
    model = bank.create_bank(tiny_bert)
    with pytest.raises(ConfigurationError, match="prompt set's name"):
        model[0].new_prompt_set(name, prefix_length=2)
    exported = tmp_path / "p"
    bank.export_prompt_set(str(a), "p", exported)
    with pytest.raises(ConfigurationError, match="prompt set's name"):
        model[0].add_prompt_set(name, str(exported))
    assert model[0].prompt_set_names == []
    before = files(a)
    status, line = run(["bank", "add", a, "--", name, exported], capsys)  # ("--": "-x" is a name, not an option)
    assert status == 2 and "prompt set's name" in line and "\x1b" not in line, line
    assert files(a) == before
    data = tmp_path / "pairs.csv"
    data.write_text("sentence1,sentence2\nA dog runs.,An animal moves.\nA man cooks.,Food is made.\n")
    status, line = run(["bank", "train", tmp_path / "new", "--data", data, "--backbone", tiny_bert, "--", name], capsys)
    assert status == 2 and "prompt set's name" in line, line
    assert not (tmp_path / "new").exists()
    # a bank folder edited by hand to carry the name is refused when it loads, in one line
    config_path = next(a.rglob("sentence_bert_config.json"))
    config = json.loads(config_path.read_text())
    config["prompt_sets"][name] = config["prompt_sets"].pop("q")
    config_path.write_text(json.dumps(config))
    status, line = run(["bank", "list", a], capsys)
    assert status == 2 and "prompt set's name" in line, line


@pytest.mark.parametrize("name", ["sts", "nli-v2", "query_2025", "A", "9", "x" * MAX_SET_NAME_LENGTH])
def test_plain_names_pass(name):
    assert check_set_name(name) == name


# ---------------------------------------------------------------------------------------------- ways forward
def test_a_bank_saved_by_model_save_is_changed_through_output(two_banks, tmp_path, capsys):
    a, _ = two_banks
    plain = tmp_path / "plain"
    load_sentence_model(str(a)).save(str(plain))  # the README's old example: no manifest
    before = files(plain)
    status, line = run(["bank", "remove", plain, "q"], capsys)
    assert status == 2 and "--output DIR" in line and "model.save" in line, line
    assert files(plain) == before
    out = tmp_path / "changed"
    assert run(["bank", "remove", plain, "q", "--output", out], capsys)[0] == 0
    assert load_sentence_model(str(out))[0].prompt_set_names == ["p"] and files(plain) == before
    assert json.loads((out / MANIFEST_FILE).read_text())["kind"] == "prompt bank"
    status, line = run(["bank", "roles", plain, "--default", "p", "--output", out], capsys)  # exists: --overwrite
    assert status == 2 and "--overwrite" in line, line
    assert run(["bank", "roles", plain, "--default", "p", "--output", out, "--overwrite"], capsys)[0] == 0
    assert load_sentence_model(str(out))[0].default_task == "p"
    status, line = run(["bank", "add", out, "q2", a], capsys)  # a bank of several sets as a source ...
    assert status == 2 and "bank export" in line and "p, q" in line, line  # ... says to export the one wanted first


def test_a_pooling_mismatch_names_the_bank_to_create_and_that_path_works(tiny_bert, two_banks, tmp_path, capsys):
    a, _ = two_banks
    source = tmp_path / "cls-set"
    model = bank.create_bank(tiny_bert, pooling="cls")
    model[0].new_prompt_set("c", prefix_length=2)
    bank.export_prompt_set(model, "c", source)
    status, line = run(["bank", "add", a, "c", source], capsys)
    assert status == 2 and "--pooling cls" in line and "bank create" in line, line
    command = line[line.index("st-prompts bank create"):].split(";")[0].replace("NEW", str(tmp_path / "cls-bank"))
    assert run(command.split()[1:], capsys)[0] == 0  # exactly what the refusal says
    assert run(["bank", "add", tmp_path / "cls-bank", "c", source], capsys)[0] == 0
    torch.testing.assert_close(encode(load_sentence_model(str(tmp_path / "cls-bank")), TEXTS, task="c"),
                               encode(model, TEXTS, task="c"), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- lock files, modes
LOCKED_COUNTER = """
import os, sys
from st_prompts.storage import folder_lock
dest, rounds = sys.argv[1], int(sys.argv[2])
for _ in range(rounds):
    with folder_lock(dest):
        path = dest + ".count"
        value = int(open(path).read()) if os.path.exists(path) else 0
        open(path, "w").write(str(value + 1))
"""


def test_writers_take_turns_and_no_lock_file_stays_behind(tmp_path):
    dest = tmp_path / "folder"
    workers = [subprocess.Popen([sys.executable, "-c", LOCKED_COUNTER, str(dest), "150"]) for _ in range(4)]
    assert [w.wait(timeout=120) for w in workers] == [0, 0, 0, 0]
    assert (tmp_path / "folder.count").read_text() == "600"  # no increment lost: never two holders at once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.count"]  # no .folder.st-prompts.lock left


def test_weights_saved_outside_st_prompts_folders_follow_the_umask(two_banks, tmp_path):
    a, _ = two_banks
    old = os.umask(0o022)
    try:
        model = load_sentence_model(str(a))
        model.save(str(tmp_path / "saved"))
        from st_prompts import save_prompts_only

        save_prompts_only(bank.prompt_set_model(model, "p"), str(tmp_path / "prompts"))
    finally:
        os.umask(old)
    weights = [*tmp_path.joinpath("saved").glob("*.safetensors"), *tmp_path.joinpath("prompts").glob("*.safetensors")]
    assert len(weights) == 3 and {stat.S_IMODE(p.stat().st_mode) for p in weights} == {0o644}
