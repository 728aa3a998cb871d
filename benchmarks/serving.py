"""Serving many tasks from one process, against Infinity and one process per task (run by hand).

    python benchmarks/serving.py --data-dir ../shared/data                       # the full run (about 30 minutes)
    python benchmarks/serving.py --quick                                          # a smoke run (a few minutes)

Infinity needs sentence-transformers < 4 and numpy < 2, so it lives in its own virtual environment, outside the
repository::

    python3 -m venv /work/infinity-venv && . /work/infinity-venv/bin/activate
    pip install torch==2.13.0 && pip install "infinity-emb[server,torch]==0.0.78"

Servers, all on this machine, each called through the same OpenAI embeddings API by a closed-loop asyncio load
generator (a minimal HTTP/1.1 keep-alive client, so that the generator costs every server the same, little CPU):

* ``infinity``: Infinity (``infinity-emb``, its own virtual environment, ``--infinity-venv``) serving the packaged
  all-MiniLM-L6-v2 from its folder, offline: the single-task anchor;
* ``ours-plain``: ``st-prompts serve minilm``, the same model (no prompt set): the same work as Infinity;
* ``ours-T`` for T in ``--tasks``: ``st-prompts serve BANK`` of T prompt sets (16 positions each, a random task per
  request); T = 1 is the single-task row the mixed rows are compared with;
* ``per-task-8``: one ``st-prompts serve`` process per task (its set as the model's own prefix, one torch thread
  each), the request sent to its task's process (routing for free): what a user does today without a bank.

Every request holds 1-16 sentences of the Wikipedia sample (the same sequence for every server, ``encoding_format``
base64 for all). For each round, concurrency and server in turn (rotated per round, so that every comparison is
interleaved in time) the server is resumed, warmed up, measured for ``--duration`` seconds and paused again
(SIGSTOP/SIGCONT: a paused server takes no CPU from the one measured). Throughput is sentences answered per second in
the window, latency the request latencies in it (pooled over rounds), memory the resident set of the server process
(all processes for per-task-8) after start and at the end.

Results: ``benchmarks/results/serving.json`` and ``benchmarks/results/serving.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PREFIX_LENGTH = 16
sys.path.insert(0, str(REPO / "benchmarks"))


# ------------------------------------------------------------------------------------------------------ the client
class Connection:
    """One keep-alive HTTP/1.1 connection: POST a body, read the status and the body."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> int:
        reused = self.writer is not None
        if not reused:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                          % (path.encode(), self.host.encode(), len(body)) + body)
        try:
            line = await self.reader.readline()
        except ConnectionResetError:
            line = b""
        if not line:
            self.close()
            if reused:  # the server closed an idle keep-alive connection: what every client retries on a new one
                return await self.post(path, body)
            raise ConnectionError("the server closed the connection")
        status = int(line.split()[1])
        length, chunked, close = 0, False, False
        while True:
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
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await self.reader.readexactly(length)
        if close:
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def request_plan(sentences: list[str], tasks: list[str], seed: int, count: int = 400) -> list[tuple[str, int, bytes]]:
    """``(task, sentences, body)`` of ``count`` requests: 1-16 sentences each, a random task each."""
    rng = random.Random(seed)
    plan = []
    for _ in range(count):
        task = rng.choice(tasks)
        texts = [rng.choice(sentences) for _ in range(rng.randint(1, 16))]
        body = json.dumps({"model": task, "input": texts, "encoding_format": "base64"}).encode()
        plan.append((task, len(texts), body))
    return plan


async def closed_loop(targets: dict[str, tuple[str, int, str]], sentences: list[str], concurrency: int,
                      warmup: float, duration: float, seed: int) -> dict:
    """``concurrency`` workers, each sending its next request when the last is answered; ``targets`` maps a task to
    ``(host, port, path)``. Returns the sentences answered and the latencies of the requests finished inside the
    measured window (answered inside it), and the failures."""
    tasks = list(targets)
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = (start + warmup, start + warmup + duration)
    latencies: list[float] = []
    answered = [0]
    failures: dict[str, int] = {}

    async def worker(index: int) -> None:
        plan = request_plan(sentences, tasks, seed * 1000 + index)
        connections: dict[tuple[str, int], Connection] = {}
        position = 0
        while loop.time() < window[1]:
            task, count, body = plan[position % len(plan)]
            position += 1
            host, port, path = targets[task]
            connection = connections.setdefault((host, port), Connection(host, port))
            sent = loop.time()
            try:
                status = await connection.post(path, body)
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
                connection.close()
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.05)
                continue
            done = loop.time()
            if status != 200:
                failures[str(status)] = failures.get(str(status), 0) + 1
                continue
            if window[0] <= done <= window[1]:  # answered inside the measured window
                latencies.append(done - sent)
                answered[0] += count
        for connection in connections.values():
            connection.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return {"sentences": answered[0], "seconds": duration, "latencies": latencies, "failures": failures}


# ----------------------------------------------------------------------------------------------------- the servers
class Server:
    """One or more server processes of one configuration; paused between its measurements."""

    def __init__(self, name: str, commands: list[list[str]], ports: list[int], targets: dict[str, tuple[str, int, str]],
                 env: dict[str, str] | None = None, log_dir: Path | None = None) -> None:
        self.name = name
        self.targets = targets
        self.ports = ports
        self.processes = []
        for i, command in enumerate(commands):
            log = open(log_dir / f"{name}-{i}.log", "w") if log_dir else subprocess.DEVNULL  # noqa: SIM115 - the child
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                   env={**os.environ, **(env or {})}, start_new_session=True))
        self.rss_start: float | None = None

    def wait_ready(self, timeout: float = 600) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        for port, process in zip(self.ports, self.processes):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {process.returncode} (see its log)")
                try:
                    for path in ("/health", "/models"):
                        try:
                            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                                if answer.status == 200:
                                    break
                        except urllib.error.HTTPError:
                            continue
                    else:
                        raise OSError("not ready")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.name} did not start in {timeout} s") from None
                    time.sleep(1)

    def pause(self) -> None:
        for process in self.processes:
            os.killpg(process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for process in self.processes:
            os.killpg(process.pid, signal.SIGCONT)

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


def tree_rss_kib(pid: int) -> int:
    """Resident set (KiB) of a process and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as handle:
                total += next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
        stack.extend(children.get(current, []))
    return total


# ------------------------------------------------------------------------------------------------------- the models
def prepare(work: Path, tasks: list[int], per_task: int) -> dict[str, Path]:
    """Banks of T sets (``t0``, ``t1``, ...; 16 positions, the official initialisation: the same cost as trained sets)
    and ``per_task`` prompts-only checkpoints holding sets ``t0``... as their model's own prefix."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    from st_prompts import PromptedTransformer, bank, save_prompts_only
    from st_prompts.utils import packaged_minilm_path

    folders = {}
    model = bank.create_bank("minilm")
    encoder = model[0]
    torch.manual_seed(0)
    for count in sorted(tasks):
        folder = work / f"bank-{count}"
        while len(encoder.prompt_set_names) < count:
            encoder.new_prompt_set(f"t{len(encoder.prompt_set_names)}", prefix_length=PREFIX_LENGTH)
        if not (folder / "modules.json").exists():
            model.save(str(folder))
        folders[f"bank-{count}"] = folder
    while len(encoder.prompt_set_names) < per_task:
        encoder.new_prompt_set(f"t{len(encoder.prompt_set_names)}", prefix_length=PREFIX_LENGTH)
    for i in range(per_task):
        folder = work / f"task-t{i}"
        if not (folder / "modules.json").exists():
            single = PromptedTransformer(packaged_minilm_path(), prefix_length=PREFIX_LENGTH, max_seq_length=256)
            with torch.no_grad():
                single.prefix_encoder.load_state_dict(encoder.prompt_sets[f"t{i}"].state_dict())
            st = SentenceTransformer(modules=[single, Pooling(384, pooling_mode="mean"), Normalize()], device="cpu")
            save_prompts_only(st, str(folder))
        folders[f"task-t{i}"] = folder
    return folders


def read_sentences(data_dir: Path | None, count: int = 2000) -> list[str]:
    path = data_dir / "train" / "wiki_sentences.txt" if data_dir is not None else None
    if path is None or not path.is_file():  # the sample bundled with the package (the demo's)
        path = REPO / "st_prompts" / "resources" / "demo" / "wiki_sentences.txt"
    lines = path.read_text(encoding="utf-8").splitlines()
    source = str(path.relative_to(REPO) if path.is_relative_to(REPO) else path.name)
    lines = [line.strip() for line in lines if len(line.split()) >= 3]
    print(f"{min(count, len(lines))} sentences from {source}", flush=True)
    return lines[:count]


# ------------------------------------------------------------------------------------------------------- reporting
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_average() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def summarise(runs: list[dict]) -> dict:
    sentences = sum(r["sentences"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    latencies = [x for r in runs for x in r["latencies"]]
    per_round = [r["sentences"] / r["seconds"] for r in runs]
    return {"throughput": sentences / seconds if seconds else 0.0, "per_round": per_round,
            "p50_ms": 1000 * percentile(latencies, 0.5) if latencies else None,
            "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None,
            "requests": len(latencies), "failures": {k: sum(r["failures"].get(k, 0) for r in runs)
                                                     for k in {k for r in runs for k in r["failures"]}}}


def write_report(out: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    rows = out["results"]
    lines = ["# Serving many tasks from one process", "",
             "Generated by `benchmarks/serving.py` (see its docstring for the protocol); do not edit by hand.", "",
             f"* Command: `{out['command']}`",
             (f"* Machine: {out['machine']}; load average (1, 5, 15 min) {out['load_before']} before, "
              f"{out['load_after']} after ({out['load_note']})"),
             (f"* {out['rounds']} rounds x {out['duration']} s measured (+{out['warmup']} s warm-up) per server and "
              f"concurrency, interleaved; {out['wall_minutes']:.1f} minutes in all"),
             f"* Requests: 1-16 sentences of {out['sentences_source']}, base64; a random task per request", ""]
    if out.get("infinity_error"):
        lines += [f"**Infinity could not run here**: {out['infinity_error']}", ""]
    lines += ["| server | T | concurrency | sentences/s | p50 ms | p99 ms | per round (sentences/s) | failures |",
              "|---|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        s = row["summary"]
        fmt = (lambda v: f"{v:.0f}" if v is not None else "–")
        lines.append(f"| {row['server']} | {row['tasks']} | {row['concurrency']} | {s['throughput']:.0f} | "
                     f"{fmt(s['p50_ms'])} | {fmt(s['p99_ms'])} | {', '.join(f'{v:.0f}' for v in s['per_round'])} | "
                     f"{', '.join(f'{k}: {v}' for k, v in s['failures'].items()) or '–'} |")
    lines += ["", "| server | processes | memory after start (MiB) | memory at the end (MiB) |", "|---|---:|---:|---:|"]
    for name, memory in out["memory"].items():
        lines.append(f"| {name} | {memory['processes']} | {memory['start']:.0f} | {memory['end']:.0f} |")
    lines += ["", "## Goals", ""] + [f"* {line}" for line in out["goals"]]
    (RESULTS / "serving.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def goals(out: dict) -> list[str]:
    by = {(r["server"], r["concurrency"]): r["summary"] for r in out["results"]}
    lines = []
    for c in out["concurrency"]:
        ours, anchor = by.get(("ours-plain", c)), by.get(("infinity", c))
        if ours and anchor and anchor["throughput"]:
            ratio = ours["throughput"] / anchor["throughput"]
            lines.append(f"single task, concurrency {c}: st-prompts {ours['throughput']:.0f} / Infinity "
                         f"{anchor['throughput']:.0f} sentences/s = **{ratio:.2f}x** (goal >= 0.9: "
                         f"{'met' if ratio >= 0.9 else 'missed'}); p99 {ours['p99_ms']:.0f} vs {anchor['p99_ms']:.0f} ms "
                         f"({'no worse' if ours['p99_ms'] <= anchor['p99_ms'] else 'worse'})")
    for c in out["concurrency"]:
        mixed, single = by.get(("ours-T64", c)), by.get(("ours-T1", c))
        if mixed and single and single["throughput"]:
            ratio = mixed["throughput"] / single["throughput"]
            lines.append(f"mixed T = 64 against single-task T = 1, concurrency {c}: **{ratio:.2f}x** (goal >= 0.9: "
                         f"{'met' if ratio >= 0.9 else 'missed'})")
    for c in out["concurrency"]:
        bank8, separate = by.get(("ours-T8", c)), by.get(("per-task-8", c))
        if bank8 and separate and separate["throughput"]:
            lines.append(f"T = 8, concurrency {c}: one bank {bank8['throughput']:.0f} vs one process per task "
                         f"{separate['throughput']:.0f} sentences/s ({bank8['throughput'] / separate['throughput']:.2f}x)")
    memory = out["memory"]
    counts = sorted(int(name[len("ours-T"):]) for name in memory if name.startswith("ours-T"))
    if len(counts) >= 2:
        low, high = counts[0], counts[-1]
        for moment in ("start", "end"):
            extra = (memory[f"ours-T{high}"][moment] - memory[f"ours-T{low}"][moment]) * 1024 / (high - low)
            lines.append(f"memory per extra set ({moment}, T = {low} -> {high}): **{extra:.0f} KiB** (goal <= 1 MB: "
                         f"{'met' if extra <= 1000 else 'missed'})")
    if "per-task-8" in memory and "ours-T8" in memory:
        lines.append(f"memory for 8 tasks: one bank {memory['ours-T8']['end']:.0f} MiB, one process per task "
                     f"{memory['per-task-8']['end']:.0f} MiB")
    if any(r["server"] == "ours-T1000" and r["summary"]["requests"] for r in out["results"]):
        lines.append("1,000 sets served from one process: yes (the ours-T1000 rows)")
    return lines


# ------------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    from common import default_data_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(), help="folder with train/wiki_sentences.txt")
    parser.add_argument("--work", type=Path, default=Path("/tmp/st-prompts-serving-bench"),
                        help="where the banks and logs go (reused)")
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 8, 64, 1000], help="T values")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-task", type=int, default=8, help="processes of the one-process-per-task row (0: none)")
    parser.add_argument("--infinity-venv", type=Path, default=Path("/work/infinity-venv"))
    parser.add_argument("--max-wait-ms", type=float, default=None, help="passed to st-prompts serve")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of st-prompts serve and (OMP_NUM_THREADS) of Infinity (default: torch's)")
    parser.add_argument("--only", nargs="+", help="run only these servers (e.g. ours-plain infinity)")
    parser.add_argument("--quick", action="store_true", help="smoke run: T = 1, 8; concurrency 1, 16; 1 round of 4 s")
    parser.add_argument("--no-report", action="store_true", help="print the table, leave the results files alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.concurrency, args.rounds, args.duration, args.warmup = [1, 8], [1, 16], 1, 4.0, 1.0
    started = time.time()
    load_before = load_average()
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    sentences = read_sentences(args.data_dir)
    folders = prepare(args.work, args.tasks, args.per_task)

    from st_prompts.utils import packaged_minilm_path

    minilm = packaged_minilm_path()
    serve = [sys.executable, "-m", "st_prompts.cli", "serve"]
    extra = ["--max-wait-ms", str(args.max_wait_ms)] if args.max_wait_ms is not None else []
    extra += ["--threads", str(args.threads)] if args.threads is not None else []
    port = [18300]

    def next_port() -> int:
        port[0] += 1
        return port[0]

    plans: dict[str, tuple] = {}
    p = next_port()
    plans["ours-plain"] = ([serve + ["minilm", "--model-name", "minilm", "--port", str(p)] + extra], [p],
                           {"minilm": ("127.0.0.1", p, "/v1/embeddings")}, {})
    for count in args.tasks:
        p = next_port()
        plans[f"ours-T{count}"] = ([serve + [str(folders[f"bank-{count}"]), "--port", str(p)] + extra], [p],
                                   {f"t{i}": ("127.0.0.1", p, "/v1/embeddings") for i in range(count)}, {})
    if args.per_task:
        commands, ports, targets = [], [], {}
        for i in range(args.per_task):
            p = next_port()
            commands.append(serve + [str(folders[f"task-t{i}"]), "--model-name", f"t{i}", "--port", str(p)] + extra
                            + ([] if args.threads is not None else ["--threads", "1"]))
            ports.append(p)
            targets[f"t{i}"] = ("127.0.0.1", p, "/v1/embeddings")
        plans[f"per-task-{args.per_task}"] = (commands, ports, targets, {})
    infinity_error = None
    infinity = args.infinity_venv / "bin" / "infinity_emb"
    if infinity.exists():
        p = next_port()
        plans["infinity"] = ([[str(infinity), "v2", "--model-id", minilm, "--served-model-name", "minilm",
                               "--port", str(p), "--host", "127.0.0.1", "--engine", "torch", "--device", "cpu",
                               "--no-trust-remote-code"]],
                             [p], {"minilm": ("127.0.0.1", p, "/embeddings")},
                             {"HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1",
                              **({"OMP_NUM_THREADS": str(args.threads)} if args.threads is not None else {})})
    else:
        infinity_error = f"no {infinity} (install infinity-emb into --infinity-venv)"
    if args.only:
        plans = {name: plan for name, plan in plans.items() if name in args.only}

    servers: dict[str, Server] = {}
    try:
        for name, (commands, ports, targets, env) in plans.items():  # one configuration at a time: a fair start
            print(f"starting {name} ({len(commands)} process{'es' * (len(commands) > 1)})", flush=True)
            server = Server(name, commands, ports, targets, {"HF_HUB_OFFLINE": "1", **env}, logs)
            try:
                server.wait_ready()
            except RuntimeError as exc:
                if name != "infinity":
                    raise
                infinity_error = f"{exc}: " + tail(logs / "infinity-0.log")
                server.stop()
                print(f"infinity failed: {infinity_error}", flush=True)
                continue
            server.rss_start = server.rss_mib()
            server.pause()
            servers[name] = server
        results = {(name, c): [] for name in servers for c in args.concurrency}
        names = list(servers)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for concurrency in args.concurrency:
                for name in order:
                    server = servers[name]
                    server.resume()
                    run = asyncio.run(closed_loop(server.targets, sentences, concurrency, args.warmup, args.duration,
                                                  seed=round_index * 100 + concurrency))
                    server.pause()
                    results[(name, concurrency)].append(run)
                    rate = run["sentences"] / run["seconds"]
                    print(f"round {round_index + 1} c={concurrency:>3} {name:>12}: {rate:7.1f} sentences/s "
                          f"p99 {1000 * (percentile(run['latencies'], 0.99) or 0):6.0f} ms "
                          f"failures {run['failures'] or '-'} (load {load_average()})", flush=True)
        memory = {name: {"processes": len(s.processes), "start": s.rss_start, "end": s.rss_mib()}
                  for name, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    out = {
        "command": "python benchmarks/serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "load_before": load_before, "load_after": load_average(),
        "load_note": "other engineers' training and benchmark runs share the machine",
        "rounds": args.rounds, "duration": args.duration, "warmup": args.warmup, "concurrency": args.concurrency,
        "sentences_source": "the Wikipedia sentences (wiki_sentences.txt)",
        "wall_minutes": (time.time() - started) / 60, "infinity_error": infinity_error,
        "versions": versions(args.infinity_venv),
        "results": [{"server": name, "tasks": _tasks_of(name), "concurrency": c,
                     "summary": summarise(runs), "runs": [{k: v for k, v in r.items() if k != "latencies"}
                                                          for r in runs]}
                    for (name, c), runs in sorted(results.items(), key=lambda kv: (kv[0][1], _order(kv[0][0])))],
        "memory": memory,
    }
    out["goals"] = goals(out)
    print("\n".join(out["goals"]))
    if not args.no_report:
        write_report(out)
        print(f"wrote {RESULTS / 'serving.md'}")


def _tasks_of(name: str) -> int:
    if name.startswith("ours-T"):
        return int(name[len("ours-T"):])
    if name.startswith("per-task-"):
        return int(name[len("per-task-"):])
    return 1


def _order(name: str) -> tuple:
    ranks = {"infinity": 0, "ours-plain": 1}
    return (ranks.get(name, 2 if name.startswith("ours-T") else 3), _tasks_of(name))


def tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def machine() -> str:
    import torch
    from common import cpu_model

    cpu = cpu_model()
    return (f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {_memory_gib():.0f} GiB, Python "
            f"{platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads)")


def _memory_gib() -> float:
    with open("/proc/meminfo") as handle:
        return int(next(line.split()[1] for line in handle if line.startswith("MemTotal"))) / 1024 / 1024


def versions(infinity_venv: Path) -> dict:
    from importlib.metadata import version

    out = {name: version(name) for name in ("sentence-transformers", "transformers", "torch", "starlette", "uvicorn")}
    python = infinity_venv / "bin" / "python"
    if python.exists():
        code = ("from importlib.metadata import version as v; "
                "print(v('infinity-emb'), v('sentence-transformers'), v('torch'), v('numpy'))")
        probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
        out["infinity"] = probe.stdout.strip() or probe.stderr.strip().splitlines()[-1:]
    return out


if __name__ == "__main__":
    main()
