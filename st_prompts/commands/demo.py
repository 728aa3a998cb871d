"""``st-prompts demo``: two tasks' prompt sets on one frozen MiniLM, trained on bundled data, served in one mixed batch."""

from __future__ import annotations

import argparse
import logging
import time

from st_prompts.commands.options import finite_float

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="two tasks' prompt sets on one frozen MiniLM, served in one mixed batch (a few minutes on two CPU cores)",
        description="Trains two prompt sets on the packaged all-MiniLM-L6-v2 (frozen, its own mean pooling) with "
        "bundled data: 'sts' (CoSENT on 1,500 STS-B train pairs) and 'nli' (multiple negatives ranking on 1,200 SNLI "
        "triplets); prints each task's score beside the shipped model's, each set's size, and checks that one "
        "encode call with a task per row gives every row its own task's embedding; saves the bank.",
    )
    parser.add_argument("--lr", type=finite_float, default=1e-1, dest="learning_rate",
                        help="learning rate of both sets (default 1e-1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output", default="st-prompts-demo", help="where to save the bank")
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


#: Bundled NLI triplets: the first ones train the 'nli' set, the rest are held out for its score.
NLI_TRAIN = 1200


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.losses import CoSENTLoss, MultipleNegativesRankingLoss

    from st_prompts import bank
    from st_prompts.commands.options import show_progress
    from st_prompts.data.senteval import load_sts
    from st_prompts.data.training_data import bundled_data_dir, read_nli_triplets
    from st_prompts.evaluation.sts import stsb_dev_evaluator
    from st_prompts.storage import check_model_destination, save_model_folder
    from st_prompts.utils import packaged_minilm_path

    # The demo replaces its own earlier output, never a folder of anything else (checked before any work).
    check_model_destination(args.output, overwrite=True)
    start = time.perf_counter()
    data = bundled_data_dir()
    progress = show_progress(args)
    sts_dev = stsb_dev_evaluator(str(data / "senteval"), batch_size=128)
    metric = "sts-dev_spearman_cosine"
    train_pairs = load_sts(str(data / "senteval"), "STSBenchmark", "train")
    triplets = read_nli_triplets(data / "nli_triplets.csv")
    held_out = triplets[NLI_TRAIN:]

    def nli_accuracy(model, **task) -> float:
        """Share of held-out triplets whose premise is closer to its entailment than to its contradiction."""
        premise, entail, contra = (model.encode([t[i] for t in held_out], normalize_embeddings=True, batch_size=128,
                                                **task) for i in range(3))
        return float(np.mean(np.sum(premise * entail, 1) > np.sum(premise * contra, 1)))

    shipped = SentenceTransformer(packaged_minilm_path(), device="cpu")
    scores = {"sts": {"shipped": sts_dev(shipped)[metric]}, "nli": {"shipped": nli_accuracy(shipped)}}

    model = bank.create_bank("minilm")  # frozen MiniLM with its own mean pooling; no task = the shipped model
    torch.manual_seed(42)
    sts_data = Dataset.from_dict({"sentence1": train_pairs.sentences1, "sentence2": train_pairs.sentences2,
                                  "score": [float(s) for s in train_pairs.scores]})
    nli_data = Dataset.from_dict({k: [t[i] for t in triplets[:NLI_TRAIN]]
                                  for i, k in enumerate(("anchor", "positive", "negative"))})
    trained = {}
    for name, dataset, loss in (("sts", sts_data, CoSENTLoss(model)),
                                ("nli", nli_data, MultipleNegativesRankingLoss(model))):
        logger.info(f"Training the prompt set {name!r} on {len(dataset):,} rows ...")
        trained[name] = bank.train_prompt_set(model, name, dataset, loss, learning_rate=args.learning_rate,
                                              batch_size=args.batch_size, show_progress_bar=progress)
    model[0].default_task = "sts"  # the evaluator encodes without a task: the default set answers
    scores["sts"]["prompt set"] = sts_dev(model)[metric]
    model[0].default_task = None
    scores["nli"]["prompt set"] = nli_accuracy(model, task="nli")

    # One encode call, a task per row: STS-B dev sentences with 'sts', held-out premises with 'nli', interleaved.
    sentences = [*train_pairs.sentences1[:256], *[t[0] for t in held_out]]
    tasks = ["sts"] * 256 + ["nli"] * len(held_out)
    order = np.random.default_rng(0).permutation(len(sentences))
    texts, row_tasks = [sentences[i] for i in order], [tasks[i] for i in order]
    began = time.perf_counter()
    mixed = model.encode(texts, task=row_tasks, batch_size=128, convert_to_tensor=True)
    mixed_seconds = time.perf_counter() - began
    separate = torch.empty_like(mixed)
    for name in ("sts", "nli"):
        rows = [i for i, t in enumerate(row_tasks) if t == name]
        separate[rows] = model.encode([texts[i] for i in rows], task=name, batch_size=128, convert_to_tensor=True)
    difference = float((mixed - separate).abs().max())
    save_model_folder(args.output, lambda folder: model.save(str(folder)), overwrite=True)

    labels = {"sts": "STS-B dev, Spearman x100 (1,500 pairs)",
              "nli": f"NLI, % of {len(held_out)} held-out triplets with entailment first"}
    sizes = {name: sum(p.numel() for p in model[0].prompt_sets[name].parameters()) for name in ("sts", "nli")}
    backbone = sum(p.numel() for p in model[0].auto_model.parameters())
    print()
    print(f"One frozen all-MiniLM-L6-v2 ({backbone / 1e6:.1f}M parameters), two prompt sets trained on bundled data:")
    width = max(len(label) for label in labels.values())
    print(f"{'task':5} {'score':{width}} {'shipped':>8} {'its set':>8}   set size")
    for name in ("sts", "nli"):
        print(f"{name:5} {labels[name]:{width}} {100 * scores[name]['shipped']:8.2f} {100 * scores[name]['prompt set']:8.2f}"
              f"   {sizes[name]:,} parameters, {4 * sizes[name] / 1e3:.0f} KB ({100 * sizes[name] / backbone:.2f} %)")
    print(f"\nOne encode call, {len(texts)} sentences, a task per row (mixed batches): {mixed_seconds:.1f}s; largest "
          f"difference from encoding each task separately: {difference:.1e}.")
    print(f"Trained in {sum(r.seconds for r in trained.values()):.0f}s; total {time.perf_counter() - start:.0f}s.")
    print(f"Saved to {args.output}: SentenceTransformer({args.output!r}, trust_remote_code=True).encode(texts, "
          "task='sts') (or task=['sts', 'nli', ...], one per text; no task: the shipped model).")
    if args.json_path:
        from st_prompts.storage import write_json_atomic

        write_json_atomic(args.json_path, {"scores": scores, "set_parameters": sizes, "mixed_max_abs_diff": difference,
                                           "mixed_seconds": mixed_seconds,
                                           "train_seconds": {k: r.seconds for k, r in trained.items()}})
    return 0
