"""``st-prompts demo``: two tasks' prompt sets on one frozen MiniLM, trained on bundled data, served in one mixed batch."""

from __future__ import annotations

import argparse
import logging
import time

from st_prompts.commands import _numbers as n

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="two tasks' prompt sets on one frozen MiniLM, served in one mixed batch (about 2 minutes on two CPU cores)",
        description="Trains two prompt sets on the packaged all-MiniLM-L6-v2 (frozen, its own mean pooling) with "
        "bundled data: 'sts' (CoSENT on 640 STS-B train pairs: the model's own task) and 'contradiction' (multiple "
        "negatives ranking on 1,000 SNLI triplets, the contradiction as the positive: a task the model was not tuned "
        "for). Each set starts as the shipped model (a zero-initialised gate) and keeps its best evaluation on a "
        "selection slice (step 0 included). Prints each task's held-out score beside the shipped model's, each set's "
        "size, and checks that one encode call with a task per row gives every row its own task's embedding; saves "
        "the bank.",
    )
    parser.add_argument("--lr", type=n.positive_float(10.0), dest="learning_rate",
                        help="learning rate of both sets (default: 0.1 for 'sts', bank.train_prompt_set's default, "
                        "and 0.3 for 'contradiction', chosen over 0.1 and 0.3 on its selection slice)")
    parser.add_argument("--batch-size", type=n.positive_int(1 << 20), default=32,
                        help="training batch size of both sets (default 32)")
    parser.add_argument("--output", default="st-prompts-demo", help="where to save the bank")
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (there are none anyway when the output is not a terminal)")
    parser.set_defaults(func=run)


#: Bundled NLI triplets: the first train the 'contradiction' set, the next select its best step, the rest give its
#: score.
NLI_TRAIN, NLI_SELECT = 1000, 1250
#: Bundled STS-B train pairs the 'sts' set trains on (the shipped model was tuned for this task: longer runs keep
#: step 0 too).
STS_TRAIN = 640
#: Bundled STS-B dev pairs: the first select the 'sts' set's best step, the next (to STS_END) give its score.
STS_SELECT = 250
#: Where the held-out slices end (None: the end of the bundled file; encoding them is most of the demo's time);
#: tests shrink the demo with these.
STS_END: int | None = 750
NLI_END: int | None = None
#: Steps between selection evaluations (besides step 0 and the last): three per set, which keeps the demo short.
EVAL_STEPS = {"sts": 10, "contradiction": 16}
#: Each set's learning rate: 'contradiction' selected on its selection slice; 'sts' at bank.train_prompt_set's default.
LEARNING_RATES = {"sts": 1e-1, "contradiction": 3e-1}
#: The demo's two tasks, in order.
TASKS = ("sts", "contradiction")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator, TripletEvaluator
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss, MultipleNegativesRankingLoss

    from st_prompts import bank
    from st_prompts.commands.options import show_progress
    from st_prompts.data.senteval import load_sts
    from st_prompts.data.training_data import bundled_data_dir, read_nli_triplets
    from st_prompts.storage import check_model_destination
    from st_prompts.utils import packaged_minilm_path

    # The demo replaces its own earlier output, never a folder of anything else (checked before any work).
    check_model_destination(args.output, overwrite=True, kind=bank.BANK_KIND)
    start = time.perf_counter()
    data = bundled_data_dir()
    progress = show_progress(args)
    logger.info("Reading the bundled data and the shipped all-MiniLM-L6-v2 ...")
    train_pairs = load_sts(str(data / "senteval"), "STSBenchmark", "train")
    dev = load_sts(str(data / "senteval"), "STSBenchmark", "dev")
    triplets = read_nli_triplets(data / "nli_triplets.csv")[:NLI_END]
    dev_end = len(dev) if STS_END is None else min(STS_END, len(dev))

    def sts_evaluator(first: int, last: int, name: str) -> EmbeddingSimilarityEvaluator:
        return EmbeddingSimilarityEvaluator(dev.sentences1[first:last], dev.sentences2[first:last],
                                            [float(x) for x in dev.scores[first:last]], batch_size=128, name=name)

    def contradiction_evaluator(first: int, last: int, name: str) -> TripletEvaluator:
        rows = triplets[first:last]  # (premise, entailment, contradiction): the contradiction must come first
        return TripletEvaluator([t[0] for t in rows], [t[2] for t in rows], [t[1] for t in rows], batch_size=128,
                                name=name)

    tasks = {  # name: (selection evaluator, held-out evaluator, metric, label)
        "sts": (sts_evaluator(0, STS_SELECT, "sts-select"), sts_evaluator(STS_SELECT, dev_end, "sts-held-out"),
                "spearman_cosine", f"STS-B dev, Spearman x100 (held-out {dev_end - STS_SELECT:,} pairs)"),
        "contradiction": (contradiction_evaluator(NLI_TRAIN, NLI_SELECT, "contradiction-select"),
                          contradiction_evaluator(NLI_SELECT, len(triplets), "contradiction-held-out"),
                          "cosine_accuracy",
                          f"SNLI, % of {len(triplets) - NLI_SELECT} held-out premises nearer their contradiction"),
    }

    def score(model, name: str, task: str | None = None) -> float:
        """The held-out score of ``model`` on task ``name`` (a bank encodes with its set ``task``)."""
        evaluator, metric = tasks[name][1], tasks[name][2]
        if task is None:
            return evaluator(model)[f"{evaluator.name}_{metric}"]
        model[0].default_task = task  # evaluators encode without a task: the default set answers
        try:
            return evaluator(model)[f"{evaluator.name}_{metric}"]
        finally:
            model[0].default_task = None

    shipped = SentenceTransformer(packaged_minilm_path(), device="cpu")
    scores = {name: {"shipped": score(shipped, name)} for name in tasks}

    model = bank.create_bank("minilm")  # frozen MiniLM with its own mean pooling; no task = the shipped model
    torch.manual_seed(42)
    sts_data = Dataset.from_dict({"sentence1": train_pairs.sentences1[:STS_TRAIN],
                                  "sentence2": train_pairs.sentences2[:STS_TRAIN],
                                  "score": [float(s) for s in train_pairs.scores[:STS_TRAIN]]})
    contradiction_data = Dataset.from_dict({"anchor": [t[0] for t in triplets[:NLI_TRAIN]],
                                            "positive": [t[2] for t in triplets[:NLI_TRAIN]],
                                            "negative": [t[1] for t in triplets[:NLI_TRAIN]]})
    trained = {}
    for name, dataset, loss in (("sts", sts_data, CoSENTLoss(model)),
                                ("contradiction", contradiction_data, MultipleNegativesRankingLoss(model))):
        logger.info(f"Training the prompt set {name!r} on {len(dataset):,} rows, selecting on "
                    f"{tasks[name][0].name} ...")
        rate = LEARNING_RATES[name] if args.learning_rate is None else args.learning_rate
        trained[name] = bank.train_prompt_set(model, name, dataset, loss, evaluator=tasks[name][0],
                                              learning_rate=rate, batch_size=args.batch_size,
                                              eval_steps=EVAL_STEPS[name], show_progress_bar=progress,
                                              prefix_gate=True)
        scores[name]["prompt set"] = score(model, name, task=name)

    # One encode call, a task per row: STS-B sentences with 'sts', held-out premises with 'contradiction', shuffled.
    held_out = triplets[NLI_SELECT:]
    sentences = [*train_pairs.sentences1[:256], *[t[0] for t in held_out]]
    row_names = ["sts"] * 256 + ["contradiction"] * len(held_out)
    order = np.random.default_rng(0).permutation(len(sentences))
    texts, row_tasks = [sentences[i] for i in order], [row_names[i] for i in order]
    began = time.perf_counter()
    mixed = model.encode(texts, task=row_tasks, batch_size=128, convert_to_tensor=True)
    mixed_seconds = time.perf_counter() - began
    separate = torch.empty_like(mixed)
    for name in TASKS:
        rows = [i for i, t in enumerate(row_tasks) if t == name]
        separate[rows] = model.encode([texts[i] for i in rows], task=name, batch_size=128, convert_to_tensor=True)
    difference = float((mixed - separate).abs().max())
    bank.save_bank(model, args.output, overwrite=True)

    labels = {name: task[3] for name, task in tasks.items()}
    sizes = {name: sum(p.numel() for p in model[0].prompt_sets[name].parameters()) for name in TASKS}
    backbone = sum(p.numel() for p in model[0].auto_model.parameters())
    print()
    print(f"One frozen all-MiniLM-L6-v2 ({backbone / 1e6:.1f}M parameters), two prompt sets trained on bundled data:")
    width = max(len(label) for label in labels.values())
    print(f"{'task':13} {'score':{width}} {'shipped':>8} {'its set':>8}   set size")
    for name in TASKS:
        print(f"{name:13} {labels[name]:{width}} {100 * scores[name]['shipped']:8.2f} {100 * scores[name]['prompt set']:8.2f}"
              f"   {sizes[name]:,} parameters, {4 * sizes[name] / 1e3:.0f} KB ({100 * sizes[name] / backbone:.2f} %)")
    print(f"\nOne encode call, {len(texts)} sentences, a task per row (mixed batches): {mixed_seconds:.1f}s; largest "
          f"difference from encoding each task separately: {difference:.1e}.")
    kept = ", ".join(f"{name} step {r.best_step} of {r.steps}" for name, r in trained.items())
    print(f"Each set started as the shipped model (a zero-initialised gate) and kept its best evaluation on a separate "
          f"selection slice, step 0 included ({kept}).")
    for name, r in trained.items():
        if r.best_step == 0:
            print(f"'{name}' kept step 0, the shipped model: all-MiniLM-L6-v2 was tuned for this task, and {r.steps} "
                  "steps did not beat it on the selection set; 'contradiction' is a task it was not tuned for.")
    print(f"Trained in {sum(r.seconds for r in trained.values()):.0f}s; total {time.perf_counter() - start:.0f}s.")
    print(f"Saved to {args.output}: SentenceTransformer({args.output!r}, trust_remote_code=True).encode(texts, "
          "task='sts') (or task=['sts', 'contradiction', ...], one per text; no task: the shipped model).")
    if args.json_path:
        from st_prompts.storage import write_json_atomic

        write_json_atomic(args.json_path, {"scores": scores, "set_parameters": sizes, "mixed_max_abs_diff": difference,
                                           "mixed_seconds": mixed_seconds,
                                           "train_seconds": {k: r.seconds for k, r in trained.items()}})
    return 0
