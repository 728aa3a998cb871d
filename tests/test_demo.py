"""``st-prompts demo``, shrunk to a few steps: it runs end to end offline, prints each task beside the shipped model,
and the bank it saves has a card that names every set and shows per-call and per-row ``task=``."""

from __future__ import annotations

import json

from st_prompts.cli import main
from st_prompts.commands import demo
from st_prompts.loading import load_sentence_model


def test_the_demo_runs_and_its_bank_card_names_every_set(tmp_path, monkeypatch, capsys):
    for name, value in {"STS_TRAIN": 32, "STS_SELECT": 32, "STS_END": 64, "NLI_TRAIN": 32, "NLI_SELECT": 64,
                        "NLI_END": 96, "EVAL_STEPS": {"sts": 1, "contradiction": 1}}.items():
        monkeypatch.setattr(demo, name, value)
    output, results = tmp_path / "demo-bank", tmp_path / "demo.json"
    assert main(["demo", "--output", str(output), "--json", str(results), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "{'loss'" not in printed  # the trainer's log dicts stay out of the demo's output
    for name in demo.TASKS:
        assert f"\n{name} " in printed  # a row per task, shipped score beside its set's

    card = (output / "README.md").read_text()
    for name in demo.TASKS:
        assert f"| `{name}` |" in card
    assert 'task="sts")' in card and 'task=["sts", "contradiction"])' in card

    scores = json.loads(results.read_text())
    assert set(scores["scores"]) == set(demo.TASKS) and scores["mixed_max_abs_diff"] < 1e-5
    model = load_sentence_model(str(output))
    assert sorted(model[0].prompt_sets) == sorted(demo.TASKS)
