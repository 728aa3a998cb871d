"""``st-prompts evaluate``: evaluate one or more models and print one comparison table.

Examples::

    st-prompts evaluate minilm --senteval-dir ../shared/data/senteval    # or SentEval's own data/downstream
    st-prompts evaluate minilm outputs/dcpcse-unsup-cpu --senteval-dir ../shared/data/senteval --tasks STS12 \
        STSBenchmark --json results.json
    st-prompts evaluate sentence-transformers/all-mpnet-base-v2 --hub

One column per model, headed ``MODEL (POOLING)``; with ``--json`` the same results as the evaluators return them.
Metric groups: :data:`METRIC_GROUPS` (``--metrics``). Only light modules are imported here, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from st_prompts.commands._numbers import positive_int
from st_prompts.commands.options import (add_dtype_argument, add_no_progress_argument, add_trust_remote_code_argument,
                                         show_progress)
from st_prompts.data.senteval import STS_TASKS, TASK_LABELS, normalize_task
from st_prompts.errors import ConfigurationError, DataNotFoundError, StPromptsError
from st_prompts.utils import resolve_model_name

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers.base.evaluation.evaluator import BaseEvaluator

STS_PROTOCOL = (
    "SentEval/SimCSE 'all' setting: Spearman correlation between gold scores and cosine similarity of the "
    "sentence embeddings over all pairs of each task's test split (STS12-16 subsets concatenated, unscored pairs "
    "skipped); avg = mean over the tasks"
)


@dataclass(frozen=True)
class MetricGroup:
    """A family of metrics ``st-prompts evaluate`` can compute.

    Attributes:
        build: the evaluator from the parsed arguments; it loads and validates its data at once, before any model.
        rows: its table rows, ``(label, metric key[, scale])`` (:func:`st_prompts.evaluation.sts.format_results_table`).
        info: what the JSON output records about it (tasks, protocol, data source, what the values are).
        caption: the line above the table: what the rows show, on which task and split.
    """

    build: Callable[[argparse.Namespace], BaseEvaluator]
    rows: Callable[[BaseEvaluator], list[tuple]]
    info: Callable[[BaseEvaluator], dict[str, Any]]
    caption: Callable[[BaseEvaluator], str]


def _build_sts(args: argparse.Namespace) -> BaseEvaluator:
    from st_prompts.evaluation.sts import STSSuiteEvaluator

    if not args.hub and args.senteval_dir is None:
        raise ConfigurationError("--senteval-dir is required for the STS metrics (or pass --hub to use the hub copies)")
    return STSSuiteEvaluator(senteval_dir=None if args.hub else args.senteval_dir, tasks=args.tasks,
                             source="hub" if args.hub else "senteval", batch_size=args.batch_size,
                             show_progress_bar=show_progress(args), name="sts")


def _sts_rows(evaluator) -> list[tuple]:
    from st_prompts.evaluation.sts import sts_table_rows

    return sts_table_rows(evaluator.name, evaluator.tasks)


def _sts_info(evaluator) -> dict[str, Any]:
    return {
        "tasks": list(evaluator.tasks), "split": "test", "similarity": evaluator.similarity, "protocol": STS_PROTOCOL,
        "source": evaluator.source,
        "senteval_dir": None if evaluator.senteval_dir is None else str(Path(evaluator.senteval_dir).resolve()),
        "pairs": {task: len(pairs) for task, pairs in evaluator.pairs.items()},
        "values": "Spearman correlation, as a fraction (-1 to 1)", "table": "Spearman x 100",
    }


def _pairs_evaluator(args: argparse.Namespace, group: str, **kwargs) -> BaseEvaluator:
    """The ``group`` evaluator over the pairs of ``--pairs-task``/``--pairs-split`` (it records the task and split)."""
    from st_prompts.evaluation.alignment import AlignmentUniformityEvaluator
    from st_prompts.evaluation.retrieval import STSRetrievalEvaluator

    if args.senteval_dir is None:
        raise ConfigurationError(f"--senteval-dir is required for the {group} metrics")
    evaluator_class = {"retrieval": STSRetrievalEvaluator, "alignment": AlignmentUniformityEvaluator}[group]
    return evaluator_class.from_senteval(
        args.senteval_dir, task=args.pairs_task, split=args.pairs_split, name=group,
        batch_size=args.batch_size, write_csv=False, **kwargs,
    )


def _pairs_data(evaluator) -> str:
    """``"STS-B (STSBenchmark) test"``: the task and split a pairs evaluator read, for captions."""
    label = TASK_LABELS.get(evaluator.task, evaluator.task)
    task = f"{label} ({evaluator.task})" if label != evaluator.task else label
    return f"{task} {evaluator.split}"


def _retrieval_info(evaluator) -> dict[str, Any]:
    return {
        "task": evaluator.task, "split": evaluator.split, "queries": evaluator.num_queries,
        "pool": evaluator.pool_size, "identical_pairs_dropped": evaluator.num_identical_dropped,
        "protocol": "D2CSE: pairs with gold score 5 (first sentence = query, its pair = the one relevant answer), "
        "pool = every distinct sentence of the split, the query's own text excluded",
        "values": "recall@k and MRR@10, as fractions (0 to 1)",
        "table": "recall@k and MRR@10 x 100",
    }


def _alignment_info(evaluator) -> dict[str, Any]:
    return {
        "task": evaluator.task, "split": evaluator.split, "positive_pairs": evaluator.num_positive_pairs,
        "sentences": evaluator.num_sentences, "positive_threshold": evaluator.positive_threshold,
        "protocol": "Wang & Isola on L2-normalised embeddings: alignment = mean squared distance of pairs with gold "
        "score >= threshold; uniformity = log mean exp(-2 squared distance) over all pairs of distinct sentences; "
        "lower is better",
        "values": "raw values (lower is better)",
        "table": "raw values",
    }


#: ``--metrics`` choices. Add an entry to add a metric group to the command.
METRIC_GROUPS: dict[str, MetricGroup] = {
    "sts": MetricGroup(
        build=_build_sts, rows=_sts_rows, info=_sts_info,
        caption=lambda e: "STS: Spearman correlation x 100 of cosine similarity, test sets (SentEval/SimCSE protocol)",
    ),
    "retrieval": MetricGroup(
        build=lambda args: _pairs_evaluator(args, "retrieval", recall_at_k=(1, 3, 5)), info=_retrieval_info,
        rows=lambda e: [("Recall@1", "retrieval_recall@1"), ("Recall@3", "retrieval_recall@3"),
                        ("Recall@5", "retrieval_recall@5"), ("MRR@10", "retrieval_mrr@10")],
        caption=lambda e: f"Retrieval (D2CSE protocol) on {_pairs_data(e)}: recall@k and MRR@10 x 100",
    ),
    "alignment": MetricGroup(
        build=lambda args: _pairs_evaluator(args, "alignment"), info=_alignment_info,
        rows=lambda e: [("Alignment", "alignment_alignment", 1.0), ("Uniformity", "alignment_uniformity", 1.0)],
        caption=lambda e: f"Alignment / uniformity on {_pairs_data(e)}: raw values, lower is better",
    ),
}


def _task_arg(value: str) -> str:
    try:
        return normalize_task(value)
    except ConfigurationError:
        return value  # argparse then reports the invalid choice


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``evaluate`` sub-command."""
    parser = subparsers.add_parser(
        "evaluate", help="evaluate models (STS suite, recall@K retrieval, alignment/uniformity) in one table",
        description="Evaluate each MODEL and print one table (one column per model, headed 'MODEL (POOLING)'). "
        "STS: Spearman x100 of cosine similarity on the test sets of STS12-16, STS-B and SICK-R, read from a "
        "SentEval directory (SimCSE's protocol, 'all' setting), and their average.",
    )
    parser.add_argument("models", metavar="MODEL", nargs="+",
                        help="model path or hub name ('minilm' = the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--senteval-dir", type=Path,
                        help="SentEval data directory, holding STS/ and SICK/ (SentEval's data/downstream)")
    parser.add_argument("--tasks", nargs="+", type=_task_arg, choices=STS_TASKS, default=list(STS_TASKS),
                        metavar="TASK", help=f"STS tasks to run (default: all): {' '.join(STS_TASKS)}")
    parser.add_argument("--metrics", nargs="+", choices=list(METRIC_GROUPS), default=["sts"],
                        help=f"metric groups to compute (default: sts); choices: {', '.join(METRIC_GROUPS)}")
    parser.add_argument("--pairs-task", type=_task_arg, choices=STS_TASKS, default="STSBenchmark", metavar="TASK",
                        help="STS task whose pairs the retrieval and alignment metrics use (default: STSBenchmark)")
    parser.add_argument("--pairs-split", default="test", choices=["train", "dev", "test"], help="split of --pairs-task "
                        "for retrieval and alignment (default: test; STS-B test gives 97 queries)")
    parser.add_argument("--hub", action="store_true", help="load the STS data from the Hugging Face hub (mteb/*, "
                        "sentence-transformers/stsb) instead of a SentEval directory; needs network access and gives "
                        "slightly different numbers than SentEval's files")
    parser.add_argument("--batch-size", type=positive_int(1 << 20), default=64,
                        help="encoding batch size (default: 64)")
    parser.add_argument("--device", help="device to encode on (default: sentence-transformers' choice)")
    add_dtype_argument(parser)
    add_trust_remote_code_argument(parser)
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the results to this JSON "
                        "file (metric values as fractions, as the evaluators return them)")
    add_no_progress_argument(parser)
    parser.set_defaults(func=run)


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith(os.sep)


def run(args: argparse.Namespace) -> int:
    """Run ``st-prompts evaluate``: validate all inputs, evaluate every model, print the table, write the JSON."""
    from st_prompts.evaluation.sts import format_results_table
    from st_prompts.loading import load_sentence_model, pooling_label
    from st_prompts.modules.chat_templates import guard_chat_templates
    from st_prompts.storage import write_json_atomic

    if args.json is not None and args.json.is_dir():
        raise ConfigurationError(f"--json {args.json} is a directory; give a file name")
    groups = list(dict.fromkeys(args.metrics))
    # Build (and so validate) every evaluator and check local model paths before loading any model.
    evaluators = {g: METRIC_GROUPS[g].build(args) for g in groups}
    resolved = {name: resolve_model_name(name) for name in dict.fromkeys(args.models)}
    for name, path in resolved.items():
        if _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
            raise DataNotFoundError(f"model path {name} does not exist")

    results: dict[str, dict[str, float]] = {}
    pooling: dict[str, str] = {}
    for name in resolved:
        model = guard_chat_templates(load_sentence_model(name, args.trust_remote_code, device=args.device,
                                                         dtype=args.dtype))
        pooling[name] = pooling_label(model)
        results[name] = {key: value for evaluator in evaluators.values() for key, value in evaluator(model).items()}
        del model
        gc.collect()

    rows = [row for g in groups for row in METRIC_GROUPS[g].rows(evaluators[g])]
    title = "\n".join(caption for g in groups if (caption := METRIC_GROUPS[g].caption(evaluators[g])))
    columns = {f"{name} ({pooling[name]})": results[name] for name in resolved}
    print(format_results_table(columns, rows=rows, title=title or None))
    if args.json is not None:
        try:
            write_json_atomic(args.json, {"results": results,
                                          "metrics": {g: METRIC_GROUPS[g].info(evaluators[g]) for g in groups},
                                          "models": resolved, "pooling": pooling})
        except OSError as exc:
            raise StPromptsError(f"could not write {args.json}: {exc.strerror or exc}") from exc
    return 0
