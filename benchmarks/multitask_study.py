"""What closes the gap between a prompt set and LoRA at the same size: one factor at a time, then together (by hand).

On the four tasks of ``benchmarks/multitask.py`` (``sts``, ``sick``, ``nli``, ``dcpcse``; packaged all-MiniLM-L6-v2,
mean pooling; batch 32; selection on each task's own set, the other set beside), from today's setting (a prompt set of
16 positions, no gate, no reparameterisation, no warm-up, one epoch):

* **one factor at a time**: the zero-initialised gate (identity start); prefix length 4 or 64; the reparameterisation
  MLP; 10 % warm-up; three epochs. Every configuration gets a grid of at least three learning rates around its best,
  extended by one step (up to twice) where the best sits at an edge;
* **together**: the factors that helped on the selection set, at once;
* **LoRA** (r = 8 on query/value, the same 73,728 parameters) and **full fine-tuning**, with the same epochs (one and
  three) and rate grids;
* **three seeds** (42, 43, 44) of each task's final prompt configuration, LoRA's and full fine-tuning's;
* **the decoder task** ``smollm2``: SmolLM2-135M-Instruct frozen (``STUDY_DECODER``: another ``.gguf`` file),
  last-token pooling, the NLI triplets, selected on STS-B dev: the same configurations (today's setting, the gate,
  LoRA and full fine-tuning first), LoRA r = 8 on ``v_proj`` only (184,320 parameters = the 16-position prefix),
  then its three seeds.

Every run evaluates its selection set at step 0 and five times during training and keeps the best weights (the
package's ``bank.train_prompt_set`` for prompt sets, the same selection for LoRA and full fine-tuning). Runs are
processes of a pool (``--workers``) sharing one device: on a GPU, many small runs at once.

    python benchmarks/multitask_study.py --data-dir ../shared/data --workers 6          # runs, resumable
    python benchmarks/multitask_study.py --data-dir ../shared/data --report-only        # tables
    python benchmarks/multitask_study.py --data-dir ../shared/data --frozen-phase1 sts sick nli dcpcse
        # continue on another device: phase 1 of these tasks from the run files, the later phases run

Results: ``benchmarks/results/multitask_study/`` (one JSON per run, ``study.json``) and the study section of
``benchmarks/results/multitask.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

RESULTS = REPO / "benchmarks" / "results" / "multitask_study"
TASKS = ("sts", "sick", "nli", "dcpcse")
SELECTION = {"sts": "stsb_dev", "sick": "sick_trial", "nli": "stsb_dev", "dcpcse": "stsb_dev"}
UNSEEN = {"sts": "sick_trial", "sick": "stsb_dev", "nli": "sick_trial", "dcpcse": "sick_trial"}
#: The decoder task: SmolLM2-135M-Instruct frozen (the packaged GGUF, or the ``.gguf`` file in ``STUDY_DECODER``),
#: last-token pooling, trained on the NLI triplets (MultipleNegativesRankingLoss), selected on STS-B dev.
DECODER_TASKS = ("smollm2",)
SELECTION["smollm2"], UNSEEN["smollm2"] = "stsb_dev", "sick_trial"
#: It runs the same configurations as the encoder tasks (today's setting, the gate, LoRA and full fine-tuning first),
#: its LoRA r = 8 on ``v_proj`` only: 30 x 8 x (576 + 192) = 184,320 parameters, the 16-position prefix's
#: 30 x 2 x 16 x 192. Each run is a 135M model.
#: Training length of the decoder runs (NLI sentences are shorter; evaluation encodes whole sentences).
DECODER_MAX_LENGTH = 128
SEEDS = (42, 43, 44)
#: Half-decade rate ladders; a configuration starts at three rungs around the rate today's setting selected.
LADDERS = {
    "prompts": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0),
    "lora": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
    "full": (3e-6, 1e-5, 3e-5, 1e-4, 3e-4),
}
START = {"prompts": 3e-2, "lora": 3e-3, "full": 3e-5}
BASE = {"approach": "prompts", "gate": False, "length": 16, "projection": False, "warmup": 0.0, "epochs": 1}
#: The factors, each one change from ``BASE`` (a name and the change).
FACTORS = {
    "gate": {"gate": True},
    "length-4": {"length": 4},
    "length-64": {"length": 64},
    "reparam": {"projection": True},
    "warmup": {"warmup": 0.1},
    "epochs-3": {"epochs": 3},
}
#: A factor helps when its best selection score beats today's setting's by more than this (Spearman x 100).
HELPS = 0.1


# ------------------------------------------------------------------------------------------------------ one run
def config_name(config: dict) -> str:
    if config["approach"] != "prompts":
        return f"{config['approach']}-epochs{config['epochs']}"
    changes = [name for name, change in FACTORS.items() if all(config.get(k) == v for k, v in change.items())]
    return "+".join(changes) if changes else "base"


def run_path(task: str, config: dict, lr: float, seed: int) -> Path:
    return RESULTS / "runs" / task / f"{config_name(config)}-lr{lr:g}-seed{seed}.json"


def run(task: str, config: dict, lr: float, seed: int, data_dir: str) -> dict:
    """Train and evaluate one run in this process; returns its record (and writes it)."""
    import torch

    import multitask as mt
    from st_prompts import bank
    from st_prompts.storage import write_json_atomic

    data_dir_path = Path(data_dir)
    torch.manual_seed(seed)
    decoder = task in DECODER_TASKS
    data_task = "nli" if decoder else task  # the decoder task trains on the NLI triplets
    data, evaluator = mt.task_data(data_task, data_dir_path), mt.dev_evaluator(data_task, data_dir_path)
    steps = math.ceil(len(data) / mt.BATCH_SIZE) * config["epochs"]
    eval_steps = max(1, steps // 5)
    start = time.perf_counter()
    if config["approach"] == "prompts":
        model = (bank.create_bank(decoder_path(), pooling="lasttoken", max_seq_length=DECODER_MAX_LENGTH)
                 if decoder else bank.create_bank("minilm"))
        trained = bank.train_prompt_set(
            model, task, data, mt.loss_for(data_task, model), evaluator=evaluator, learning_rate=lr,
            epochs=config["epochs"], batch_size=mt.BATCH_SIZE, eval_steps=eval_steps, warmup_ratio=config["warmup"],
            seed=seed, show_progress_bar=False, prefix_length=config["length"], prefix_projection=config["projection"],
            prefix_gate=config["gate"])
        result = {"steps": trained.steps, "best_step": trained.best_step, "selected": 100 * trained.best_metric,
                  "trainable_parameters": trained.trainable_parameters}
        metrics = mt.evaluate(model, data_dir_path, task=task)
    else:
        if decoder:
            model = decoder_model(lora=config["approach"] == "lora")
        else:
            model = mt.lora_model() if config["approach"] == "lora" else mt.shipped()
        if torch.cuda.is_available():
            model.to("cuda")
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result = mt.fit(model, data, mt.loss_for(data_task, model), evaluator, lr, epochs=config["epochs"],
                        warmup=config["warmup"], seed=seed, eval_steps=eval_steps, step_zero=True)
        result["trainable_parameters"] = trainable
        metrics = mt.evaluate(model, data_dir_path)
    from common import run_environment

    environment = run_environment()
    record = {"task": task, "config": config, "name": config_name(config), "learning_rate": lr, "seed": seed,
              **result, "metrics": metrics, "seconds": time.perf_counter() - start, "rows": len(data),
              "device": environment["device"] if torch.cuda.is_available() else platform.machine(),
              "environment": environment, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json_atomic(run_path(task, config, lr, seed), record)
    return record


def decoder_path() -> str:
    """The decoder backbone: ``STUDY_DECODER`` (a ``.gguf`` file) or the packaged SmolLM2."""
    return os.environ.get("STUDY_DECODER") or "smollm2"


def decoder_model(lora: bool):
    """SmolLM2 as a plain sentence-transformers model (last-token pooling), with a LoRA of the prefix's size."""
    from decoder import plain_decoder

    model = plain_decoder("lasttoken", DECODER_MAX_LENGTH, decoder_path())
    if lora:
        from peft import LoraConfig, TaskType

        model.add_adapter(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["v_proj"],
                                     task_type=TaskType.FEATURE_EXTRACTION))
    return model


def _worker(job):
    task, config, lr, seed, data_dir = job
    path = run_path(task, config, lr, seed)
    if path.exists():
        return json.loads(path.read_text())
    try:
        return run(task, config, lr, seed, data_dir)
    except Exception:  # noqa: BLE001 - a failed run is reported, the study goes on
        return {"task": task, "config": config, "learning_rate": lr, "seed": seed,
                "error": traceback.format_exc(limit=6)}


def best_of(records: list[dict]) -> dict:
    """The record with the best selection score; ties go to the smaller learning rate (the scheduler and the report
    choose alike)."""
    return max(records, key=lambda r: (round(r["selected"], 6), -r["learning_rate"]))


# ------------------------------------------------------------------------------------------------ the scheduler
class Study:
    """Runs the study's groups (a configuration over its rate grid) as their inputs become known, on a pool. Groups
    and phases are generators that yield while their runs are in flight, so that no task waits for another."""

    def __init__(self, pool, data_dir: str, tasks, frozen=()) -> None:
        self.pool, self.data_dir, self.tasks = pool, data_dir, tasks
        #: Tasks whose phase 1 is read from the run files alone (no new phase-1 run): a study continued on another
        #: device runs only its later phases (the helpful factors together, three seeds).
        self.frozen = set(frozen)
        self.pending: dict[tuple, object] = {}
        self.records: dict[tuple, dict] = {}

    def submit(self, task, config, lr, seed=SEEDS[0]):
        key = (task, json.dumps(config, sort_keys=True), lr, seed)
        if key not in self.pending and key not in self.records:
            self.pending[key] = self.pool.apply_async(_worker, ((task, config, lr, seed, self.data_dir),))
        return key

    def ready(self, keys) -> bool:
        return all(key in self.records or self.pending[key].ready() for key in keys)

    def collect(self, keys) -> list[dict]:
        """The records of ``keys`` (all ready)."""
        out = []
        for key in keys:
            if key not in self.records:
                record = self.pending.pop(key).get()
                self.records[key] = record
                if "error" in record:
                    print(f"FAILED {key}: {record['error']}", flush=True)
                else:
                    print(f"{record['task']:6s} {record['name']:24s} lr {record['learning_rate']:<7g} seed "
                          f"{record['seed']}  selected {record['selected']:6.2f}  unseen "
                          f"{record['metrics'][UNSEEN[record['task']]]:6.2f}  {record['seconds']:5.0f}s",
                          flush=True)
            out.append(self.records[key])
        return out

    def first_rungs(self, config: dict) -> list[float]:
        ladder = LADDERS[config["approach"]]
        centre = ladder.index(START[config["approach"]])
        return [ladder[i] for i in sorted({max(0, centre - 1), centre, min(len(ladder) - 1, centre + 1)})]

    def grid(self, task: str, config: dict, phase1: bool = False):
        """Three rungs around the start, then one more at a leading edge (twice at most); returns the best record.
        A phase-1 grid of a frozen task returns the best of its runs on file (``None`` when none)."""
        if phase1 and task in self.frozen:
            name = config_name(config)
            records = [json.loads(p.read_text()) for p in sorted((RESULTS / "runs" / task).glob(f"{name}-lr*-seed"
                                                                                               f"{SEEDS[0]}.json"))]
            records = [r for r in records if r.get("name") == name and "error" not in r]
            return best_of(records) if records else None
        ladder = LADDERS[config["approach"]]
        tried = [ladder.index(lr) for lr in self.first_rungs(config)]
        keys = [self.submit(task, config, ladder[i]) for i in tried]
        for _ in range(3):
            while not self.ready(keys):
                yield
            records = [r for r in self.collect(keys) if "error" not in r]
            if not records:
                return None
            best = best_of(records)
            if sum(abs(r["selected"] - best["selected"]) < 1e-6 for r in records) > 1:
                return best  # a tie (e.g. every rate kept step 0): the grid does not lead anywhere
            index = ladder.index(best["learning_rate"])
            edge = index - 1 if index == min(tried) else index + 1 if index == max(tried) else None
            if edge is None or not 0 <= edge < len(ladder) or edge in tried or len(tried) >= 5:
                return best
            tried.append(edge)
            keys.append(self.submit(task, config, ladder[edge]))
        return best


def together_of(task: str, best: dict) -> dict | None:
    """Today's setting with every factor that helped (one prefix length: the better one), or ``None`` when fewer than
    two helped."""
    base = best.get("base")
    if base is None:
        return None
    helpful = [n for n in FACTORS if best.get(n) and best[n]["selected"] > base["selected"] + HELPS]
    lengths = [n for n in helpful if n.startswith("length-")]
    if len(lengths) > 1:
        keep = max(lengths, key=lambda n: (round(best[n]["selected"], 6), n))
        helpful = [n for n in helpful if not n.startswith("length-") or n == keep]
    if len(helpful) < 2:
        return None
    config = dict(BASE)
    for name in helpful:
        config.update(FACTORS[name])
    return config


def task_configs() -> dict[str, dict]:
    """Every configuration of phase 1 (every task's, the decoder task's too), most important first (the order runs
    are queued in)."""
    lora = {"approach": "lora", "warmup": 0.0}
    full = {"approach": "full", "warmup": 0.0}
    return {"base": BASE, "gate": {**BASE, **FACTORS["gate"]}, "lora-epochs1": {**lora, "epochs": 1},
            "full-epochs1": {**full, "epochs": 1},
            **{name: {**BASE, **change} for name, change in FACTORS.items() if name not in ("gate", "epochs-3")},
            "epochs-3": {**BASE, **FACTORS["epochs-3"]}, "lora-epochs3": {**lora, "epochs": 3},
            "full-epochs3": {**full, "epochs": 3}}


def step_all(generators: dict, results: dict) -> None:
    """Advance every generator once; a finished one leaves ``generators`` and its return value goes to ``results``."""
    for name, gen in list(generators.items()):
        try:
            next(gen)
        except StopIteration as stop:
            results[name] = stop.value
            del generators[name]


def pipeline(study: Study, task: str):
    """One task's study: phase 1 (factors, LoRA and full grids), the helpful factors together, three seeds."""
    groups = {name: study.grid(task, config, phase1=True) for name, config in task_configs().items()}
    best: dict[str, dict] = {}
    while groups:
        step_all(groups, best)
        yield
    config = together_of(task, best)
    if config is not None:
        best["together"] = yield from study.grid(task, config)
    keys = []
    for approach in ("prompts", "lora", "full"):
        candidates = [r for r in best.values() if r and r["config"]["approach"] == approach]
        if candidates:
            final = best_of(candidates)
            keys += [study.submit(task, final["config"], final["learning_rate"], seed) for seed in SEEDS[1:]]
    while not study.ready(keys):
        yield
    study.collect(keys)
    return best


def queue_first_rungs(study: Study, tasks) -> None:
    """Queue phase 1's first rungs in order of importance, across tasks (not those of a frozen task)."""
    for config in task_configs().values():
        for task in tasks:
            if task not in study.frozen:
                for lr in study.first_rungs(config):
                    study.submit(task, config, lr)


def plan(study: Study, tasks) -> dict:
    """Queue phase 1's first rungs, then drive every task's pipeline."""
    queue_first_rungs(study, tasks)
    pipelines = {task: pipeline(study, task) for task in tasks}
    results = {}
    while pipelines:
        step_all(pipelines, results)
        time.sleep(0.2)
    return results


def job_config(task: str, config) -> dict:
    """A ``--jobs`` entry's configuration: its settings, or its name as run files spell it (``"gate+length-4"``,
    ``"lora-epochs1"``)."""
    if isinstance(config, dict):
        return config
    known = task_configs()
    if config in known:
        return known[config]
    factors = config.split("+")
    if any(factor not in FACTORS for factor in factors):
        raise SystemExit(f"--jobs: {task!r} has no configuration {config!r} (a name of {', '.join(known)}, or "
                         "factors joined by '+')")
    settings = dict(BASE)
    for factor in factors:
        settings.update(FACTORS[factor])
    if config_name(settings) != config:
        raise SystemExit(f"--jobs: {config!r} does not name one configuration (it reads as {config_name(settings)!r})")
    return settings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS + DECODER_TASKS), choices=TASKS + DECODER_TASKS)
    parser.add_argument("--frozen-phase1", nargs="*", default=[], choices=TASKS + DECODER_TASKS, metavar="TASK",
                        help="tasks whose phase 1 is taken from the run files only (continue a study: the later "
                        "phases run)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--limit", type=int, help="training rows per task (smoke runs)")
    parser.add_argument("--results", type=Path, help="results folder")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--jobs", type=Path, help="run only these runs (a JSON list of [task, config, lr, seed]; "
                        "config: a configuration's name, e.g. \"gate+length-4\", or its settings as in a run file), "
                        "in order, then report: how a study interrupted on one device is continued on another")
    args = parser.parse_args(argv)
    global RESULTS
    if args.results:
        RESULTS = args.results
    os.environ["STUDY_RESULTS"] = str(RESULTS)
    os.environ["STUDY_THREADS"] = str(args.threads)
    if args.limit:
        os.environ["STUDY_LIMIT"] = str(args.limit)
    if args.jobs:
        entries = json.loads(args.jobs.read_text())
        jobs = [(t, job_config(t, c), lr, seed, str(args.data_dir)) for t, c, lr, seed in entries]
        with mp.get_context("spawn").Pool(args.workers, initializer=_init_worker) as pool:
            for record in pool.imap_unordered(_worker, jobs):
                print(record.get("task"), record.get("name"), record.get("learning_rate"), record.get("seed"),
                      round(record.get("selected", float("nan")), 2), flush=True)
    elif not args.report_only:
        context = mp.get_context("spawn")
        with context.Pool(args.workers, initializer=_init_worker) as pool:
            plan(Study(pool, str(args.data_dir), args.tasks, args.frozen_phase1), args.tasks)
    report(args.tasks)
    return 0


def _init_worker() -> None:
    global RESULTS
    import torch

    import multitask as mt

    RESULTS = Path(os.environ["STUDY_RESULTS"])
    torch.set_num_threads(int(os.environ.get("STUDY_THREADS", "1")))
    if os.environ.get("STUDY_LIMIT"):
        mt.LIMIT = int(os.environ["STUDY_LIMIT"])
        mt.DEV_LIMIT = 4 * mt.LIMIT  # a smoke run: the dev sets cut too (its numbers measure nothing)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ------------------------------------------------------------------------------------------------------- report
#: (layers, key/value width, key/value heads) of each task's backbone: MiniLM's 6 x 384 (12 heads), SmolLM2-135M's
#: 30 layers with 3 key/value heads of 64.
PREFIX_SHAPES = {"smollm2": (30, 192, 3)}
MINILM_SHAPE = (6, 384, 12)


def stored_parameters(record: dict) -> int:
    """The numbers a run's trained weights take in a checkpoint: a prompt set stores its prefix (``l x 2L x H``, the
    MLP's output when reparameterised, as st_prompts saves it since issue 51) and its gate (``L x heads``); LoRA and
    full fine-tuning store what they train."""
    config = record["config"]
    if config["approach"] != "prompts":
        return int(record.get("trainable_parameters") or 0)
    layers, width, heads = PREFIX_SHAPES.get(record["task"], MINILM_SHAPE)
    return 2 * layers * config["length"] * width + (layers * heads if config["gate"] else 0)


def load_records() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((RESULTS / "runs").glob("*/*.json"))]


def report(tasks=TASKS) -> str:
    """``study.json`` and the markdown tables, from the run files alone."""
    from collections import Counter
    from statistics import fmean, stdev

    from st_prompts.storage import write_file_atomic, write_json_atomic

    records = [r for r in load_records() if "error" not in r]
    first = [r for r in records if r["seed"] == SEEDS[0]]
    groups: dict[tuple, list[dict]] = {}
    for r in first:
        groups.setdefault((r["task"], r["name"]), []).append(r)
    best = {key: best_of(group) for key, group in groups.items()}
    lines = ["## What closes the gap to LoRA: the study", ""]
    devices = sorted({r["device"] for r in records})
    lines += [f"`python benchmarks/multitask_study.py --data-dir ../shared/data`; {', '.join(devices)}. One factor at "
              "a time from today's setting (16 positions, no gate, no reparameterisation, no warm-up, one epoch), "
              "each over at least three learning rates (extended at a leading edge); seed 42; selection on each "
              "task's own set (step 0 and five evaluations, best kept); Δ = the configuration's best selection "
              "score minus today's setting's. Spearman × 100, selection set / unseen set. The decoder task "
              "`smollm2` (SmolLM2-135M-Instruct frozen, last-token pooling, the NLI triplets, selected on STS-B "
              "dev, SICK-R trial unseen) has the same configurations, LoRA r = 8 on `v_proj` (184,320 parameters, "
              "the prefix's size); a cell reads – where a configuration has not run.", ""]
    header = "| configuration | " + " | ".join(f"{t} (sel. / unseen, lr, Δ)" for t in tasks) + " |"
    lines += [header, "|---|" + "---|" * len(tasks)]
    names = ["base", *FACTORS, "together", "lora-epochs1", "lora-epochs3", "full-epochs1", "full-epochs3"]
    for name in names:
        cells = []
        for task in tasks:
            together = [v for (t, n), v in best.items() if t == task and "+" in n] if name == "together" else []
            r = best.get((task, name)) or (best_of(together) if together else None)  # the best combination tried
            base = best.get((task, "base"))
            if r is None:
                cells.append("–")
                continue
            delta = f"{r['selected'] - base['selected']:+.2f}" if base else ""
            run_rates = sorted(g["learning_rate"] for g in groups.get((task, r["name"]), []))
            rates = len(run_rates)
            short = f" (only {rates} rate{'s' if rates != 1 else ''} run)" if rates < 3 else ""
            if rates >= 2 and r["learning_rate"] in (run_rates[0], run_rates[-1]) and r["best_step"] > 0:
                # the best trained rate is the lowest or highest run: the grid does not bracket it
                short += f" (grid edge: {'lowest' if r['learning_rate'] == run_rates[0] else 'highest'} rate run)"
            cells.append(f"{r['selected']:.2f} / {r['metrics'][UNSEEN[task]]:.2f}, {r['learning_rate']:g}, {delta}"
                         f"{short}")
        label = {"base": "today's setting"}.get(name, name)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    # three seeds
    lines += ["", "**Three seeds** (42, 43, 44) of each task's final configuration (best selection score over the "
              "study) — mean ± std over the seeds run so far (the `seeds` column), selection set / unseen set:", "",
              "| task | approach | configuration | lr | seeds | trainable / stored parameters | selection set | "
              "unseen set |",
              "|---|---|---|---:|---|---:|---:|---:|"]
    summary = {}
    # a seed run on another device than most of the study's runs is marked: another device's arithmetic takes
    # another trajectory (like another seed), so the table says which seeds those are
    main_device = Counter(r["device"] for r in records).most_common(1)[0][0] if records else None
    other_devices: set[str] = set()
    for task in tasks:
        for approach in ("prompts", "lora", "full"):
            candidates = [r for (t, n), r in best.items() if t == task and r["config"]["approach"] == approach]
            if not candidates:
                continue
            final = best_of(candidates)
            runs = [r for r in records if r["task"] == task and r["name"] == final["name"]
                    and r["learning_rate"] == final["learning_rate"]]
            sel = [r["metrics"][SELECTION[task]] for r in runs]
            uns = [r["metrics"][UNSEEN[task]] for r in runs]

            def fmt(values):
                return f"{fmean(values):.2f} ± {stdev(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"

            summary[f"{task}/{approach}"] = {"name": final["name"], "learning_rate": final["learning_rate"],
                                             "seeds": sorted(r["seed"] for r in runs), "selection": sel,
                                             "unseen": uns, "selection_mean": fmean(sel), "unseen_mean": fmean(uns)}
            seeds = ", ".join(f"{r['seed']}" + ("†" if r["device"] != main_device else "")
                              for r in sorted(runs, key=lambda r: r["seed"]))
            other_devices |= {r["device"] for r in runs if r["device"] != main_device}
            sizes = f"{final.get('trainable_parameters', 0):,} / {stored_parameters(final):,}"
            summary[f"{task}/{approach}"].update(trainable_parameters=final.get("trainable_parameters"),
                                                 stored_parameters=stored_parameters(final))
            lines.append(f"| {task} | {approach} | {final['name']} | {final['learning_rate']:g} | {seeds} | "
                         f"{sizes} | {fmt(sel)} | {fmt(uns)} |")
    if other_devices:
        def named(device):
            return device if device.startswith("NVIDIA") else f"the CPU ({device})"

        lines += ["", f"† run on {', '.join(named(d) for d in sorted(other_devices))}, the other seeds on "
                  f"{named(main_device)}."]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json_atomic(RESULTS / "study.json", {"best": {f"{t}/{n}": r for (t, n), r in best.items()},
                                               "finals": summary})
    write_file_atomic(RESULTS / "study.md", text)
    print(text)
    return text


if __name__ == "__main__":
    raise SystemExit(main())
