"""The benchmark's run bookkeeping (benchmarks/run_all.py): claims let several invocations share one results folder
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
    spec = importlib.util.spec_from_file_location("run_all", REPO / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


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


def test_draw_provenance_names_the_prefix_dropout_runs_made_with_the_earlier_draw(run_all):
    """Runs that trained a prefix with a mask per example and lack the recorded draw are named as made with the
    earlier bernoulli_ draw; runs without per-example prefix dropout never are."""
    def record(row, seed, drawn, **settings):
        out = {"row": row, "seed": seed, "settings": settings}
        if drawn:
            out["prefix_dropout_draw"] = run_all.PREFIX_DROPOUT_DRAW
        return out

    records = [
        record("dcpcse-unsup", 42, True, method="dcpcse"),
        record("dcpcse-unsup", 43, False, method="dcpcse"),
        record("d2cse-sup", 42, False, method="d2cse"),
        record("skicse-prompted-sup", 44, False, method="skicse", encoder="prompted"),
        record("skicse-full-sup", 42, False, method="skicse", encoder="full"),  # no prefix
        record("dcpcse-sup-shared-dropout", 42, False, method="dcpcse", prefix_dropout_shared=True),  # nn.Dropout
        record("simcse-unsup", 42, False, method="simcse"),
        {"row": "backbone-cls", "seed": 42},
    ]
    text = " ".join(run_all.draw_provenance(records)).strip()
    older, current = text.split("Runs with the earlier draw: ")[1].split(" Runs with the current draw: ")
    assert older == "`d2cse-sup` (seed 42), `dcpcse-unsup` (seed 43), `skicse-prompted-sup` (seed 44)."
    assert current == "`dcpcse-unsup` (seed 42)."
    assert run_all.draw_provenance([r for r in records if r.get("prefix_dropout_draw")]) == []
    assert run_all.draw_provenance(records, quick=True) == []
