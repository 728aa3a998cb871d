"""int8 inference (st_prompts.quantization) against fp32: throughput on one torch thread and STS quality, for the
packaged MiniLM and for a bank with a trained gated prompt set; torch's deprecated ``quantize_dynamic`` beside them
as the reference issue 50 measured, and the other engines where they are installed::

    python benchmarks/int8.py --data-dir ../shared/data                  # -> benchmarks/results/int8.{json,md}
    python benchmarks/int8.py --data-dir ../shared/data --rounds 7 --sentences 1000
    python benchmarks/int8.py --data-dir ../shared/data --part quality --models shipped  # one part (they merge)
    python benchmarks/int8.py --data-dir ../shared/data --dtypes --out benchmarks/results/precision  # bf16, fp16 too

Throughput: the first ``--sentences`` distinct STS-B dev sentences, ``model.encode(batch_size=32)``, one torch thread,
``--rounds`` interleaved rounds (every engine once per round, in turn) after a warm-up round; the median is reported.
Quality: Spearman x100 of cosine similarities on STS-B dev and SICK-R trial (whole sentences), two threads. Row
identity: the largest difference between a row encoded alone and in a mixed batch. The gated set is trained here
(``bank.train_prompt_set`` on STS-B train, CoSENT, ``--train-steps`` steps) and kept in ``--cache`` for later runs.
Candidates (``--candidates``): the plain backbone (no prompts: ONNX Runtime and OpenVINO cannot take them) under
ONNX Runtime fp32/qint8, OpenVINO fp32 and torchao's int8 configs, each if importable.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, default_data_dir, run_environment  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
EXTRA_LIBRARIES = ("torchao", "onnxruntime", "onnx", "openvino")


def sentences(data_dir: Path, count: int) -> list[str]:
    from st_prompts.data.senteval import load_sts

    pairs = load_sts(str(data_dir / "senteval"), "STSBenchmark", "dev")
    return list(dict.fromkeys(pairs.sentences1 + pairs.sentences2))[:count]


def spearman(model, data_dir: Path, **encode) -> dict[str, float]:
    from scipy.stats import spearmanr

    from st_prompts.data.senteval import load_sts
    from st_prompts.modules.lengths import full_length

    out = {}
    for key, name in (("stsb_dev", "STSBenchmark"), ("sickr_trial", "SICKRelatedness")):
        pairs = load_sts(str(data_dir / "senteval"), name, "dev")
        with full_length(model):
            a = model.encode(pairs.sentences1, batch_size=64, normalize_embeddings=True, **encode)
            b = model.encode(pairs.sentences2, batch_size=64, normalize_embeddings=True, **encode)
        out[key] = round(100 * float(spearmanr(np.sum(a * b, axis=1), pairs.scores).statistic), 2)
    return out


def reference_int8(model):
    """torch's deprecated dynamic quantization of every Linear of the backbone (per-tensor activations)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(model[0].auto_model, {torch.nn.Linear}, dtype=torch.qint8,
                                               inplace=True)
    return model


def row_identity(model, texts: list[str], tasks=None) -> float:
    """Largest |difference| between each row encoded alone and in one batch of all (with its task, if any)."""
    kwargs = {"task": tasks} if tasks is not None else {}
    batch = model.encode(texts, batch_size=len(texts), convert_to_tensor=True, **kwargs)
    alone = [model.encode([t], convert_to_tensor=True, **({"task": tasks[i]} if tasks else {}))[0]
             for i, t in enumerate(texts)]
    return float((batch - torch.stack(alone)).abs().max())


def trained_bank(data_dir: Path, cache: Path, steps: int) -> str:
    """A bank (on the packaged MiniLM) with a gated set 'sts' trained on STS-B train; built once into ``cache``."""
    if (cache / "modules.json").is_file():
        return str(cache)
    from datasets import Dataset
    from sentence_transformers.losses import CoSENTLoss

    from st_prompts import bank
    from st_prompts.data.senteval import load_sts

    pairs = load_sts(str(data_dir / "senteval"), "STSBenchmark", "train")
    data = Dataset.from_dict({"sentence1": pairs.sentences1, "sentence2": pairs.sentences2,
                              "score": [float(s) / 5.0 for s in pairs.scores]})
    model = bank.create_bank("minilm")
    result = bank.train_prompt_set(model, "sts", data, CoSENTLoss(model), max_steps=steps, batch_size=32,
                                   show_progress_bar=False, prefix_length=16)
    print(f"trained the gated set 'sts': {result.steps} steps in {result.seconds:.0f} s", flush=True)
    model.save(str(cache))
    return str(cache)


def throughput(engines: dict, texts: list[str], rounds: int) -> dict[str, dict]:
    """Interleaved rounds after one warm-up round: sentences per second of each engine (median and all rounds)."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(rounds + 1):
        for name, run in engines.items():
            start = time.perf_counter()
            run(texts)
            if round_:
                times[name].append(time.perf_counter() - start)
        print(f"  round {round_}{' (warm-up)' if not round_ else ''}: " + ", ".join(
            f"{n} {len(texts) / t[-1]:.1f}/s" for n, t in times.items() if t), flush=True)
    return {name: {"sentences_per_s": round(len(texts) / statistics.median(ts), 2),
                   "rounds_s": [round(t, 3) for t in ts]} for name, ts in times.items()}


def candidates(texts: list[str], rounds: int) -> dict[str, dict]:
    """The plain MiniLM backbone (token embeddings, no prompts) under each engine that imports here."""
    from sentence_transformers import SentenceTransformer

    from st_prompts.quantization import _replace_linears
    from st_prompts.utils import packaged_minilm_path

    st = SentenceTransformer(packaged_minilm_path(), device="cpu")
    texts = sorted(texts, key=len)
    batches = [dict(st.tokenizer(texts[i:i + 32], padding=True, truncation=True, max_length=256, return_tensors="pt"))
               for i in range(0, len(texts), 32)]
    backbone = st[0].auto_model.eval()

    def torch_engine(module):
        return lambda: [module(**b) for b in batches]

    engines, notes = {"torch fp32": torch_engine(backbone)}, {}
    ours = copy.deepcopy(backbone)
    _replace_linears(ours)
    engines["st_prompts int8 (per token)"] = torch_engine(ours)
    reference = reference_int8([copy.deepcopy(st[0])])[0].auto_model  # (a list: model[0] is the module)
    engines["torch.ao quantize_dynamic (deprecated)"] = torch_engine(reference)
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic

        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask, token_type_ids):
                return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                  token_type_ids=token_type_ids).last_hidden_state

        names = ["input_ids", "attention_mask", "token_type_ids"]
        path = Path(os.environ.get("TMPDIR", "/tmp")) / "st_prompts_int8_minilm.onnx"
        torch.onnx.export(Wrapped(backbone), tuple(batches[0][n] for n in names), str(path), input_names=names,
                          output_names=["out"], dynamic_axes={n: {0: "b", 1: "s"} for n in names + ["out"]},
                          dynamo=False, opset_version=17)
        quantize_dynamic(str(path), str(path.with_suffix(".q.onnx")), weight_type=QuantType.QInt8)
        for label, file in (("onnxruntime fp32", path), ("onnxruntime dynamic qint8", path.with_suffix(".q.onnx"))):
            options = ort.SessionOptions()
            options.intra_op_num_threads = options.inter_op_num_threads = 1
            session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
            engines[label] = (lambda s: lambda: [s.run(None, {n: b[n].numpy() for n in names}) for b in batches])(
                session)
    except ImportError as exc:
        notes["onnxruntime"] = f"not installed ({exc.name})"
    try:
        import openvino as ov

        compiled = ov.Core().compile_model(ov.convert_model(Wrapped(backbone), example_input=tuple(
            batches[0][n] for n in names)), "CPU", {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1})
        engines["openvino fp32"] = lambda: [compiled([b[n] for n in names]) for b in batches]
    except (ImportError, NameError) as exc:
        notes["openvino"] = f"not installed ({getattr(exc, 'name', exc)})"
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        torchao_model = copy.deepcopy(backbone)
        quantize_(torchao_model, Int8DynamicActivationInt8WeightConfig())
        start = time.perf_counter()  # one batch only: eager torchao int8 on a CPU is too slow for whole rounds
        torchao_model(**batches[len(batches) // 2])
        notes["torchao Int8DynamicActivationInt8WeightConfig (eager)"] = (
            f"{32 / (time.perf_counter() - start):.2f} sentences/s on one middle batch of 32 (torch._int_mm on the "
            "CPU); not timed in rounds")
    except ImportError as exc:
        notes["torchao"] = f"not installed ({exc.name})"
    with torch.inference_mode():
        results = throughput({k: (lambda f: lambda _texts: f())(v) for k, v in engines.items()}, texts, rounds)
    return {"engines": results, "notes": notes}


def markdown(record: dict) -> str:
    runs = record.get("runs", {})
    lines = ["# int8 and half-precision inference (benchmarks/int8.py)", "",
             "Every part ran on a **busy machine**: two cores shared with other work (its load average is given per "
             "part), so absolute rates are a fraction of an idle machine's; the engines of a part were timed in turn, "
             "round after round, so they shared the same conditions.", ""]
    for key, run in runs.items():
        env = run["environment"]
        flags = env.get("cpu_instructions", "flags not recorded")
        lines.append(f"- {key}: `{run['command']}`; {env['device']} ({flags}), {env['cpus']} cores; load average "
                     f"{[round(x, 1) for x in run['load_at_start']]} at the start, "
                     f"{[round(x, 1) for x in env['load_average']]} at the end; "
                     + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ".")
    if record.get("throughput"):
        run = next(r for k, r in runs.items() if k.startswith("throughput"))
        lines += ["", f"## Throughput, one torch thread ({run['sentences']} STS-B dev sentences, batch 32, median of "
                  f"{run['rounds']} interleaved rounds after a warm-up round)", "",
                  "| model | engine | sentences/s | x fp32 |", "|---|---|---:|---:|"]
        for model, engines in record["throughput"].items():
            base = engines["fp32"]["sentences_per_s"]
            for engine, row in engines.items():
                lines.append(f"| {model} | {engine} | {row['sentences_per_s']:.1f} | "
                             f"{row['sentences_per_s'] / base:.2f} |")
    if record.get("quality"):
        lines += ["", "## Quality (Spearman x100 of cosine similarities, whole sentences, two threads)", "",
                  "| model | engine | STS-B dev | SICK-R trial | row alone vs in a batch, max abs diff |",
                  "|---|---|---:|---:|---:|"]
        for model, engines in record["quality"].items():
            for engine, row in engines.items():
                lines.append(f"| {model} | {engine} | {row['stsb_dev']:.2f} | {row['sickr_trial']:.2f} | "
                             f"{row['row_identity']:.1e} |")
    if record.get("candidates"):
        cand = record["candidates"]
        base = cand["engines"]["torch fp32"]["sentences_per_s"]
        lines += ["", "## Engines on the plain backbone (token embeddings, no prompts), one thread", "",
                  "| engine | sentences/s | x torch fp32 |", "|---|---:|---:|"]
        lines += [f"| {k} | {v['sentences_per_s']:.1f} | {v['sentences_per_s'] / base:.2f} |"
                  for k, v in cand["engines"].items()]
        lines += [""] + [f"- {k}: {v}" for k, v in cand["notes"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "st_prompts_int8_bank")
    parser.add_argument("--candidates", action="store_true", help="also time ONNX Runtime, OpenVINO, torchao")
    parser.add_argument("--dtypes", action="store_true", help="also bfloat16 and float16 (load_sentence_model(dtype=))")
    parser.add_argument("--no-int8", action="store_true", help="leave out the int8 engines (with --dtypes)")
    parser.add_argument("--part", choices=("all", "quality", "throughput", "candidates", "report"), default="all",
                        help="run one part only (parts can run at once); its results replace that part in --out")
    parser.add_argument("--models", choices=("both", "shipped", "bank"), default="both",
                        help="the shipped MiniLM, the bank with a trained set, or both (default)")
    parser.add_argument("--out", type=Path, default=RESULTS / "int8")
    args = parser.parse_args()
    if args.data_dir is None:
        parser.error("--data-dir is required (no ../shared/data here)")
    if args.part == "report":  # the markdown again, from the JSON file
        args.out.with_suffix(".md").write_text(markdown(json.loads(args.out.with_suffix(".json").read_text())))
        return 0
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from st_prompts.loading import load_sentence_model

    load_at_start = list(os.getloadavg())
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    texts = sentences(args.data_dir, args.sentences)
    part: dict = {}
    if args.part in ("all", "quality", "throughput"):
        models = {}
        if args.models in ("both", "shipped"):
            models["shipped MiniLM"] = {"fp32": load_sentence_model("minilm"),
                                        "int8": load_sentence_model("minilm", quantize="int8"),
                                        "torch.ao quantize_dynamic": reference_int8(load_sentence_model("minilm"))}
        if args.models in ("both", "bank"):
            bank_path = trained_bank(args.data_dir, args.cache, args.train_steps)
            models["bank, gated set 'sts'"] = {"fp32": load_sentence_model(bank_path),
                                               "int8": load_sentence_model(bank_path, quantize="int8")}
        for model_name, engines in models.items():
            path = bank_path if "bank" in model_name else "minilm"
            if args.no_int8:
                engines.pop("int8", None)
                engines.pop("torch.ao quantize_dynamic", None)
            if args.dtypes:
                engines.update({dtype: load_sentence_model(path, dtype=dtype) for dtype in ("bfloat16", "float16")})
    if args.part in ("all", "quality"):
        torch.set_num_threads(2)
        mixed = ["sts" if i % 2 else None for i in range(16)]
        part["quality"] = {}
        for model_name, engines in models.items():
            task = {"task": "sts"} if "bank" in model_name else {}
            part["quality"][model_name] = {}
            for engine, model in engines.items():
                scores = spearman(model, args.data_dir, **task)
                scores["row_identity"] = row_identity(model, texts[:16], mixed if task else None)
                part["quality"][model_name][engine] = scores
                print(model_name, engine, scores, flush=True)
    torch.set_num_threads(1)
    if args.part in ("all", "throughput"):
        part["throughput"] = {}
        for model_name, engines in models.items():
            print("throughput:", model_name, flush=True)
            tasks = ["sts" if i % 2 else None for i in range(len(texts))] if "bank" in model_name else None
            runs = {engine: (lambda m: lambda t: m.encode(t, batch_size=32, **({"task": tasks} if tasks else {})))(
                model) for engine, model in engines.items()}
            part["throughput"][model_name + (" (mixed rows: sts / backbone)" if tasks else "")] = throughput(
                runs, texts, args.rounds)
    if args.candidates or args.part == "candidates":
        print("candidates (plain backbone):", flush=True)
        part["candidates"] = candidates(texts, args.rounds)
    environment = run_environment()
    from importlib.metadata import PackageNotFoundError, version

    for name in EXTRA_LIBRARIES:
        try:
            environment["versions"][name] = version(name)
        except PackageNotFoundError:
            pass
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_suffix(".json")
    record = json.loads(path.read_text()) if args.part != "all" and path.is_file() else {}  # the other parts
    for key, value in part.items():
        if key == "candidates":
            record[key] = value
        else:  # per model: a run of one model keeps the other's results
            record.setdefault(key, {}).update(value)
        label = key if key == "candidates" else f"{key}, {args.models}"
        record.setdefault("runs", {})[label] = {"command": command, "rounds": args.rounds, "sentences": len(texts),
                                              "load_at_start": load_at_start, "environment": environment}
    path.write_text(json.dumps(record, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
