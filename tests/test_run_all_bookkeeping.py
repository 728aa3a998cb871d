"""The benchmark's run bookkeeping (benchmarks/run_all): claims let several invocations share one results folder
without running a run twice, and options that only choose which seeds run stay out of a run's cache key."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_all():
    """The benchmark's modules (benchmarks/run_all/rows.py, runner.py and report.py) as one namespace."""
    import types

    sys.path.insert(0, str(REPO / "benchmarks" / "run_all"))
    try:
        modules = [importlib.import_module(name) for name in ("rows", "runner", "report")]
    finally:
        sys.path.pop(0)
    return types.SimpleNamespace(**{k: v for m in modules for k, v in vars(m).items() if not k.startswith("__")})


def test_claim_skips_done_and_running_runs_and_takes_over_stale_claims(run_all, tmp_path):
    path = tmp_path / "runs" / "row" / "seed42.json"
    marker = run_all.claim(path, "k1", force=False)
    assert marker is not None and marker.read_text() == str(os.getpid())
    assert run_all.claim(path, "k1", force=False) is None  # claimed by a live process (this one)

    marker.unlink()
    path.write_text(json.dumps({"key": "k1"}))
    assert run_all.claim(path, "k1", force=False) is None  # done with this key
    assert run_all.claim(path, "k2", force=False) is not None  # done with other settings: runs again
    (path.parent / f".{path.name}.claim").unlink()
    assert run_all.claim(path, "k1", force=True) is not None  # --force reruns a finished run
    (path.parent / f".{path.name}.claim").unlink()

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (path.parent / f".{path.name}.claim").write_text(str(gone.pid))  # its process has ended: a stale claim
    assert run_all.claim(path, "k2", force=False) is not None


def test_all_seeds_changes_the_seeds_not_the_run_key(run_all, tmp_path):
    row = run_all.ROWS["dcpcse-unsup-shared-dropout"]
    assert row.all_seeds and row.seeds == run_all.SEEDS
    single = dataclasses.replace(row, all_seeds=False)
    assert single.seeds == (run_all.SEEDS[0],)
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "wiki_sentences.txt").write_text("one sentence\nanother sentence\n")
    data = tmp_path  # the evaluation files are missing: the fingerprint says so, the key is still defined
    assert run_all.run_key(row, 42, data, False) == run_all.run_key(single, 42, data, False)


def test_a_preset_change_of_a_setting_the_run_does_not_use_keeps_its_key(run_all, tmp_path, monkeypatch):
    """SKICSE's ``prompted_learning_rate`` keys only the prompted runs that take it (not full, not a named rate)."""
    from st_prompts.methods.skicse import config as skicse_config

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "wiki_sentences.txt").write_text("one sentence\nanother sentence\n")
    (tmp_path / "train" / "nli_triplets.csv").write_text("sent0,sent1,hard_neg\na man sits,a person sits,nobody\n")
    rows = [run_all.ROWS[n] for n in ("skicse-full-sup", "skicse-prompted-sup", "skicse-prompted-sup-lambda0")]
    before = [run_all.run_key(row, 42, tmp_path, False) for row in rows]
    presets = skicse_config.presets
    changed = lambda *args: {**presets(*args), "prompted_learning_rate": 7e-2}  # noqa: E731
    monkeypatch.setattr(skicse_config, "CONFIG", dataclasses.replace(skicse_config.CONFIG, presets=changed))
    after = [run_all.run_key(row, 42, tmp_path, False) for row in rows]
    assert after[:2] == before[:2] and after[2] != before[2]


def test_lora_route_problem_names_the_versions_before_any_run(run_all, monkeypatch):
    """transformers checks the PEFT version only inside add_adapter; the benchmark checks it up front."""
    import peft
    import transformers.integrations.peft as integration

    monkeypatch.setattr(integration, "MIN_PEFT_VERSION", "0.0.1")
    assert run_all.lora_route_problem() is None
    monkeypatch.setattr(integration, "MIN_PEFT_VERSION", "99.0.0")
    problem = run_all.lora_route_problem()
    assert problem is not None and "peft >= 99.0.0" in problem and f"peft {peft.__version__} is installed" in problem
    assert ".[bench]" in problem


def test_learning_rate_note_says_which_sweeps_ran_and_flags_a_best_rate_the_rows_do_not_use(run_all):
    """Read from the sweep rows: a setting without its sweep says so; a best STS-B dev rate not the rows' is named."""
    def e(x):
        return f"{x:.0e}".replace("e-0", "e-")

    def entry(dev):
        return {"stsb_dev": {"mean": dev}}

    chosen = run_all.D2CSE_LR[False]
    summary = {f"d2cse-unsup-lr{lr:g}": entry(0.80 + (0.05 if lr == chosen else 0.0)) for lr in (1e-2, chosen)}
    note = run_all._lr_selection_note(summary)
    assert f"D2CSE unsupervised {e(chosen)} and supervised {e(run_all.D2CSE_LR[True])} (its sweep has not run" in note
    rows_rate = run_all.D2CSE_LR[True]
    summary.update({f"d2cse-sup-lr{lr:g}": entry(0.70 + (0.1 if lr == 1e-2 else 0.0)) for lr in (rows_rate, 1e-2)})
    note = run_all._lr_selection_note(summary)
    assert f"supervised {e(rows_rate)} (the sweep's best on STS-B dev is 1e-2)" in note
    d2cse = note.split("D2CSE")[1].split(";")[0]
    assert "D2CSE unsupervised 1e-1 and" in note and "(its sweep has not run" not in d2cse


def test_a_sweep_partly_rerun_under_protocol_2_compares_like_with_like(run_all):
    """Where only some rates of a sweep were re-run under the current protocol, a protocol-1 number never wins."""
    chosen = run_all.DIFFAUG_STAGE1_LR[False]
    summary = {f"diffaug-semi-stage1-lr{chosen:g}": {"stsb_dev": {"mean": 0.84}},
               "diffaug-semi-stage1-lr0.001": {"stsb_dev": {"mean": 0.83}},
               "diffaug-semi-stage1-lr0.0003": {"stsb_dev": {"mean": 0.90}, "evaluated_at_training_length": True}}
    part = run_all._lr_selection_note(summary).split("DiffAug's stage 1")[1].split(" and supervised")[0]
    assert "the sweep's best" not in part and "among the rates re-run under protocol 2: 1e-3, 3e-3" in part
    summary["diffaug-semi-stage1-lr0.001"]["stsb_dev"]["mean"] = 0.85
    part = run_all._lr_selection_note(summary).split("DiffAug's stage 1")[1].split(" and supervised")[0]
    assert "(the sweep's best on STS-B dev is 1e-3)" in part


def test_protocol_moves_pair_seeds_and_skip_runs_whose_settings_changed(run_all):
    def run(seed, dev, sick, **settings):
        return {"seed": seed, "settings": {"learning_rate": 0.1, "pooling": None, **settings},
                "metrics": {"stsb_dev": dev, "sick_trial": sick}}

    old = [run(42, 0.80, 0.70), run(43, 0.81, 0.71), run(44, 0.82, 0.72, learning_rate=0.01)]
    new = [run(42, 0.81, 0.69, pooling="cls"), run(43, 0.81, 0.72), run(44, 0.5, 0.5)]
    moves = run_all.protocol_moves(new, old)
    assert [m["seed"] for m in moves] == [42, 43]  # seed 44 trained at another rate: another experiment
    assert moves[0]["stsb_dev"] == pytest.approx(1.0) and moves[0]["sick_trial"] == pytest.approx(-1.0)
    ablation = {"ablation": True, "protocol_moves": [{"stsb_dev": 9, "sick_trial": 9}]}
    sentence = run_all._moves_sentence({"x": {"protocol_moves": moves}, "y": ablation})
    assert sentence.startswith("The 2 runs of main rows") and "+0.00 to +1.00 on STS-B dev" in sentence
