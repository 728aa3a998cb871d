"""A recipe under ``torchrun`` (2 CPU processes, gloo) trains like one process with the same global batch and seed
(no backbone dropout: each process draws its own masks), and only rank 0 writes the model."""

from __future__ import annotations

import os
import runpy
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import FIXTURES, make_tiny_backbone

REPO = Path(__file__).resolve().parents[1]
#: Largest absolute difference allowed between the prompts of the two runs after two Adam steps of lr 1e-2 (each
#: step moves a prompt value by about 1e-2; float summation order differs between the runs).
TOLERANCE = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_match_one_process_and_only_rank0_saves(tmp_path, monkeypatch):
    backbone = make_tiny_backbone(tmp_path / "tiny", "bert", dropout=0.0)
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    shutil.copy(FIXTURES / "d2cse" / "train" / "wiki_sentences.txt", data / "train")
    shutil.copytree(FIXTURES / "senteval", data / "senteval")
    common = ["--scale", "cpu", "--backbone", backbone, "--data-dir", str(data), "--limit", "16", "--max-steps", "2",
              "--lr", "1e-2", "--seed", "0", "--eval-steps", "1000", "--no-progress", "--prefix-length", "4",
              "--no-prefix-gate", "--max-seq-length", "16"]
    env = {**os.environ, "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    recipe = str(REPO / "recipes" / "dcpcse_unsup.py")
    monkeypatch.syspath_prepend(str(REPO / "recipes"))  # the one process: this one (an interpreter start less)
    monkeypatch.setattr(sys, "argv", [recipe, *common, "--batch-size", "8", "--output", str(tmp_path / "one")])
    runpy.run_path(recipe, run_name="__main__")
    multi = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(free_port()), recipe, *common, "--batch-size", "4", "--output", str(tmp_path / "two")],
                           capture_output=True, text=True, env=env, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]

    one = load_file(tmp_path / "one" / "soft_prompts.safetensors")["prefix_encoder.embedding.weight"]
    two = load_file(tmp_path / "two" / "soft_prompts.safetensors")["prefix_encoder.embedding.weight"]
    assert (one - two).abs().max() < TOLERANCE

    # the comparison means something: training moved the prompts far more than the tolerance
    from st_prompts import methods

    initial = methods.build("dcpcse", backbone=backbone, scale="cpu", seed=0, prefix_length=4, prefix_gate=False)
    start = initial[0].prefix_encoder.embedding.weight.detach()
    assert (one - start).abs().max() > 10 * TOLERANCE

    # only rank 0 wrote the model (both processes log; the save is logged once)
    log = multi.stdout + multi.stderr
    assert log.count("Saving the model to") == 1, log[-3000:]
    assert log.count('"steps": 2') == 2  # both processes trained and reported
    assert torch.isfinite(two).all()
