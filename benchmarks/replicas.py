"""Replicas on one machine: how long a replica takes to be ready, and the rate of 1 replica, 2 replicas and one server
with ``--workers 2`` (issue 63, part 4; run by hand).

    python benchmarks/replicas.py --data-dir ../shared/data        # about 5-10 minutes on a 2-core machine

**Server**: ``st-prompts serve`` of a MiniLM bank of 3 prompt sets (16 positions each, the official initialisation),
fp32, every option at its default but the torch threads. **Contenders**: ``1 replica`` (one process, ``--threads 2``),
``2 replicas`` (two independent processes, ``--threads 1`` each, each client bound to one of them, as a load balancer
with keep-alive connections binds it) and ``--workers 2`` (one server forking two workers after the load,
``--threads 1`` each), on the same cores.

**Start**: seconds from starting the process(es) until every one's ``GET /health`` answers 200 (probed every 50 ms,
as a readiness probe would); ``2 replicas`` start at once. **Rate**: ``--concurrency`` closed-loop clients
(``http.client`` keep-alive connections, threads of this process, on the same cores), ``--requests`` requests per
round (1-16 Wikipedia sentences each, a random set each), after ``--warmup`` requests; rounds interleave the
contenders (their order rotates each round) and the contenders not measured are paused (SIGSTOP). Every vector of
every answer is compared with the bank's in-process ``encode`` (max abs difference below 1e-4). Results:
``benchmarks/results/replicas.json`` and ``.md``; the load average is recorded at every round (the machine may be
shared).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

from common import default_data_dir, run_environment  # noqa: E402

TASKS = ("sts", "nli", "para")


def make_bank(work: Path) -> Path:
    """A MiniLM bank of 3 prompt sets (16 positions, the official initialisation, seed 0)."""
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


def read_sentences(data_dir: Path | None, count: int = 2000) -> list[str]:
    path = data_dir / "train" / "wiki_sentences.txt" if data_dir is not None else None
    if path is None or not path.is_file():  # the sample bundled with the package (the demo's)
        path = REPO / "st_prompts" / "resources" / "demo" / "wiki_sentences.txt"
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if len(line.split()) >= 3][:count]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ready(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


class Contender:
    """One or more server processes started at once; ``start_seconds``: until every ``/health`` answered 200."""

    def __init__(self, name: str, bank: Path, processes: int, extra: list[str], log_dir: Path) -> None:
        self.name = name
        self.ports = [free_port() for _ in range(processes)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.monotonic()
        self.processes = [subprocess.Popen([sys.executable, "-m", "st_prompts.cli", "serve", str(bank), "--port",
                                            str(port), *extra], stdout=subprocess.DEVNULL,
                                           stderr=open(log_dir / f"{name.replace(' ', '-')}-{i}.log", "w"), env=env)
                          for i, port in enumerate(self.ports)]
        waiting = set(self.ports)
        try:
            while waiting:
                if any(p.poll() is not None for p in self.processes):
                    raise SystemExit(f"{name}: a server exited (see {log_dir})")
                waiting = {port for port in waiting if not ready(port)}
                time.sleep(0.05)
        except BaseException:  # Ctrl-C or a failed start: no server is left behind
            self.stop()
            raise
        self.start_seconds = time.monotonic() - start

    def pids(self) -> list[int]:
        """Every process, forked workers included."""
        out = []
        for process in self.processes:
            out.append(process.pid)
            children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True,
                                      check=False).stdout.split()
            out += [int(c) for c in children]
        return out

    def signal(self, sig: int) -> None:
        for pid in self.pids():
            os.kill(pid, sig)

    def stop(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            process.wait(60)


def run_round(contender: Contender, pool: list, references: list, concurrency: int, requests: int,
              warmup: int, seed: int) -> dict:
    """``warmup`` then ``requests`` requests from ``concurrency`` closed-loop clients; every answer checked."""
    rng = random.Random(seed)
    order = [rng.randrange(len(pool)) for _ in range(warmup + requests)]
    next_item = iter(range(len(order)))
    rows = [0]
    worst = [0.0]
    window = {}

    def client(index: int) -> None:
        port = contender.ports[index % len(contender.ports)]
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for item in next_item:  # shared iterator: each request taken once (the GIL makes next() atomic)
            if item == warmup:
                window["start"] = time.perf_counter()
            task, texts = pool[order[item]]
            connection.request("POST", "/v1/embeddings", json.dumps({"model": task, "input": texts}),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            body = response.read()
            assert response.status == 200, body[:300]
            vectors = np.array([d["embedding"] for d in json.loads(body)["data"]], dtype=np.float32)
            worst[0] = max(worst[0], float(np.abs(vectors - references[order[item]]).max()))
            if item >= warmup:
                rows[0] += len(texts)
        connection.close()

    with ThreadPoolExecutor(concurrency) as threads:
        list(threads.map(client, range(concurrency)))
    seconds = time.perf_counter() - window["start"]
    assert worst[0] < 1e-4, f"{contender.name}: a vector differs from encode by {worst[0]:.2e}"
    return {"rows_per_s": rows[0] / seconds, "seconds": seconds, "rows": rows[0], "max_abs_diff": worst[0],
            "load_average": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--work", type=Path, default=Path("/tmp/st-prompts-replicas-bench"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pool", type=int, default=200)
    parser.add_argument("--out", default="replicas")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    bank = make_bank(args.work)
    rng = random.Random(0)
    sentences = read_sentences(args.data_dir)
    pool = [(rng.choice(TASKS), [rng.choice(sentences) for _ in range(rng.randint(1, 16))]) for _ in range(args.pool)]

    from st_prompts.loading import load_sentence_model

    model = load_sentence_model(str(bank), device="cpu")
    # one encode of each task's distinct sentences (a row's vector does not depend on its batch, within 1e-4)
    vectors = {}
    for task in TASKS:
        distinct = sorted({text for t, texts in pool if t == task for text in texts})
        vectors[task] = dict(zip(distinct, model.encode(distinct, task=task, batch_size=32)))
    references = [np.stack([vectors[task][text] for text in texts]) for task, texts in pool]
    del model
    command = " ".join(["python", "benchmarks/replicas.py", *(argv if argv is not None else sys.argv[1:])])
    specs = [("1 replica", 1, ["--threads", "2"]), ("2 replicas", 2, ["--threads", "1"]),
             ("--workers 2", 1, ["--workers", "2", "--threads", "1"])]
    contenders = []
    rounds: dict[str, list[dict]] = {name: [] for name, _, _ in specs}
    try:
        for name, processes, extra in specs:  # one at a time, each paused once ready
            load = list(os.getloadavg())
            contender = Contender(name, bank, processes, extra, args.work)
            print(f"{name}: ready in {contender.start_seconds:.1f} s (load {load[0]:.2f})", flush=True)
            contender.signal(signal.SIGSTOP)
            contenders.append((contender, load))
        for index in range(args.rounds):
            shift = index % len(contenders)
            for contender, _ in contenders[shift:] + contenders[:shift]:
                contender.signal(signal.SIGCONT)
                time.sleep(0.5)
                result = run_round(contender, pool, references, args.concurrency, args.requests, args.warmup,
                                   seed=index)
                contender.signal(signal.SIGSTOP)
                rounds[contender.name].append(result)
                print(f"round {index} {contender.name}: {result['rows_per_s']:.1f} rows/s "
                      f"(load {result['load_average'][0]:.2f})", flush=True)
    finally:
        for contender, _ in contenders:
            contender.stop()
    base = rounds["1 replica"]
    out = {"command": command, "environment": run_environment(), "concurrency": args.concurrency,
           "requests": args.requests, "warmup": args.warmup, "rounds": args.rounds,
           "start": {c.name: {"seconds": c.start_seconds, "load_average": load} for c, load in contenders},
           "results": {}}
    for name, results in rounds.items():
        ratios = [r["rows_per_s"] / b["rows_per_s"] for r, b in zip(results, base)]
        out["results"][name] = {"rounds": results,
                                "median_rows_per_s": statistics.median(r["rows_per_s"] for r in results),
                                "ratio_to_1_replica_per_round": ratios, "median_ratio": statistics.median(ratios)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    env = out["environment"]
    lines = [f"# Replicas on one machine ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"`{command}`", "",
             f"{env['device']} ({env['cpu_instructions']}), {env['cpus']} CPUs; versions: "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v), "",
             "The machine was shared with other jobs: the load average (1 min) is given beside every number.", "",
             "| contender | ready after (s) | load at start | median rows/s | per round (rows/s, load) | "
             "median ratio to 1 replica |", "|---|---|---|---|---|---|"]
    for contender, load in contenders:
        result = out["results"][contender.name]
        per_round = ", ".join(f"{r['rows_per_s']:.0f} ({r['load_average'][0]:.1f})" for r in result["rounds"])
        lines.append(f"| {contender.name} | {contender.start_seconds:.1f} | {load[0]:.2f} | "
                     f"{result['median_rows_per_s']:.1f} | {per_round} | {result['median_ratio']:.2f} |")
    lines += ["", f"{args.concurrency} clients, {args.requests} requests a round after {args.warmup} of warm-up, "
              f"{args.rounds} interleaved rounds; every vector within 1e-4 of `encode` (worst: "
              f"{max(r['max_abs_diff'] for rs in rounds.values() for r in rs):.1e})."]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
