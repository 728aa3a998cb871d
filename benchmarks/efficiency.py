"""Efficiency of every benchmark row against SimCSE full fine-tuning on the same batches: training step time, peak
training memory, encode throughput relative to the plain backbone, checkpoint sizes, and whether the saved model
reloads.

Run by hand, on an otherwise idle machine (timings are only comparable within one run)::

    python benchmarks/efficiency.py --data-dir ../shared/data                  # every main row + the variants
    python benchmarks/efficiency.py --data-dir ../shared/data --rows dcpcse-unsup simcse-unsup lora-unsup
    python benchmarks/efficiency.py --data-dir ../shared/data --quick          # 1 + 2 steps per row (smoke run)

The rows are those of ``benchmarks/run_all`` (same settings, seed 42, batch 64, max length 32) plus efficiency
variants of DCPCSE: one prefix dropout mask per batch (``prefix_dropout_shared``), activation checkpointing
(``gradient_checkpointing``), and ``torch.compile`` of the backbone. DiffAug is measured in its stage 2 (joint tuning,
the stage that costs), D2CSE with its corruption computed before the timed steps (it is a pre-pass), SKICSE on its SKI
data. Each row runs in a fresh process, on the same first ``(warm-up + steps) × 64`` training rows of its setting:

1. **Step time**: the trainer's own training steps (``SentenceTransformerTrainer`` via ``st_prompts.training.train``,
   timed from ``on_step_begin`` to ``on_step_end``: forward, loss, backward, optimizer step), median over
   ``--steps`` steps after ``--warmup`` warm-up steps; ratio to SimCSE of the same setting.
2. **Training memory**: the peak of live tensor bytes created during the first two training steps (torch profiler with
   ``profile_memory``; the weights, present before, are not counted): gradients, optimizer state, activations,
   temporaries. The CPU counterpart of ``torch.cuda.max_memory_allocated`` minus the weights. Ratio to SimCSE.
3. **Encode throughput**: ``model.encode`` of ``--encode-sentences`` Wikipedia sentences (batch 128, eval mode)
   against the plain backbone with the same pooling, interleaved repetitions, best of each; ratio.
4. **Checkpoints**: the bytes ``model.save`` writes, and ``save_prompts_only`` where the backbone is unchanged; whether
   ``SentenceTransformer(path, trust_remote_code=True)`` reloads it with the same embeddings.

Results: ``benchmarks/results/run_all/efficiency.json`` and ``efficiency.md`` (``--quick``: ``outputs/``), which
``run_all`` puts into its report.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent / "run_all"))
import rows as run_all_rows  # noqa: E402
import runner as run_all_runner  # noqa: E402
from rows import ROWS, Row  # noqa: E402

CHILD_MARKER = "EFFICIENCY_CHILD_RESULT "
MiB = 2**20
TARGETS = {"memory_vs_simcse": 0.70, "throughput_vs_backbone": 0.95}

#: Efficiency variants of DCPCSE (the things issue 11 asks to try), measured beside the rows of run_all.
VARIANTS = [
    Row("dcpcse-unsup+shared-dropout", "DCPCSE, one prefix dropout mask per batch", "dcpcse", False,
        (("prefix_dropout_shared", True),)),
    Row("dcpcse-sup+shared-dropout", "DCPCSE, one prefix dropout mask per batch", "dcpcse", True,
        (("prefix_dropout_shared", True),)),
    Row("dcpcse-unsup+checkpointing", "DCPCSE, activation checkpointing", "dcpcse", False,
        (("gradient_checkpointing", True),)),
    Row("dcpcse-unsup+compile", "DCPCSE, torch.compile of the backbone", "dcpcse", False, note="compile"),
    Row("lora-unsup+checkpointing", "LoRA, activation checkpointing", "simcse", False,
        (("learning_rate", run_all_rows.LORA_LR[False]), ("gradient_checkpointing", True)), adapter="lora"),
    Row("simcse-unsup+checkpointing", "SimCSE, activation checkpointing", "simcse", False,
        (("gradient_checkpointing", True),)),
]
ALL = {**{r.name: r for r in ROWS.values() if not r.ablation and r.method is not None}, **{r.name: r for r in VARIANTS}}
#: The rows whose step times the targets compare, timed step by step in one process (see paired_child).
PAIRED = {
    setting: [f"simcse-{setting}", f"lora-{setting}", f"peft-prefix-{setting}", f"dcpcse-{setting}",
              f"dcpcse-{setting}+shared-dropout"]
    for setting in ("unsup", "sup")
}


def apply_variant(model, row: Row):
    """The model of a variant row whose change is not a setting (torch.compile)."""
    import torch

    if row.note == "compile":
        model[0].auto_model.forward = torch.compile(model[0].auto_model.forward, dynamic=True)
    return model


# ------------------------------------------------------------------------------------------------- child
class StepProbe:
    """Trainer callback: times steps after the warm-up and profiles the memory of the first two steps."""

    def __new__(cls, *args, **kwargs):
        from transformers import TrainerCallback

        class _Probe(TrainerCallback):
            def __init__(self, warmup: int, profile: bool, last_step: int) -> None:
                self.warmup, self.profile, self.last_step = warmup, profile, last_step
                self.times: list[float] = []
                self._start = 0.0
                self.profiler = None
                self.op_profiler = None

            def on_step_begin(self, args, state, control, **kw):
                from torch.profiler import ProfilerActivity, profile

                if self.profile and state.global_step == 0:
                    gc.collect()
                    self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                            record_shapes=True, with_stack=True)
                    self.profiler.start()
                if state.global_step == self.last_step - 1:  # the last step: where the time goes, by operator
                    self.op_profiler = profile(activities=[ProfilerActivity.CPU])
                    self.op_profiler.start()
                self._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                elapsed = time.perf_counter() - self._start
                if self.op_profiler is not None and state.global_step == self.last_step:
                    self.op_profiler.stop()
                elif state.global_step > self.warmup:
                    self.times.append(elapsed)
                if self.profiler is not None and state.global_step == 2:
                    self.profiler.stop()

        return _Probe(*args, **kwargs)


def peak_live_tensors(profiler) -> dict[str, Any]:
    """Peak of live tensor bytes created while profiling (tensors that existed before, e.g. weights, excluded), with
    the breakdown by the profiler's categories (activation, gradient, optimizer state, ...) at the peak."""
    from torch.profiler._memory_profiler import Action

    memory = profiler._memory_profile()
    live: dict = {}
    total = peak = 0
    at_peak: dict[str, int] = {}
    for _, action, (key, version), size in memory.timeline:
        if action == Action.PREEXISTING:
            continue
        if action == Action.CREATE:
            live[key] = (size, memory._categories.get(key, version))
            total += size
        elif action == Action.INCREMENT_VERSION and key in live:
            live[key] = (live[key][0], memory._categories.get(key, version))
        elif action == Action.DESTROY and key in live:
            total -= live.pop(key)[0]
        if total > peak:
            peak = total
            at_peak = {}
            for size_, category in live.values():
                name = category.name.lower() if category is not None else "unknown"
                at_peak[name] = at_peak.get(name, 0) + size_
    return {"peak_mib": peak / MiB,
            "breakdown_mib": {k: v / MiB for k, v in sorted(at_peak.items(), key=lambda kv: -kv[1])}}


def top_operators(profiler, count: int = 8) -> dict[str, float]:
    """Self CPU milliseconds of the most expensive operators of the profiled step (``aten::`` ops only)."""
    averages = [e for e in profiler.key_averages() if e.key.startswith("aten::")]
    averages.sort(key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in averages)
    out = {e.key.removeprefix("aten::"): e.self_cpu_time_total / 1000 for e in averages[:count]}
    out["(all aten ops)"] = total / 1000
    return out


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def checkpoints(model, row: Row) -> dict[str, Any]:
    """Bytes written by model.save (and save_prompts_only where allowed); does each reload to the same embeddings?"""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from st_prompts.errors import BackboneMismatchError
    from st_prompts.modules import PromptedTransformer, save_prompts_only

    probe = ["A man is playing a guitar.", "The cat sits on the mat.", "Stocks fell sharply on Monday."]
    model.eval()
    reference = model.encode(probe, convert_to_numpy=True)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        targets = {"saved": Path(tmp, "saved")}
        model.save(str(targets["saved"]), create_model_card=False)
        if isinstance(model[0], PromptedTransformer):
            try:
                save_prompts_only(model, str(Path(tmp, "prompts-only")))
                targets["prompts_only"] = Path(tmp, "prompts-only")
            except BackboneMismatchError:
                out["prompts_only"] = {"bytes": None, "reloads": "refused: the backbone was trained"}
        for kind, path in targets.items():
            entry: dict[str, Any] = {"bytes": directory_bytes(path)}
            try:
                again = SentenceTransformer(str(path), trust_remote_code=True)
                same = np.allclose(again.encode(probe, convert_to_numpy=True), reference, atol=1e-5)
                entry["reloads"] = "identical embeddings" if same else "DIFFERENT embeddings"
            except Exception as exc:  # what a user meets when reloading: record it
                entry["reloads"] = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            out[kind] = entry
    return out


def plain_backbone(pooling_module):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from st_prompts.utils import packaged_minilm_path

    encoder = Transformer(packaged_minilm_path(), max_seq_length=32)
    mode = getattr(pooling_module, "pooling_mode_cls_token", True)
    return SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(),
                                                         pooling_mode="cls" if mode else "mean")])


def throughput(model, sentences: list[str], repeats: int) -> dict[str, Any]:
    import torch

    plain = plain_backbone(model[1])
    models = {"model": model.eval(), "backbone": plain.eval()}
    with torch.no_grad():
        for m in models.values():
            m.encode(sentences[:128], batch_size=128)
        rates: dict[str, list[float]] = {k: [] for k in models}
        for r in range(repeats):
            for name in (("model", "backbone") if r % 2 == 0 else ("backbone", "model")):
                start = time.perf_counter()
                models[name].encode(sentences, batch_size=128)
                rates[name].append(len(sentences) / (time.perf_counter() - start))
    return {"sentences_per_s": {k: max(v) for k, v in rates.items()}, "all": rates,
            "ratio": max(rates["model"]) / max(rates["backbone"])}


def child(row: Row, args) -> dict[str, Any]:
    import torch

    from st_prompts import methods
    from st_prompts.data.training_data import read_sentences
    from st_prompts.training.run import count_parameters, train

    data_dir = Path(args.data_dir)
    steps = args.warmup + args.steps
    overrides = dict(max_steps=steps + 1, eval_steps=10**6, logging_steps=10**6)  # + 1 step profiled by operator
    overrides.update(dict(methods.config(row.method).last_stage_alone))  # e.g. DiffAug's stage 2 without stage 1
    with tempfile.TemporaryDirectory() as tmp:
        settings = run_all_rows.run_settings(row, 42, data_dir, False, os.path.join(tmp, "run"))
        settings = settings.replace(**overrides)
        method = methods.get(row.method)
        stages = method.stages(settings)
        stage = stages[-1]
        data = stage.load_data(settings, str(data_dir), (steps + 1) * settings.batch_size)
        model = method.build_model(settings)
        if row.adapter:
            model = run_all_runner.attach_adapter(model, row)
        model = apply_variant(model, row)
        # The memory profiler with a compiled model needs more memory than this machine has (killed): not profiled.
        probe = StepProbe(args.warmup, profile=not args.no_memory and row.note != "compile", last_step=steps + 1)
        load = os.getloadavg()
        model, _ = train(settings, data if len(stages) == 1 else {stage.name: data}, None, model=model,
                         show_progress_bar=False, callbacks=[probe])
    memory = peak_live_tensors(probe.profiler) if probe.profiler is not None else None
    operators = top_operators(probe.op_profiler) if probe.op_profiler is not None else None
    trainable, total = count_parameters(model)
    sentences = read_sentences(data_dir / "train" / "wiki_sentences.txt")[: args.encode_sentences]
    gc.collect()
    result = {
        "row": row.name, "label": row.label, "setting": row.setting,
        "step_seconds": {"median": statistics.median(probe.times), "all": probe.times},
        "memory": memory,
        "operators_ms": operators,
        "throughput": throughput(model, sentences, args.repeats),
        "checkpoints": {} if row.note == "compile" else checkpoints(model, row),
        "trainable_parameters": trainable, "total_parameters": total,
        "load_average_start": load, "load_average_end": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
    }
    return result


def paired_throughput(models: dict[str, Any], sentences: list[str], repeats: int) -> dict[str, Any]:
    """Encode throughput of each model against the plain backbone, paired batch by batch in one process.

    ``sentences`` are cut into batches of 128; every batch is encoded (eval mode) by the backbone and by each model
    back to back, starting with a different one each batch, ``repeats`` times over. A model's ratio is the backbone's
    time on a batch over the model's on the same batch in the same round, then the median and quartiles across all
    batches and repeats: load drifts, which on a shared 2-core machine move a whole ``encode`` call by ±5 %, cancel
    out as in the paired step times."""
    import torch

    first = next(iter(models.values()))
    every = {"backbone": plain_backbone(first[1]).eval(), **{name: m.eval() for name, m in models.items()}}
    names = list(every)
    batches = [sentences[i:i + 128] for i in range(0, len(sentences), 128)]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for model in every.values():
            model.encode(batches[0], batch_size=128, show_progress_bar=False)
        turn = 0
        for _ in range(repeats):
            for batch in batches:
                for name in names[turn % len(names):] + names[:turn % len(names)]:
                    start = time.perf_counter()
                    every[name].encode(batch, batch_size=128, show_progress_bar=False)
                    seconds[name].append(time.perf_counter() - start)
                turn += 1
    total = repeats * len(sentences)
    out: dict[str, Any] = {"backbone": {"sentences_per_s": total / sum(seconds["backbone"])},
                           "repeats": repeats, "sentences": len(sentences), "batches": len(batches)}
    for name in models:
        per_batch = [b / m for m, b in zip(seconds[name], seconds["backbone"])]
        quartiles = statistics.quantiles(per_batch, n=4) if len(per_batch) > 1 else [per_batch[0]] * 3
        out[name] = {"sentences_per_s": total / sum(seconds[name]), "vs_backbone": per_batch,
                     "median_vs_backbone": statistics.median(per_batch),
                     "quartiles_vs_backbone": [quartiles[0], quartiles[2]]}
    return out


def paired_child(setting: str, args) -> dict[str, Any]:
    """Step times of the rows of ``PAIRED[setting]`` measured in one process, interleaved step by step on the same
    batches, so that load drifts and batch lengths cancel out of the comparison.

    Each row gets the trainer :func:`st_prompts.training.run.train` would build (``stage_trainer``) and its own
    optimizer; a step is what the trainer's loop does: ``trainer.training_step`` (forward, loss, backward), gradient
    clipping, the optimizer and scheduler steps. Round ``k`` runs batch ``k`` through every row, starting with a
    different row each round; the first ``--warmup`` rounds are not timed.
    """
    import torch

    from st_prompts import methods
    from st_prompts.training.run import stage_trainer

    data_dir = Path(args.data_dir)
    rounds = args.warmup + args.steps
    entries = {}
    draws: dict[str, list[int]] = {}  # prefix dropout draws of each pass, per row with a prefix
    shared: set[str] = set()  # the rows drawing one prefix dropout mask per batch
    with tempfile.TemporaryDirectory() as tmp:
        for name in PAIRED[setting]:
            row = ALL[name]
            settings = run_all_rows.run_settings(row, 42, data_dir, False, os.path.join(tmp, name))
            settings = settings.replace(max_steps=rounds, eval_steps=10**6, logging_steps=10**6)
            method = methods.get(row.method)
            stage = method.stages(settings)[-1]
            data = stage.load_data(settings, str(data_dir), rounds * settings.batch_size)
            torch.manual_seed(settings.seed)
            model = method.build_model(settings)
            if row.adapter:
                model = run_all_runner.attach_adapter(model, row)
            model = apply_variant(model, row)
            trainer, _, _ = stage_trainer(settings, stage, data, model, show_progress_bar=False)
            trainer.create_optimizer_and_scheduler(num_training_steps=rounds)
            trainer.current_gradient_accumulation_steps = 1  # set by the trainer's loop, read by training_step
            batches = [batch for _, batch in zip(range(rounds), trainer.get_train_dataloader())]
            entries[name] = (trainer, batches, [])
            prefix = getattr(model[0], "prefix_encoder", None)
            if prefix is not None:
                draws[name] = count_prefix_draws(prefix)
                if prefix.shared_dropout:
                    shared.add(name)

        def step(trainer, batch) -> float:
            model = trainer.model
            start = time.perf_counter()
            trainer.training_step(model, batch)
            if trainer.args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad()
            return time.perf_counter() - start

        names = list(entries)
        load = os.getloadavg()
        for k in range(rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                trainer, batches, times = entries[name]
                elapsed = step(trainer, batches[k])
                if k >= args.warmup:
                    times.append(elapsed)
        from st_prompts.data.training_data import read_sentences

        sentences = read_sentences(data_dir / "train" / "wiki_sentences.txt")[: args.encode_sentences]
        encode = paired_throughput({name: entries[name][0].model for name in names if not name.startswith("simcse")},
                                   sentences, args.encode_repeats)
    base = entries[names[0]][2]
    out: dict[str, Any] = {"setting": setting, "rows": {}, "base": names[0], "load_average_start": load,
                           "load_average_end": os.getloadavg(), "torch_threads": torch.get_num_threads(),
                           "encode": encode}
    for name, (_, _, times) in entries.items():
        per_batch = [t / b for t, b in zip(times, base)]
        quartiles = statistics.quantiles(per_batch, n=4) if len(per_batch) > 1 else [per_batch[0]] * 3
        out["rows"][name] = {"seconds": times, "median_seconds": statistics.median(times),
                             "vs_base": per_batch, "median_vs_base": statistics.median(per_batch),
                             "quartiles_vs_base": [quartiles[0], quartiles[2]]}
        if name in encode:
            out["rows"][name]["encode"] = encode[name]
        if name in draws:
            # What the prefix dropout draws cost by themselves: one step's keep decisions, drawn alone
            per_step = sum(draws[name]) // rounds
            out["rows"][name]["prefix_dropout_draws_per_step"] = per_step
            seconds = draw_seconds(per_step)
            # a shared mask is drawn by nn.Dropout (bernoulli_) on the prefix itself
            out["rows"][name]["prefix_dropout_draw_ms"] = 1000 * seconds["bernoulli" if name in shared else "package"]
            out["rows"][name]["prefix_dropout_bernoulli_ms"] = 1000 * seconds["bernoulli"]
    return out


def count_prefix_draws(prefix) -> list[int]:
    """Wrap ``prefix.values`` to record how many dropout numbers each pass draws (one per example and prefix entry
    with a mask per example; one per prefix entry with a shared mask)."""
    counts: list[int] = []
    original = prefix.values

    def values(batch_size: int):
        draw = original(batch_size)
        if prefix.training and prefix.dropout.p > 0:
            counts.append(draw.keep.numel() if draw.keep is not None else draw.prefix.numel())
        return draw

    prefix.values = values
    return counts


def draw_seconds(count: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of drawing ``count`` dropout keep decisions alone: as the prefix encoder draws them
    (``st_prompts.prompts.prefix.draw_keep_mask``, 16 random bits each) and with ``torch.bernoulli_`` into a boolean
    tensor (what ``nn.Dropout`` draws, one random number each), for comparison."""
    import torch

    from st_prompts.prompts.prefix import draw_keep_mask

    if count == 0:
        return {"package": 0.0, "bernoulli": 0.0}
    target = torch.empty(count, dtype=torch.bool)
    ways = {"package": lambda: draw_keep_mask((count,), 0.1), "bernoulli": lambda: target.bernoulli_(0.9)}
    out = {}
    for name, draw in ways.items():
        draw()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            draw()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


# ------------------------------------------------------------------------------------------------- parent
def measure(row: Row, args) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--_child", row.name, "--data-dir", str(args.data_dir),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--encode-sentences",
               str(args.encode_sentences), "--repeats", str(args.repeats)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.no_memory:
        command.append("--no-memory")
    env = {**os.environ, "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(CHILD_MARKER):
            return json.loads(line[len(CHILD_MARKER):])
    return {"row": row.name, "label": row.label, "setting": row.setting,
            "error": f"exit {done.returncode}: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]}


def measure_paired(setting: str, args) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--_paired", setting, "--data-dir", str(args.data_dir),
               "--steps", str(args.paired_steps), "--warmup", str(args.warmup), "--encode-sentences",
               str(args.encode_sentences), "--encode-repeats", str(args.encode_repeats)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    env = {**os.environ, "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(CHILD_MARKER):
            return json.loads(line[len(CHILD_MARKER):])
    last = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    return {"setting": setting, "error": f"exit {done.returncode}: {last}"}


def human_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def markdown(report: dict[str, Any]) -> str:
    results = report["rows"]
    lines = [
        "# Efficiency against SimCSE full fine-tuning (same batches)",
        "",
        f"`{report['command']}`; {report['machine']}; load average (1 min) {report['load_min']:.2f}-"
        f"{report['load_max']:.2f} during the runs. Batch 64 (two or three columns), max length 32, seed 42; step "
        f"time = median of {report['steps']} trainer steps after {report['warmup']} warm-up steps; memory = peak of "
        "live tensors created in the first two steps (weights excluded); throughput = `encode` of "
        f"{report['encode_sentences']} sentences against the plain backbone with the same pooling (best of "
        f"{report['repeats']}). Targets: this package's deep prompts (DCPCSE) at most LoRA's and PEFT prefix "
        "tuning's step time and memory, memory ≤ 0.70 × SimCSE, throughput ≥ 0.95 × the backbone.",
        "",
        "| row | step (s) | × SimCSE | memory (MiB) | × SimCSE | encode × backbone | `model.save` | reloads | "
        "prompts-only | reloads |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| `{name}` | failed: {r['error']} |  |  |  |  |  |  |  |  |")
            continue
        ck = r.get("checkpoints", {})
        saved, prompts = ck.get("saved", {}), ck.get("prompts_only", {})
        mem = r["memory"]["peak_mib"] if r.get("memory") else None
        lines.append(
            f"| `{name}` {r['label']} | {r['step_seconds']['median']:.3f} | {r.get('step_vs_simcse', float('nan')):.3f} | "
            f"{'–' if mem is None else f'{mem:.0f}'} | "
            f"{'–' if r.get('memory_vs_simcse') is None else format(r['memory_vs_simcse'], '.3f')} | "
            f"{r['throughput']['ratio']:.3f} | {human_bytes(saved.get('bytes'))} | {saved.get('reloads', '–')} | "
            f"{human_bytes(prompts.get('bytes'))} | {prompts.get('reloads', '–')} |"
        )
    lines += ["", "Live tensors at the memory peak (MiB):", ""]
    for name, r in results.items():
        if r.get("memory"):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["memory"]["breakdown_mib"].items() if v >= 0.05)
            lines.append(f"- `{name}`: {parts}")
    lines += ["", "Where one training step's time goes (self CPU ms of the top operators in one profiled step; the "
              "profiler slows the step, so compare rows rather than read absolute times):", ""]
    for name, r in results.items():
        if r.get("operators_ms"):
            parts = ", ".join(f"{k} {v:.0f}" for k, v in r["operators_ms"].items())
            lines.append(f"- `{name}`: {parts}")
    paired = {k: v for k, v in report.get("paired", {}).items() if "error" not in v}
    if paired:
        lines += ["", f"Paired step times (the rows the targets compare, in one process, interleaved step by step on "
                  f"the same batches: {report.get('paired_steps')} timed batches after {report['warmup']} warm-up; "
                  "the ratio is taken per batch, then the median and the quartiles across batches; load drifts and "
                  "batch lengths cancel out of it):", "",
                  "| row | median step (s) | × first row, median | quartiles | prefix dropout draws per step | "
                  "drawing them alone (ms) | with `bernoulli_` (ms) | encode × backbone, median | quartiles |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---|"]
        for setting, result in paired.items():
            lines.append(f"| **{setting}** (first row: `{result['base']}`) |  |  |  |  |  |  |  |  |")
            for name, r in result["rows"].items():
                q1, q3 = r["quartiles_vs_base"]
                count = r.get("prefix_dropout_draws_per_step")
                drawn = "–" if count is None else f"{count / 1e6:.2f}M"
                draw_ms = "–" if count is None else f"{r['prefix_dropout_draw_ms']:.0f}"
                bern = r.get("prefix_dropout_bernoulli_ms")
                bern_ms = "–" if bern is None else f"{bern:.0f}"
                enc = r.get("encode")
                enc_text = ("– | –" if enc is None else f"{enc['median_vs_backbone']:.3f} | "
                            f"{enc['quartiles_vs_backbone'][0]:.3f}-{enc['quartiles_vs_backbone'][1]:.3f}")
                lines.append(f"| `{name}` {ALL[name].label} | {r['median_seconds']:.3f} | {r['median_vs_base']:.3f} | "
                             f"{q1:.3f}-{q3:.3f} | {drawn} | {draw_ms} | {bern_ms} | {enc_text} |")
        encoded = next((v["encode"] for v in paired.values() if "encode" in v), None)
        if encoded:
            lines += ["", f"Encode × backbone in this table: the same models (after the timed steps; a prefix's "
                      f"values do not change its cost) and the plain backbone encode the same {encoded['sentences']} "
                      f"sentences in one process, batch by batch ({encoded['batches']} batches of up to 128, each "
                      "encoded by every model back to back in a rotating order, "
                      f"{encoded['repeats']} rounds); the ratio is the backbone's time over the model's on the same "
                      "batch, then the median and quartiles across batches. The first table's column (best of "
                      f"{report['repeats']}, each row in its own process after its training steps) is noisier: there "
                      "the SimCSE rows, which have the backbone's architecture, read "
                      + " and ".join(f"{results[n]['throughput']['ratio']:.3f}" for n in ("simcse-unsup", "simcse-sup")
                                     if n in results and "error" not in results[n]) + "."]
    checks = report.get("targets")
    if checks:
        lines += ["", "Targets:", ""] + [f"- {text}: **{'met' if ok else 'not met'}**" for text, ok in checks]
    return "\n".join(lines) + "\n"


def paired_ratio(paired: dict[str, Any] | None, name: str, other: str) -> tuple[float, float, float] | None:
    """Median and quartiles over batches of ``name``'s step time / ``other``'s on the same batch (paired run)."""
    if not paired or "error" in paired or name not in paired["rows"] or other not in paired["rows"]:
        return None
    values = [a / b for a, b in zip(paired["rows"][name]["seconds"], paired["rows"][other]["seconds"])]
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return statistics.median(values), q[0], q[2]


def ratios(results: dict[str, Any], paired: dict[str, Any] | None = None) -> list[tuple[str, bool]]:
    """Fill in the ratios against SimCSE of the same setting; return the target checks (the step-time ones from the
    paired measurement when there is one)."""
    for r in results.values():
        if "error" in r:
            continue
        base = results.get("simcse-sup" if r["setting"] == "supervised" else "simcse-unsup")
        if base and "error" not in base:
            r["step_vs_simcse"] = r["step_seconds"]["median"] / base["step_seconds"]["median"]
            if r.get("memory") and base.get("memory"):
                r["memory_vs_simcse"] = r["memory"]["peak_mib"] / base["memory"]["peak_mib"]
    checks = []
    for setting in ("unsup", "sup"):
        ours, lora, prefix = (results.get(f"{m}-{setting}") for m in ("dcpcse", "lora", "peft-prefix"))
        if not all(x and "error" not in x for x in (ours, lora, prefix)):
            continue
        pair = (paired or {}).get(setting)
        vs_lora, vs_prefix = (paired_ratio(pair, f"dcpcse-{setting}", f"{m}-{setting}")
                              for m in ("lora", "peft-prefix"))
        if vs_lora and vs_prefix:
            checks.append((f"DCPCSE {setting} step time ≤ LoRA's and PEFT prefix's (paired, median per batch: "
                           f"{vs_lora[0]:.3f} × LoRA [quartiles {vs_lora[1]:.3f}-{vs_lora[2]:.3f}], "
                           f"{vs_prefix[0]:.3f} × PEFT prefix [{vs_prefix[1]:.3f}-{vs_prefix[2]:.3f}])",
                           vs_lora[0] <= 1.0 and vs_prefix[0] <= 1.0))
        else:
            fastest = min(lora["step_seconds"]["median"], prefix["step_seconds"]["median"])
            checks.append((f"DCPCSE {setting} step time ≤ LoRA's and PEFT prefix's "
                           f"({ours['step_seconds']['median']:.3f} s vs {lora['step_seconds']['median']:.3f} / "
                           f"{prefix['step_seconds']['median']:.3f})",
                           ours["step_seconds"]["median"] <= fastest))
        if ours.get("memory") and lora.get("memory") and prefix.get("memory"):
            least = min(lora["memory"]["peak_mib"], prefix["memory"]["peak_mib"])
            checks.append((f"DCPCSE {setting} memory ≤ LoRA's and PEFT prefix's ({ours['memory']['peak_mib']:.0f} MiB "
                           f"vs {lora['memory']['peak_mib']:.0f} / {prefix['memory']['peak_mib']:.0f})",
                           ours["memory"]["peak_mib"] <= least))
            checks.append((f"DCPCSE {setting} memory ≤ 0.70 × SimCSE ({ours['memory_vs_simcse']:.3f})",
                           ours["memory_vs_simcse"] <= TARGETS["memory_vs_simcse"]))
        encode = ((pair or {}).get("rows", {}).get(f"dcpcse-{setting}") or {}).get("encode")
        if encode:
            q1, q3 = encode["quartiles_vs_backbone"]
            checks.append((f"DCPCSE {setting} encode throughput ≥ 0.95 × backbone (paired, median of "
                           f"{len(encode['vs_backbone'])} batches: {encode['median_vs_backbone']:.3f} [quartiles "
                           f"{q1:.3f}-{q3:.3f}]; best of {len(ours['throughput']['all']['model'])} in its own process: "
                           f"{ours['throughput']['ratio']:.3f})",
                           encode["median_vs_backbone"] >= TARGETS["throughput_vs_backbone"]))
        else:
            checks.append((f"DCPCSE {setting} encode throughput ≥ 0.95 × backbone ({ours['throughput']['ratio']:.3f})",
                           ours["throughput"]["ratio"] >= TARGETS["throughput_vs_backbone"]))
    return checks


def main(argv: list[str] | None = None) -> int:
    from common import default_data_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--rows", nargs="+", default=list(ALL), choices=list(ALL), metavar="ROW",
                        help=f"rows to measure (default: all): {', '.join(ALL)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--encode-sentences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's default)")
    parser.add_argument("--no-memory", action="store_true", help="skip the profiler")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up + 2 steps, 256 sentences")
    parser.add_argument("--paired-steps", type=int, default=20,
                        help="timed batches of the paired step-time comparison (the rows the targets compare)")
    parser.add_argument("--no-paired", action="store_true", help="skip the paired step-time comparison")
    parser.add_argument("--encode-repeats", type=int, default=5,
                        help="repeats of the paired encode-throughput comparison (the one the target uses)")
    parser.add_argument("--paired-only", action="store_true",
                        help="run only the paired comparisons of the settings of --rows, keep the rows' results")
    parser.add_argument("--paired", nargs="+", choices=list(PAIRED), metavar="SET",
                        help=f"paired comparisons to run (default: those with a row in --rows): {', '.join(PAIRED)}")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_paired", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.data_dir is None:
        parser.error("pass --data-dir")
    if args.quick:
        args.steps, args.warmup, args.encode_sentences, args.repeats, args.paired_steps = 2, 1, 256, 1, 2
        args.encode_repeats = 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args._child:
        print(CHILD_MARKER + json.dumps(child(ALL[args._child], args), default=str), flush=True)
        return 0
    if args._paired:
        print(CHILD_MARKER + json.dumps(paired_child(args._paired, args), default=str), flush=True)
        return 0

    problem = run_all_runner.lora_route_problem() if any(ALL[name].adapter for name in args.rows) else None
    if problem:
        parser.error(problem)
    out_dir = run_all_rows.QUICK_DIR if args.quick else run_all_rows.RESULTS_DIR
    path = out_dir / "efficiency.json"
    previous = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    results = dict(previous.get("rows", {}))
    for name in [] if args.paired_only else args.rows:
        print(f"measuring {name} ...", flush=True)
        results[name] = measure(ALL[name], args)
        r = results[name]
        if "error" in r:
            print(f"  failed: {r['error']}", flush=True)
        else:
            print(f"  step {r['step_seconds']['median']:.3f}s, memory "
                  f"{r['memory']['peak_mib'] if r.get('memory') else float('nan'):.0f} MiB, encode x "
                  f"{r['throughput']['ratio']:.3f}", flush=True)
    paired = dict(previous.get("paired", {}))
    if not args.no_paired:
        settings = args.paired or [s for s in PAIRED if any(n in args.rows for n in PAIRED[s])]
        for setting in settings:
            print(f"paired step times, {setting}: {', '.join(PAIRED[setting])} ...", flush=True)
            paired[setting] = measure_paired(setting, args)
            if "error" in paired[setting]:
                print(f"  failed: {paired[setting]['error']}", flush=True)
            else:
                print("  " + ", ".join(f"{n} {r['median_vs_base']:.3f}" for n, r in paired[setting]["rows"].items()),
                      flush=True)
    order = [n for n in ALL if n in results]
    results = {n: results[n] for n in order}
    # the header's load range covers every row in the report, also those kept from an earlier invocation
    loads = [r[key][0] for r in (*results.values(), *paired.values()) if "error" not in r
             for key in ("load_average_start", "load_average_end")]
    checks = ratios(results, paired)
    import torch

    report = {
        "command": "python benchmarks/efficiency.py --data-dir ../shared/data" + (" --quick" if args.quick else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} with "
                   f"{args.threads or torch.get_num_threads()} threads",
        "load_min": min(loads) if loads else float("nan"), "load_max": max(loads) if loads else float("nan"),
        "steps": args.steps, "warmup": args.warmup, "encode_sentences": args.encode_sentences,
        "repeats": args.repeats, "rows": results, "paired": paired, "paired_steps": args.paired_steps,
        "targets": checks,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    run_all_runner.write_json(path, report)
    (out_dir / "efficiency.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
