"""Running the benchmark: one run in a child process (:func:`child_main`), and many runs, a few at a time, resumable
and shared safely by several invocations (:func:`plan`, :func:`run_plan`)."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rows import INITIALISATION_VERSION, LOG_DIR, ROWS, SEEDS, Row, run_key, run_settings, senteval_dir

from st_prompts.storage import write_json_atomic

#: What a child process runs: this package's folder (``python benchmarks/run_all``).
PACKAGE_DIR = Path(__file__).resolve().parent


def attach_adapter(model, row: Row):
    """The PEFT baselines on top of SimCSE's model (backbone frozen by PEFT)."""
    from peft import LoraConfig, PrefixTuningConfig, TaskType, get_peft_model

    if row.adapter == "lora":
        # sentence-transformers' own, supported route (saves and reloads adapter-only).
        model.add_adapter(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"],
                                     task_type=TaskType.FEATURE_EXTRACTION))
    elif row.adapter == "peft-prefix":
        # The unsupported route (add_adapter refuses prompt-learning configs); the model cannot be reloaded with
        # SentenceTransformer(path) afterwards.
        prefix = dict(row.overrides)["prefix_length"]
        encoder = model[0]
        for parameter in encoder.model.parameters():
            parameter.requires_grad = False
        encoder.model = get_peft_model(encoder.model, PrefixTuningConfig(task_type=TaskType.FEATURE_EXTRACTION,
                                                                         num_virtual_tokens=prefix))
    else:
        raise ValueError(f"unknown adapter {row.adapter!r}")
    return model


def lora_route_problem() -> str | None:
    """Why ``model.add_adapter(LoraConfig(...))`` would fail with the installed versions, or None.

    transformers checks the PEFT version only when the adapter is added, i.e. minutes into a benchmark (and inside a
    child process): transformers 5.24 requires peft >= 0.22, which PyPI did not have on 2026-11-24 (0.21.2 was the
    newest). Checked up front so that the benchmark stops with this message instead of a traceback per LoRA run.
    """
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        installed = version("peft")
    except PackageNotFoundError:
        return "the LoRA and PEFT prefix-tuning rows need peft: pip install -e '.[bench]'"
    try:
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except ImportError:  # moved or removed: let add_adapter itself decide
        return None
    if Version(installed) < Version(MIN_PEFT_VERSION):
        import transformers

        return (f"transformers {transformers.__version__} needs peft >= {MIN_PEFT_VERSION} for model.add_adapter (the "
                f"LoRA rows), but peft {installed} is installed: install the benchmark's pinned versions with "
                f"pip install -e '.[bench]' (transformers < 5.24), or a newer peft")
    return None


def evaluate_all(model, senteval: str) -> dict[str, float]:
    """STS-B dev Spearman, SICK-R trial Spearman, recall@1/3/5 and alignment/uniformity on STS-B dev."""
    import numpy as np
    from scipy.stats import spearmanr

    from st_prompts.data.senteval import load_sts
    from st_prompts.evaluation import AlignmentUniformityEvaluator, STSRetrievalEvaluator, stsb_dev_evaluator
    from st_prompts.modules.lengths import full_length

    metrics: dict[str, float] = {}
    metrics["stsb_dev"] = stsb_dev_evaluator(senteval, batch_size=128)(model)["sts-dev_spearman_cosine"]
    pairs = load_sts(senteval, "SICKRelatedness", "dev")
    with full_length(model) as metrics["max_length"]:  # SentEval encodes sentences whole
        a = model.encode(pairs.sentences1, batch_size=128, normalize_embeddings=True)
        b = model.encode(pairs.sentences2, batch_size=128, normalize_embeddings=True)
    metrics["sick_trial"] = float(spearmanr(np.sum(a * b, axis=1), pairs.scores).statistic)
    retrieval = STSRetrievalEvaluator.from_senteval(senteval, split="dev", name="r", batch_size=128,
                                                    recall_at_k=(1, 3, 5), write_csv=False)(model)
    metrics.update({f"recall@{k}": retrieval[f"r_recall@{k}"] for k in (1, 3, 5)})
    align = AlignmentUniformityEvaluator.from_senteval(senteval, split="dev", name="a", batch_size=128,
                                                       write_csv=False)(model)
    metrics.update(alignment=align["a_alignment"], uniformity=align["a_uniformity"])
    return metrics


def untrained_model(pooling: str):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from st_prompts.utils import packaged_minilm_path

    encoder = Transformer(packaged_minilm_path(), max_seq_length=32)
    return SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)])


def run_one(row: Row, seed: int, data_dir: Path, quick: bool, eval_senteval: Path) -> dict[str, Any]:
    """Train and evaluate one (row, seed) in this process; returns the result record."""
    import torch
    from common import cpu_model, run_environment  # benchmarks/, on the path when run as python benchmarks/run_all

    from st_prompts import methods
    from st_prompts.evaluation import stsb_dev_evaluator
    from st_prompts.training.run import count_parameters, train

    import resource

    load_start = os.getloadavg()
    started = time.perf_counter()
    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    record: dict[str, Any] = {"row": row.name, "seed": seed}
    if row.method is None:
        model = untrained_model(row.pooling)
        trainable, total = 0, sum(p.numel() for p in model.parameters())
        record.update(steps=0, best_step=None, train_seconds=0.0)
    else:
        with tempfile.TemporaryDirectory(prefix="run_all-") as tmp:
            # DiffAug writes its stage-1 checkpoint beside the output folder: keep both in the temporary folder
            settings = run_settings(row, seed, data_dir, quick, os.path.join(tmp, "run"))
            method = methods.get(row.method)
            limit = 64 if quick else None
            stages = method.stages(settings)
            data = {stage.name: stage.load_data(settings, str(data_dir), limit) for stage in stages}
            model = method.build_model(settings)
            if row.adapter:
                model = attach_adapter(model, row)
            model, result = train(settings, data if len(stages) > 1 else data[stages[0].name],
                                  stsb_dev_evaluator(str(eval_senteval), batch_size=128), model=model,
                                  show_progress_bar=False)
            trainable, total = count_parameters(model)
            diagnostics = [e for e in result.log_history if "diffaug_delta" in e]
            if diagnostics:  # DiffAug's stage-1 delta/kappa, plotted by the report
                record["stage1_diagnostics"] = diagnostics
            record.update(
                steps=result.steps, best_step=result.best_step, train_seconds=result.seconds,
                examples={name: len(d) for name, d in data.items()},
                stage_reports=result.stage_reports,
                settings={k: v for k, v in dataclasses.asdict(settings).items() if k != "output_dir"},
            )
    cpu_end = resource.getrusage(resource.RUSAGE_SELF)
    # CPU seconds of the whole run (all threads; loading, training, the in-training evaluations): unlike wall time,
    # hardly affected by other processes on a shared machine.
    record["cpu_seconds"] = (cpu_end.ru_utime + cpu_end.ru_stime) - (cpu_start.ru_utime + cpu_start.ru_stime)
    model.eval()
    with torch.no_grad():
        record["metrics"] = evaluate_all(model, str(eval_senteval))
    record.update(
        trainable_parameters=trainable, total_parameters=total,
        wall_seconds=time.perf_counter() - started,
        load_average_start=load_start, load_average_end=os.getloadavg(),
        torch_threads=torch.get_num_threads(), torch=torch.__version__,
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        finished=time.strftime("%Y-%m-%d %H:%M:%S"), initialisation=INITIALISATION_VERSION,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        environment=run_environment(),
    )
    return record


def quick_senteval(data_dir: Path, target: Path) -> Path:
    """A SentEval tree with the first rows of STS-B dev and SICK trial (quick mode evaluates on it)."""
    sts = target / "STS" / "STSBenchmark"
    sick = target / "SICK"
    sts.mkdir(parents=True, exist_ok=True)
    sick.mkdir(parents=True, exist_ok=True)
    source = senteval_dir(data_dir)
    lines = (source / "STS" / "STSBenchmark" / "sts-dev.csv").read_text(encoding="utf-8").splitlines(True)
    (sts / "sts-dev.csv").write_text("".join(lines[:300]), encoding="utf-8")
    lines = (source / "SICK" / "SICK_trial.txt").read_text(encoding="utf-8").splitlines(True)
    (sick / "SICK_trial.txt").write_text("".join(lines[:101]), encoding="utf-8")
    return target


def write_json(path: Path, data: Any) -> None:
    write_json_atomic(path, data, default=str)


def child_main(args) -> int:
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    row = ROWS[args._run]
    data_dir = Path(args.data_dir)
    with tempfile.TemporaryDirectory(prefix="run_all-senteval-") as tmp:
        eval_senteval = quick_senteval(data_dir, Path(tmp)) if args.quick else senteval_dir(data_dir)
        record = run_one(row, args._seed, data_dir, args.quick, eval_senteval)
    record["key"] = args._key
    write_json(Path(args._out), record)
    return 0


# ------------------------------------------------------------------------------------------------- orchestration
def result_path(results: Path, row: Row, seed: int) -> Path:
    return results / "runs" / row.name / f"seed{seed}.json"


def load_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def select_rows(patterns: list[str] | None, ablations: bool, quick: bool) -> list[Row]:
    if patterns:
        chosen = [row for row in ROWS.values() if any(fnmatch.fnmatchcase(row.name, p) for p in patterns)]
        unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in ROWS)]
        if unknown:
            sys.exit(f"--only: no row matches {', '.join(unknown)}; rows: {', '.join(ROWS)}")
        return chosen
    return [row for row in ROWS.values() if not row.ablation or (ablations and not quick)]


def plan(rows: list[Row], args) -> list[tuple[Row, int, str, Path]]:
    """(row, seed, key, result path) of every run that is not cached yet.

    A run cached under another row with the same key (e.g. a learning-rate selection row equal to a main row) is
    copied instead of run again.
    """
    todo = []
    by_key = {}
    for path in (args.results_dir / "runs").glob("*/seed*.json"):
        record = load_record(path)
        if record and record.get("key"):
            by_key[record["key"]] = record
    for row in rows:
        seeds = (SEEDS[0],) if args.quick else (tuple(args.seeds) if args.seeds and row.method else row.seeds)
        for seed in seeds:
            key = run_key(row, seed, args.data_dir, args.quick)
            path = result_path(args.results_dir, row, seed)
            cached = load_record(path)
            if cached and cached.get("key") == key and not args.force:
                continue
            if key in by_key and not args.force:
                write_json(path, {**by_key[key], "row": row.name, "copied_from": by_key[key]["row"]})
                continue
            if any(k == key for _, _, k, _ in todo):
                args.duplicates.append((key, row, path))  # same settings as a queued run: copied when it is done
                continue
            todo.append((row, seed, key, path))
    return todo


def copy_duplicates(args) -> None:
    """Give the rows whose runs were identical to another queued run that run's result."""
    for key, row, path in args.duplicates:
        for source in (args.results_dir / "runs").glob("*/seed*.json"):
            record = load_record(source)
            if record and record.get("key") == key and source != path:
                write_json(path, {**record, "row": row.name, "copied_from": record["row"]})
                break


def launch(row: Row, seed: int, key: str, path: Path, args, threads: int) -> tuple[subprocess.Popen, Path]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{'quick-' if args.quick else ''}{row.name}-seed{seed}.log"
    command = [sys.executable, str(PACKAGE_DIR), "--data-dir", str(args.data_dir), "--_run", row.name,
               "--_seed", str(seed), "--_key", key, "--_out", str(path), "--threads", str(threads)]
    if args.quick:
        command.append("--quick")
    handle = open(log, "w", encoding="utf-8")
    env = {**os.environ, "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=PACKAGE_DIR.parents[1])
    handle.close()
    return process, log


def claim(path: Path, key: str, force: bool) -> Path | None:
    """Claim the run whose result goes to ``path`` for this process; ``None`` if it is done (another invocation
    finished it since the plan was made) or another live invocation is running it.

    Invocations sharing one results folder (two terminals, or a long run split in parts) thereby never run the same
    run twice: the claim is a file beside the result, created atomically, holding the claiming process's id; a claim
    whose process is gone is taken over.
    """
    if not force:
        cached = load_record(path)
        if cached and cached.get("key") == key:
            return None
    marker = path.with_name(f".{path.name}.claim")
    marker.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                owner = int(marker.read_text() or 0)
                os.kill(owner, 0)  # raises if that process is gone
                return None
            except (OSError, ValueError):
                marker.unlink(missing_ok=True)  # a stale claim: take it over
                continue
        with os.fdopen(fd, "w") as handle:
            handle.write(str(os.getpid()))
        return marker
    return None


def run_plan(todo: list[tuple[Row, int, str, Path]], args) -> list[str]:
    """Run the planned runs, ``args.jobs`` at a time (skipping those another invocation finished or is running, see
    :func:`claim`); returns the failures."""
    jobs = max(1, args.jobs)
    threads = args.threads or max(1, (os.cpu_count() or 1) // jobs)
    running: list[tuple[subprocess.Popen, Path, Row, int, float, Path]] = []
    failures: list[str] = []
    queue = list(todo)
    total = len(queue)
    done = 0
    while queue or running:
        while queue and len(running) < jobs:
            row, seed, key, path = queue.pop(0)
            marker = claim(path, key, args.force)
            if marker is None:
                done += 1
                print(f"[{done}/{total}] skipped {row.name} seed {seed}: done or running elsewhere", flush=True)
                continue
            process, log = launch(row, seed, key, path, args, threads)
            marker.write_text(str(process.pid))  # the claim lives as long as the run, even if this process dies
            running.append((process, log, row, seed, time.perf_counter(), marker))
            print(f"[{done + len(running)}/{total}] started {row.name} seed {seed} (log: {log})", flush=True)
        time.sleep(1.0)
        for item in list(running):
            process, log, row, seed, start, marker = item
            if process.poll() is None:
                continue
            marker.unlink(missing_ok=True)
            running.remove(item)
            done += 1
            elapsed = time.perf_counter() - start
            if process.returncode == 0:
                record = load_record(result_path(args.results_dir, row, seed)) or {}
                value = record.get("metrics", {}).get("stsb_dev", float("nan"))
                print(f"[{done}/{total}] {row.name} seed {seed}: STS-B dev {100 * value:.2f} in {elapsed:.0f}s",
                      flush=True)
            else:
                failures.append(f"{row.name} seed {seed} (exit {process.returncode}; log {log})")
                print(f"[{done}/{total}] FAILED {row.name} seed {seed}: exit {process.returncode}, see {log}",
                      flush=True)
    return failures


