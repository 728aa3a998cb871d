"""Efficiency of DCPCSE prompt tuning versus SimCSE full fine-tuning on the same backbone, batch and data.

Run by hand (not part of the test suite; takes several minutes on two busy cores)::

    python benchmarks/efficiency.py                      # packaged all-MiniLM-L6-v2, batch 64, 10 timed steps
    python benchmarks/efficiency.py --steps 20 --out-dir /tmp/bench
    python benchmarks/efficiency.py --threads 1          # steadier timings on a CPU shared with other jobs

Both methods are built with :func:`st_prompts.training.preset` (``scale="cpu"``), :func:`build_model` and
:func:`build_loss`, i.e. exactly what ``st-prompts train`` runs: DCPCSE is a frozen backbone with a deep prefix of
``--prefix-length`` positions, SimCSE the plain sentence-transformers ``Transformer``; both use [CLS] pooling and
``PromptContrastiveLoss`` with the training-only MLP. A batch is ``--batch-size`` sentences of
``<data>/train/wiki_sentences.txt``, each sentence twice (unsupervised pairs), truncated to ``--max-seq-length`` tokens.

Measured (results in ``OUT_DIR/efficiency.json`` and ``OUT_DIR/efficiency.md``):

1. **Step time**: forward of both columns + loss + backward + AdamW step + zero_grad, the optimiser holding only the
   trainable parameters (fused AdamW, the trainer's default on CPU). A few warm-up steps, then ``--steps`` steps per
   method, interleaved (A, B, B, A, ...) on the same batches so that load from other processes hits both alike.
   Medians are reported together with the load average at start and end. Target: DCPCSE / SimCSE <= 0.70.
2. **Training memory**, each method in a fresh subprocess (``--_child``):
   * peak of live tensor bytes created during two training steps (torch.profiler with ``profile_memory``; the
     model's weights, present before, are excluded): gradients, optimiser state, activations, temporaries. This is
     the CPU counterpart of ``torch.cuda.max_memory_allocated`` minus the weights, and the metric the target
     (<= 0.70) applies to;
   * RSS overhead: peak RSS during three training steps minus the RSS right after model and data are loaded (the
     peak is reset with ``/proc/self/clear_refs`` before the first step); coarser (allocator caching);
   * peak RSS of the whole process (VmHWM), which also holds the Python/torch runtime and the weights.
3. **Trainable parameters**: share of the model (the prefix) and of everything the optimiser updates (plus the
   training-only MLP of the loss).
4. **Inference throughput**: ``model.encode(sentences, batch_size=128)`` in eval mode on ``--encode-sentences``
   sentences, prompted encoder versus the plain backbone, interleaved repetitions; the ratio uses the best
   repetition of each (the one least disturbed by other processes). Target >= 0.95.
5. **Checkpoint size**: ``save_prompts_only`` versus ``model.save``, bytes on disk.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_prompts import save_prompts_only  # noqa: E402
from st_prompts.data.training_data import read_sentences  # noqa: E402
from st_prompts.training.presets import preset  # noqa: E402
from st_prompts.training.run import build_loss, build_model, count_parameters  # noqa: E402
from st_prompts.utils import default_data_dir  # noqa: E402

METHODS = ("dcpcse", "simcse")
TARGETS = {"step_time": 0.70, "memory": 0.70, "throughput": 0.95}
WARMUP_STEPS = 3
MEMORY_STEPS = 3
CHILD_MARKER = "EFFICIENCY_CHILD_RESULT "
MiB = 2**20


# ---------------------------------------------------------------------------------------------------- setup
def wiki_sentences(data_dir: Path) -> list[str]:
    base = data_dir / "train" if (data_dir / "train").is_dir() else data_dir
    return read_sentences(base / "wiki_sentences.txt")


def build(method: str, args):
    """(model, loss, optimiser) for a method, as the trainer builds them."""
    settings = preset(method, scale="cpu", backbone=args.backbone, batch_size=args.batch_size,
                      max_seq_length=args.max_seq_length, prefix_length=args.prefix_length)
    torch.manual_seed(settings.seed)
    model = build_model(settings)
    loss = build_loss(model, settings)
    model.train()
    loss.train()
    return model, loss, new_optimizer(loss, settings.learning_rate)


def new_optimizer(loss, learning_rate: float = 1e-3) -> torch.optim.Optimizer:
    # The trainer optimises the loss module's trainable parameters (model + training-only MLP) with fused AdamW.
    params = [p for p in loss.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0, fused=True)


def tokenized_batches(model, sentences: list[str], batch_size: int, count: int) -> list[dict]:
    batches = []
    for i in range(count):
        start = (i * batch_size) % max(1, len(sentences) - batch_size)
        batches.append(model.preprocess(sentences[start:start + batch_size]))
    return batches


def training_step(loss, optimizer, features: dict) -> None:
    # Unsupervised SimCSE pair: the same sentence twice; the model writes into the dicts, hence the copies.
    losses = loss([dict(features), dict(features)], None)
    sum(losses.values()).backward()
    optimizer.step()
    optimizer.zero_grad()


# ---------------------------------------------------------------------------------------------------- memory (child)
def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_live_tensor_bytes(loss, batches: list[dict]) -> dict:
    """Peak of live CPU tensor bytes created during two steps from a fresh optimiser (the weights exist before).

    Uses the profiler's memory timeline (allocation / free events of every tensor, with a category per tensor) and
    reports the peak with its breakdown by category.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    optimizer = new_optimizer(loss)
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for features in batches[:2]:
            training_step(loss, optimizer, features)
    memory = prof._memory_profile()
    live: dict = {}  # tensor key -> (bytes, category)
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
    return {"peak_bytes": peak, "breakdown_at_peak_bytes": dict(sorted(at_peak.items(), key=lambda kv: -kv[1]))}


def child(method: str, args) -> dict:
    """Run in a fresh process: RSS during MEMORY_STEPS steps, then the profiler's peak of live tensor bytes."""
    sentences = wiki_sentences(args.data_dir)
    model, loss, optimizer = build(method, args)
    batches = tokenized_batches(model, sentences, args.batch_size, MEMORY_STEPS)
    gc.collect()
    peak_rss_loading = proc_status_kib("VmHWM")
    rss_loaded = proc_status_kib("VmRSS")
    reset_ok = reset_peak_rss()
    for features in batches:
        training_step(loss, optimizer, features)
    peak_rss_training = proc_status_kib("VmHWM")
    del optimizer
    gc.collect()
    live = peak_live_tensor_bytes(loss, batches)
    param_bytes = sum(p.numel() * p.element_size() for p in loss.parameters())
    return {
        "rss_after_load_mib": rss_loaded / 1024,
        "peak_rss_mib": max(peak_rss_loading, peak_rss_training) / 1024,
        "rss_overhead_mib": (peak_rss_training - rss_loaded) / 1024,
        "peak_rss_reset_ok": reset_ok,
        "parameter_mib": param_bytes / MiB,
        "peak_live_tensor_mib": live["peak_bytes"] / MiB,
        "live_tensor_breakdown_at_peak_mib": {k: v / MiB for k, v in live["breakdown_at_peak_bytes"].items()},
    }


def measure_memory(method: str, args) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--_child", method,
               "--backbone", args.backbone, "--data-dir", str(args.data_dir), "--batch-size", str(args.batch_size),
               "--max-seq-length", str(args.max_seq_length), "--prefix-length", str(args.prefix_length)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(CHILD_MARKER):
            return json.loads(line[len(CHILD_MARKER):])
    raise RuntimeError(f"memory child for {method} failed (rc={done.returncode}):\n{done.stderr[-3000:]}")


# ---------------------------------------------------------------------------------------------------- parent
def measure_step_times(built: dict, batches: dict, steps: int) -> dict[str, list[float]]:
    """Interleaved steps (A B, B A, ...) on the same batch; the first WARMUP_STEPS pairs are not recorded."""
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for i in range(WARMUP_STEPS + steps):
        for method in (METHODS if i % 2 == 0 else METHODS[::-1]):
            _, loss, optimizer = built[method]
            start = time.perf_counter()
            training_step(loss, optimizer, batches[method][i])
            elapsed = time.perf_counter() - start
            if i >= WARMUP_STEPS:
                times[method].append(elapsed)
    return times


def measure_throughput(built: dict, sentences: list[str], repeats: int) -> dict[str, list[float]]:
    """Sentences/s of ``model.encode`` in eval mode, repetitions interleaved."""
    for model, _, _ in built.values():
        model.eval()
        model.encode(sentences[:128], batch_size=128)  # warm-up
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(repeats):
        for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
            start = time.perf_counter()
            built[method][0].encode(sentences, batch_size=128)
            rates[method].append(len(sentences) / (time.perf_counter() - start))
    return rates


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_sizes(model) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        save_prompts_only(model, os.path.join(tmp, "prompts"))
        model.save(os.path.join(tmp, "full"), create_model_card=False)
        return {"prompts_only_bytes": directory_bytes(Path(tmp, "prompts")),
                "full_bytes": directory_bytes(Path(tmp, "full"))}


def parameter_shares(built: dict) -> dict:
    shares = {}
    for method, (model, loss, _) in built.items():
        trainable, total = count_parameters(model)
        opt_trainable, opt_total = count_parameters(loss)  # the loss holds the model and the training-only MLP
        shares[method] = {
            "model_trainable": trainable, "model_total": total, "model_share_pct": 100 * trainable / total,
            "optimised": opt_trainable, "optimised_total": opt_total,
            "optimised_share_pct": 100 * opt_trainable / opt_total,
        }
    return shares


def run(args) -> dict:
    load_start = os.getloadavg()
    started = time.time()
    sentences = wiki_sentences(args.data_dir)

    print("memory: one fresh subprocess per method ...", flush=True)
    memory = {method: measure_memory(method, args) for method in METHODS}

    print(f"step time: {WARMUP_STEPS} warm-up + {args.steps} interleaved steps per method ...", flush=True)
    built = {method: build(method, args) for method in METHODS}
    count = WARMUP_STEPS + args.steps
    batches = {m: tokenized_batches(built[m][0], sentences, args.batch_size, count) for m in METHODS}
    load_timing_start = os.getloadavg()
    times = measure_step_times(built, batches, args.steps)
    load_timing_end = os.getloadavg()

    print(f"throughput: encode {args.encode_sentences} sentences x {args.repeats} interleaved ...", flush=True)
    rates = measure_throughput(built, sentences[: args.encode_sentences], args.repeats)
    shares = parameter_shares(built)
    sizes = checkpoint_sizes(built["dcpcse"][0])
    load_end = os.getloadavg()

    median_time = {m: statistics.median(times[m]) for m in METHODS}
    best_rate = {m: max(rates[m]) for m in METHODS}
    ratios = {
        "step_time": median_time["dcpcse"] / median_time["simcse"],
        "step_time_paired_median": statistics.median(a / b for a, b in zip(times["dcpcse"], times["simcse"])),
        "memory_live_tensors": memory["dcpcse"]["peak_live_tensor_mib"] / memory["simcse"]["peak_live_tensor_mib"],
        "memory_rss_overhead": memory["dcpcse"]["rss_overhead_mib"] / memory["simcse"]["rss_overhead_mib"],
        "memory_peak_rss": memory["dcpcse"]["peak_rss_mib"] / memory["simcse"]["peak_rss_mib"],
        "throughput": best_rate["dcpcse"] / best_rate["simcse"],
        "throughput_median": statistics.median(rates["dcpcse"]) / statistics.median(rates["simcse"]),
        "checkpoint": sizes["prompts_only_bytes"] / sizes["full_bytes"],
    }
    return {
        "settings": {"backbone": args.backbone, "data_dir": str(args.data_dir), "batch_size": args.batch_size,
                     "max_seq_length": args.max_seq_length, "prefix_length": args.prefix_length, "steps": args.steps,
                     "warmup_steps": WARMUP_STEPS, "encode_sentences": args.encode_sentences,
                     "repeats": args.repeats},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "load_average_start": load_start, "load_average_step_timing_start": load_timing_start,
                    "load_average_step_timing_end": load_timing_end, "load_average_end": load_end,
                    "seconds": time.time() - started},
        "step_time_s": {m: {"median": median_time[m], "all": times[m]} for m in METHODS},
        "memory": memory,
        "parameters": shares,
        "throughput_sentences_per_s": {m: {"best": best_rate[m], "median": statistics.median(rates[m]), "all": rates[m]}
                                       for m in METHODS},
        "checkpoint": sizes,
        "ratios": ratios,
        "targets": TARGETS,
        "pass": {
            "step_time": ratios["step_time"] <= TARGETS["step_time"],
            "memory": ratios["memory_live_tensors"] <= TARGETS["memory"],
            "throughput": ratios["throughput"] >= TARGETS["throughput"],
        },
    }


# ---------------------------------------------------------------------------------------------------- report
def markdown(r: dict) -> str:
    s, m, mem, ratios, ok = r["settings"], r["machine"], r["memory"], r["ratios"], r["pass"]
    t, p, thr, ck = r["step_time_s"], r["parameters"], r["throughput_sentences_per_s"], r["checkpoint"]
    mark = {True: "pass", False: "**FAIL**"}
    d, b = mem["dcpcse"], mem["simcse"]

    def load(values) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    def breakdown(x: dict) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in x["live_tensor_breakdown_at_peak_mib"].items())

    rows = [
        ("Training step time (median, s)", f"{t['dcpcse']['median']:.3f}", f"{t['simcse']['median']:.3f}",
         f"{ratios['step_time']:.3f}", "<= 0.70", mark[ok["step_time"]]),
        ("Training memory: peak live tensors beyond the weights (MiB)", f"{d['peak_live_tensor_mib']:.1f}",
         f"{b['peak_live_tensor_mib']:.1f}", f"{ratios['memory_live_tensors']:.3f}", "<= 0.70", mark[ok["memory"]]),
        ("Training memory: RSS overhead (MiB)", f"{d['rss_overhead_mib']:.1f}", f"{b['rss_overhead_mib']:.1f}",
         f"{ratios['memory_rss_overhead']:.3f}", "(info)", ""),
        ("Peak RSS of the process (MiB)", f"{d['peak_rss_mib']:.0f}", f"{b['peak_rss_mib']:.0f}",
         f"{ratios['memory_peak_rss']:.3f}", "(info)", ""),
        ("Trainable share of the model", f"{p['dcpcse']['model_share_pct']:.2f}% ({p['dcpcse']['model_trainable']:,})",
         f"{p['simcse']['model_share_pct']:.0f}% ({p['simcse']['model_trainable']:,})", "", "", ""),
        ("Optimised share incl. training-only MLP",
         f"{p['dcpcse']['optimised_share_pct']:.2f}% ({p['dcpcse']['optimised']:,})",
         f"{p['simcse']['optimised_share_pct']:.0f}% ({p['simcse']['optimised']:,})", "", "", ""),
        ("Inference throughput, best of reps (sentences/s)", f"{thr['dcpcse']['best']:.1f}",
         f"{thr['simcse']['best']:.1f}", f"{ratios['throughput']:.3f}", ">= 0.95", mark[ok["throughput"]]),
        ("Checkpoint size (KB): prompts-only vs full", f"{ck['prompts_only_bytes'] / 1000:,.1f}",
         f"{ck['full_bytes'] / 1000:,.1f}", f"{ratios['checkpoint']:.4f}", "(info)", ""),
    ]
    lines = [
        "# Efficiency: DCPCSE prompt tuning vs SimCSE full fine-tuning",
        "",
        f"Backbone `{s['backbone']}`, batch {s['batch_size']} sentences x 2 views, max_seq_length "
        f"{s['max_seq_length']}, prefix length {s['prefix_length']}, [CLS] pooling, PromptContrastiveLoss with the "
        f"training-only MLP; data `{s['data_dir']}`. {s['steps']} timed steps per method after {s['warmup_steps']} "
        f"warm-up steps, interleaved; throughput on {s['encode_sentences']} sentences, {s['repeats']} interleaved "
        f"repetitions, batch 128.",
        "",
        f"Machine: {m['cpu_count']} CPUs, torch {m['torch']} with {m['torch_threads']} threads. Load average "
        f"(1/5/15 min) at start {load(m['load_average_start'])}, at the start of step timing "
        f"{load(m['load_average_step_timing_start'])}, at the end of it {load(m['load_average_step_timing_end'])}, "
        f"at the end {load(m['load_average_end'])}; total {m['seconds']:.0f} s.",
        "",
        *([f"The load exceeded the {m['cpu_count']} CPUs: other processes shared them, which makes the timings "
           "noisy (more so with several torch threads, whose parallel regions wait for descheduled threads); the "
           "interleaving exposes both methods to it alike.", ""]
          if max(m["load_average_start"][0], m["load_average_end"][0]) > m["cpu_count"] else []),
        "| Metric | DCPCSE | SimCSE | Ratio | Target | Result |",
        "|---|---:|---:|---:|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows),
        "",
        f"Median of the per-pair step-time ratios: {ratios['step_time_paired_median']:.3f}; throughput ratio of the "
        f"medians: {ratios['throughput_median']:.3f}.",
        "",
        "**Which memory number the target refers to.** The peak of live tensor bytes created during training (torch "
        "profiler with `profile_memory`, two steps from a fresh optimiser, the model's weights excluded) is what "
        "training adds on top of the loaded model: gradients, AdamW state and the activations kept for backward. It "
        "is the CPU counterpart of `torch.cuda.max_memory_allocated` minus the weights and is exact, so the target "
        "applies to it. The RSS overhead (peak RSS during three steps minus the RSS right after loading) measures the "
        "same thing through the allocator, which caches and fragments memory, so it is coarser. The total peak RSS "
        "also holds the Python/torch runtime and the weights, identical for both methods, and so says little about "
        "the training method.",
        "",
        f"Live tensors at the peak (MiB) - DCPCSE: {breakdown(d)}; SimCSE: {breakdown(b)}. "
        f"Weights: {d['parameter_mib']:.1f} MiB (DCPCSE, incl. prefix and MLP), {b['parameter_mib']:.1f} MiB (SimCSE).",
        "",
    ]
    return "\n".join(lines)


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="minilm")
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--prefix-length", type=int, default=16)
    parser.add_argument("--encode-sentences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--_child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.data_dir is None:
        parser.error("no shared data directory found; pass --data-dir")
    if args.threads:
        torch.set_num_threads(args.threads)

    if args._child:
        print(CHILD_MARKER + json.dumps(child(args._child, args)), flush=True)
        return 0

    result = run(args)
    table = markdown(result)
    write_atomically(args.out_dir / "efficiency.json", json.dumps(result, indent=2) + "\n")
    write_atomically(args.out_dir / "efficiency.md", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
