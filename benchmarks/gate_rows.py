"""The prefix gate on the paper methods: run_all's main rows of DCPCSE, D2CSE, SKICSE's prompted encoder and DiffAug
against their ``-gate`` rows, three seeds each, from run files made on one device (run by hand).

The run files come from ``python benchmarks/run_all --data-dir ../shared/data --seeds 42 43 44 --only ROW --force``
for ROW in ``dcpcse-unsup dcpcse-unsup-gate dcpcse-sup dcpcse-sup-gate`` (four runners at once), copied from
``benchmarks/results/run_all/runs/ROW/`` into one folder per device, so that they do not replace the CPU runs of the
main table. Writes ``gate.md`` and ``gate.json`` beside them.

    python benchmarks/gate_rows.py benchmarks/results/run_all/h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import fmean, stdev

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAIRS = (("dcpcse-unsup", "dcpcse-unsup-gate"), ("dcpcse-sup", "dcpcse-sup-gate"),
         ("d2cse-unsup", "d2cse-unsup-gate"), ("d2cse-sup", "d2cse-sup-gate"),
         ("skicse-prompted-unsup", "skicse-prompted-unsup-gate"), ("skicse-prompted-sup", "skicse-prompted-sup-gate"),
         ("diffaug-semi", "diffaug-semi-gate"), ("diffaug-sup", "diffaug-sup-gate"))
METRICS = (("stsb_dev", "STS-B dev"), ("sick_trial", "SICK-R trial"))


def load(folder: Path, row: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / row).glob("seed*.json"))]


def summary(records: list[dict]) -> dict:
    out = {"seeds": [r["seed"] for r in records], "best_steps": [r["best_step"] for r in records]}
    for key, _ in METRICS:
        values = [100 * r["metrics"][key] for r in records]
        out[key] = {"values": values, "mean": fmean(values), "std": stdev(values) if len(values) > 1 else 0.0}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    from st_prompts.storage import write_file_atomic, write_json_atomic

    result, machines = {}, set()
    for pair in PAIRS:
        for row in pair:
            records = load(args.folder, row)
            if records:
                result[row] = summary(records)
                machines |= {f"{r.get('gpu') or 'CPU'} ({r['machine'].split(',')[1].strip()}), torch {r['torch']}"
                             for r in records}
    lines = ["# The prefix gate on the prompt methods (issues 39 and 51)", "",
             (f"Machine: {'; '.join(sorted(machines))}. Each row at run_all's CPU preset and rates (the ungated "
              "prefix, the official one, against the zero-initialised gate); "
              "STS-B dev selects the checkpoint, SICK-R trial is never selected on. Spearman × 100, mean ± std over "
              "the seeds (each seed's value in brackets); Δ = gate − no gate."), "",
             "| row | seeds | best steps | STS-B dev | SICK-R trial |", "|---|---|---|---:|---:|"]
    for plain, gated in PAIRS:
        for row in (plain, gated):
            if row not in result:
                continue
            s = result[row]
            cells = [f"{s[k]['mean']:.2f} ± {s[k]['std']:.2f} ({', '.join(f'{v:.2f}' for v in s[k]['values'])})"
                     for k, _ in METRICS]
            lines.append(f"| {row} | {', '.join(map(str, s['seeds']))} | {', '.join(map(str, s['best_steps']))} | "
                         + " | ".join(cells) + " |")
        if plain in result and gated in result:
            deltas = [f"{result[gated][k]['mean'] - result[plain][k]['mean']:+.2f}" for k, _ in METRICS]
            lines.append(f"| Δ ({gated}) | | | " + " | ".join(deltas) + " |")
    text = "\n".join(lines) + "\n"
    write_file_atomic(args.folder / "gate.md", text)
    write_json_atomic(args.folder / "gate.json", result)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
