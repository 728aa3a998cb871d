"""``st-prompts serve --devices cpu,cpu``: one started (not forked) worker per device, each loading the model, behind
one port (the code of ``--devices cuda:0,cuda:1``), in bfloat16: half precision is served as ``encode`` computes it."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from conftest import cli_error, edit_json, make_tiny_backbone, random_bank, save_plain
from test_serving import TOKEN, Server, add_set, get, saved_prompts, wait_for
from test_serving_workers import TEXTS, children, encode_many

from st_prompts import precision
from st_prompts.loading import load_sentence_model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("devices")
    backbone = make_tiny_backbone(root / "tiny-backbone", "bert", max_positions=512)
    bank = str(root / "bank")
    random_bank(backbone, a=4, b={"prefix_length": 9, "prefix_gate": True}).save(bank)
    with Server("devices", [bank, "--devices", "cpu,cpu", "--dtype", "bfloat16", "--threads", "1", "--drain-timeout",
                            "4"], env={"ST_PROMPTS_ADMIN_TOKEN": TOKEN}, stderr_apart=True) as server:
        base = server.wait_ready(300)
        yield {"backbone": backbone, "bank": bank, "server": server, "base": base,
               "reference": load_sentence_model(bank, device="cpu", dtype="bfloat16")}


def started(pid: int) -> bool:
    """Whether ``pid`` is a fresh interpreter started by multiprocessing's spawn (not a fork of its parent); a child
    that ended since it was listed is none."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"spawn_main" in handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def workers(pid: int) -> list[int]:
    """The started workers among the children of ``pid`` (multiprocessing's resource tracker is one too)."""
    return [child for child in children(pid) if started(child)]


def close_to(got: np.ndarray, expected: np.ndarray, dtype: str = "bfloat16") -> bool:
    """Within the per-row tolerance of half precision (a row batched otherwise than in ``encode``)."""
    norms = np.linalg.norm(expected, axis=1, keepdims=True)
    return bool((np.abs(got - expected) / norms).max() <= precision.ROW_TOLERANCE[dtype])


def test_each_device_has_a_started_worker_that_loaded_the_model_in_its_dtype(served):
    server, base = served["server"], served["base"]
    assert len(workers(server.process.pid)) == 2, children(server.process.pid)
    log = server.log()
    assert "starting 2 workers (on cpu, cpu, each loading the model)" in log
    for index in (0, 1):  # each worker loaded the model itself, and says in what and with which CPU instructions
        assert f"worker {index}: loaded a prompt bank in bfloat16 on cpu (CPU: {precision.cpu_summary()})" in log
    health = get(base, "/health").json()
    assert (health["dtype"], health["device"], health["cpu"]) == ("bfloat16", "cpu", precision.cpu_summary())
    assert {m["dtype"] for m in get(base, "/v1/models").json()["data"]} == {"bfloat16"}
    for task in ("a", "b", "backbone"):
        expected = served["reference"].encode(TEXTS, task=task)
        for got in encode_many(base, task, TEXTS, 8):
            assert close_to(got, expected), task


def test_an_added_set_reaches_every_started_worker_and_a_killed_one_is_started_again_with_it(served, tmp_path):
    base, server = served["base"], served["server"]
    expected = saved_prompts(served["backbone"], 5, 9, tmp_path / "added").encode(TEXTS)
    answer = add_set(base, "added", tmp_path / "added")
    assert answer.status_code == 201, answer.text
    for got in encode_many(base, "added", TEXTS, 12):  # either worker, at once after the answer
        assert close_to(got, expected)
    pid = server.process.pid
    first = workers(pid)
    os.kill(first[0], signal.SIGKILL)
    # started again, loading the model again (never a fork of the parent): workers() counts started ones only
    assert wait_for(lambda: len(workers(pid)) == 2 and first[0] not in workers(pid), 120), server.log()
    assert wait_for(lambda: sum("added the prompt set 'added'" in line for line in server.lines) >= 3, 240), \
        server.log()
    for got in encode_many(base, "added", TEXTS, 12):
        assert close_to(got, expected)


@pytest.mark.parametrize("args, message", [
    (["--devices", "cpu,cuda:99"], "--devices: 'cuda:99' is not here (this machine has"),
    (["--devices", "cpu,cpu", "--workers", "2"], "leave out --device and --workers"),
    (["--devices", "cpu", "--device", "cpu"], "leave out --device and --workers"),
    (["--devices", "cpu,gpu:0"], "'gpu:0' is not a device"),
    (["--devices", "cpu,,cpu"], "comma-separated devices"),
    (["--workers", "2", "--device", "cuda"], "--workers 2 serves on the CPU only"),  # a fork: refused before loading
    (["--max-url-bytes", "70000"], "--max-url-bytes"),
    (["--max-header-bytes", "10"], "--max-header-bytes"),
    (["--max-headers", "0"], "--max-headers"),
])
def test_devices_workers_and_bounds_that_cannot_be_served_are_refused_in_one_line(args, message, capsys, tmp_path):
    assert message in cli_error(["serve", str(tmp_path / "no-model"), *args, "--port", "0"], capsys, alone=True)


def test_a_model_that_names_code_is_refused_by_the_parent_in_one_line_before_any_worker_starts(tiny_bert, tmp_path,
                                                                                               capsys):
    folder = save_plain(tmp_path / "carries-code", tiny_bert)
    (folder / "evil.py").write_text("raise SystemExit('foreign code ran')\n", encoding="utf-8")
    edit_json(folder / "config.json", lambda config: config.update(auto_map={"AutoModel": "evil.EvilModel"}))
    line = cli_error(["serve", str(folder), "--devices", "cpu,cpu", "--port", "0"], capsys)
    assert "refused to load model" in line and "auto_map" in line

