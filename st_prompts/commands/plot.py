"""``st-prompts plot``: figures of the D2CSE analysis (similarity per gold-score bucket, the alignment-uniformity plane)
and DiffAug's stage-1 curves. Each model is shown as ``LABEL (POOLING)`` so that models pooled differently are not
compared unawares. Only light modules are imported here, so that ``--help`` is fast."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from st_prompts.commands._numbers import finite_float, positive_int
from st_prompts.commands.options import add_no_progress_argument, add_trust_remote_code_argument, show_progress
from st_prompts.errors import ConfigurationError, DataNotFoundError, first_line

#: Tasks that have a dev split; the others (STS12-16) only have ``test``.
_TASKS_WITH_DEV = ("STSBenchmark", "SICKRelatedness")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plot`` and its sub-commands ``similarity`` and ``align-uniform``."""
    parser = subparsers.add_parser(
        "plot", help="draw the similarity-by-score and alignment-uniformity figures",
        description="Draw the figures of the D2CSE analysis for one or more models, as PNG.",
    )
    figures = parser.add_subparsers(dest="figure", metavar="FIGURE", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("models", nargs="+", metavar="MODEL", help="model path or hub id; 'minilm' = packaged MiniLM")
        p.add_argument("--senteval-dir", required=True, type=Path, help="SentEval data directory (with STS/, SICK/)")
        p.add_argument("--task", default="STSBenchmark", help="STS task (default: STSBenchmark)")
        p.add_argument("--split", help="split (default: dev for STSBenchmark and SICKRelatedness, else test)")
        p.add_argument("--out", required=True, type=Path, help="PNG file to write")
        p.add_argument("--labels", nargs="+", metavar="LABEL",
                       help="names shown in the figure, one per MODEL (default: the last path component of each "
                       "MODEL); the pooling is appended to each, e.g. 'minilm (mean)'")
        p.add_argument("--batch-size", type=positive_int(1 << 20), default=64, help="encoding batch size (default: 64)")
        p.add_argument("--title", help="figure title (default: a description of the figure)")
        add_trust_remote_code_argument(p)
        add_no_progress_argument(p)

    sim = figures.add_parser(
        "similarity", help="predicted cosine similarity per gold-score bucket",
        description="Box plots of each model's cosine similarity of STS pairs, per gold-score bucket "
        "[0,1) [1,2) [2,3) [3,4) [4,5].",
    )
    common(sim)
    sim.set_defaults(func=run_similarity)

    au = figures.add_parser(
        "align-uniform", help="models in the alignment-uniformity plane",
        description="Alignment (positive pairs: gold score >= --positive-threshold) and uniformity (all distinct "
        "sentences) of each model on an STS split, as a labelled scatter plot; the values are printed too.",
    )
    common(au)
    au.add_argument("--positive-threshold", type=finite_float(0.0, 5.0), default=4.0,
                    help="gold score from which a pair is positive (default: 4)")
    au.set_defaults(func=run_align_uniform)

    stage1 = figures.add_parser(
        "diffaug-stage1", help="DiffAug's stage-1 curves: delta and kappa against the step",
        description="Draw the representation divergence (delta) and the weight convergence (kappa) that a DiffAug "
        "run logged during stage 1 (RUN_DIR/train_result.json), with the step where stage 1 ended.",
    )
    stage1.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="output folder of 'st-prompts train diffaug'")
    stage1.add_argument("--out", required=True, type=Path, help="PNG file to write")
    stage1.add_argument("--title", help="figure title")
    stage1.set_defaults(func=run_diffaug_stage1)
    return parser


def _check_args(args: argparse.Namespace) -> list[str]:
    """Validate the options shared by both figures (canonicalising ``args.task``, filling in the default
    ``args.split``); return the label of each model."""
    from st_prompts.data.senteval import normalize_task

    args.task = normalize_task(args.task)
    if not args.split:
        args.split = "dev" if args.task in _TASKS_WITH_DEV else "test"
    if args.out.suffix.lower() != ".png":
        raise ConfigurationError(f"--out must be a .png file, got {str(args.out)!r}")
    if args.out.is_dir():
        raise ConfigurationError(f"--out {str(args.out)!r} is a directory")
    if not args.senteval_dir.is_dir():
        raise DataNotFoundError(f"--senteval-dir {str(args.senteval_dir)!r} is not a directory")
    labels = args.labels or _default_labels(args.models)
    if len(labels) != len(args.models):
        raise ConfigurationError(f"--labels gives {len(labels)} names for {len(args.models)} models")
    if len(set(labels)) != len(labels):
        raise ConfigurationError(f"model labels must be distinct, got {labels} (use --labels)")
    return labels


def _default_labels(models: list[str]) -> list[str]:
    """Last path component of each model name (``runs/d2cse/final`` -> ``final``), unless two would collide."""
    short = [name.rstrip("/\\").replace("\\", "/").split("/")[-1] or name for name in models]
    return short if len(set(short)) == len(short) else list(models)


def _dataset_label(args: argparse.Namespace) -> str:
    from st_prompts.data.senteval import TASK_LABELS

    return f"{TASK_LABELS.get(args.task, args.task)} {args.split}"


def _load_models(args: argparse.Namespace, labels: list[str]) -> Iterator[tuple[str, Any]]:
    """``("LABEL (POOLING)", model)`` for every MODEL, in order, each loaded when it is reached (see
    :func:`st_prompts.loading.pooling_label`)."""
    from st_prompts.loading import load_sentence_model, pooling_label
    from st_prompts.modules.chat_templates import guard_chat_templates

    for label, name in zip(labels, args.models):
        model = guard_chat_templates(load_sentence_model(name, args.trust_remote_code))
        yield f"{label} ({pooling_label(model)})", model


def run_similarity(args: argparse.Namespace) -> int:
    """Run ``st-prompts plot similarity``."""
    from st_prompts.data.senteval import load_sts
    from st_prompts.plots import plot_similarity_by_score

    labels = _check_args(args)
    pairs = load_sts(args.senteval_dir, args.task, args.split)
    models = dict(_load_models(args, labels))
    path = plot_similarity_by_score(models, pairs, args.out, dataset_label=_dataset_label(args), title=args.title,
                                    batch_size=args.batch_size, show_progress_bar=show_progress(args))
    print(f"wrote {path}")
    return 0


def run_align_uniform(args: argparse.Namespace) -> int:
    """Run ``st-prompts plot align-uniform``."""
    from st_prompts.data.senteval import load_sts
    from st_prompts.evaluation.alignment import AlignmentUniformityEvaluator
    from st_prompts.plots import plot_alignment_uniformity

    labels = _check_args(args)
    pairs = load_sts(args.senteval_dir, args.task, args.split)
    evaluator = AlignmentUniformityEvaluator(pairs.sentences1, pairs.sentences2, pairs.scores,
                                             positive_threshold=args.positive_threshold, batch_size=args.batch_size,
                                             show_progress_bar=show_progress(args), write_csv=False)
    points = {}
    for label, model in _load_models(args, labels):
        result = evaluator.compute(model)
        points[label] = (result["alignment"], result["uniformity"])
    print(f"{_dataset_label(args)}: {evaluator.num_positive_pairs} positive pairs (gold score >= "
          f"{args.positive_threshold:g}), {evaluator.num_sentences} distinct sentences")
    width = max(len(label) for label in points)
    print(f"{'model':<{width}}  alignment  uniformity")
    for label, (a, u) in points.items():
        print(f"{label:<{width}}  {a:9.4f}  {u:10.4f}")
    note = (f"Embeddings L2-normalised; alignment over the {evaluator.num_positive_pairs} pairs with gold score >= "
            f"{args.positive_threshold:g}, uniformity over all pairs of the {evaluator.num_sentences} distinct "
            "sentences.")
    path = plot_alignment_uniformity(points, args.out, title=args.title, dataset_label=_dataset_label(args), note=note)
    print(f"wrote {path}")
    return 0


def _checked_stage1_rows(read, run_dir: Path) -> list[dict[str, float]]:
    """``read(run_dir)``'s stage-1 rows, each with a whole-number step and finite delta and kappa; a damaged or
    hand-edited ``train_result.json`` is one :class:`~st_prompts.errors.DataFormatError`."""
    import math

    from st_prompts.errors import DataFormatError

    where = f"{str(Path(run_dir) / 'train_result.json')!r}"
    try:
        rows = read(run_dir)
    except (ValueError, AttributeError, TypeError) as exc:  # not JSON, or not the object a training run writes
        if isinstance(exc, DataFormatError):
            raise
        raise DataFormatError(f"{where} is damaged or not a training run's result ({type(exc).__name__}: "
                              f"{first_line(exc)})") from exc
    for row in rows if isinstance(rows, list) else [None]:
        values = [row.get(k) for k in ("diffaug_delta", "diffaug_kappa")] if isinstance(row, dict) else [None]
        step = row.get("step") if isinstance(row, dict) else None
        if (not isinstance(step, int) or isinstance(step, bool)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values)):
            raise DataFormatError(f"{where} holds a stage-1 entry without a whole-number step and finite "
                                  "diffaug_delta and diffaug_kappa")
    return rows


def run_diffaug_stage1(args: argparse.Namespace) -> int:
    """Run ``st-prompts plot diffaug-stage1``."""
    from st_prompts.methods.diffaug.plot import plot_diffaug_stage1, read_diffaug_stage1

    if args.out.suffix.lower() != ".png":
        raise ConfigurationError(f"--out must be a .png file, got {str(args.out)!r}")
    rows = _checked_stage1_rows(read_diffaug_stage1, args.run_dir)
    path = plot_diffaug_stage1(rows, args.out, title=args.title)
    last = rows[-1]
    print(f"stage 1: {len(rows)} measurements, last at step {last['step']} (delta={last['diffaug_delta']:.4f}, "
          f"kappa={last['diffaug_kappa']:.4f})")
    print(f"wrote {path}")
    return 0
