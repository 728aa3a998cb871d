"""The benchmark's report: tables (markdown and JSON) and plots from the run files."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from rows import (
    BATCH_SIZE,
    D2CSE_LR,
    DCPCSE_LR,
    DIFFAUG_STAGE1_LR,
    KEY_UNUSED_SETTINGS,
    LORA_LR,
    OFFICIAL_MLP_INITIALISATION_SINCE,
    PEFT_PREFIX_LR,
    PEFT_PREFIX_LR_CANDIDATES,
    ROWS,
    SEEDS,
    SKICSE_PROMPTED_LR,
    Row,
    run_key,
)
from runner import load_record, result_path, write_json

from st_prompts.storage import write_file_atomic

METRICS = ("stsb_dev", "sick_trial", "recall@1", "recall@3", "recall@5", "alignment", "uniformity")
PERCENT = {"stsb_dev", "sick_trial", "recall@1", "recall@3", "recall@5"}

#: The papers' BERT-base numbers (seven-task STS test average, STS-B test, SICK-R test; Spearman x 100), quoted from
#: the papers in ../shared/papers and NOT re-measured here; a different backbone, data size and metric than ours.
PAPER_NUMBERS = [
    ("SimCSE", "unsupervised", 76.25, 76.85, 72.23, "DCPCSE Table 1 (from Gao et al.)"),
    ("DCPCSE", "unsupervised", 78.49, 80.62, 70.00, "DCPCSE Table 1"),
    ("SCPCSE", "unsupervised", 73.28, 76.33, 68.73, "DCPCSE Table 1"),
    ("D2CSE", "unsupervised", 79.02, 81.97, 70.61, "D2CSE Table 1"),
    ("SKICSE", "unsupervised", 78.65, 80.69, 73.38, "SKICSE Table 1"),
    ("DiffAug", "semi-supervised", 80.13, 82.42, 73.24, "DiffAug Table 1"),
    ("DiffAug + aux loss", "semi-supervised", 80.61, 82.70, 77.00, "DiffAug Table 1"),
    ("SimCSE", "supervised", 81.57, 84.25, 80.39, "DCPCSE Table 1 (from Gao et al.)"),
    ("DCPCSE", "supervised", 81.65, 84.25, 80.79, "DCPCSE Table 1"),
    ("D2CSE", "supervised", 81.52, 83.93, 79.38, "D2CSE Table 8"),
    ("DiffAug", "supervised", 82.42, 84.32, 80.27, "DiffAug Table 1"),
    ("SKICSE", "supervised", 82.45, 85.08, 80.48, "SKICSE Table 1"),
]


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"seeds": sorted(r["seed"] for r in records)}
    for metric in METRICS:
        by_seed = {r["seed"]: r["metrics"][metric] for r in records if r.get("metrics", {}).get(metric) is not None}
        by_seed = {seed: v for seed, v in by_seed.items() if not math.isnan(v)}
        values = list(by_seed.values())
        if values:
            out[metric] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                           "values": values, "by_seed": {str(k): v for k, v in sorted(by_seed.items())}}
    out["trainable_parameters"] = records[0]["trainable_parameters"]
    out["total_parameters"] = records[0]["total_parameters"]
    out["train_seconds"] = statistics.fmean(r.get("train_seconds", 0.0) for r in records)
    out["cpu_seconds"] = statistics.fmean(r.get("cpu_seconds", 0.0) for r in records)
    out["wall_seconds"] = statistics.fmean(r.get("wall_seconds", 0.0) for r in records)
    out["load_average_max"] = max(max(r["load_average_start"][0], r["load_average_end"][0]) for r in records)
    out["examples"] = records[0].get("examples")
    out["steps"] = records[0].get("steps")
    return out


def _same_training(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two runs trained with the same settings (a field one record lacks or leaves unset is not compared:
    fields were added over time with their then-default value)."""
    x, y = a.get("settings") or {}, b.get("settings") or {}
    unused = {name for fields in KEY_UNUSED_SETTINGS.values() for name in fields}  # not what a run trains with
    return all(x[k] == y[k] for k in x.keys() & y.keys() - unused if x[k] is not None and y[k] is not None)


def protocol_moves(records: list[dict[str, Any]], old: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seed by seed, what re-running under protocol 2 changed (STS-B dev, SICK-R trial, x 100) for the runs whose
    training settings did not change in between (a row whose preset changed is another experiment, not a move)."""
    before = {r["seed"]: r for r in old}
    moves = []
    for r in records:
        o = before.get(r["seed"])
        if o is None or not _same_training(r, o):
            continue
        moves.append({"seed": r["seed"], **{m: 100 * (r["metrics"][m] - o["metrics"][m])
                                           for m in ("stsb_dev", "sick_trial")}})
    return moves


def collect(results: Path, rows: list[Row], data_dir: Path, quick: bool) -> dict[str, Any]:
    """The aggregated results of every row whose runs are done with the current key."""
    summary: dict[str, Any] = {}
    frozen = results / "protocol1_keys.json"
    protocol1 = json.loads(frozen.read_text())["keys"] if frozen.is_file() else {}
    for row in rows:
        seeds = (SEEDS[0],) if quick else row.seeds
        records = [r for r in (load_record(result_path(results, row, seed)) for seed in seeds)
                   if r and r.get("key") == run_key(row, r["seed"], data_dir, quick)]
        # a row with no run of the current protocol yet shows its runs of protocol 1 (evaluation at the training
        # length) that the report counted then, marked, never mixed with runs of the current protocol
        short = not records and not quick
        old = [r for r in (load_record(path) for seed in seeds
                           for path in (result_path(results, row, seed),
                                        results / "earlier" / "before-full-length-evaluation" / row.name
                                        / f"seed{seed}.json"))
               if r and r.get("key") == protocol1.get(f"{row.name}/seed{r['seed']}")]
        if short:
            records = old
        if records:
            earlier = row.method is not None and any(r.get("finished", "") < OFFICIAL_MLP_INITIALISATION_SINCE
                                                     for r in records)
            label = row.label + (" ¹" if earlier else "") + (" ²" if short else "")
            summary[row.name] = {"label": label, "setting": row.setting,
                                 "ablation": row.ablation, "compare": row.compare, "earlier_mlp_init": earlier,
                                 "evaluated_at_training_length": short, **aggregate(records)}
            if old and not short:  # what an ablation of protocol 1 compares with
                summary[row.name]["protocol1"] = aggregate(old)
                summary[row.name]["protocol_moves"] = protocol_moves(records, old)
    return summary


def fmt(entry: dict[str, Any], metric: str) -> str:
    value = entry.get(metric)
    if value is None:
        return "–"
    factor, digits = (100, 2) if metric in PERCENT else (1, 3)
    if metric.startswith("recall"):
        digits = 1
    mean, std = factor * value["mean"], factor * value["std"]
    if len(value["values"]) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def params(entry: dict[str, Any]) -> str:
    n, total = entry["trainable_parameters"], entry["total_parameters"]
    if n == 0:
        return "0"
    text = f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"
    return f"{text} ({100 * n / total:.2f}%)" if n < total else f"{text} (100%)"


def quality_table(summary: dict[str, Any], names: list[str]) -> list[str]:
    lines = ["| row | trainable | seeds | STS-B dev | SICK-R trial | R@1 | R@3 | R@5 | alignment | uniformity | "
             "train wall s | CPU s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        if name not in summary:
            continue
        e = summary[name]
        lines.append(
            f"| `{name}` {e['label']} | {params(e)} | {len(e['seeds'])} | {fmt(e, 'stsb_dev')} | "
            f"{fmt(e, 'sick_trial')} | {fmt(e, 'recall@1')} | {fmt(e, 'recall@3')} | {fmt(e, 'recall@5')} | "
            f"{fmt(e, 'alignment')} | {fmt(e, 'uniformity')} | {e['train_seconds']:.0f} | {e['cpu_seconds']:.0f} |"
        )
    return lines


def ablation_table(summary: dict[str, Any], names: list[str]) -> list[str]:
    lines = ["| row | compared with | seeds | STS-B dev | Δ | SICK-R trial | Δ | R@1 | Δ | alignment | "
             "uniformity |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def delta(entry: dict[str, Any], other: dict[str, Any] | None, metric: str, factor: float) -> str:
        """Mean over the seeds both rows ran of (this run - the compared row's run of the same seed)."""
        if other is not None and entry.get("evaluated_at_training_length") and \
                not other.get("evaluated_at_training_length"):
            other = other.get("protocol1")  # like with like: both rows' runs of protocol 1
        if other is None or metric not in entry or metric not in other:
            return "–"
        mine, theirs = entry[metric]["by_seed"], other[metric]["by_seed"]
        common = [seed for seed in mine if seed in theirs]
        if not common:
            return "–"
        return f"{factor * statistics.fmean(mine[s] - theirs[s] for s in common):+.2f}"

    for name in names:
        e = summary[name]
        other = summary.get(e.get("compare") or "")
        lines.append(
            f"| `{name}` {e['label']} | `{e.get('compare') or '–'}` | {len(e['seeds'])} | "
            f"{fmt(e, 'stsb_dev')} | "
            f"{delta(e, other, 'stsb_dev', 100)} | {fmt(e, 'sick_trial')} | {delta(e, other, 'sick_trial', 100)} | "
            f"{fmt(e, 'recall@1')} | {delta(e, other, 'recall@1', 100)} | {fmt(e, 'alignment')} | "
            f"{fmt(e, 'uniformity')} |"
        )
    return lines


def efficiency_section(results: Path) -> list[str]:
    path = results / "efficiency.md"
    if not path.is_file():
        return ["Efficiency: not measured yet (`python benchmarks/efficiency.py --rows all`)."]
    return [line.replace("# ", "### ", 1) if line.startswith("# ") else line
            for line in path.read_text(encoding="utf-8").splitlines()]


def _rate(x: float) -> str:
    """A learning rate as the report writes it: 0.005 -> 5e-3, 1.0 -> 1."""
    return f"{x:g}" if x >= 1 else f"{x:.0e}".replace("e-0", "e-")


def _lr_selection_note(summary: dict[str, Any]) -> str:
    """One sentence per selected method: the rate its rows use in each setting, read from the ``*-lr*`` rows of the
    summary. A setting whose sweep has not run says so, and a sweep whose best STS-B dev rate is not the one the rows
    use is flagged, so the note can never claim a selection that did not happen."""
    methods = (("LoRA", "lora", LORA_LR, "unsup"), ("DCPCSE", "dcpcse", DCPCSE_LR, "unsup"),
               ("D2CSE", "d2cse", D2CSE_LR, "unsup"),
               ("SKICSE's prompted encoder", "skicse-prompted", SKICSE_PROMPTED_LR, "unsup"),
               ("DiffAug's stage 1", "diffaug", DIFFAUG_STAGE1_LR, "semi"))
    names = {"sup": "supervised", "unsup": "unsupervised", "semi": "semi-supervised"}
    parts = []
    for label, method, rates, unsupervised in methods:
        settings = []
        for sup in (False, True):
            s = "sup" if sup else unsupervised
            prefix = f"{method}-{s}-{'stage1-' if method == 'diffaug' else ''}lr"
            swept = [n for n in summary if n.startswith(prefix)]
            # like with like: where part of a sweep is re-run under protocol 2, only those rates are compared
            current = [n for n in swept if not summary[n].get("evaluated_at_training_length")]
            partly = 2 <= len(current) < len(swept)
            sweep = {float(n[len(prefix):]): summary[n]["stsb_dev"]["mean"]
                     for n in (current if len(current) >= 2 else swept)}
            if len(sweep) < 2:
                flag = " (its sweep has not run)"
            else:
                best = max(sweep, key=sweep.get)
                flag = "" if math.isclose(best, rates[sup]) else f" (the sweep's best on STS-B dev is {_rate(best)})"
                if partly:
                    flag += f" (among the rates re-run under protocol 2: {', '.join(map(_rate, sorted(sweep)))})"
                several = sorted(_rate(float(n[len(prefix):])) for n in swept if len(summary[n].get("seeds", [])) > 1)
                if len(several) > 1:  # a choice seed 42 alone could not make (D2CSE supervised: 3e-1 collapsed)
                    flag += f" (chosen on the seed means of {', '.join(several)})"
            settings.append(f"{names[s]} {_rate(rates[sup])}{flag}")
        parts.append(f"{label} " + " and ".join(settings))
    return ("Learning rates were selected on STS-B dev with seed 42 (the `*-lr*` rows below): " + "; ".join(parts)
            + f"; PEFT prefix tuning keeps {_rate(PEFT_PREFIX_LR[False])} (checked at "
            f"{_rate(max(PEFT_PREFIX_LR_CANDIDATES))}). SCPCSE (1e-3) runs at its CPU preset, not re-selected.")


def _moves_sentence(summary: dict[str, Any]) -> str:
    """What the re-runs under protocol 2 moved, computed from the run files (main rows, unchanged settings)."""
    moves = [m for e in summary.values() if not e.get("ablation") for m in e.get("protocol_moves", ())]
    if not moves:
        return ""
    sts = sorted(m["stsb_dev"] for m in moves)
    sick = sorted(m["sick_trial"] for m in moves)
    return (f"The {len(moves)} runs of main rows re-run with unchanged settings moved by {sts[0]:+.2f} to "
            f"{sts[-1]:+.2f} on STS-B dev (median {statistics.median(sts):+.2f}; 4.2 % of its sentences are over "
            f"32 tokens) and by {sick[0]:+.2f} to {sick[-1]:+.2f} on SICK-R trial (median "
            f"{statistics.median(sick):+.2f}), which has no sentence over 32 tokens: most of a move is run-to-run "
            "variation of training on another host, not the evaluation length, except SCPCSE's, whose template left "
            "22 tokens per sentence under protocol 1 (docs/benchmarks.md).")


def markdown(summary: dict[str, Any], rows: list[Row], args, environment: str) -> str:
    main = [r.name for r in rows if not r.ablation]
    lines = [
        "### Quality under one protocol and one budget",
        "",
        *(["**Smoke run (`--quick`): 2 steps of 16 rows, evaluation on the first 299 STS-B dev and 100 SICK-R "
           "trial pairs; the numbers only show that every row runs, they measure nothing.**", ""] if args.quick else []),
        f"`python benchmarks/run_all --data-dir ../shared/data{' --ablations' if args.ablations else ''}`; "
        f"{environment}. Packaged all-MiniLM-L6-v2, [CLS] pooling (mean pooling only where stated), batch "
        f"{BATCH_SIZE}, training length 32 tokens (selection and evaluation encode sentences whole, as SentEval), "
        "τ = 0.05; one epoch of the setting's training set in optimizer steps for "
        "every row (unsupervised: 187 steps over 11,914 Wikipedia sentences; supervised: 92 steps over 5,864 SNLI "
        "triplets); best STS-B dev checkpoint (evaluated every 50 steps). Mean ± std over the runs counted in the "
        f"`seeds` column (seeds {', '.join(map(str, SEEDS))} planned per main row; a row with one seed shows a single "
        "run, and differences of a few tenths between single runs are within seed noise). "
        "Spearman and recall × 100. SICK-R trial is a second set model selection never sees. Recall@k: the 55 "
        "STS-B dev score-5 pairs as queries over its 2,909 distinct sentences. Alignment/uniformity on STS-B dev "
        "(lower is better for both). Train wall s: mean wall seconds of training per run, on a shared machine "
        "(see `load_average` in the run files); CPU s: CPU seconds of the run up to the final evaluation (all "
        "threads; model loading, pre-passes, training and the in-training evaluations), less sensitive to load.",
        "",
    ]
    for setting in ("none", "unsupervised", "semi-supervised", "supervised"):
        names = [n for n in main if summary.get(n, {}).get("setting") == setting]
        if names:
            title = {"none": "No training"}.get(setting, setting.capitalize())
            lines += [f"**{title}**", "", *quality_table(summary, names), ""]
    missing = [n for n in [*main, *(r.name for r in rows if r.all_seeds)] if n not in summary]
    if missing:
        lines += ["Not run with the current settings (a run whose settings changed since, e.g. the prefix "
                  "initialisation, does not count; the full run takes hours on two cores and is run in parts; "
                  "rerunning the command resumes it): " + ", ".join(f"`{n}`" for n in missing) + ".", ""]
    by_name = {r.name: r for r in rows}
    short = [f"`{n}` ({len(summary[n]['seeds'])} of {len(by_name[n].seeds)})"
             for n in [*main, *(r.name for r in rows if r.all_seeds)]
             if n in summary and len(summary[n]["seeds"]) < len(by_name[n].seeds)]
    if short and not args.quick:
        lines += ["Seeds still to run (the same command resumes them): " + ", ".join(short) + ".", ""]
    lr_rows = [n for n in summary if "-lr" in n]

    lr_note = (_lr_selection_note(summary) if lr_rows else "The learning-rate selection rows (`*-lr*`, with "
               "`--ablations`) have not run: every row uses its preset.")
    if any(e.get("earlier_mlp_init") for e in summary.values()):
        lines += ["¹ Runs made before SimCSE's MLP heads (training-only or saved) started at N(0, 0.02) with zero "
                  "biases as in SimCSE's code; they used torch's default initialisation of those layers. These rows "
                  "train no prefix of this package and were not re-run for that change; every row with a prefix "
                  "(DCPCSE, D2CSE, DiffAug, SKICSE's prompted encoder) was re-run with the official initialisation "
                  "of the prefix and the MLP (ablation rows not re-run are left out of the tables).", ""]
    if any(e.get("evaluated_at_training_length") for e in summary.values()):
        lines += ["² Runs of protocol 1: selected and evaluated with sentences cut at the training length (32 tokens) "
                  "instead of whole, as SentEval; not yet re-run under protocol 2. " + _moves_sentence(summary)
                  + " The runs of protocol 1 are in earlier/before-full-length-evaluation/.", ""]
    lines += [
        "Notes: SKICSE rows train on the rows that have SmolLM2 SKI (2,028 Wikipedia sentences / 2,000 NLI "
        "premises) for the same number of steps; their λ = 0 ablations below are SimCSE / DCPCSE on that data. "
        "DiffAug's stage 1 (200 steps of 32 NLI triplets, 64 classifier rows, prefix only) comes on top of the budget, and its semi-"
        "supervised setting uses those NLI labels. DiffAug trains its backbone in stage 2, so it is counted as "
        "100% trainable; on MiniLM it pools [CLS] without the PromptBERT template (the paper's template runs are "
        "the `diffaug-*-template` ablations; see the DiffAug reading). " + lr_note,
        "",
    ]
    ablations = [r.name for r in rows if r.ablation and r.name in summary]
    if ablations:
        lines += ["**Ablations and learning-rate selection** (seed 42 unless the `seeds` column says 3; Δ = this "
                  "row minus the compared main row, run by run over the seeds both have (same seed, same data order "
                  "and initialisation), averaged)", "",
                  *ablation_table(summary, ablations), ""]
    lines += [
        "**The papers' numbers** (BERT-base, full SimCSE data, seven-task STS *test* average, STS-B test and "
        "SICK-R test; quoted from the papers, not re-measured here, and not comparable with the MiniLM STS-B dev "
        "figures above):",
        "",
        "| method | setting | STS avg | STS-B test | SICK-R test | source |",
        "|---|---|---:|---:|---:|---|",
        *(f"| {m} | {s} | {a:.2f} | {b:.2f} | {c:.2f} | {src} |" for m, s, a, b, c, src in PAPER_NUMBERS),
        "",
        "![STS-B dev against trainable parameters](quality_vs_params.png)",  # relative to run_all.md
        "![alignment and uniformity](align_uniform.png)",
        "",
        *efficiency_section(args.results_dir),
    ]
    return "\n".join(lines) + "\n"


def plots(summary: dict[str, Any], results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = {n: e for n, e in summary.items() if not e["ablation"] and e["setting"] != "none"}
    colors = {"unsupervised": "tab:blue", "semi-supervised": "tab:green", "supervised": "tab:red"}
    fig, ax = plt.subplots(figsize=(8, 5))
    placed: list[tuple[float, float]] = []
    for name, e in main.items():
        if "stsb_dev" not in e:
            continue
        x = max(e["trainable_parameters"], 1)
        ax.errorbar(x, 100 * e["stsb_dev"]["mean"], yerr=100 * e["stsb_dev"]["std"], fmt="o",
                    color=colors[e["setting"]], capsize=3)
        y = 100 * e["stsb_dev"]["mean"]
        crowd = sum(1 for px, py in placed if px == x and abs(py - y) < 0.5)  # same parameter count, close scores
        placed.append((x, y))
        left = crowd % 2 == 1  # points of one parameter count with close scores: labels alternate sides
        ax.annotate(name, (x, y), fontsize=7, xytext=(-4 if left else 4, 2 - 6 * (crowd // 2)),
                    textcoords="offset points", ha="right" if left else "left")
    for name in ("backbone-cls", "backbone-mean"):
        if name in summary:
            ax.axhline(100 * summary[name]["stsb_dev"]["mean"], ls="--", lw=0.8, color="grey")
            ax.text(0.01, 100 * summary[name]["stsb_dev"]["mean"] + 0.05, name, fontsize=7, color="grey",
                    transform=ax.get_yaxis_transform())
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters (log)")
    ax.set_ylabel("STS-B dev Spearman x 100 (mean ± std over seeds)")
    ax.set_title("packaged all-MiniLM-L6-v2: quality against trainable parameters")
    for setting, color in colors.items():
        ax.plot([], [], "o", color=color, label=setting)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results / "quality_vs_params.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, e in summary.items():
        if e["ablation"] or "alignment" not in e:
            continue
        color = colors.get(e["setting"], "grey")
        ax.plot(e["uniformity"]["mean"], e["alignment"]["mean"], "o", color=color)
        ax.annotate(name, (e["uniformity"]["mean"], e["alignment"]["mean"]), fontsize=7, xytext=(3, 2),
                    textcoords="offset points")
    ax.set_xlabel("uniformity (lower is better)")
    ax.set_ylabel("alignment (lower is better)")
    ax.set_title("alignment and uniformity on STS-B dev (mean over seeds)")
    fig.tight_layout()
    fig.savefig(results / "align_uniform.png", dpi=110)
    plt.close(fig)


def stage1_plots(results: Path) -> None:
    """DiffAug's stage-1 delta/kappa curves of the seed-42 runs (``<row>-stage1.png``)."""
    from st_prompts.methods.diffaug.plot import plot_diffaug_stage1

    for path in sorted((results / "runs").glob("diffaug-*/seed42.json")):
        record = load_record(path)
        if record and record.get("stage1_diagnostics"):
            row = record["row"]
            plot_diffaug_stage1(record["stage1_diagnostics"], results / f"{row}-stage1.png",
                                title=f"DiffAug stage 1 ({row}, packaged MiniLM, seed 42)")


def report(rows: list[Row], args) -> dict[str, Any]:
    summary = collect(args.results_dir, list(ROWS.values()), args.data_dir, args.quick)
    environment = "no run yet"
    records = [load_record(p) for p in (args.results_dir / "runs").glob("*/seed*.json")]
    records = [r for r in records if r]
    if records:
        threads = sorted({r.get("torch_threads") for r in records})
        loads = [max(r["load_average_start"][0], r["load_average_end"][0]) for r in records]
        threads_text = "/".join(map(str, threads))
        environment = (f"{records[0].get('machine')}, torch {records[0].get('torch')} with {threads_text} thread(s) per "
                       f"run; 1-min load average during the runs {min(loads):.1f}-{max(loads):.1f}")
    write_json(args.results_dir / "summary.json", {"environment": environment, "rows": summary})
    text = markdown(summary, list(ROWS.values()), args, environment)
    (args.results_dir / "run_all.md").write_text(text, encoding="utf-8")
    if summary:
        plots(summary, args.results_dir)
        stage1_plots(args.results_dir)
    if not args.quick:
        write_results_readme(args.results_dir.parent / "README.md", text)
    return summary


def write_results_readme(path: Path, tables: str) -> None:
    """``benchmarks/results/README.md``: the generated tables under a short header."""
    header = ("# Benchmark results\n\nGenerated by `python benchmarks/run_all --report-only` from the run files in "
              "`run_all/runs/` (never edit the numbers by hand); the efficiency section comes from "
              "`benchmarks/efficiency.py`. One-off probes whose question is answered are kept at the git tag "
              "`probes-archive` beside their reports ([archived-probes.md](archived-probes.md)).\n\n")
    # run_all.md links relative to run_all/, where it lies; the README lies one folder up
    write_file_atomic(path, header + re.sub(r"\]\((?![a-z]+:|/|#)", "](run_all/", tables))


