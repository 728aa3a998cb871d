"""The safe loader's checks and the non-finite check before a save, measured against an earlier checkout.

Each run is a fresh interpreter on one torch thread that imports st_prompts from one checkout (``--before`` or this
repository), loads the packaged MiniLM with ``load_sentence_model`` once as a warm-up and then ``--loads`` times,
timing each load and each ``check_finite_training`` of the loaded model; it encodes one sentence, whose vector must
be the same for both checkouts. Rounds interleave the two checkouts after a warm-up run of each.

    git worktree add /tmp/before 5076944
    python benchmarks/load_checks.py --before /tmp/before --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_environment  # noqa: E402

#: One run: argv[1] the checkout, argv[2] the number of timed loads; prints the medians and the vector's head.
RUN = """
import json, statistics, sys, time, torch
torch.set_num_threads(1)
import st_prompts
from st_prompts.loading import load_sentence_model
from st_prompts.modules.set_checks import check_finite_training
assert st_prompts.__file__.startswith(sys.argv[1]), st_prompts.__file__
model = load_sentence_model("minilm", device="cpu")
check_finite_training(model, 0.5)
loads, checks = [], []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    model = load_sentence_model("minilm", device="cpu")
    loads.append(time.perf_counter() - start)
    start = time.perf_counter()
    check_finite_training(model, 0.5)
    checks.append(time.perf_counter() - start)
vector = model.encode(["A man is playing a guitar."])[0]
print(json.dumps({"load": statistics.median(loads), "check": statistics.median(checks), "head": vector[:8].tolist()}))
"""


def run_once(checkout: Path, loads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run([sys.executable, "-c", RUN, str(checkout), str(loads)], capture_output=True, text=True,
                          env=env, cwd="/", check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the earlier st_prompts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=7, help="timed loads a run (default 7)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    checkouts = {"before": args.before.resolve(), "after": REPO}
    rows = []
    for round_ in range(-1, args.rounds):  # round -1: the warm-up of each
        for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
            load = os.getloadavg()[0]
            rows.append({"round": round_, "code": name, **run_once(checkouts[name], args.loads),
                         "load_average": round(load, 2)})
            print(rows[-1], flush=True)
    timed = [r for r in rows if r["round"] >= 0]
    medians = {name: {key: statistics.median(r[key] for r in timed if r["code"] == name) for key in ("load", "check")}
               for name in checkouts}
    record = {"command": "python benchmarks/load_checks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "runs": rows, "medians_s": medians,
              "same_vectors": all(r["head"] == rows[0]["head"] for r in rows), "environment": run_environment()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "load_checks.json").write_text(json.dumps(record, indent=1) + "\n")
    env = record["environment"]
    lines = ["# A MiniLM load through the safe loader, and the non-finite check before a save", "",
             f"Command: `{record['command']}`. {env['device']}, {env['cpus']} CPUs ({env['cpu_instructions']}); "
             "versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ".", "",
             f"Each run a fresh interpreter on one torch thread: the median of {args.loads} loads of the packaged "
             f"MiniLM and of {args.loads} `check_finite_training` calls; {args.rounds} interleaved rounds after a "
             f"warm-up of each checkout. The same vector from both: {record['same_vectors']}.", "",
             "| checkout | median load (s) | median check (s) |", "|---|---|---|"]
    lines += [f"| {name} | {medians[name]['load']:.3f} | {medians[name]['check']:.4f} |" for name in checkouts]
    lines += ["", "| round | checkout | load (s) | check (s) | load average (1 min) |", "|---|---|---|---|---|"]
    lines += [f"| {r['round'] if r['round'] >= 0 else 'warm-up'} | {r['code']} | {r['load']:.3f} | {r['check']:.4f} | "
              f"{r['load_average']} |" for r in rows]
    (args.out_dir / "load_checks.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
