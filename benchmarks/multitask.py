"""Many tasks on one frozen backbone: quality of a prompt set per task against LoRA and full fine-tuning, and the cost
of serving many tasks at once (run by hand).

    python benchmarks/multitask.py --data-dir ../shared/data quality          # resumable: one JSON per run
    python benchmarks/multitask.py --data-dir ../shared/data serving
    python benchmarks/multitask.py --data-dir ../shared/data report           # tables from the run files

**Quality.** Four tasks on the packaged all-MiniLM-L6-v2 with its own mean pooling: ``sts`` (CoSENT on STS-B train,
selection on STS-B dev), ``sick`` (CoSENT on SICK train, selection on SICK-R trial), ``nli`` (multiple negatives
ranking on the SNLI triplets, selection on STS-B dev) and ``dcpcse`` (DCPCSE's InfoNCE on the Wikipedia sentences,
selection on STS-B dev). Each is trained as a prompt set of a bank (16 positions, 73,728 parameters), as LoRA r = 8 on
query/value through ``add_adapter`` (73,728 parameters), and by full fine-tuning, with the same budget (one epoch,
batch 32, linear decay, seed 42) and selection (every fifth of the epoch, best weights kept); each row's learning rate
is selected on the task's own dev set over the candidates below. Both STS-B dev and SICK-R trial are reported: the
one a task selects on, and the other, which it never sees.

**Serving.** The same 2,000 Wikipedia sentences with T = 1, 4, 16, 64 tasks (the four trained sets, then perturbed
copies): (a) one encode call with a task per row (mixed batches), (b) batches grouped by task, (c) one full model per
task, (d) LoRA adapters switched with ``set_adapter`` between task-grouped batches. Throughput is paired batch by
batch against single-task batches of the same sentences; memory is the bytes each task adds.

Results: ``benchmarks/results/multitask/`` (run files, ``quality.json``, ``serving.json``) and
``benchmarks/results/multitask.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "multitask"
TASKS = ("sts", "sick", "nli", "dcpcse")
APPROACHES = ("prompts", "lora", "full")
LEARNING_RATES = {"prompts": (3e-2, 1e-1), "lora": (1e-3, 5e-3), "full": (2e-5, 5e-5)}
#: Each (task, approach) grid is extended by one rate beyond its edge where the best of the two rates above sat at
#: that edge *and* led the other by more than one point on the task's selection set (the grid is too coarse there;
#: below one point the edge is left, as CPU time is short). Decided on the selection sets only.
EXTENDED_RATES = {("sts", "prompts"): (1e-2,), ("sick", "prompts"): (3e-1,), ("sick", "full"): (1e-4,),
                  ("dcpcse", "prompts"): (1e-2,)}
BATCH_SIZE = 32
SEED = 42
PREFIX_LENGTH = 16
#: Training rows per task (``--limit``, for smoke runs; ``None``: all).
LIMIT: int | None = None
#: Dev pairs per set (smoke runs of the study only; ``None``: all).
DEV_LIMIT: int | None = None


# ------------------------------------------------------------------------------------------------- data
def senteval(data_dir: Path) -> str:
    return str(data_dir / "senteval")


def task_data(task: str, data_dir: Path):
    data = _task_data(task, data_dir)
    return data.select(range(min(LIMIT, len(data)))) if LIMIT else data


def _task_data(task: str, data_dir: Path):
    from datasets import Dataset

    from st_prompts.data.senteval import load_sts
    from st_prompts.data.training_data import read_nli_triplets, read_sentences

    if task in ("sts", "sick"):
        pairs = load_sts(senteval(data_dir), "STSBenchmark" if task == "sts" else "SICKRelatedness", "train")
        return Dataset.from_dict({"sentence1": pairs.sentences1, "sentence2": pairs.sentences2,
                                  "score": [float(s) for s in pairs.scores]})
    if task == "nli":
        triplets = read_nli_triplets(data_dir / "train" / "nli_triplets.csv")
        return Dataset.from_dict({"anchor": [t[0] for t in triplets], "positive": [t[1] for t in triplets],
                                  "negative": [t[2] for t in triplets]})
    sentences = read_sentences(data_dir / "train" / "wiki_sentences.txt")
    return Dataset.from_dict({"anchor": sentences, "positive": sentences})


def dev_evaluator(task: str, data_dir: Path):
    from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator

    from st_prompts.data.senteval import load_sts

    name = "SICKRelatedness" if task == "sick" else "STSBenchmark"
    pairs = _limited(load_sts(senteval(data_dir), name, "dev"))
    return EmbeddingSimilarityEvaluator(pairs.sentences1, pairs.sentences2, [float(s) for s in pairs.scores],
                                        name="dev", batch_size=128, main_similarity="cosine")


def evaluate(model, data_dir: Path, **encode) -> dict[str, float]:
    from st_prompts.data.senteval import load_sts
    from st_prompts.modules.lengths import full_length

    out = {}
    for key, name in (("stsb_dev", "STSBenchmark"), ("sick_trial", "SICKRelatedness")):
        pairs = _limited(load_sts(senteval(data_dir), name, "dev"))
        with full_length(model):  # sentences whole, as SentEval
            a = model.encode(pairs.sentences1, batch_size=128, normalize_embeddings=True, **encode)
            b = model.encode(pairs.sentences2, batch_size=128, normalize_embeddings=True, **encode)
        out[key] = 100 * float(spearmanr(np.sum(a * b, axis=1), pairs.scores).statistic)
    return out


def _limited(pairs):
    """The first :data:`DEV_LIMIT` pairs (smoke runs), or all."""
    if not DEV_LIMIT:
        return pairs
    return dataclasses.replace(pairs, sentences1=pairs.sentences1[:DEV_LIMIT], sentences2=pairs.sentences2[:DEV_LIMIT],
                               scores=pairs.scores[:DEV_LIMIT], subsets=pairs.subsets[:DEV_LIMIT])


# ------------------------------------------------------------------------------------------------- models
def shipped():
    from sentence_transformers import SentenceTransformer

    from st_prompts.utils import packaged_minilm_path

    return SentenceTransformer(packaged_minilm_path(), device="cpu")


def lora_model():
    from peft import LoraConfig, TaskType

    model = shipped()
    model.add_adapter(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"],
                                 task_type=TaskType.FEATURE_EXTRACTION))
    return model


def loss_for(task: str, model):
    from sentence_transformers.losses import CoSENTLoss, MultipleNegativesRankingLoss

    from st_prompts.losses import PromptContrastiveLoss

    if task in ("sts", "sick"):
        return CoSENTLoss(model)
    if task == "nli":
        return MultipleNegativesRankingLoss(model)
    return PromptContrastiveLoss(model, mlp=True)


def fit(model, data, loss, evaluator, learning_rate: float, epochs: float = 1, warmup: float = 0.0, seed: int = SEED,
        eval_steps: int | None = None, step_zero: bool = False) -> dict:
    """``epochs`` with SentenceTransformerTrainer, evaluating every fifth of the run (``eval_steps``; and before the first
    step with ``step_zero``, as ``bank.train_prompt_set`` does) and keeping the best weights."""
    from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    from transformers.trainer_callback import PrinterCallback

    from st_prompts.training.run import KeepBestCallback

    steps = -(-len(data) // BATCH_SIZE) * epochs
    eval_steps = eval_steps or max(1, int(steps // 5))
    with tempfile.TemporaryDirectory() as scratch:
        args = SentenceTransformerTrainingArguments(
            output_dir=scratch, num_train_epochs=epochs, per_device_train_batch_size=BATCH_SIZE,
            learning_rate=learning_rate, weight_decay=0.0, lr_scheduler_type="linear", seed=seed,
            warmup_steps=warmup, eval_strategy="steps", eval_steps=eval_steps, save_strategy="no",
            logging_steps=eval_steps, report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available())
        keep = KeepBestCallback(model, evaluator)
        if step_zero:
            model.eval()
            keep.consider(evaluator(model)[evaluator.primary_metric], 0)
        torch.manual_seed(seed)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss,
                                             evaluator=evaluator, callbacks=[keep])
        trainer.remove_callback(PrinterCallback)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        if keep.last_step != trainer.state.global_step:
            keep.consider(evaluator(model)[evaluator.primary_metric], trainer.state.global_step)
        keep.restore()
    model.eval()
    return {"steps": trainer.state.global_step, "best_step": keep.best_step, "selected": 100 * keep.best,
            "train_seconds": seconds}


def run_one(task: str, approach: str, learning_rate: float, data_dir: Path) -> dict:
    from st_prompts import bank, save_prompts_only

    torch.manual_seed(SEED)
    data, evaluator = task_data(task, data_dir), dev_evaluator(task, data_dir)
    start = time.process_time()
    if approach == "prompts":
        model = bank.create_bank("minilm")
        # ungated, as the recorded results were trained (a new set is gated by default since then)
        with bank.training_prompt_set(model, task, prefix_length=PREFIX_LENGTH, prefix_gate=False):
            result = fit(model, data, loss_for(task, model), evaluator, learning_rate)
        trainable = sum(p.numel() for p in model[0].prompt_sets[task].parameters())
        metrics = evaluate(model, data_dir, task=task)
        save_prompts_only(model, str(RESULTS / "sets" / f"{task}-lr{learning_rate:g}"))  # for the serving benchmark
    else:
        model = lora_model() if approach == "lora" else shipped()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result = fit(model, data, loss_for(task, model), evaluator, learning_rate)
        metrics = evaluate(model, data_dir)
    return {"task": task, "approach": approach, "learning_rate": learning_rate, "seed": SEED, **result,
            "metrics": metrics, "trainable_parameters": trainable, "cpu_seconds": time.process_time() - start,
            "rows": len(data), "batch_size": BATCH_SIZE, "torch_threads": torch.get_num_threads(),
            "load_average_end": os.getloadavg(), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}


def rates(task: str, approach: str) -> tuple[float, ...]:
    """The learning rates tried for one row: the approach's grid and its extension for that task, if any."""
    return tuple(sorted(LEARNING_RATES[approach] + EXTENDED_RATES.get((task, approach), ())))


def quality(args) -> None:
    from st_prompts.storage import write_json_atomic

    runs = RESULTS / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    base = runs / "shipped.json"
    if not base.exists():
        write_json_atomic(base, {"approach": "shipped", "metrics": evaluate(shipped(), args.data_dir)})
    for task in args.tasks:
        for approach in args.approaches:
            for lr in rates(task, approach):
                path = runs / f"{task}-{approach}-lr{lr:g}.json"
                if path.exists():
                    continue
                print(f"{task} {approach} lr {lr:g} ...", flush=True)
                record = run_one(task, approach, lr, args.data_dir)
                write_json_atomic(path, record)
                print(f"  selected {record['selected']:.2f}, STS-B dev {record['metrics']['stsb_dev']:.2f}, SICK-R "
                      f"trial {record['metrics']['sick_trial']:.2f} ({record['train_seconds']:.0f}s)", flush=True)
                gc.collect()


# ------------------------------------------------------------------------------------------------- serving
def serving(args) -> None:
    from st_prompts.data.training_data import read_sentences
    from st_prompts.storage import write_json_atomic

    torch.manual_seed(SEED)
    sentences = read_sentences(args.data_dir / "train" / "wiki_sentences.txt")[: args.sentences]
    batches = [sentences[i:i + 128] for i in range(0, len(sentences), 128)]
    trained = bank_from_runs(args)
    encoder = trained[0]
    names = list(encoder.prompt_set_names)
    backbone_bytes = sum(p.numel() * p.element_size() for p in encoder.auto_model.parameters())
    out = {"sentences": len(sentences), "batch_size": 128, "trained_sets": names, "rows": {},
           "backbone_bytes": backbone_bytes, "machine": machine(), "command": command()}
    rng = np.random.default_rng(SEED)
    for count in args.tasks_count:
        model = copy.deepcopy(trained)
        grow_bank(model, count)
        tasks = [f"t{i}" for i in range(count)]
        row_tasks = [tasks[i] for i in rng.integers(0, count, len(sentences))]
        model.eval()
        with torch.no_grad():
            # identity: a row alone, in its task's batch and in a mixed batch
            mixed = model.encode(sentences, task=row_tasks, batch_size=128, convert_to_tensor=True)
            grouped = torch.empty_like(mixed)
            for task in tasks:
                rows = [i for i, t in enumerate(row_tasks) if t == task]
                if rows:
                    grouped[rows] = model.encode([sentences[i] for i in rows], task=task, batch_size=128,
                                                 convert_to_tensor=True)
            alone = torch.stack([model.encode([sentences[i]], task=row_tasks[i], convert_to_tensor=True)[0]
                                 for i in range(0, len(sentences), 50)])
            times = paired_encode(model, batches, row_tasks, tasks, args.repeats)
            single = {"mixed": times}
        set_bytes = prompt_set_bytes(model, tasks)
        disk = prompts_only_bytes(model)
        full = full_models_serving(count, batches, row_tasks, tasks, args.repeats)
        lora = lora_serving(count, batches, row_tasks, tasks, args.repeats) if args.lora else None
        out["rows"][str(count)] = {
            "identity_max_abs_diff": {"mixed_vs_grouped": float((mixed - grouped).abs().max()),
                                      "mixed_vs_alone": float((mixed[::50] - alone).abs().max())},
            "throughput": single["mixed"], "memory_per_set_bytes": set_bytes, "disk_per_set_bytes": disk,
            "full_models": full, "lora": lora,
        }
        print(json.dumps({count: out["rows"][str(count)]["throughput"]["summary"]}), flush=True)
        del model
        gc.collect()
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json_atomic(RESULTS / "serving.json", out)


def bank_from_runs(args):
    """A bank with the selected prompt set of each task's quality runs (saved by them; an untrained set where a task
    has not run)."""
    from st_prompts import bank

    model = bank.create_bank("minilm")
    selected = select(load_runs())
    for task in TASKS:
        record = selected.get((task, "prompts"))
        folder = RESULTS / "sets" / f"{task}-lr{record['learning_rate']:g}" if record else None
        if folder is not None and folder.exists():
            bank.add_prompt_set(model, task, str(folder))
        else:
            print(f"no trained {task} set: an untrained one stands in (same cost)", flush=True)
            model[0].new_prompt_set(task, prefix_length=PREFIX_LENGTH)
    return model


def grow_bank(model, count: int) -> None:
    """``count`` sets ``t0..``: the trained ones first, then perturbed copies of them (other values, same cost)."""
    encoder = model[0]
    trained = [encoder.prompt_sets[n] for n in encoder.prompt_set_names]
    for i in range(count):
        source = trained[i % len(trained)]
        new = encoder.new_prompt_set(f"t{i}", prefix_length=source.prefix_length)
        with torch.no_grad():
            for target, value in zip(new.parameters(), source.parameters()):
                target.copy_(value + (0.0 if i < len(trained) else 0.01 * torch.randn_like(value)))


def paired_encode(model, batches, row_tasks, tasks, repeats: int) -> dict:
    """Seconds per batch of (a) a mixed batch (each row its task) and the same sentences as a single-task batch, and
    (b) the batch's rows grouped by task, interleaved batch by batch; ratios are per batch."""
    mixed, single, grouped = [], [], []
    start_row = 0
    layout = []
    for batch in batches:
        layout.append((batch, row_tasks[start_row:start_row + len(batch)]))
        start_row += len(batch)
    for batch, tasks_of_batch in layout[:1]:  # warm-up
        model.encode(batch, task=tasks_of_batch, batch_size=128)
        model.encode(batch, task=tasks[0], batch_size=128)
    for r in range(repeats):
        for k, (batch, tasks_of_batch) in enumerate(layout):
            order = ("mixed", "single", "grouped") if (k + r) % 2 == 0 else ("grouped", "single", "mixed")
            for kind in order:
                start = time.perf_counter()
                if kind == "mixed":
                    model.encode(batch, task=tasks_of_batch, batch_size=128)
                elif kind == "single":
                    model.encode(batch, task=tasks[0], batch_size=128)
                else:
                    for task in sorted(set(tasks_of_batch)):
                        model.encode([s for s, t in zip(batch, tasks_of_batch) if t == task], task=task,
                                     batch_size=128)
                {"mixed": mixed, "single": single, "grouped": grouped}[kind].append(time.perf_counter() - start)
    ratio = [s / m for m, s in zip(mixed, single)]
    ratio_grouped = [s / g for g, s in zip(grouped, single)]
    n = sum(len(b) for b in batches) * repeats
    return {"sentences_per_s": {"mixed": n / sum(mixed), "single_task": n / sum(single),
                                "grouped_by_task": n / sum(grouped)},
            "summary": {"mixed_vs_single_median": statistics.median(ratio),
                        "mixed_vs_single_quartiles": quartiles(ratio),
                        "grouped_vs_single_median": statistics.median(ratio_grouped)},
            "per_batch_mixed_vs_single": ratio}


def quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [q[0], q[2]]


def prompt_set_bytes(model, tasks) -> dict:
    encoder = model[0]
    params = sum(p.numel() * p.element_size() for n in tasks for p in encoder.prompt_sets[n].parameters())
    stacked_bytes = encoder.inference_cache_bytes()  # the stacked keys/values of the sets a mixed batch used
    return {"parameters": params / len(tasks), "stacked_cache": stacked_bytes / len(tasks),
            "total": (params + stacked_bytes) / len(tasks)}


def prompts_only_bytes(model) -> float:
    from st_prompts import save_prompts_only

    with tempfile.TemporaryDirectory() as folder:
        save_prompts_only(model, folder)
        size = os.path.getsize(os.path.join(folder, "soft_prompts.safetensors"))
    return size / len(model[0].prompt_set_names)


def grouped_timing(batches, row_tasks, repeats, encode_group) -> tuple[int, list[float]]:
    """Time each batch split into its tasks' groups, ``encode_group(task, texts)`` per group: (sentences, seconds)."""
    seconds, n = [], 0
    for _ in range(repeats):
        start_row = 0
        for batch in batches:
            tasks_of_batch = row_tasks[start_row:start_row + len(batch)]
            start_row += len(batch)
            start = time.perf_counter()
            for task in sorted(set(tasks_of_batch)):
                encode_group(task, [s for s, t in zip(batch, tasks_of_batch) if t == task])
            seconds.append(time.perf_counter() - start)
            n += len(batch)
    return n, seconds


def full_models_serving(count, batches, row_tasks, tasks, repeats) -> dict:
    """(c) one full fine-tuned model per task: the task-grouped rows of each batch go to that task's model. Up to 16
    models are held (cycled beyond); memory is the weights of ``count`` models (what serving them takes)."""
    base = shipped().eval()
    held = [copy.deepcopy(base) for _ in range(min(count, 16))]
    weights = sum(p.numel() * p.element_size() for p in base.parameters())

    def encode_group(task, texts):
        held[tasks.index(task) % len(held)].encode(texts, batch_size=128)

    n, seconds = grouped_timing(batches, row_tasks, repeats, encode_group)
    return {"sentences_per_s": n / sum(seconds), "memory_bytes": weights * count, "per_task_bytes": weights}


def lora_serving(count, batches, row_tasks, tasks, repeats) -> dict:
    """(d) LoRA adapters (r 8, query/value) on one backbone, switched with ``set_adapter`` between task groups."""
    from peft import LoraConfig, TaskType

    model = shipped().eval()
    for task in tasks:
        model.add_adapter(LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"],
                                     task_type=TaskType.FEATURE_EXTRACTION), adapter_name=task)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n) / count

    def encode_group(task, texts):
        model.set_adapter(task)
        model.encode(texts, batch_size=128)

    with torch.no_grad():
        n, seconds = grouped_timing(batches, row_tasks, repeats, encode_group)
    return {"sentences_per_s": n / sum(seconds), "per_adapter_bytes": adapter_bytes}


# ------------------------------------------------------------------------------------------------- report
def load_runs() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((RESULTS / "runs").glob("*-lr*.json"))]


def select(records: list[dict]) -> dict:
    """The run of each (task, approach) with the best selection score on the task's dev set."""
    best = {}
    for r in records:
        key = (r["task"], r["approach"])
        if key not in best or r["selected"] > best[key]["selected"]:
            best[key] = r
    return best


def machine() -> str:
    from common import cpu_model

    return f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__}, {torch.get_num_threads()} threads"


def command() -> str:
    return "python benchmarks/multitask.py " + " ".join(sys.argv[1:])


def report(args) -> None:
    from st_prompts.storage import write_file_atomic, write_json_atomic

    records = load_runs()
    best = select(records)
    base = json.loads((RESULTS / "runs" / "shipped.json").read_text()) if (RESULTS / "runs" / "shipped.json"
                                                                           ).exists() else None
    selection = {"sts": "STS-B dev", "sick": "SICK-R trial", "nli": "STS-B dev", "dcpcse": "STS-B dev"}
    lines = ["# Many tasks on one frozen backbone", "",
             f"Packaged all-MiniLM-L6-v2, mean pooling (its own); one epoch, batch {BATCH_SIZE}, seed {SEED}, "
             "best weights of five evaluations on the task's selection set; learning rate selected per row on that "
             "set over " + "; ".join(f"{a} {', '.join(f'{x:g}' for x in lrs)}" for a, lrs in LEARNING_RATES.items())
             + " (extended by one rate beyond the edge where the best led by more than a point: "
             + "; ".join(f"{t} {a} {', '.join(f'{x:g}' for x in lrs)}" for (t, a), lrs in EXTENDED_RATES.items())
             + "). Spearman × 100. Command: `python benchmarks/multitask.py --data-dir ../shared/data quality "
             f"--tasks {' '.join(t for t in TASKS if any(r['task'] == t for r in records))}`"
             f"{'' if {r['task'] for r in records} >= set(TASKS) else ' (the tasks not listed did not run)'}.", ""]
    if base:
        lines += [f"The shipped model, untouched: STS-B dev {base['metrics']['stsb_dev']:.2f}, SICK-R trial "
                  f"{base['metrics']['sick_trial']:.2f}.", ""]
    lines += ["| task (selection set) | approach | lr | trainable | STS-B dev | SICK-R trial | train s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for task in TASKS:
        for approach in APPROACHES:
            r = best.get((task, approach))
            if r is None:
                continue
            lines.append(f"| {task} ({selection[task]}) | {approach} | {r['learning_rate']:g} | "
                         f"{r['trainable_parameters']:,} | {r['metrics']['stsb_dev']:.2f} | "
                         f"{r['metrics']['sick_trial']:.2f} | {r['train_seconds']:.0f} |")
    lines += ["", "Every run (the selected one of each row in bold):", "",
              "| run | selected on its set | STS-B dev | SICK-R trial |", "|---|---:|---:|---:|"]
    for r in records:
        chosen = best.get((r["task"], r["approach"])) is r
        name = f"{r['task']} {r['approach']} lr {r['learning_rate']:g}"
        lines.append(f"| {'**' + name + '**' if chosen else name} | {r['selected']:.2f} | "
                     f"{r['metrics']['stsb_dev']:.2f} | {r['metrics']['sick_trial']:.2f} |")
    serving_file = RESULTS / "serving.json"
    if serving_file.exists():
        s = json.loads(serving_file.read_text())
        lines += ["", "## Serving many tasks", "",
                  f"`{s['command']}`; {s['machine']}. {s['sentences']} Wikipedia sentences, batches of "
                  f"{s['batch_size']}, a random task per row. Throughput in sentences per second; \"mixed ÷ single\" is "
                  "the median over batches of a single-task batch's time over the mixed batch's time on the same "
                  "sentences (paired, interleaved). Memory and disk: what each extra task adds (the backbone, "
                  f"{s['backbone_bytes'] / 2**20:.1f} MiB, is held once).", "",
                  "| T | mixed batches | grouped by task | single task | mixed ÷ single (quartiles) | one full model "
                  "per task | LoRA + set_adapter | memory per set | disk per set | full models' memory | max "
                  "difference mixed vs alone / grouped |",
                  "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
        for count, row in s["rows"].items():
            t = row["throughput"]
            q1, q3 = t["summary"]["mixed_vs_single_quartiles"]
            lora = row.get("lora")
            lines.append(
                f"| {count} | {t['sentences_per_s']['mixed']:.0f} | {t['sentences_per_s']['grouped_by_task']:.0f} | "
                f"{t['sentences_per_s']['single_task']:.0f} | {t['summary']['mixed_vs_single_median']:.3f} "
                f"({q1:.3f}-{q3:.3f}) | {row['full_models']['sentences_per_s']:.0f} | "
                f"{(format(lora['sentences_per_s'], '.0f') if lora else '–')} | "
                f"{row['memory_per_set_bytes']['total'] / 1e3:.0f} KB | {row['disk_per_set_bytes'] / 1e3:.0f} KB | "
                f"{row['full_models']['memory_bytes'] / 2**20:.0f} MiB | "
                f"{row['identity_max_abs_diff']['mixed_vs_alone']:.1e} / "
                f"{row['identity_max_abs_diff']['mixed_vs_grouped']:.1e} |")
    study = REPO / "benchmarks" / "results" / "multitask_study" / "study.md"
    if study.exists():  # the study's --report-only wrote it (archived: benchmarks/results/archived-probes.md)
        lines += ["", study.read_text().strip()]
    text = "\n".join(lines) + "\n"
    write_file_atomic(RESULTS.parent / "multitask.md" if RESULTS.name == "multitask" else RESULTS / "multitask.md", text)
    write_json_atomic(RESULTS / "quality.json", {"selected": {f"{t}/{a}": r for (t, a), r in best.items()},
                                                 "shipped": base})
    print(text)


def main(argv=None) -> None:
    global RESULTS, LIMIT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("action", choices=("quality", "serving", "report"))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--approaches", nargs="+", default=list(APPROACHES), choices=APPROACHES)
    parser.add_argument("--tasks-count", nargs="+", type=int, default=[1, 4, 16, 64], help="serving: T values")
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-lora", dest="lora", action="store_false")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--limit", type=int, help="training rows per task (smoke runs)")
    parser.add_argument("--results", type=Path, help=f"results folder (default: {RESULTS.relative_to(REPO)})")
    args = parser.parse_args(argv)
    RESULTS, LIMIT = args.results or RESULTS, args.limit
    if args.threads:
        torch.set_num_threads(args.threads)
    {"quality": quality, "serving": serving, "report": report}[args.action](args)


if __name__ == "__main__":
    main()
