"""64 well-behaved clients of `st-prompts serve` under attack: an endless-header client and a 500-connection slowloris,
against the same clients without them, for one process and ``--workers 2`` (issue 60; run by hand).

    python benchmarks/serving_attack.py                    # 5 rounds per server: about 12 minutes on a 2-core machine
    python benchmarks/serving_attack.py --rounds 1 --duration 5 --out-name serving_attack-smoke   # a smoke run
    git archive 0057e26 | tar -x -C /tmp/before            # the code before the fix, for a contrast:
    python benchmarks/serving_attack.py --code /tmp/before --rounds 2 --out-name serving_attack-before

**Goal** (issue 60): under the attackers, the 64 clients keep at least 0.8x the throughput they have without them,
with one process and with ``--workers 2``. Before the fix, one connection streaming an endless header stalled the
event loop (httptools gathers a header that arrives in pieces by concatenating bytes: quadratic), until the header
timeout: 1,635 answers in 15 s fell to 32 in 20 s.

**Server**: ``st-prompts serve`` of a MiniLM bank of 3 prompt sets (16 positions each, the official initialisation),
every option at its default (10 s header timeout, 1,000 connections, a 64 KiB head), ``--workers 2`` or one process;
its code is this checkout's, or ``--code DIR``'s (the server runs with that folder first on its path).

**Clients**: ``--clients`` (64) closed-loop keep-alive clients (``benchmarks/serving.py``'s minimal HTTP/1.1 client,
in this process), each sending its next request when the last is answered: a pool of ``--pool`` requests of 1 to
``--max-sentences`` (4) Wikipedia sentences (the package's demo sample), a random set each, base64. (Short requests:
each client gets several answers in a window even on a busy machine, where 1-16 sentences gave it about one, and the
count of answers in a window swung with that.) Every response's vectors are checked
against in-process ``encode`` (max abs difference <= ``--atol``).

**Attackers** (one process of their own, started ``--ramp`` seconds before the measured window, stopped after it; a
thread each, sockets without asyncio, so that they take little of the CPU they share with the server here: a real
attacker runs elsewhere):

* the endless-header client: one connection at a time sends ``GET /health``, a header name, and then the header's
  value in ``--chunk``-byte writes at ``--endless-rate`` MB/s (10; 0: as fast as the server reads), never ending it;
  when the server closes the connection (431 now; before the fix, 408 at the header timeout) it reads what the server
  answered and starts again at once;
* the slowloris: ``--slowloris`` (500) connections that each send a request line and then one header line every
  ``--slowloris-interval`` (2) seconds, never ending the head; each connects again when the server answers or drops
  it (408 at the header timeout). Their first connections are spread over the ramp.

**Protocol**: per server, first each attacker alone against the idle server for ``--idle-seconds`` (its cost to the
server: CPU cores from ``/proc``), then a warm-up (``--warmup`` s of the clients alone), then ``--rounds`` rounds, each measuring
the clients without and with the attackers (the order alternating per round, so that the comparison is interleaved
in time): the window is ``--duration`` s after a 2 s warm-up of the clients. The ratio of a round is its throughput
(sentences answered per second in the window) with the attackers over without; the goal is met when every round's
ratio is >= 0.8; the pooled ratio (sentences per second over all the windows with the attackers, over all without)
and the ratio per core of CPU the server got (on a machine shared with other work, what the server could do with
what it was given) are given beside it. Recorded per run: throughput, p50/p99 latency, failures (a non-200 answer or a lost connection),
the vectors' check, what the attackers achieved (refusals by status, bytes sent, reconnects), the CPU seconds of the
server, of the attackers and of this process, the CPU other processes took (cores), the load average before and
after. Results: ``benchmarks/results/serving_attack.json`` and ``.md`` (``--out-name``).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import platform
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

HOST = "127.0.0.1"
TASKS = ("t0", "t1", "t2")
GOAL = 0.8


# ------------------------------------------------------------------------------------------------------ attackers
def endless_header(port: int, chunk: int, rate: float, stats: dict, stop: threading.Event) -> None:
    """One connection at a time: a header value that never ends, written at ``rate`` bytes a second in all (0: as
    fast as the server reads it); when the server closes the connection, what it answered, and again."""
    value = b"v" * chunk
    start = time.monotonic()
    while not stop.is_set():
        try:
            sock = socket.create_connection((HOST, port), timeout=5)
        except OSError:
            stats["connect_failures"] += 1
            time.sleep(0.05)
            continue
        stats["endless_connections"] += 1
        sock.settimeout(1.0)  # a send blocked (the server reads no more) is tried again: stop is seen within 1 s
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ")
            while not stop.is_set():
                try:
                    sock.sendall(value)
                except TimeoutError:
                    continue
                stats["endless_bytes"] += chunk
                if rate:
                    time.sleep(max(0.0, stats["endless_bytes"] / rate - (time.monotonic() - start)))
        except OSError:  # closed by the server
            pass
        try:  # what it answered, if that arrived before its reset
            first = sock.recv(4096)
        except OSError:
            first = b""
        sock.close()
        status = first.split(b" ", 2)[1].decode() if first.startswith(b"HTTP/") else "closed, no answer read"
        stats["endless_answers"][status] = stats["endless_answers"].get(status, 0) + 1


def slowloris(port: int, count: int, interval: float, ramp: float, stats: dict, stop: threading.Event) -> None:
    """``count`` connections, each sending a request line and then a header line every ``interval`` seconds, never
    ending the head; each connects again (after up to 0.5 s) when the server answers or drops it. One thread and a
    selector, so that the attacker itself costs little of the machine it shares with the server."""
    selector = selectors.DefaultSelector()
    due: list[tuple[float, int, int]] = []  # (when, connection, generation): connect (no socket yet) or send a line
    sockets: dict[int, tuple[socket.socket, int]] = {}  # connection -> (socket, generation)
    lines: dict[int, int] = {}
    now = time.monotonic()
    for index in range(count):
        heapq.heappush(due, (now + random.uniform(0, ramp), index, 0))
    generation = 0
    while not stop.is_set():
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, index, gen = heapq.heappop(due)
            if gen == 0:  # connect
                if index in sockets:
                    continue
                try:
                    sock = socket.create_connection((HOST, port), timeout=5)
                    sock.setblocking(False)
                    sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                except OSError:
                    stats["connect_failures"] += 1
                    heapq.heappush(due, (now + 1.0, index, 0))
                    continue
                generation += 1
                sockets[index], lines[index] = (sock, generation), 0
                selector.register(sock, selectors.EVENT_READ, index)
                stats["slowloris_connections"] += 1
                heapq.heappush(due, (now + interval, index, generation))
            elif index in sockets and sockets[index][1] == gen:  # a line, on the connection still open
                lines[index] += 1
                try:
                    sockets[index][0].send(b"X-Slow-%d: y\r\n" % lines[index])
                except OSError:
                    pass  # closed: its read says so
                heapq.heappush(due, (now + interval, index, gen))
        wait = min(0.1, max(0.0, due[0][0] - time.monotonic())) if due else 0.1
        for key, _ in selector.select(wait):
            index = key.data
            sock = sockets[index][0]
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
            stats["slowloris_answers"][status] = stats["slowloris_answers"].get(status, 0) + 1
            selector.unregister(sock)
            sock.close()
            del sockets[index]
            heapq.heappush(due, (time.monotonic() + random.uniform(0, 0.5), index, 0))


def attack(args) -> None:
    """The attackers' process: runs until SIGTERM, then prints what they achieved (one JSON line)."""
    stats = {"endless_connections": 0, "endless_bytes": 0, "endless_answers": {}, "slowloris_connections": 0,
             "slowloris_answers": {}, "connect_failures": 0}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    threads = [threading.Thread(target=endless_header, daemon=True,
                                args=(args.attack, args.chunk, args.endless_rate * 1e6, stats, stop))
               for _ in range(args.endless)]
    if args.slowloris:
        threads.append(threading.Thread(target=slowloris, daemon=True, args=(
            args.attack, args.slowloris, args.slowloris_interval, args.ramp, stats, stop)))
    for thread in threads:
        thread.start()
    while not stop.is_set():
        stop.wait(0.5)
    for thread in threads:
        thread.join(3)
    print(json.dumps(stats), flush=True)
    os._exit(0)  # the attackers' sockets go with the process


class Attackers:
    def __init__(self, port: int, args, endless: int | None = None, slowloris: int | None = None) -> None:
        endless = args.endless if endless is None else endless
        slowloris = args.slowloris if slowloris is None else slowloris
        command = [sys.executable, __file__, "--attack", str(port), "--endless", str(endless), "--slowloris",
                   str(slowloris), "--slowloris-interval", str(args.slowloris_interval), "--chunk",
                   str(args.chunk), "--endless-rate", str(args.endless_rate), "--ramp", str(args.ramp)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

    def stop(self) -> dict:
        from serving import tree_ticks

        ticks = tree_ticks(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            out, _ = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate(timeout=60)
        stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        stats["cpu_s"] = ticks / os.sysconf("SC_CLK_TCK")
        return stats


# ------------------------------------------------------------------------------------------------------ the server
class Server:
    def __init__(self, bank: Path, workers: int, code: Path | None, log: Path) -> None:
        from serving import free_port

        self.port = free_port()
        command = [sys.executable, "-m", "st_prompts.cli", "serve", str(bank), "--port", str(self.port)]
        if workers > 1:
            command += ["--workers", str(workers)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": str(code or REPO)}
        self.log = open(log, "w")  # noqa: SIM115 - the child's
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        cwd=str(code or REPO), start_new_session=True)
        self.command = " ".join(["st-prompts serve BANK"] + command[5:])

    def wait_ready(self, timeout: float = 600) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()


class Requests:
    """What ``serving.closed_loop`` asks of a contender: the port, path and body of each pool item."""

    def __init__(self, port: int, pool: list) -> None:
        self.bodies = [json.dumps({"model": task, "input": texts, "encoding_format": "base64"}).encode()
                       for task, texts in pool]
        self.port = port

    def request(self, item: int, entry) -> tuple[int, str, bytes]:
        return self.port, "/v1/embeddings", self.bodies[item]


# ------------------------------------------------------------------------------------------------------ measuring
def server_counters(port: int) -> dict[str, float]:
    """The server's counters of connections it closed (by reason) and moved (``rebalanced``), from /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=60) as answer:
        text = answer.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "st_prompts_dropped_connections_total":
                out[f"dropped {sample.labels['reason']}"] = sample.value
            elif sample.name == "st_prompts_rebalanced_connections_total":
                out["rebalanced"] = sample.value
    return out


def run_once(server: Server, pool: list, reference: list, args, attacked: bool, seed: int) -> dict:
    from serving import check_vectors, closed_loop, load_snapshot, machine_ticks, tree_ticks

    tick = os.sysconf("SC_CLK_TCK")
    attackers = Attackers(server.port, args) if attacked else None
    time.sleep(args.ramp + 1)  # the slowloris connections are all open, the endless header streams (or the same pause)
    counters = server_counters(server.port)
    before, busy0, own0 = load_snapshot(), machine_ticks(), os.times()
    server0 = tree_ticks(server.process.pid)
    attack0 = tree_ticks(attackers.process.pid) if attackers else 0
    started = time.perf_counter()
    run = asyncio.run(closed_loop(Requests(server.port, pool), pool, args.clients, 2.0, args.duration, seed))
    wall = time.perf_counter() - started
    busy1, own1 = machine_ticks(), os.times()
    server_s = (tree_ticks(server.process.pid) - server0) / tick
    attack_s = ((tree_ticks(attackers.process.pid) - attack0) / tick) if attackers else 0.0
    own_s = (own1.user + own1.system) - (own0.user + own0.system)
    other = ((busy1[0] - busy0[0]) / tick - server_s - attack_s - own_s) / wall
    after = server_counters(server.port)
    latencies = sorted(run.pop("latencies"))
    check = check_vectors(run.pop("responses"), reference)
    out = {"attacked": attacked, "sentences": run["sentences"], "seconds": run["seconds"],
           "throughput": run["sentences"] / run["seconds"], "requests": len(latencies),
           "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
           "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
           "failures": run["failures"], "check": check,
           "server_counters": {k: v - counters.get(k, 0) for k, v in after.items() if v - counters.get(k, 0)},
           "cpu": {"wall_s": wall, "server_s": server_s, "attackers_s": attack_s, "harness_s": own_s,
                   "other_cores": max(0.0, other)},
           "load": {"before": before, "after": load_snapshot()}}
    if attackers is not None:
        out["attackers"] = attackers.stop()
        time.sleep(1)  # what they left open is closed before the next run
    return out


def idle_cost(server: Server, args) -> list[dict]:
    """Each attacker alone against the idle server for ``--idle-seconds``: the server's CPU (cores) and what the
    attacker achieved; what the attack costs the server, apart from the clients."""
    from serving import tree_ticks

    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for endless, slowloris in ((args.endless, 0), (0, args.slowloris)):
        ticks, started = tree_ticks(server.process.pid), time.monotonic()
        attackers = Attackers(server.port, args, endless, slowloris)
        time.sleep(args.idle_seconds)
        stats = attackers.stop()
        wall = time.monotonic() - started
        out.append({"endless": endless, "slowloris": slowloris, "seconds": wall,
                    "server_cores": (tree_ticks(server.process.pid) - ticks) / tick / wall,
                    "attackers_cores": stats["cpu_s"] / wall, "attackers": stats})
        time.sleep(2)
    return out


def reference_vectors(bank: Path, pool: list) -> list[np.ndarray]:
    from st_prompts.loading import load_sentence_model

    model = load_sentence_model(str(bank), device="cpu")
    return [np.asarray(model.encode(texts, task=task, batch_size=32, convert_to_numpy=True), dtype=np.float32)
            for task, texts in pool]


def make_bank(work: Path) -> Path:
    folder = work / "bank-3"
    if not (folder / "modules.json").exists():
        import torch

        from st_prompts import bank

        model = bank.create_bank("minilm")
        torch.manual_seed(0)
        for name in TASKS:
            bank.bank_encoder(model).new_prompt_set(name, prefix_length=16)
        model.save(str(folder))
    return folder


def environment(code: Path | None) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from common import cpu_model

    versions = {}
    for name in ("torch", "transformers", "sentence-transformers", "tokenizers", "numpy", "starlette", "uvicorn",
                 "httptools", "uvloop", "prometheus-client"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags")), [])
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "st_prompts"],
                                capture_output=True, text=True, check=False).stdout.strip())
    with open("/proc/meminfo") as handle:
        memory = int(next(line.split()[1] for line in handle if line.startswith("MemTotal"))) / 1024 / 1024
    return {"versions": versions, "cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(memory, 1),
            "cpu_flags": {flag: flag in flags for flag in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")},
            "platform": platform.platform(), "python": platform.python_version(),
            "code": str(code) if code else f"this checkout ({commit}{', st_prompts modified' if dirty else ''})",
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()}


def busiest_processes() -> list[str]:
    """The processes using the most CPU now (``ps``): who else loads the machine."""
    out = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True,
                         check=False).stdout.splitlines()
    return [" ".join(line.split()) for line in out[1:6]]


# ------------------------------------------------------------------------------------------------------ reporting
def verdict(ratios: list[float]) -> str:
    if not ratios:
        return "no rounds"
    if all(r >= GOAL for r in ratios):
        return "met in every round"
    if all(r < GOAL for r in ratios):
        return "missed in every round"
    return "undecided: the rounds disagree"


def write_report(out: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    env = out["environment"]
    rate = f"{out['endless_rate']:g} MB/s" if out["endless_rate"] else "as fast as the server reads"
    lines = ["# 64 clients under an endless-header client and a 500-connection slowloris", "",
             "Generated by `benchmarks/serving_attack.py` (its docstring gives the protocol); do not edit by hand.", "",
             f"* Command: `{out['command']}`",
             f"* Code served: {env['code']}",
             f"* Machine: {env['cpu']}, {env['cores']} cores, {env['memory_gib']} GiB, {env['platform']}, Python "
             f"{env['python']}; CPU flags: " + ", ".join(f"{k} {'yes' if v else 'no'}"
                                                        for k, v in env["cpu_flags"].items()),
             "* Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
             (f"* Load: `{env['uptime']}` at the start, `{out['uptime_end']}` at the end; the busiest processes at "
             f"the start: {'; '.join(out['busiest_start'])}. Per run below: the CPU other processes took (cores)."),
             (f"* {out['rounds']} rounds per server, the runs without and with the attackers interleaved (the order "
             f"alternating); a {out['duration']:.0f} s window per run after a 2 s warm-up, {out['clients']} "
             f"keep-alive clients; attackers: {out['endless']} endless-header client ({out['chunk']}-byte writes, "
               f"{rate}), "
             f"{out['slowloris']} slowloris connections (a header line every {out['slowloris_interval']:g} s), started "
             f"{out['ramp']:g} s before the window; {out['wall_minutes']:.1f} minutes in all"),
             (f"* Requests: a pool of {out['pool']} requests of 1-{out['max_sentences']} sentences "
              f"({out['pool_sentences']} in all), a "
             f"random set of 3 each, base64; every response checked against in-process `encode` (max abs difference "
             f"<= {out['atol']})"), "", "## Goal (issue 60): with the attackers >= 0.8x the throughput without", ""]
    for server in out["servers"]:
        ratios = server["ratios"]
        runs = server["runs"]
        pooled = (sum(r["sentences"] for r in runs if r["attacked"]) / sum(r["seconds"] for r in runs if r["attacked"])
                  ) / (sum(r["sentences"] for r in runs if not r["attacked"])
                       / sum(r["seconds"] for r in runs if not r["attacked"]))
        per_core = [r["throughput"] / (r["cpu"]["server_s"] / r["cpu"]["wall_s"]) for r in runs]
        with_, without = ([v for v, r in zip(per_core, runs) if r["attacked"] is flag] for flag in (True, False))
        lines.append(f"* {server['label']}: **{pooled:.2f}x** pooled over the rounds, {np.median(ratios):.2f}x the "
                     f"median round (rounds {', '.join(f'{r:.2f}' for r in ratios)}): {verdict(ratios)}. Per core "
                     f"of CPU the server got: {np.mean(with_) / np.mean(without):.2f}x")
    lines += ["", "## Each attacker alone against the idle server (what it costs the server)", "",
              "| server | attacker | seconds | server CPU (cores) | attacker CPU (cores) | connections | answers |",
              "|---|---|---:|---:|---:|---:|---|"]
    for server in out["servers"]:
        for cost in server.get("idle_cost", []):
            stats = cost["attackers"]
            which = "endless header" if cost["endless"] else f"slowloris ({cost['slowloris']})"
            connections = stats["endless_connections"] if cost["endless"] else stats["slowloris_connections"]
            answers = stats["endless_answers"] if cost["endless"] else stats["slowloris_answers"]
            lines.append(f"| {server['label']} | {which} | {cost['seconds']:.0f} | {cost['server_cores']:.3f} | "
                         f"{cost['attackers_cores']:.3f} | {connections} | "
                         f"{', '.join(f'{k}: {v}' for k, v in answers.items()) or '–'} |")
    lines += ["", "## Runs", "",
              ("| server | round | attackers | sentences/s | p50 ms | p99 ms | requests | failures | vectors (max abs "
              "diff, checked) | endless header: connections, answers, MB sent | slowloris: connections, answers | "
              "CPU s: server, attackers, harness | other CPU (cores) | load 1-min before -> after |"),
              "|---|---:|---|---:|---:|---:|---:|---|---|---|---|---|---:|---|"]
    for server in out["servers"]:
        for run in server["runs"]:
            attackers = run.get("attackers")
            endless = slow = "–"
            if attackers:
                endless = (f"{attackers['endless_connections']}, "
                           f"{', '.join(f'{k}: {v}' for k, v in attackers['endless_answers'].items()) or '–'}, "
                           f"{attackers['endless_bytes'] / 1e6:.0f}")
                slow = (f"{attackers['slowloris_connections']}, "
                        f"{', '.join(f'{k}: {v}' for k, v in attackers['slowloris_answers'].items()) or '–'}")
            check = run["check"]
            ok = "ok" if check["max_abs_diff"] <= out["atol"] and not check["malformed"] else "FAIL"
            cpu = run["cpu"]
            fmt = (lambda v: "–" if v is None else f"{v:.0f}")
            lines.append(
                f"| {server['label']} | {run['round']} | {'yes' if run['attacked'] else 'no'} | "
                f"{run['throughput']:.1f} | {fmt(run['p50_ms'])} | {fmt(run['p99_ms'])} | {run['requests']} | "
                f"{', '.join(f'{k}: {v}' for k, v in run['failures'].items()) or '–'} | "
                f"{ok} {check['max_abs_diff']:.1e}, {check['checked']} | {endless} | {slow} | "
                f"{cpu['server_s']:.0f}, {cpu['attackers_s']:.0f}, {cpu['harness_s']:.0f} | {cpu['other_cores']:.2f} | "
                f"{run['load']['before']['load_average'][0]:.1f} -> {run['load']['after']['load_average'][0]:.1f} |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each measured window")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of the clients alone before the rounds")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--pool", type=int, default=512)
    parser.add_argument("--max-sentences", type=int, default=4, help="sentences per request: 1 to this many")
    parser.add_argument("--endless", type=int, default=1, help="endless-header clients")
    parser.add_argument("--chunk", type=int, default=16384, help="bytes per write of the endless header")
    parser.add_argument("--endless-rate", type=float, default=10.0,
                        help="MB/s the endless-header client sends (0: as fast as the server reads)")
    parser.add_argument("--slowloris", type=int, default=500, help="slowloris connections")
    parser.add_argument("--slowloris-interval", type=float, default=2.0)
    parser.add_argument("--ramp", type=float, default=4.0, help="seconds the attackers run before the window")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="seconds each attacker runs alone against the idle server first (0: not at all)")
    parser.add_argument("--servers", nargs="+", default=["one", "w2"], choices=("one", "w2"))
    parser.add_argument("--code", type=Path, help="serve another checkout's st_prompts (e.g. the code before a fix)")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/st-prompts-serving-attack"))
    parser.add_argument("--out-name", default="serving_attack")
    parser.add_argument("--attack", type=int, help=argparse.SUPPRESS)  # the attackers' process: the port
    args = parser.parse_args(argv)
    if args.attack:
        attack(args)
        return
    started = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    from serving import read_sentences

    out = {"command": "python benchmarks/serving_attack.py " + " ".join(sys.argv[1:]),
           "environment": environment(args.code), "busiest_start": busiest_processes(), "rounds": args.rounds,
           "duration": args.duration, "clients": args.clients, "pool": args.pool,
           "max_sentences": args.max_sentences, "endless": args.endless,
           "chunk": args.chunk, "endless_rate": args.endless_rate, "slowloris": args.slowloris,
           "slowloris_interval": args.slowloris_interval,
           "ramp": args.ramp, "atol": args.atol, "servers": []}
    bank = make_bank(args.work)
    sentences, source = read_sentences(None)
    rng = random.Random(0)
    pool = [(rng.choice(TASKS), [rng.choice(sentences) for _ in range(rng.randint(1, args.max_sentences))])
            for _ in range(args.pool)]
    out["pool_sentences"], out["sentences_source"] = sum(len(texts) for _, texts in pool), source
    reference = reference_vectors(bank, pool)
    for which in args.servers:
        workers = 2 if which == "w2" else 1
        label = "--workers 2" if workers == 2 else "one process"
        server = Server(bank, workers, args.code, args.work / f"server-{which}.log")
        try:
            server.wait_ready()
            costs = idle_cost(server, args) if args.idle_seconds > 0 else []
            for cost in costs:
                print(f"{label}: alone against the idle server: {cost}", flush=True)
            print(f"{label}: ready; warming up {args.warmup:g} s", flush=True)
            from serving import closed_loop

            asyncio.run(closed_loop(Requests(server.port, pool), pool, args.clients, 0.0, args.warmup, 999))
            runs = []
            for round_ in range(1, args.rounds + 1):
                order = (False, True) if round_ % 2 else (True, False)
                for attacked in order:
                    run = run_once(server, pool, reference, args, attacked, seed=round_ * 10 + attacked)
                    run["round"] = round_
                    runs.append(run)
                    print(f"{label} round {round_} {'with' if attacked else 'without'} attackers: "
                          f"{run['throughput']:.1f} sentences/s, failures {run['failures']}, "
                          f"{run.get('attackers', {})}, server {run['server_counters']}", flush=True)
            by_round = {(r["round"], r["attacked"]): r["throughput"] for r in runs}
            ratios = [by_round[(r, True)] / by_round[(r, False)] for r in range(1, args.rounds + 1)
                      if by_round[(r, False)]]
            out["servers"].append({"label": label, "command": server.command, "idle_cost": costs, "runs": runs,
                                   "ratios": ratios})
        finally:
            server.stop()
    out["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    out["wall_minutes"] = (time.monotonic() - started) / 60
    write_report(out, args.out_name)
    for server in out["servers"]:
        print(f"{server['label']}: ratios {', '.join(f'{r:.2f}' for r in server['ratios'])}: "
              f"{verdict(server['ratios'])}")


if __name__ == "__main__":
    main()
