"""How torch's OpenMP threads wait, measured: ``OMP_WAIT_POLICY`` unset (libgomp spins a while between parallel
regions) against ``PASSIVE`` (they sleep), which ``st-prompts`` sets unless the user did (``st_prompts/cli.py``).

Each run is a fresh interpreter (libgomp reads the variable when torch loads it) that encodes ``--rows`` Wikipedia
sentences with the packaged MiniLM on two torch threads, on a quiet machine and beside one busy core (a Python loop
standing in for another process: a test worker, a build beside a server). Rounds interleave the two policies after a
warm-up of each; every run's vectors are compared with the first run's.

    python benchmarks/omp_wait.py --data-dir ../shared/data --rounds 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, default_data_dir, run_environment  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
POLICIES = ("default", "PASSIVE")

#: One run: load MiniLM, encode, print wall and CPU seconds of the encode, save the vectors.
RUN = """
import json, sys, time, numpy, torch
from st_prompts.loading import load_sentence_model
texts = json.loads(open(sys.argv[1]).read())
model = load_sentence_model("minilm", device="cpu")
torch.set_num_threads(2)
start, cpu = time.perf_counter(), time.process_time()
vectors = model.encode(texts, batch_size=32)
print(json.dumps({"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}))
numpy.save(sys.argv[2], vectors)
"""


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run_once(policy: str, texts_file: Path, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["HF_HUB_OFFLINE"] = "1"
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", RUN, str(texts_file), str(out)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import numpy as np

    if args.data_dir is None:
        parser.error("--data-dir is required (the shared data layout)")
    lines = (args.data_dir / "train" / "wiki_sentences.txt").read_text(encoding="utf-8").splitlines()
    texts = [line.strip() for line in lines if line.strip()][:args.rows]
    work = Path(tempfile.mkdtemp(prefix="omp-wait-"))
    texts_file = work / "texts.json"
    texts_file.write_text(json.dumps(texts))
    reference = None
    rows = []
    for condition in ("quiet", "one busy core"):
        for round_ in range(-1, args.rounds):  # round -1: the warm-up of each policy
            order = POLICIES if round_ % 2 == 0 else POLICIES[::-1]
            for policy in order:
                hog = None
                if condition != "quiet":
                    hog = multiprocessing.get_context("fork").Process(target=_busy, args=(600,), daemon=True)
                    hog.start()
                    time.sleep(0.5)
                try:
                    load = os.getloadavg()[0]
                    result = run_once(policy, texts_file, work / "vectors.npy")
                finally:
                    if hog is not None:
                        hog.terminate()
                        hog.join()
                vectors = np.load(work / "vectors.npy")
                reference = vectors if reference is None else reference
                diff = float(np.abs(vectors - reference).max())
                rows.append({"condition": condition, "round": round_, "policy": policy,
                             "wall": round(result["wall"], 2), "cpu": round(result["cpu"], 2), "max_abs_diff": diff,
                             "load": round(load, 2)})
                print(rows[-1], flush=True)
    summary = {}
    for condition in ("quiet", "one busy core"):
        for policy in POLICIES:
            measured = [r for r in rows if r["condition"] == condition and r["policy"] == policy and r["round"] >= 0]
            summary[f"{condition} / {policy}"] = {"wall": statistics.median(r["wall"] for r in measured),
                                                  "cpu": statistics.median(r["cpu"] for r in measured)}
    ratios = {}
    for condition in ("quiet", "one busy core"):
        per_round = []
        for round_ in range(args.rounds):
            pick = {r["policy"]: r for r in rows if r["condition"] == condition and r["round"] == round_}
            per_round.append(pick["PASSIVE"]["wall"] / pick["default"]["wall"])
        ratios[condition] = {"median_wall_ratio_passive_over_default": round(statistics.median(per_round), 3),
                             "per_round": [round(x, 3) for x in per_round]}
    record = {"command": "python benchmarks/omp_wait.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows_encoded": len(texts), "rounds": args.rounds, "runs": rows, "medians": summary, "ratios": ratios,
              "checks_passed": all(r["max_abs_diff"] < 1e-5 for r in rows), "environment": run_environment()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "omp_wait.json").write_text(json.dumps(record, indent=1) + "\n")
    env = record["environment"]
    lines = ["# OpenMP threads that wait: spinning (default) against sleeping (`OMP_WAIT_POLICY=PASSIVE`)", "",
             f"Command: `{record['command']}`. {env['device']}, {env['cpus']} CPUs ({env['cpu_instructions']}); "
             f"versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ".", "",
             f"Each run: a fresh interpreter, the packaged MiniLM (fp32) encoding {len(texts)} Wikipedia sentences on "
             "two torch threads (batch 32); encode time only. \"one busy core\": a Python loop spinning in another "
             f"process for the whole run. {args.rounds} interleaved rounds after a warm-up of each policy; vectors "
             f"equal across runs: {record['checks_passed']} (largest difference "
             f"{max(r['max_abs_diff'] for r in rows):.1e}).", "",
             "| condition | policy | median wall (s) | median CPU (s) | PASSIVE / default wall, per round |",
             "|---|---|---|---|---|"]
    for condition in ("quiet", "one busy core"):
        for policy in POLICIES:
            cell = summary[f"{condition} / {policy}"]
            ratio = (f"{ratios[condition]['median_wall_ratio_passive_over_default']} "
                     f"({', '.join(map(str, ratios[condition]['per_round']))})" if policy == "PASSIVE" else "")
            lines.append(f"| {condition} | {policy} | {cell['wall']} | {cell['cpu']} | {ratio} |")
    lines += ["", "| condition | round | policy | wall (s) | CPU (s) | load (1 min) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['condition']} | {r['round'] if r['round'] >= 0 else 'warm-up'} | {r['policy']} | {r['wall']} | "
              f"{r['cpu']} | {r['load']} |" for r in rows]
    (args.out_dir / "omp_wait.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:14]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
