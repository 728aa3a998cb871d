"""Quality benchmark on the packaged MiniLM ([CLS] pooling): STS-B dev Spearman before training, after SimCSE full
fine-tuning, after DCPCSE (frozen backbone) — unsupervised on the 11.9k Wikipedia sentences and supervised on the
5.9k SNLI triplets of the shared data — plus D2CSE-style retrieval and alignment/uniformity on STS-B dev, and SICK-R
trial Spearman as a second set that model selection never sees (to check that a default chosen on STS-B dev is not
fitted to it).

Run by hand (about an hour on two CPU cores for all runs)::

    python benchmarks/quality.py --data-dir ../shared/data [--runs dcpcse-unsup simcse-unsup ...]
    python benchmarks/quality.py --data-dir ../shared/data --runs dcpcse-sup --set mlp_head=saved --tag -saved
    python benchmarks/quality.py --data-dir ../shared/data --runs d2cse-unsup d2cse-sup
    python benchmarks/quality.py --data-dir ../shared/data --runs d2cse-unsup --set cls_prompt=true --tag=-cls
    python benchmarks/quality.py --data-dir ../shared/data --runs diffaug-semi diffaug-semi-aux diffaug-sup \
        diffaug-semi-same diffaug-semi-nostage1

A run of several stages (DiffAug) loads each stage's data with the stage's own loader; DiffAug runs also write the
delta/kappa curves of stage 1 to ``benchmarks/results/<run>-stage1.png``.

D2CSE runs record their corruption report (generator, its masked-token accuracy, share of tokens replaced) next to
the metrics, and the markdown lists it under the table.

Writes ``benchmarks/results/quality.json`` and ``quality.md`` after every run (so partial results survive), and keeps
the trained models under ``outputs/quality/<run>``. Every run uses ``st_prompts.methods.settings(..., scale="cpu")``:
batch 64, max length 32, τ = 0.05, STS-B dev every 50 steps with the best checkpoint kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

from st_prompts.storage import write_file_atomic, write_json_atomic
from st_prompts.training.pipeline import save_run
from st_prompts.data.training_data import load_training_dataset
from st_prompts.evaluation import AlignmentUniformityEvaluator, STSRetrievalEvaluator, stsb_dev_evaluator
from st_prompts import methods
from st_prompts.data.senteval import load_sts
from st_prompts.evaluation.sts import STSSuiteEvaluator  # noqa: F401  (documents where the protocol lives)
from st_prompts.training.run import train
from st_prompts.utils import default_data_dir, packaged_minilm_path

#: run name -> (method, supervised[, fixed settings of the run])
RUNS = {
    "simcse-unsup": ("simcse", False),
    "dcpcse-unsup": ("dcpcse", False),
    "simcse-sup": ("simcse", True),
    "dcpcse-sup": ("dcpcse", True),
    "scpcse-unsup": ("scpcse", False),
    "d2cse-unsup": ("d2cse", False),
    "d2cse-sup": ("d2cse", True),
    "diffaug-semi": ("diffaug", False),
    "diffaug-semi-aux": ("diffaug", False, {"aux_weight": 1e-3}),
    "diffaug-sup": ("diffaug", True),
    "diffaug-semi-same": ("diffaug", False, {"same_prefix": True}),
    "diffaug-semi-nostage1": ("diffaug", False, {"skip_stage1": True}),
}


def evaluate_all(model, senteval: str) -> dict[str, float]:
    results = {}
    results.update(stsb_dev_evaluator(senteval, batch_size=128)(model))
    results.update(STSRetrievalEvaluator.from_senteval(senteval, split="dev", name="retrieval", batch_size=128,
                                                       recall_at_k=(1, 3, 5), write_csv=False)(model))
    results.update(AlignmentUniformityEvaluator.from_senteval(senteval, split="dev", name="align", batch_size=128,
                                                              write_csv=False)(model))
    results["sick-trial_spearman_cosine"] = sick_trial_spearman(model, senteval)
    return results


def sick_trial_spearman(model, senteval: str) -> float:
    """Spearman of cosine similarity on SICK-R trial (500 pairs): a second dev set, never used for selection."""
    import numpy as np
    from scipy.stats import spearmanr

    pairs = load_sts(senteval, "SICKRelatedness", "dev")
    a = model.encode(pairs.sentences1, batch_size=128, normalize_embeddings=True)
    b = model.encode(pairs.sentences2, batch_size=128, normalize_embeddings=True)
    return float(spearmanr(np.sum(a * b, axis=1), pairs.scores).statistic)


def write_report(report: dict, out_dir: Path) -> None:
    write_json_atomic(out_dir / "quality.json", report)
    lines = [
        "# Quality on the packaged all-MiniLM-L6-v2 ([CLS] pooling), STS-B dev",
        "",
        f"{report['environment']}",
        "",
        "| run | trainable params | steps | train time | STS-B dev Spearman | SICK-R trial Spearman | R@1 | R@3 | R@5 | alignment | uniformity |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        m = r["metrics"]
        lines.append(
            f"| {name} | {r.get('trainable_parameters', '-'):,} | {r.get('steps', 0)} | {r.get('seconds', 0):.0f}s | "
            f"{100 * m['sts-dev_spearman_cosine']:.2f} | "
            f"{(100 * m['sick-trial_spearman_cosine']) if 'sick-trial_spearman_cosine' in m else float('nan'):.2f} | "
            f"{100 * m['retrieval_recall@1']:.1f} | "
            f"{100 * m['retrieval_recall@3']:.1f} | {100 * m['retrieval_recall@5']:.1f} | "
            f"{m['align_alignment']:.3f} | {m['align_uniformity']:.3f} |"
        )
    lines += ["", "Retrieval: 55 queries (56 score-5 dev pairs, one identical pair dropped), pool 2,909 sentences.", ""]
    corrupted = {name: r["corruption"] for name, r in report["runs"].items() if r.get("corruption")}
    if corrupted:
        lines += ["Replaced-token corruption of the D2CSE runs (generator; its masked-token accuracy, held out where it "
                  "was trained on the training sentences; share of the tokens replaced):", ""]
        for name, c in corrupted.items():
            accuracy = c.get("heldout_masked_token_accuracy", c.get("masked_token_accuracy"))
            where = (f"held-out {c['heldout_sentences']:,} sentences" if "heldout_masked_token_accuracy" in c
                     else "training sentences")
            lines.append(f"- {name}: {c.get('generator')}; masked-token accuracy {100 * accuracy:.1f}% ({where}); "
                         f"{100 * c['replaced_share']:.1f}% of {c['eligible_tokens']:,} tokens replaced in "
                         f"{c['sentences']:,} sentences")
        lines.append("")
    write_file_atomic(out_dir / "quality.md", "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=default_data_dir())
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=["simcse-unsup", "dcpcse-unsup", "dcpcse-sup", "simcse-sup"])
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--models-dir", default="outputs/quality")
    parser.add_argument("--max-steps", type=int, help="cap every run (for a quick check)")
    parser.add_argument("--lr", type=float, help="override the learning rate of every run")
    parser.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="override settings fields of every run, e.g. mlp_head=saved head_learning_rate=1e-3")
    parser.add_argument("--rescore", action="store_true", help="re-evaluate the saved models of --runs (no training)")
    parser.add_argument("--tag", default="", help="suffix for run names (e.g. an lr sweep)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    senteval = str(Path(args.data_dir) / "senteval")
    out_dir = Path(args.out_dir)
    report_path = out_dir / "quality.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {"runs": {}}
    report["environment"] = (f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
                             f"{torch.get_num_threads()} threads; data: {args.data_dir}")

    if "before" not in report["runs"]:
        plain = Transformer(packaged_minilm_path(), max_seq_length=32)
        model = SentenceTransformer(modules=[plain, Pooling(plain.get_embedding_dimension(), pooling_mode="cls")])
        report["runs"]["before"] = {"metrics": evaluate_all(model, senteval), "trainable_parameters": 0, "steps": 0,
                                    "seconds": 0.0}
        write_report(report, out_dir)

    if args.rescore:
        for name in args.runs:
            path = Path(args.models_dir) / (name + args.tag)
            model = SentenceTransformer(str(path), trust_remote_code=True)
            report["runs"][name + args.tag]["metrics"] = evaluate_all(model, senteval)
            write_report(report, out_dir)
        return

    overrides = dict(_parse_assignment(a) for a in args.set)
    for name in args.runs:
        method, supervised, *fixed = RUNS[name]
        settings = methods.settings(method, supervised=supervised, scale="cpu",
                                    output_dir=str(Path(args.models_dir) / (name + args.tag)),
                                    max_steps=args.max_steps, learning_rate=args.lr, **{**(fixed[0] if fixed else {}),
                                                                                       **overrides})
        stages = methods.get(method).stages(settings)
        if len(stages) == 1:
            dataset = load_training_dataset(supervised, args.data_dir)
            examples = len(dataset)
        else:
            dataset = {stage.name: stage.load_data(settings, args.data_dir, None) for stage in stages}
            examples = {stage: len(data) for stage, data in dataset.items()}
        start = time.perf_counter()
        model, result = train(settings, dataset, stsb_dev_evaluator(senteval, batch_size=128), show_progress_bar=False)
        save_run(model, result, settings.output_dir)
        if any("diffaug_delta" in entry for entry in result.log_history):
            from st_prompts.methods.diffaug.plot import read_diffaug_stage1
            from st_prompts.plots import plot_diffaug_stage1

            plot_diffaug_stage1(read_diffaug_stage1(Path(settings.output_dir)), out_dir / f"{name}{args.tag}-stage1.png",
                                title=f"DiffAug stage 1 ({name}{args.tag}, packaged MiniLM)")
        report["runs"][name + args.tag] = {
            "metrics": evaluate_all(model, senteval),
            "trainable_parameters": result.trainable_parameters,
            "total_parameters": result.total_parameters,
            "steps": result.steps,
            "seconds": time.perf_counter() - start,
            "best_step": result.best_step,
            "settings": {k: v for k, v in result.settings.items() if k != "extra"},
            "train_examples": examples,
            "corruption": result.stage_reports.get("train"),
        }
        write_report(report, out_dir)


def _parse_assignment(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False, "none": None}.get(value.lower(), value)


if __name__ == "__main__":
    main()
