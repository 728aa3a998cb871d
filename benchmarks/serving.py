"""Serving eight tasks: one st-prompts bank (fp32, int8) against eight single-task processes and Infinity, beside the
in-process ceiling, with every response's vectors checked (run by hand).

    python benchmarks/serving.py                  # the full run: 5 rounds, about 1,500 requests a cell (1-1.5 hours
                                                  # on a quiet 2-core machine; it prints its own estimate first)
    python benchmarks/serving.py --smoke --threads 1   # every contender runs, its vectors check (7-10 min); no verdict

Infinity needs sentence-transformers < 4 and numpy < 2, so it lives in its own virtual environment, outside the
repository (torch first, from the local wheel, so that pip never pulls another torch; check with ``--dry-run``)::

    python3 -m venv /work/infinity-venv
    /work/infinity-venv/bin/pip install torch==2.13.0
    /work/infinity-venv/bin/pip install "infinity-emb[server,torch,optimum]==0.0.78"   # optimum: its ONNX backend

**Contenders** (all on 127.0.0.1, each called through the OpenAI embeddings API, ``encoding_format`` base64, by a
closed-loop asyncio load generator: a minimal HTTP/1.1 keep-alive client that costs every server the same):

* ``bank-fp32``: ``st-prompts serve BANK`` of ``--tasks`` (8) prompt sets of 16 positions, a random task per request;
* ``bank-int8``: the same with ``--quantize int8`` (only where ``st-prompts serve --help`` offers it);
* ``bank-fp32-wN`` / ``bank-int8-wN``: the same bank with ``--workers N`` (``--workers``, default the cores;
  ``--worker-threads`` torch threads each): N processes forked after the load, sharing the weights and the port;
* ``per-task-8``: one ``st-prompts serve`` process per task (its set as the model's own prefix,
  ``--per-task-threads`` torch threads each), each request sent to its task's process: what a user does without a bank;
* ``infinity-torch`` / ``infinity-onnx``: Infinity (``--engine torch`` / ``optimum``) serving the packaged
  all-MiniLM-L6-v2 from a copy of its folder, offline: it cannot serve prompt sets, so every request goes to the plain
  model (16 positions fewer per row than the bank's rows: slightly less work);
* ``ceiling-fp32`` / ``ceiling-int8`` / ``ceiling-plain``: the in-process ceiling, one ``encode`` call of the whole
  request pool (length-sorted by sentence-transformers, ``batch_size`` = the servers' batch rows, the same torch
  threads) in this process, for the bank fp32, the bank int8 and the plain MiniLM (Infinity's model).

**Equalised settings**: ``--threads`` torch threads for the bank servers, the ceilings and Infinity (its
``OMP_NUM_THREADS``/``MKL_NUM_THREADS``); rows per forward pass ``--batch-rows`` for every server (st-prompts
``--max-batch-rows``, Infinity ``--batch-size``). Only st-prompts has a token budget (``--max-batch-tokens``, its
default) and a wait option (``--max-wait-ms``, its default 2 ms); Infinity's ``batch_delay`` is a fixed 5 ms (not an
option). The JSON and the markdown state every server's settings.

**Protocol.** A pool of ``--pool`` requests (1-16 Wikipedia sentences each, a random task each) is encoded in this
process first: the reference vectors of every contender's model (fp32 bank, int8 bank, plain MiniLM). Servers start one
at a time, then all are paused (SIGSTOP: a paused server takes no CPU from the one measured). A pilot per concurrency
measures each server's median latency and rate; the warm-up of that cell is twice the largest median (at least
``--min-warmup`` s), the same for every contender, and each server's measured window is sized for 1.2 x
``--requests`` answers at its pilot rate (at most ``--max-seconds``; a fixed window, since stopping at the n-th
answer would bias the rate). Then ``--rounds`` rounds; in each round, for each concurrency (1, 16, 64), every
contender in turn (the order rotated per round, so that comparisons are interleaved in time) is resumed, warmed up,
measured, drained, paused; then every response of the run (warm-up included) is checked against the reference vectors
(max abs difference; one above ``--atol`` fails the cell). The same request sequence goes to every
contender of a round and cell. Throughput is sentences answered per second in the window; p50/p99 are pooled over the
rounds (about 1.2 x ``requests`` x ``rounds`` latencies a cell: with 1,500, p99 is the 15th slowest; the table gives
each cell's count and rank). Load: uptime and load average
before and after each run, and the CPU time other processes took during it (``/proc/stat`` less the server's processes
and this one), in cores. A verdict is drawn only from a run of >= 5 rounds and >= 1,000 requests a cell; it says
"met"/"missed" only when every round's ratio is on the same side of the goal.

Results: ``benchmarks/results/serving.json`` and ``benchmarks/results/serving.md`` (``--out-name`` for others).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PREFIX_LENGTH = 16
HOST = "127.0.0.1"  # loopback only
sys.path.insert(0, str(REPO / "benchmarks"))


# ------------------------------------------------------------------------------------------------------ the client
class Connection:
    """One keep-alive HTTP/1.1 connection to 127.0.0.1: POST a body, read the status and the body."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, retry: bool = True) -> tuple[int, bytes]:
        reused = self.writer is not None
        if not reused:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        self.writer.write(head % (path.encode(), HOST.encode(), len(body)) + body)
        try:
            line = await self.reader.readline()
        except ConnectionResetError:
            line = b""
        if not line:
            self.close()
            if reused and retry:  # the server closed an idle keep-alive connection: retried once on a new one
                return await self.post(path, body, retry=False)
            raise ConnectionError("the server closed the connection")
        status = int(line.split()[1])
        length, chunked, close = 0, False, False
        for _ in range(200):  # headers
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            key, _, value = line.partition(b":")
            key = key.strip().lower()
            if key == b"content-length":
                length = int(value)
            elif key == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif key == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            parts = []
            for _ in range(100_000):
                size = int((await self.reader.readline()).strip(), 16)
                parts.append((await self.reader.readexactly(size + 2))[:size])
                if size == 0:
                    break
            payload = b"".join(parts)
        else:
            payload = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def make_pool(sentences: list[str], tasks: list[str], size: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    """``size`` requests ``(task, texts)``: 1-16 sentences each, a random task each."""
    rng = random.Random(seed)
    return [(rng.choice(tasks), [rng.choice(sentences) for _ in range(rng.randint(1, 16))]) for _ in range(size)]


async def closed_loop(contender: Contender, pool: list, concurrency: int, warmup: float, duration: float,
                      seed: int, stop_after: int | None = None) -> dict:
    """``concurrency`` workers, each sending its next request when the last is answered, for ``warmup`` seconds and
    then ``duration`` seconds, the measured window (a fixed length: counting the answers in it estimates the rate
    without bias, where stopping at the n-th answer would not); then the workers stop and the requests in flight are
    drained. Every 200 response body is kept for checking. ``stop_after`` (the pilot): the window ends at that many
    answers instead, or at ``duration``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    window_start = start + warmup
    end = [start + warmup + duration]
    latencies: list[float] = []
    answered = [0]
    failures: dict[str, int] = {}
    responses: list[tuple[int, bytes]] = []
    orders = [random.Random(seed * 1000 + w).sample(range(len(pool)), len(pool)) for w in range(concurrency)]

    async def worker(index: int) -> None:
        connections: dict[int, Connection] = {}
        for step in range(1_000_000):
            if loop.time() >= end[0]:
                break
            item = orders[index][step % len(pool)]
            port, path, body = contender.request(item, pool[item])
            connection = connections.setdefault(port, Connection(port))
            sent = loop.time()
            try:
                status, payload = await connection.post(path, body)
            except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                connection.close()
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.05)
                continue
            done = loop.time()
            if status != 200:
                failures[str(status)] = failures.get(str(status), 0) + 1
                continue
            responses.append((item, payload))
            if window_start <= done <= end[0]:  # answered inside the measured window
                latencies.append(done - sent)
                answered[0] += len(pool[item][1])
                if stop_after is not None and len(latencies) >= stop_after:
                    end[0] = done
        for connection in connections.values():
            connection.close()

    await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(concurrency))), warmup + duration + 300)
    return {"sentences": answered[0], "seconds": end[0] - window_start, "latencies": latencies, "failures": failures,
            "responses": responses}


def check_vectors(responses: list[tuple[int, bytes]], reference: list[np.ndarray]) -> dict:
    """Every response's vectors against the reference of its request: the max abs difference, and the responses
    whose shape is wrong."""
    worst, bad = 0.0, 0
    for item, payload in responses:
        expected = reference[item]
        try:
            data = sorted(json.loads(payload)["data"], key=lambda d: d["index"])
            got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        if got.shape != expected.shape:
            bad += 1
            continue
        worst = max(worst, float(np.abs(got - expected).max()))
    return {"checked": len(responses), "max_abs_diff": worst, "malformed": bad}


# ----------------------------------------------------------------------------------------------------- the servers
class Contender:
    """One configuration: server processes (paused between its measurements), or an in-process ceiling."""

    def __init__(self, name: str, kind: str, settings: dict, commands: list[list[str]] | None = None,
                 ports: list[int] | None = None, route=None, env: dict | None = None, log_dir: Path | None = None,
                 ceiling=None, cwd: Path | None = None) -> None:
        self.name, self.kind, self.settings = name, kind, settings  # kind: which reference vectors it must give
        self.ports, self.route, self.ceiling = ports or [], route, ceiling
        self.processes: list[subprocess.Popen] = []
        self.rss_start: float | None = None
        self._bodies: dict[int, tuple[int, str, bytes]] = {}
        for i, command in enumerate(commands or []):
            log = open(log_dir / f"{name}-{i}.log", "w")  # noqa: SIM115 - the child's
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                   env={**os.environ, **(env or {})}, start_new_session=True,
                                                   cwd=cwd))

    def request(self, item: int, entry: tuple[str, list[str]]) -> tuple[int, str, bytes]:
        if item not in self._bodies:
            task, texts = entry
            port, path, model = self.route(task)
            body = json.dumps({"model": model, "input": texts, "encoding_format": "base64"}).encode()
            self._bodies[item] = (port, path, body)
        return self._bodies[item]

    def wait_ready(self, timeout: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        for port, process in zip(self.ports, self.processes):
            for _ in range(int(timeout) + 1):
                if process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {process.returncode}")
                try:
                    with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as answer:
                        if answer.status == 200:
                            break
                except (OSError, urllib.error.HTTPError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not start in {timeout:.0f} s")
                time.sleep(1)

    def signal(self, sig: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, sig)

    def cpu_ticks(self) -> int:
        return sum(tree_ticks(p.pid) for p in self.processes)

    def rss_mib(self) -> float:
        return sum(tree_rss_kib(p.pid) for p in self.processes) / 1024

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGCONT)
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return children


def _tree(pid: int) -> list[int]:
    children, out, stack = _children(), [], [pid]
    while stack and len(out) < 10_000:
        current = stack.pop()
        out.append(current)
        stack.extend(children.get(current, []))
    return out


def tree_rss_kib(pid: int) -> int:
    """Proportional set size (KiB) of a process and its descendants, from /proc/PID/smaps_rollup: each page shared by
    n processes counts 1/n in each, so the sum over processes is the memory they hold together (forked workers share
    the weights; RSS would count them once per worker). RSS where smaps_rollup cannot be read."""
    total = 0
    for current in _tree(pid):
        try:
            with open(f"/proc/{current}/smaps_rollup") as handle:
                total += next(int(line.split()[1]) for line in handle if line.startswith("Pss:"))
            continue
        except (OSError, StopIteration):
            pass
        try:
            with open(f"/proc/{current}/status") as handle:
                total += next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def tree_ticks(pid: int) -> int:
    """CPU time (clock ticks, user + system, all threads) of a process and its descendants."""
    total = 0
    for current in _tree(pid):
        try:
            with open(f"/proc/{current}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return total


def machine_ticks() -> tuple[int, int]:
    """(busy, steal) clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def load_snapshot() -> dict:
    with open("/proc/loadavg") as handle:
        load = [float(x) for x in handle.read().split()[:3]]
    with open("/proc/uptime") as handle:
        uptime = float(handle.read().split()[0])
    return {"load_average": load, "uptime_s": round(uptime)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------------------- the models
def prepare(work: Path, tasks: int) -> tuple[Path, list[Path], Path]:
    """A bank of ``tasks`` sets ``t0``... (16 positions, the official initialisation: the same cost as trained sets),
    each set exported alone as a prompts-only checkpoint, and a copy of the packaged MiniLM's folder for Infinity (its
    ONNX backend writes an export beside the model)."""
    import torch

    from st_prompts import bank
    from st_prompts.utils import packaged_minilm_path

    folder = work / f"bank-{tasks}"
    singles = [work / f"task-t{i}" for i in range(tasks)]
    if not (folder / "modules.json").exists() or not all((s / "modules.json").exists() for s in singles):
        model = bank.create_bank("minilm")
        torch.manual_seed(0)
        for i in range(tasks):
            bank.bank_encoder(model).new_prompt_set(f"t{i}", prefix_length=PREFIX_LENGTH)
        shutil.rmtree(folder, ignore_errors=True)
        model.save(str(folder))
        for i, single in enumerate(singles):
            bank.export_prompt_set(model, f"t{i}", single, overwrite=True)
    plain = work / "minilm-copy"
    if not (plain / "modules.json").exists():
        shutil.copytree(packaged_minilm_path(), plain)
    return folder, singles, plain


def export_onnx(plain: Path, venv: Path, work: Path) -> str | None:
    """Infinity's ONNX backend reads a ``*.onnx`` file of the model's folder and exports nothing itself: export the
    transformer (fp32, ``last_hidden_state``: Infinity pools) with the venv's ``optimum-cli``, once, as ``model.onnx``
    at the top of the folder (infinity-emb 0.0.78 hands optimum 2 the file's path where optimum matches its bare name,
    so Infinity is started in the folder with ``--model-id .``). Returns why it cannot, or ``None``."""
    if (plain / "model.onnx").exists():
        return None
    cli = venv / "bin" / "optimum-cli"
    if not cli.exists():
        return f"no {cli} (pip install \"infinity-emb[optimum]\" into --infinity-venv)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(work / "hf-home")}
    export = work / "onnx-export"
    probe = subprocess.run([str(cli), "export", "onnx", "--model", str(plain), "--task", "feature-extraction",
                            "--library-name", "transformers", str(export)], capture_output=True, text=True,
                           timeout=900, env=env, check=False)
    if probe.returncode or not (export / "model.onnx").exists():
        return f"optimum-cli export onnx failed: {(probe.stderr.strip().splitlines() or ['?'])[-1][:300]}"
    shutil.copy(export / "model.onnx", plain / "model.onnx")
    return None


def read_sentences(data_dir: Path | None, count: int = 2000) -> tuple[list[str], str]:
    path = data_dir / "train" / "wiki_sentences.txt" if data_dir is not None else None
    if path is None or not path.is_file():  # the sample bundled with the package (the demo's)
        path = REPO / "st_prompts" / "resources" / "demo" / "wiki_sentences.txt"
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if len(line.split()) >= 3]
    source = str(path.relative_to(REPO) if path.is_relative_to(REPO) else path.name)
    return lines[:count], source


class Ceiling:
    """The in-process ceiling: one ``encode`` of every row of the pool (a task per row for a bank)."""

    def __init__(self, model, pool: list, per_row_tasks: bool, batch_rows: int) -> None:
        self.model, self.batch_rows = model, batch_rows
        self.texts = [text for _, texts in pool for text in texts]
        self.tasks = [task for task, texts in pool for _ in texts] if per_row_tasks else None
        self.bounds = np.cumsum([0] + [len(texts) for _, texts in pool])

    def encode(self) -> tuple[np.ndarray, float]:
        options = {"batch_size": self.batch_rows, "convert_to_numpy": True, "show_progress_bar": False}
        if self.tasks is not None:
            options["task"] = self.tasks
        started = time.perf_counter()
        vectors = np.asarray(self.model.encode(self.texts, **options), dtype=np.float32)
        return vectors, time.perf_counter() - started

    def split(self, vectors: np.ndarray) -> list[np.ndarray]:
        return [vectors[a:b] for a, b in zip(self.bounds[:-1], self.bounds[1:])]


def serve_supports_int8() -> bool:
    probe = subprocess.run([sys.executable, "-m", "st_prompts.cli", "serve", "--help"], capture_output=True,
                           text=True, timeout=300, check=False)
    return "--quantize" in probe.stdout and "int8" in probe.stdout


# ------------------------------------------------------------------------------------------------------- reporting
def percentile(values: list[float], q: float) -> tuple[float | None, int]:
    """The nearest-rank ``q`` quantile and which slowest value it is (1: the slowest)."""
    if not values:
        return None, 0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1], len(ordered) - rank + 1


def summarise(runs: list[dict]) -> dict:
    seconds = sum(r["seconds"] for r in runs)
    latencies = [x for r in runs for x in r.get("latencies", [])]
    p50, _ = percentile(latencies, 0.5)
    p99, rank = percentile(latencies, 0.99)
    failures: dict[str, int] = {}
    for r in runs:
        for key, value in r.get("failures", {}).items():
            failures[key] = failures.get(key, 0) + value
    checks = [r["check"] for r in runs if r.get("check")]
    return {"throughput": sum(r["sentences"] for r in runs) / seconds if seconds else 0.0,
            "per_round": [r["sentences"] / r["seconds"] for r in runs],
            "p50_ms": None if p50 is None else 1000 * p50, "p99_ms": None if p99 is None else 1000 * p99,
            "requests": len(latencies), "p99_is_kth_slowest": rank, "failures": failures,
            "responses_checked": sum(c["checked"] for c in checks),
            "max_abs_diff": max((c["max_abs_diff"] for c in checks), default=None),
            "malformed": sum(c["malformed"] for c in checks),
            "other_cpu_cores": [r["load"]["other_cpu_cores"] for r in runs],
            "load_before": [r["load"]["before"]["load_average"][0] for r in runs],
            "load_after": [r["load"]["after"]["load_average"][0] for r in runs]}


def verdict_line(label: str, ratios: list[float], pooled: float, goal: float, decisive: bool) -> str:
    spread = f"rounds {min(ratios):.2f}-{max(ratios):.2f}" if ratios else "no rounds"
    if not decisive:
        verdict = "no verdict (smoke or busy machine)"
    elif all(r >= goal for r in ratios):
        verdict = "met in every round"
    elif all(r < goal for r in ratios):
        verdict = "missed in every round"
    else:
        verdict = "undecided: the rounds disagree"
    return f"{label}: **{pooled:.2f}x** ({spread}; goal >= {goal}): {verdict}"


def goals(out: dict) -> list[str]:
    cells = {(r["contender"], r["concurrency"]): r for r in out["results"]}
    decisive = out["decisive"]
    lines = []

    def compare(a: str, b: str, c: int, goal: float, label: str) -> None:
        x, y = cells.get((a, c)), cells.get((b, c))
        if not x or not y or not y["summary"]["throughput"]:
            return
        ratios = [p / q for p, q in zip(x["summary"]["per_round"], y["summary"]["per_round"]) if q]
        line = verdict_line(f"{label}, concurrency {c}", ratios,
                            x["summary"]["throughput"] / y["summary"]["throughput"], goal,
                            decisive and x["ok"] and y["ok"])
        if b.startswith("infinity") and x["summary"]["p99_ms"] and y["summary"]["p99_ms"]:
            worse = x["summary"]["p99_ms"] > y["summary"]["p99_ms"]
            line += (f"; p99 {x['summary']['p99_ms']:.0f} vs {y['summary']['p99_ms']:.0f} ms "
                     f"({'worse' if worse else 'no worse'})")
        lines.append(line)

    workers = sorted({r["contender"] for r in out["results"] if r["contender"].startswith("bank-fp32-w")})
    for c in out["concurrency"]:
        compare("bank-fp32", "ceiling-fp32", c, 0.95, "bank fp32 / its in-process ceiling")
        for name in workers:
            compare(name, "per-task-8", c, 1.0, f"bank fp32 {name[10:]} workers / eight single-task processes")
            compare(name, "infinity-torch", c, 1.1, f"bank fp32 {name[10:]} workers / Infinity torch")
            compare(name, "bank-fp32", c, 1.0, f"bank fp32 {name[10:]} workers / one process")
        compare("bank-fp32", "infinity-torch", c, 1.1, "bank fp32 / Infinity torch")
        compare("bank-fp32", "infinity-onnx", c, 1.1, "bank fp32 / Infinity ONNX")
        compare("bank-int8", "infinity-torch", c, 2.0, "bank int8 / Infinity torch")
        compare("bank-fp32", "per-task-8", c, 1.0, "bank fp32 / eight single-task processes")
        compare("bank-int8", "bank-fp32", c, 2.0, "bank int8 / bank fp32")
    memory = out["memory"]
    for name in ["bank-fp32"] + workers:
        if name in memory and "per-task-8" in memory:
            key = "peak" if "peak" in memory[name] else "end"  # runs before the peak was sampled: at the end
            ratio = memory[name][key] / memory["per-task-8"][key]
            what = "the largest after a run (under load)" if key == "peak" else "at the end"
            lines.append(f"memory (PSS, {what}), {name} / eight processes: {memory[name][key]:.0f} / "
                         f"{memory['per-task-8'][key]:.0f} MiB = **{ratio:.2f}** (goal <= 0.25: "
                         f"{'met' if ratio <= 0.25 else 'missed'})")
            if "idle" in memory[name]:
                lines.append(f"memory (PSS, idle for a while after the rounds), {name} / eight processes: "
                             f"{memory[name]['idle']:.0f} / {memory['per-task-8']['idle']:.0f} MiB = "
                             f"{memory[name]['idle'] / memory['per-task-8']['idle']:.2f}")
    return lines


def write_report(out: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    fmt = (lambda v, spec=".0f": format(v, spec) if v is not None else "–")
    lines = ["# Serving eight tasks: one bank against eight processes and Infinity", "",
             "Generated by `benchmarks/serving.py` (its docstring gives the protocol); do not edit by hand.", ""]
    if out["smoke"]:
        lines += [f"**SMOKE RUN, NOT A RESULT**: {out['smoke']}. It shows that every contender runs and that its "
                  "vectors check; its numbers carry no verdict.", ""]
    lines += [f"* Command: `{out['command']}`",
              f"* Machine: {out['machine']}; {out['load_note']}",
              f"* Versions: {', '.join(f'{k} {v}' for k, v in out['versions'].items())}",
              (f"* {out['rounds']} rounds, interleaved (contenders rotated per round); each run's measured window "
               f"sized from the pilot's rate for about {out['requests']} requests (at most {out['max_seconds']:.0f} "
               f"s), so about {out['rounds'] * out['requests']} a cell (the requests column gives the count and which "
               f"slowest request the p99 is); {out['wall_minutes']:.1f} minutes in all"),
              (f"* Warm-up per cell (2 x the largest pilot median latency, >= {out['min_warmup']} s): "
               + ", ".join(f"concurrency {c}: {w:.1f} s" for c, w in out["warmup"].items())),
              (f"* Requests: a pool of {out['pool']} requests of 1-16 sentences ({out['pool_sentences']} in all) of "
               f"{out['sentences_source']}, a random task of {out['tasks']} each, base64; every response checked "
               f"against in-process `encode` (max abs difference <= {out['atol']}, int8 <= {out['atol_int8']}, or "
               f"the cell fails)"), ""]
    for name_, error in out["unavailable"].items():
        lines.append(f"* **{name_} did not run**: {error}")
    lines += ["", "## Settings", "", "| contender | processes | settings |", "|---|---:|---|"]
    for name_, settings in out["settings"].items():
        lines.append(f"| {name_} | {settings.get('processes', 0)} | "
                     f"{', '.join(f'{k} {v}' for k, v in settings.items() if k != 'processes')} |")
    lines += ["", "## Results", "",
              "| concurrency | contender | sentences/s | x ceiling | per round | p50 ms | p99 ms | "
              "requests (p99: k-th slowest) | vectors (max abs diff, checked) | failures | other CPU (cores) | "
              "load 1-min before -> after |",
              "|---:|---|---:|---:|---|---:|---:|---:|---|---|---|---|"]
    for row in out["results"]:
        s = row["summary"]
        ceiling = row.get("ceiling_ratio")
        vectors = f"{'ok' if row['vectors_ok'] else 'FAIL'} {fmt(s['max_abs_diff'], '.1e')}, {s['responses_checked']}"
        other = ", ".join(f"{v:.2f}" for v in s["other_cpu_cores"])
        load = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in zip(s["load_before"], s["load_after"]))
        lines.append(f"| {row['concurrency']} | {row['contender']} | {s['throughput']:.1f} | "
                     f"{fmt(ceiling, '.2f')} | {', '.join(f'{v:.0f}' for v in s['per_round'])} | "
                     f"{fmt(s['p50_ms'])} | {fmt(s['p99_ms'])} | {s['requests']} ({s['p99_is_kth_slowest']}) | "
                     f"{vectors} | "
                     f"{', '.join(f'{k}: {v}' for k, v in s['failures'].items()) or '–'} | {other} | {load} |")
    lines += ["", "Memory (PSS of each contender's processes, MiB): after its start; the largest at the end of a run "
              "(paused at once: what it held under load); at the end of the rounds; after the rounds, resumed and idle for "
              "`--idle-seconds` (st-prompts servers give freed heap back after a second idle).", "",
              "| contender | after start | largest after a run | at the end | idle |", "|---|---:|---:|---:|---:|"]
    for name_, memory in out["memory"].items():
        lines.append(f"| {name_} | {memory['start']:.0f} | {fmt(memory.get('peak'))} | {memory['end']:.0f} | "
                     f"{fmt(memory.get('idle'))} |")
    lines += ["", "## Goals (issue 50)", ""] + [f"* {line}" for line in out["goals"]]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------------------------- main
def build_contenders(args, folders, logs: Path, int8: bool, unavailable: dict) -> dict[str, Contender]:
    """Start every server (one configuration at a time, each waited for), pause it; record what did not start."""
    bank_folder, singles, plain = folders
    serve = [sys.executable, "-m", "st_prompts.cli", "serve"]
    batching = ["--max-batch-rows", str(args.batch_rows)]
    batching += ["--max-wait-ms", str(args.max_wait_ms)] if args.max_wait_ms is not None else []
    ours = {"max-batch-rows": args.batch_rows, "max-wait-ms": args.max_wait_ms or "2 (default)",
            "max-batch-tokens": "4096 (default)"}
    plans = []
    for quantize in ("none", "int8") if int8 else ("none",):
        for workers in (1, args.workers) if args.workers > 1 else (1,):
            name = ("bank-fp32" if quantize == "none" else "bank-int8") + (f"-w{workers}" if workers > 1 else "")
            threads = args.threads if workers == 1 else args.worker_threads
            port = free_port()
            plans.append((name, "fp32" if quantize == "none" else "int8",
                          {"processes": 1 if workers == 1 else f"{workers} workers forked from 1 (--workers)",
                           "threads": threads if workers == 1 else f"{threads} each", "quantize": quantize, **ours},
                          [serve + [str(bank_folder), "--port", str(port), "--threads", str(threads),
                                    "--quantize", quantize, "--workers", str(workers)] + batching], [port],
                          (lambda task, p=port: (p, "/v1/embeddings", task)), {}))
    if not int8:
        unavailable["bank-int8"] = "`st-prompts serve --help` offers no `--quantize int8`"
    ports = [free_port() for _ in singles]
    plans.append((f"per-task-{len(singles)}", "fp32",
                  {"processes": len(singles), "threads": f"{args.per_task_threads} each", **ours},
                  [serve + [str(single), "--model-name", f"t{i}", "--port", str(p), "--threads",
                            str(args.per_task_threads)] + batching
                   for i, (single, p) in enumerate(zip(singles, ports))],
                  ports, (lambda task, ps=tuple(ports): (ps[int(task[1:])], "/v1/embeddings", task)), {}))
    infinity = args.infinity_venv / "bin" / "infinity_emb"
    for engine in ("torch", "optimum"):
        name = f"infinity-{'torch' if engine == 'torch' else 'onnx'}"
        if not infinity.exists():
            unavailable[name] = f"no {infinity} (install infinity-emb into --infinity-venv, see the docstring)"
            continue
        if engine == "optimum" and (error := export_onnx(plain, args.infinity_venv, args.work)):
            unavailable[name] = error
            continue
        port = free_port()
        threads = str(args.threads)
        plans.append((name, "plain", {"processes": 1, "threads": f"{args.threads} (OMP_NUM_THREADS)",
                                      "engine": engine if engine == "torch" else
                                      "optimum (ONNX Runtime, the fp32 export of optimum-cli)",
                                      "batch-size": args.batch_rows,
                                      "batch_delay": "5 ms (fixed, not an option)",
                                      "pooling-method": "mean (the model's; the ONNX backend's auto is CLS)"},
                      [[str(infinity), "v2", "--model-id", str(plain) if engine == "torch" else ".",
                        "--served-model-name", "minilm", "--port",
                        str(port), "--host", HOST, "--engine", engine, "--device", "cpu", "--batch-size",
                        str(args.batch_rows), "--pooling-method", "mean", "--no-trust-remote-code",
                        "--no-vector-disk-cache"]],
                      [port], (lambda task, p=port: (p, "/embeddings", "minilm")),
                      {"HF_HUB_OFFLINE": "1", "HF_HOME": str(args.work / "hf-home"), "DO_NOT_TRACK": "1",
                       "INFINITY_ANONYMOUS_USAGE_STATS": "0", "OMP_NUM_THREADS": threads,
                       "MKL_NUM_THREADS": threads}))
    contenders: dict[str, Contender] = {}
    for name, kind, settings, commands, ports_, route, env in plans:
        if args.only and name not in args.only:
            continue
        print(f"starting {name} ({len(commands)} process{'es' * (len(commands) > 1)})", flush=True)
        contender = Contender(name, kind, settings, commands, ports_, route, {"HF_HUB_OFFLINE": "1", **env}, logs,
                              cwd=plain if name == "infinity-onnx" else None)
        try:
            contender.wait_ready(args.start_timeout)
        except RuntimeError as exc:
            contender.stop()
            if not name.startswith("infinity"):
                raise
            unavailable[name] = f"{exc}: {tail(logs / f'{name}-0.log')}"
            print(f"{name} failed: {unavailable[name]}", flush=True)
            continue
        contender.rss_start = contender.rss_mib()
        contender.signal(signal.SIGSTOP)
        contenders[name] = contender
    return contenders


def measure(contender: Contender, pool: list, references: dict, concurrency: int, warmup: float, duration: float,
            seed: int, stop_after: int | None = None) -> dict:
    """One run of one contender (resumed, measured, drained, paused, its responses checked), with the load."""
    before, busy0, own0 = load_snapshot(), machine_ticks(), os.times()
    server0 = contender.cpu_ticks()
    started = time.perf_counter()
    if contender.ceiling is not None:
        vectors, seconds = contender.ceiling.encode()
        split = contender.ceiling.split(vectors)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(split, references[contender.kind]))
        run = {"sentences": len(vectors), "seconds": seconds, "failures": {},
               "check": {"checked": len(split), "max_abs_diff": diff, "malformed": 0}}
    else:
        contender.signal(signal.SIGCONT)
        try:
            run = asyncio.run(closed_loop(contender, pool, concurrency, warmup, duration, seed, stop_after))
        finally:
            contender.signal(signal.SIGSTOP)
        run["pss_mib"] = contender.rss_mib()  # paused at the end of its load: what serving it held
    wall = time.perf_counter() - started
    busy1, own1 = machine_ticks(), os.times()
    tick = os.sysconf("SC_CLK_TCK")
    server = (contender.cpu_ticks() - server0) / tick
    own = (own1.user + own1.system) - (own0.user + own0.system)
    other = ((busy1[0] - busy0[0]) / tick - server - own) / wall
    run["load"] = {"before": before, "after": load_snapshot(), "wall_s": wall, "server_cpu_s": server,
                   "harness_cpu_s": own, "other_cpu_cores": max(0.0, other),
                   "steal_cores": (busy1[1] - busy0[1]) / tick / wall}
    if "responses" in run:
        run["check"] = check_vectors(run.pop("responses"), references[contender.kind])
    return run


def main(argv: list[str] | None = None) -> None:
    from common import cpu_model, default_data_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(),
                        help="folder with train/wiki_sentences.txt")
    parser.add_argument("--work", type=Path, default=Path("/tmp/st-prompts-serving-bench"),
                        help="where the bank, the checkpoints and the logs go (reused)")
    parser.add_argument("--tasks", type=int, default=8, help="prompt sets in the bank = single-task processes")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=250,
                        help="requests a run's window is sized for, from the pilot's rate (x rounds: a cell's)")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="the longest measured window of a run")
    parser.add_argument("--min-warmup", type=float, default=3.0, help="the shortest warm-up, seconds")
    parser.add_argument("--pilot-seconds", type=float, default=90.0, help="the longest one pilot lasts")
    parser.add_argument("--pool", type=int, default=256, help="distinct requests (their vectors are the reference)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the bank servers, "
                        "Infinity and the ceilings")
    parser.add_argument("--per-task-threads", type=int, default=1, help="torch threads of each single-task process")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="also the bank with `serve --workers N` (bank-fp32-wN, bank-int8-wN; 1: not)")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads of each forked worker")
    parser.add_argument("--batch-rows", type=int, default=32, help="rows per forward pass, every server")
    parser.add_argument("--max-wait-ms", type=float, default=None, help="st-prompts serve's (default: its own)")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest abs difference to encode's vectors")
    parser.add_argument("--atol-int8", type=float, default=None,
                        help="the same for int8 contenders (default: --atol; int8 rows may depend on their batch)")
    parser.add_argument("--infinity-venv", type=Path, default=Path("/work/infinity-venv"))
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    parser.add_argument("--only", nargs="+", help="only these contenders (e.g. bank-fp32 infinity-torch)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 rounds of 24 requests, pool 48, concurrency 1 and 16: every contender runs, no verdict")
    parser.add_argument("--idle-seconds", type=float, default=5.0,
                        help="after the rounds each server is resumed this long without requests, then measured")
    parser.add_argument("--out-name", default="serving", help="results file names under benchmarks/results/")
    parser.add_argument("--no-report", action="store_true", help="print, leave the results files alone")
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):  # smoke defaults; explicit options still win
        parser.set_defaults(rounds=2, requests=24, pool=48, concurrency=[1, 16], max_seconds=90.0, pilot_seconds=40.0,
                            min_warmup=1.0)
    args = parser.parse_args(argv)
    started = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)

    import torch

    torch.set_num_threads(args.threads)
    from st_prompts.loading import load_sentence_model

    sentences, source = read_sentences(args.data_dir)
    tasks = [f"t{i}" for i in range(args.tasks)]
    pool = make_pool(sentences, tasks, args.pool)
    pool_sentences = sum(len(texts) for _, texts in pool)
    folders = prepare(args.work, args.tasks)
    int8 = serve_supports_int8()
    print(f"{pool_sentences} sentences in {len(pool)} requests from {source}; int8 serving: {int8}", flush=True)

    ceilings = {"fp32": Ceiling(load_sentence_model(str(folders[0])), pool, True, args.batch_rows),
                "plain": Ceiling(load_sentence_model(str(folders[2])), pool, False, args.batch_rows)}
    if int8:
        ceilings["int8"] = Ceiling(load_sentence_model(str(folders[0]), quantize="int8"), pool, True, args.batch_rows)
    references, rates = {}, []
    for kind, ceiling in ceilings.items():
        vectors, seconds = ceiling.encode()
        references[kind] = ceiling.split(vectors)
        rates.append(len(vectors) / seconds)
        print(f"reference {kind}: {len(vectors)} sentences in {seconds:.1f} s ({len(vectors) / seconds:.0f}/s)",
              flush=True)
    estimate = _estimate(args, pool_sentences, min(rates))
    print(f"estimated wall time: about {estimate:.0f} minutes on a quiet machine", flush=True)

    unavailable: dict[str, str] = {}
    servers: dict[str, Contender] = {}
    try:
        servers = build_contenders(args, folders, logs, int8, unavailable)
        contenders = dict(servers)
        for kind, ceiling in ceilings.items():
            name = f"ceiling-{kind}"
            if not args.only or name in args.only:
                contenders[name] = Contender(name, kind, {"processes": 0, "threads": args.threads, "in-process":
                                                          "one encode of the pool", "batch_size": args.batch_rows},
                                             ceiling=ceiling)
        warmup, pilots, windows = {}, {}, {}
        for c in args.concurrency:  # the pilot: each server's median latency and rate at this concurrency
            medians = {}
            for name, contender in servers.items():
                run = measure(contender, pool, references, c, 0.0, args.pilot_seconds, 99, stop_after=max(2 * c, 16))
                medians[name] = percentile(run["latencies"], 0.5)[0] or 0.0
                rate = len(run["latencies"]) / run["seconds"] if run["seconds"] > 0 else 0.0
                # a window long enough for --requests answers at the pilot's rate (and a margin), within the bound
                windows[(name, c)] = min(args.max_seconds, max(2.0, 1.2 * args.requests / max(rate, 1e-3)))
                print(f"pilot c={c:>3} {name:>15}: median {1000 * medians[name]:7.0f} ms, {rate:6.2f} requests/s, "
                      f"window {windows[(name, c)]:5.1f} s, vectors max diff {run['check']['max_abs_diff']:.1e}",
                      flush=True)
            pilots[c] = {name: {"median_s": m, "window_s": windows[(name, c)]} for name, m in medians.items()}
            warmup[c] = max(args.min_warmup, 2 * max(medians.values(), default=0.0))
        results = {(name, c): [] for name in contenders for c in args.concurrency}
        names = list(contenders)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for c in args.concurrency:
                for name in order:
                    run = measure(contenders[name], pool, references, c, warmup[c], windows.get((name, c), 0.0),
                                  seed=round_index * 100 + c)
                    results[(name, c)].append(run)
                    p99 = percentile(run.get("latencies", []), 0.99)[0]
                    print(f"round {round_index + 1} c={c:>3} {name:>15}: {run['sentences'] / run['seconds']:7.1f} "
                          f"sentences/s p99 {1000 * (p99 or 0):6.0f} ms, vectors {run['check']['max_abs_diff']:.1e}, "
                          f"failures {run['failures'] or '-'}, other CPU {run['load']['other_cpu_cores']:.2f} cores",
                          flush=True)
        memory = {}
        for name, s in servers.items():
            peak = max((run.get("pss_mib", 0.0) for (n, _), runs in results.items() if n == name for run in runs),
                       default=0.0)
            end = s.rss_mib()
            s.signal(signal.SIGCONT)  # idle for a while: what a server holds between bursts of work
            time.sleep(args.idle_seconds)
            idle = s.rss_mib()
            s.signal(signal.SIGSTOP)
            memory[name] = {"processes": len(s.processes), "start": s.rss_start, "peak": peak, "end": end,
                            "idle": idle}
    finally:
        for server in servers.values():
            server.stop()
    wall = (time.time() - started) / 60
    rows = []
    for (name, c), runs in results.items():
        summary = summarise(runs)
        atol = args.atol_int8 if contenders[name].kind == "int8" and args.atol_int8 is not None else args.atol
        vectors_ok = summary["max_abs_diff"] is not None and summary["max_abs_diff"] <= atol \
            and not summary["malformed"]
        ceiling = results.get((f"ceiling-{contenders[name].kind}", c))
        ratio = summary["throughput"] / summarise(ceiling)["throughput"] if ceiling else None
        rows.append({"contender": name, "kind": contenders[name].kind, "concurrency": c, "summary": summary,
                     "ceiling_ratio": ratio, "vectors_ok": vectors_ok,
                     "ok": vectors_ok and not summary["failures"],
                     "runs": [{k: v for k, v in r.items() if k != "latencies"} for r in runs]})
    rows.sort(key=lambda r: (r["concurrency"], names.index(r["contender"])))
    busy = max((x for r in rows for x in r["summary"]["other_cpu_cores"]), default=0.0)
    smoke = []
    fewest = min((r["summary"]["requests"] for r in rows if not r["contender"].startswith("ceiling")), default=0)
    if args.rounds < 5 or fewest < 1000:
        smoke.append(f"{args.rounds} rounds, as few as {fewest} requests a cell (a verdict needs >= 5 rounds and "
                     f">= 1,000 requests in every cell)")
    if busy > 0.25:
        smoke.append(f"a busy machine (other processes took up to {busy:.2f} cores during a run)")
    out = {
        "command": "python benchmarks/serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "smoke": "; ".join(smoke), "decisive": not smoke,
        "machine": (f"{platform.machine()}, {os.cpu_count()} cores ({cpu_model()}), {_memory_gib():.0f} GiB, Linux "
                    f"{platform.release()}, Python {platform.python_version()}"),
        "load_note": "load per run in the table (other CPU: cores other processes took during the run)",
        "versions": versions(args.infinity_venv), "rounds": args.rounds, "requests": args.requests,
        "max_seconds": args.max_seconds, "min_warmup": args.min_warmup, "warmup": warmup,
        "pilot_median_s": pilots, "concurrency": args.concurrency, "tasks": args.tasks, "pool": args.pool,
        "pool_sentences": pool_sentences, "sentences_source": source, "atol": args.atol,
        "atol_int8": args.atol if args.atol_int8 is None else args.atol_int8,
        "settings": {name: c.settings for name, c in contenders.items()}, "unavailable": unavailable,
        "wall_minutes": wall, "results": rows, "memory": memory,
    }
    out["goals"] = goals(out)
    print("\n".join(out["goals"]))
    failed = [f"{r['contender']} c={r['concurrency']}" for r in rows if not r["ok"]]
    print(f"cells failed: {', '.join(failed) or 'none'}")
    if not args.no_report:
        write_report(out, args.out_name)
        print(f"wrote {RESULTS / (args.out_name + '.md')}")


def _estimate(args, pool_sentences: int, slowest_rate: float, servers: int = 5, ceilings: int = 3) -> float:
    """Minutes, roughly: every server run's window holds 1.2 x ``requests`` requests (about 8.5 sentences each) at
    0.7 x the slowest ceiling's rate, after a warm-up of twice a request's time at that concurrency; every ceiling run
    encodes the pool; the pilots; three minutes to start the servers."""
    per_request = 8.5 / max(0.7 * slowest_rate, 1e-9)
    minutes = 3.0
    for c in args.concurrency:
        window = min(args.max_seconds, max(2.0, 1.2 * args.requests * per_request))
        run = window + max(args.min_warmup, 2 * c * per_request)
        minutes += args.rounds * (servers * run + ceilings * pool_sentences / slowest_rate) / 60
        minutes += servers * max(2 * c, 16) * per_request / 60  # the pilot
    return minutes


def tail(path: Path, lines: int = 2) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])[-400:]
    except OSError:
        return "(no log)"


def _memory_gib() -> float:
    with open("/proc/meminfo") as handle:
        return int(next(line.split()[1] for line in handle if line.startswith("MemTotal"))) / 1024 / 1024


def versions(infinity_venv: Path) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("st-prompts", "torch", "transformers", "sentence-transformers", "tokenizers", "numpy", "starlette",
                 "uvicorn"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    python = infinity_venv / "bin" / "python"
    if python.exists():
        names = ["infinity-emb", "torch", "transformers", "sentence-transformers", "numpy", "optimum", "optimum-onnx",
                 "onnxruntime"]
        code = ("from importlib.metadata import version as v, PackageNotFoundError as E\n"
                f"for n in {names!r}:\n"
                "    try: print(n, v(n))\n"
                "    except E: print(n, None)")
        probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=False)
        out["infinity venv"] = "; ".join(probe.stdout.strip().splitlines()) or probe.stderr.strip()[-200:]
    return out


if __name__ == "__main__":
    main()
