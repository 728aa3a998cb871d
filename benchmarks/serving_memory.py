"""What each process of `st-prompts serve --workers 2` holds, against one process (issue 60, item 15; run by hand).

    python benchmarks/serving_memory.py          # about 3 minutes on a 2-core machine

The server of ``benchmarks/serving_attack.py`` (a MiniLM bank of 3 prompt sets, fp32, every option at its default)
is started with ``--workers 2`` and as one process. Each gets 20 requests per set (1-16 Wikipedia sentences each, one
at a time), then ``/proc/PID/smaps_rollup`` of every process is read (``after 20 requests each``); then 64 closed-loop
clients for ``--load-seconds`` and the same reading (``after load``), then again after ``--idle-seconds`` idle (the
servers give freed heap back after a second idle). **Private** is ``Private_Clean + Private_Dirty``: the pages only
that process maps, what one more worker adds; ``Private_Dirty`` alone is what docs/serving.md gave before (31 MB);
``Pss`` shares each shared page among the processes that map it (their sum is what the server holds in all).
Results: ``benchmarks/results/serving_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


def rollup(pid: int) -> dict[str, float]:
    """The fields of ``/proc/PID/smaps_rollup`` (MiB), and ``Private`` (clean + dirty)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) / 1024
    out["Private"] = out["Private_Clean"] + out["Private_Dirty"]
    return out


def processes(pid: int) -> dict[str, dict[str, float]]:
    """The server's processes (the parent, then its workers by pid) and what each holds."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
    out = {"parent" if children else "server": rollup(pid)}
    for index, child in enumerate(sorted(int(c) for c in children)):
        out[f"worker {index}"] = rollup(child)
    return out


def requests_per_set(port: int, pool: list, per_set: int) -> None:
    sent = dict.fromkeys({task for task, _ in pool}, 0)
    for task, texts in pool:
        if sent[task] >= per_set:
            continue
        body = json.dumps({"model": task, "input": texts}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert answer.status == 200
        sent[task] += 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-set", type=int, default=20)
    parser.add_argument("--load-seconds", type=float, default=15.0)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/st-prompts-serving-attack"))
    parser.add_argument("--out-name", default="serving_memory")
    args = parser.parse_args(argv)
    from serving import closed_loop, make_pool, read_sentences
    from serving_attack import TASKS, Requests, Server, busiest_processes, environment, make_bank

    args.work.mkdir(parents=True, exist_ok=True)
    bank = make_bank(args.work)
    sentences, _ = read_sentences(None)
    pool = make_pool(sentences, list(TASKS), 256)
    out = {"command": "python benchmarks/serving_memory.py " + " ".join(sys.argv[1:]),
           "environment": environment(None), "busiest_start": busiest_processes(), "per_set": args.per_set,
           "load_seconds": args.load_seconds, "idle_seconds": args.idle_seconds, "servers": {}}
    for workers in (2, 1):
        label = "--workers 2" if workers == 2 else "one process"
        server = Server(bank, workers, None, args.work / f"memory-{workers}.log")
        try:
            server.wait_ready()
            requests_per_set(server.port, pool, args.per_set)
            time.sleep(2)
            readings = {"after 20 requests each": processes(server.process.pid)}
            asyncio.run(closed_loop(Requests(server.port, pool), pool, 64, 0.0, args.load_seconds, 7))
            readings["after load"] = processes(server.process.pid)
            time.sleep(args.idle_seconds)
            readings["idle after load"] = processes(server.process.pid)
            out["servers"][label] = readings
            print(label, json.dumps({k: {p: round(v["Private"], 1) for p, v in r.items()}
                                     for k, r in readings.items()}), flush=True)
        finally:
            server.stop()
    out["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    write_report(out, args.out_name)


def write_report(out: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    env = out["environment"]
    lines = ["# What each process of `st-prompts serve --workers 2` holds", "",
             "Generated by `benchmarks/serving_memory.py` (its docstring says what is read); do not edit by hand.", "",
             f"* Command: `{out['command']}`", f"* Code: {env['code']}",
             f"* Machine: {env['cpu']}, {env['cores']} cores, {env['memory_gib']} GiB, {env['platform']}",
             "* Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
             f"* Load: `{env['uptime']}` at the start, `{out['uptime_end']}` at the end", "",
             "MiB, from `/proc/PID/smaps_rollup`; Private = Private_Clean + Private_Dirty.", "",
             "| server | when | process | Rss | Pss | Shared | Private | of which dirty |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for label, readings in out["servers"].items():
        for when, procs in readings.items():
            for process, m in procs.items():
                lines.append(f"| {label} | {when} | {process} | {m['Rss']:.0f} | {m['Pss']:.0f} | "
                             f"{m['Shared_Clean'] + m['Shared_Dirty']:.0f} | {m['Private']:.1f} | "
                             f"{m['Private_Dirty']:.1f} |")
            total = sum(m["Pss"] for m in procs.values())
            lines.append(f"| {label} | {when} | all (Pss summed) | | {total:.0f} | | | |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
