"""What per-row exactness costs int8 inference: fp32 against three int8 designs, for the packaged MiniLM and for a
MiniLM bank whose batches mix tasks::

    python benchmarks/int8_exactness.py --data-dir ../shared/data   # -> benchmarks/results/int8_exactness.{json,md}

The int8 designs (st_prompts.quantization): attention computed row by row (st_prompts/prompts/row_exact.py, what an
encoder gets), each pass run as groups of rows of equal length and prefix length (``exact_rows_forward``, what a
causal decoder gets, and what every model got before), and one padded batch (neither: a row moves with its
neighbours). Throughput: the first ``--sentences`` distinct STS-B dev sentences, ``encode(batch_size=32)``, one torch
thread, ``--rounds`` interleaved rounds after a warm-up round, median. Exactness: the largest difference between each
of the first 48 rows encoded in those batches and encoded alone. The bank's three sets (4 and 16 positions, and a gated
one of 8) have random weights: the cost does not depend on what they learned.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, default_data_dir, run_environment  # noqa: E402
from int8 import sentences  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CHECKED_ROWS = 48


def bank_model():
    from st_prompts import bank

    model = bank.create_bank("minilm")
    torch.manual_seed(3)
    with torch.no_grad():
        for name, length, gate in (("short", 4, False), ("long", 16, False), ("gated", 8, True)):
            for parameter in model[0].new_prompt_set(name, prefix_length=length, prefix_gate=gate).parameters():
                parameter.normal_(0, 0.3)
    return model


def designs(build) -> dict:
    from st_prompts.prompts.row_exact import ROW_EXACT_ATTRIBUTE
    from st_prompts.quantization import exact_rows_forward, quantize_model

    def without_row_exact(model):
        for module in model[0].auto_model.modules():
            setattr(module, ROW_EXACT_ATTRIBUTE, False)
        return model

    grouped = without_row_exact(quantize_model(build(), "int8"))
    grouped[0].forward = functools.partial(exact_rows_forward, grouped[0], grouped[0].forward)
    return {"fp32": build(), "int8, attention row by row": quantize_model(build(), "int8"),
            "int8, grouped passes": grouped, "int8, one padded batch (not exact)":
            without_row_exact(quantize_model(build(), "int8"))}


def measure(label: str, models: dict, texts: list[str], tasks, rounds: int) -> list[dict]:
    kwargs = {"task": tasks} if tasks else {}
    rows = []
    exact = {}
    for name, model in models.items():
        batch = model.encode(texts, batch_size=32, convert_to_tensor=True, **kwargs)[:CHECKED_ROWS]
        alone = torch.stack([model.encode([text], convert_to_tensor=True, **({"task": [tasks[i]]} if tasks else {}))[0]
                             for i, text in enumerate(texts[:CHECKED_ROWS])])
        exact[name] = float((batch - alone).abs().max())
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(rounds + 1):
        for name, model in models.items():
            start = time.perf_counter()
            model.encode(texts, batch_size=32, **kwargs)
            if round_:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["fp32"])
    for name in models:
        median = statistics.median(times[name])
        rows.append({"model": label, "engine": name, "sentences_per_s": round(len(texts) / median, 1),
                     "x_fp32": round(base / median, 2), "rounds_s": [round(t, 3) for t in times[name]],
                     "row_alone_vs_batch": exact[name]})
        print(f"{label} | {name}: {rows[-1]['sentences_per_s']}/s x{rows[-1]['x_fp32']} "
              f"exact {exact[name]:.1e}", flush=True)
    return rows


def markdown(record: dict) -> str:
    env = record["environment"]
    lines = ["# The cost of per-row exactness in int8 (benchmarks/int8_exactness.py)", "",
             f"`{record['command']}`; {env['device']}, {env['cpus']} cores; torch threads 1; "
             f"load average {record['load_start']} at "
             f"the start, {record['load_end']} at the end; {record['sentences']} STS-B dev sentences, batch 32, median "
             f"of {record['rounds']} interleaved rounds after a warm-up; libraries: "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".", "",
             "| model | engine | sentences/s | x fp32 | row alone vs in its batch, max abs diff |",
             "|---|---|---:|---:|---:|"]
    for row in record["rows"]:
        lines.append(f"| {row['model']} | {row['engine']} | {row['sentences_per_s']} | {row['x_fp32']:.2f} | "
                     f"{row['row_alone_vs_batch']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--sentences", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    texts = sentences(args.data_dir, args.sentences)
    load_start = [round(x, 2) for x in os.getloadavg()]
    from st_prompts.loading import load_sentence_model

    rows = measure("shipped MiniLM", designs(lambda: load_sentence_model("minilm")), texts, None, args.rounds)
    names = ["short", "long", "gated", None]
    rows += measure("bank of 3 sets, mixed tasks", designs(bank_model), texts,
                    [names[i % len(names)] for i in range(len(texts))], args.rounds)
    record = {"command": "python benchmarks/int8_exactness.py " + " ".join(sys.argv[1:]), "rows": rows,
              "sentences": len(texts), "rounds": args.rounds, "load_start": load_start,
              "load_end": [round(x, 2) for x in os.getloadavg()], "environment": run_environment()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "int8_exactness.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    (RESULTS / "int8_exactness.md").write_text(markdown(record), encoding="utf-8")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
