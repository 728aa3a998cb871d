"""One reproducible benchmark of every method against the alternatives users have, under one protocol and one budget.

Run by hand (not part of the test suite)::

    python benchmarks/run_all --data-dir ../shared/data                  # everything (hours on two CPU cores)
    python benchmarks/run_all --data-dir ../shared/data --only dcpcse-unsup 'lora-*'   # part of it
    python benchmarks/run_all --data-dir ../shared/data --quick          # smoke run of every main row (minutes)
    python benchmarks/run_all --data-dir ../shared/data --report-only    # rebuild the tables and plots
    python benchmarks/run_all --list                                     # the rows and what they run

**Protocol.** The packaged all-MiniLM-L6-v2 ([CLS] pooling, max length 32, τ = 0.05, SimCSE's MLP over [CLS] in
training only) trained with ``st_prompts.training.train`` on the shared data, one budget for every row: batch 64 and
as many optimizer steps as one epoch of the full training set of the setting (unsupervised: the Wikipedia sentences;
supervised: the NLI triplets). STS-B dev is evaluated every 50 steps and the best weights are kept (model selection
on STS-B dev only). Each row runs with three seeds (42, 43, 44); the tables give mean ± std.

Rows (``--list`` prints them): the untrained backbone ([CLS] and mean pooling); SimCSE full fine-tuning; LoRA r = 8 on
query/value through sentence-transformers' own ``model.add_adapter`` (73,728 parameters, the size of a 16-position
prefix); PEFT's prefix tuning through the unsupported ``model[0].model = get_peft_model(...)`` route; DCPCSE and
SCPCSE; D2CSE; DiffAug (on MiniLM [CLS] without the template, see its ablation rows); SKICSE with the full and the
prompted encoder. Each row is unsupervised (DiffAug: semi-supervised) and supervised where the method has that
setting. Ablation rows (issues 7-10: the saved MLP, the
[CLS] prompt, DiffAug's auxiliary loss / same prefix / no stage 1 / the paper's template [MASK] pooling, SKICSE with
λ = 0) and the learning-rate selection of the two PEFT baselines run with ``--ablations`` (or ``--only``).

Data exceptions, both stated in the tables: SKICSE rows train on the rows that have SmolLM2 SKI (the 2,028 Wikipedia
sentences / 2,000 NLI premises shipped in ``st_prompts/resources/ski``) for the same number of steps (several epochs
of that subset); their λ = 0 ablations are SimCSE / DCPCSE on exactly that data. DiffAug's stage 1 (prefix tuning
on NLI pairs) comes on top of the budget, as in the paper.

Metrics per run: STS-B dev Spearman (the selected checkpoint), SICK-R trial Spearman (a second set that selection
never sees), recall@1/3/5 on the STS-B dev score-5 pairs, alignment/uniformity on STS-B dev, trainable parameters
(count and share of the model), training and wall time, and the machine's load average.

**Caching.** Every run writes ``benchmarks/results/run_all/runs/<row>/seed<seed>.json`` holding a key computed from
its settings (the resolved method settings, the adapter, the seed, the budget and a fingerprint of the data files).
A run whose file holds the same key is not run again, so an interrupted benchmark resumes where it stopped and
``--only`` reruns part of it; ``--force`` reruns regardless. Runs are separate processes (``--jobs N`` runs N at a
time, each with ``cpus // N`` torch threads); their logs go to ``outputs/run_all/logs/``.

**Outputs.** ``benchmarks/results/run_all/summary.json`` and ``run_all.md`` (the tables), ``quality_vs_params.png``
and ``align_uniform.png``, and ``benchmarks/results/README.md``, which holds the generated tables (never edit numbers
there by hand). Efficiency (step time, memory, throughput, checkpoint sizes) is
measured by ``benchmarks/efficiency.py`` over the same rows and merged into the report when its results exist.
``--quick`` writes to ``outputs/run_all-quick/`` and never touches the committed results or the README.

Layout: ``rows.py`` (the rows, budget, settings and cache keys), ``runner.py`` (one run in a child process, and the
orchestration of many), ``report.py`` (tables and plots), ``__main__.py`` (the command line).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rows, runner, report
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # st_prompts of this checkout

from report import report  # noqa: E402
from rows import QUICK_DIR, RESULTS_DIR, ROWS, SEEDS  # noqa: E402
from runner import child_main, copy_duplicates, lora_route_problem, plan, run_plan, select_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from common import default_data_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(),
                        help="shared data (train/ and senteval/); default ../shared/data")
    parser.add_argument("--only", nargs="+", metavar="ROW", help="rows to run (names or shell patterns, e.g. 'lora-*')")
    parser.add_argument("--ablations", action="store_true", help="also run the ablation and selection rows")
    parser.add_argument("--seeds", nargs="+", type=int, help=f"seeds of the trained rows (default {SEEDS})")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: every main row, one seed, 2 steps of 16, evaluation on 300 STS-B dev pairs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cpus // jobs torch threads)")
    parser.add_argument("--threads", type=int, help="torch threads per run")
    parser.add_argument("--force", action="store_true", help="rerun cached runs")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the tables and plots")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--_run", help=argparse.SUPPRESS)
    parser.add_argument("--_seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_key", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.list:
        for row in ROWS.values():
            extra = ", ".join(f"{k}={v}" for k, v in row.overrides)
            print(f"{row.name:32s} {row.setting:16s} {'ablation ' if row.ablation else ''}{row.method or '-'}"
                  f"{' + ' + row.adapter if row.adapter else ''}{' (' + extra + ')' if extra else ''}")
        return 0
    if args.data_dir is None or not (Path(args.data_dir) / "train").is_dir():
        parser.error("pass --data-dir DIR with DIR/train (wiki_sentences.txt, nli_triplets.csv) and DIR/senteval")
    args.data_dir = Path(args.data_dir).resolve()
    if args._run:
        return child_main(args)
    args.results_dir = QUICK_DIR if args.quick else RESULTS_DIR
    rows = select_rows(args.only, args.ablations, args.quick)
    if not args.report_only:
        problem = lora_route_problem() if any(row.adapter for row in rows) else None
        if problem:
            parser.error(problem)
        args.duplicates = []
        todo = plan(rows, args)
        print(f"{len(todo)} run(s) to do ({len(rows)} row(s) selected; cached runs are skipped); results in "
              f"{args.results_dir}", flush=True)
        started = time.perf_counter()
        failures = run_plan(todo, args)
        copy_duplicates(args)
        print(f"runs finished in {time.perf_counter() - started:.0f}s", flush=True)
        if failures:
            report(rows, args)
            print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
            return 1
    report(rows, args)
    print(f"report: {args.results_dir / 'run_all.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
