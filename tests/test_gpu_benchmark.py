"""``benchmarks/gpu.py``: its CPU smoke mode runs every row, the server's included, with tiny sizes and checks the
vectors as the GPU run does; ``--device cuda`` without a GPU is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CLIProcess

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
IN_PROCESS = ("tokenize", "hf-fp32", "hf-bf16", "bank-plain-fp32", "bank-mixed-fp32", "bank-plain-bf16",
              "bank-mixed-bf16", "st-fp32", "st-bf16")


class _ForkedServers:
    """The script's ``subprocess`` module, except that its ``st-prompts serve`` processes are forked by the suite's
    warm process (:class:`conftest.CLIProcess`) instead of started as fresh interpreters."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(command, **options):  # noqa: N802 - subprocess.Popen's name
        assert command[:3] == [sys.executable, "-m", "st_prompts.cli"], command
        assert set(options) <= {"stdout", "stderr", "text", "env", "cwd", "start_new_session"}, options
        return CLIProcess(command[3:], options["env"], stdout=options.get("stdout"), stderr=options.get("stderr"),
                          text=options.get("text", False), cwd=options.get("cwd"),
                          start_new_session=options.get("start_new_session", False))


def test_smoke_runs_every_row_and_checks_the_vectors(tmp_path, capsys, monkeypatch):
    """The script's ``main`` in this process (no interpreter start; its servers are processes of their own)."""
    pytest.importorskip("uvicorn")  # the server rows need the serve extra
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "subprocess", _ForkedServers())
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    try:
        code = script.main(["--device", "cpu", "--smoke", "--out-dir", str(tmp_path), "--work", str(tmp_path / "work")])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert (tmp_path / "gpu.md").read_text().startswith("# GPU throughput (SMOKE")
    assert record["smoke"] and record["checks_passed"]
    rows = {row["name"]: row for row in record["rows"]}
    assert set(rows) == set(IN_PROCESS)
    for row in rows.values():
        assert len(row["rates"]) == record["rounds"] and min(row["rates"]) > 0 and row["median"] > 0, row
    served = {(row["dtype"], row["concurrency"]): row for row in record["serve"]}
    assert set(served) == {("float32", 4), ("bfloat16", 4)}  # the smoke's concurrency
    for row in served.values():
        assert row["median"] > 0 and row["ratio"] > 0 and not row["failures"], row
        assert row["check"]["ok"] and row["check"]["checked"] > 0 and not row["check"]["malformed"], row
    names = [check["check"] for check in record["checks"]]
    assert len(names) == 1 + 3 * 2 + 2 and all(check["ok"] for check in record["checks"]), record["checks"]
    env = record["environment"]
    assert env["versions"]["torch"] and env["cpu"]["model"] and "avx2" in env["cpu"]["flags"]
    assert not (ROOT / "benchmarks" / "results" / "gpu-smoke.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_exits_2_in_one_line():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--no-serve"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path},
                          cwd=str(ROOT), check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpu.py: error: --device cuda"), done.stderr[-2000:]
