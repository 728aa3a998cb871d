"""STS evaluation with the SentEval/SimCSE protocol, built on sentence-transformers' EmbeddingSimilarityEvaluator.

Protocol (SimCSE, "all" setting): for each of STS12-16, STS-B and SICK-R, the Spearman correlation between the gold
scores and the cosine similarity of the two sentence embeddings, over all pairs of the task's test split (the
subsets of STS12-16 concatenated), and the average of the tasks. Models are selected on STS-B dev
(:func:`stsb_dev_evaluator`), never on the test sets. Sentences are encoded whole, as SentEval's and the official
SimCSE, PromCSE and DiffAug batchers tokenize them (no maximum length): up to what the backbone can take, whatever
length the model was trained at (:func:`~st_prompts.modules.lengths.full_length`); each evaluator records the length
it used (``max_length``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from sentence_transformers.base.evaluation.evaluator import BaseEvaluator
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

from st_prompts.data.senteval import (
    STS_TASKS,
    TASK_LABELS,
    STSPairs,
    check_senteval_dir,
    load_sts,
    load_sts_from_hub,
    normalize_task,
)
from st_prompts.errors import ConfigurationError
from st_prompts.modules.lengths import full_length

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

SOURCES = ("senteval", "hub")


def _load_pairs(senteval_dir, tasks: Sequence[str], split: str, source: str) -> dict[str, STSPairs]:
    if source == "senteval":
        root = check_senteval_dir(senteval_dir, tasks, split)
        return {task: load_sts(root, task, split) for task in tasks}
    if source == "hub":
        return {task: load_sts_from_hub(task, split) for task in tasks}
    raise ConfigurationError(f"unknown STS data source {source!r}; choose from {', '.join(SOURCES)}")


class _CachedEmbeddingSimilarityEvaluator(EmbeddingSimilarityEvaluator):
    """EmbeddingSimilarityEvaluator that takes its embeddings from ``self.cache`` (sentence -> vector) when set.

    :class:`STSSuiteEvaluator` fills the cache once with every distinct sentence of all its tasks, so a sentence
    shared by several pairs or tasks is encoded once.
    """

    cache: dict[str, np.ndarray] | None = None

    def embed_inputs(self, model, sentences, **kwargs) -> np.ndarray:
        if self.cache is None:
            return super().embed_inputs(model, sentences, **kwargs)
        return np.stack([self.cache[s] for s in sentences])


class STSSuiteEvaluator(BaseEvaluator):
    """The SentEval/SimCSE STS suite: Spearman of cosine similarity on each task's test split, and their average.

    One :class:`~sentence_transformers.sentence_transformer.evaluation.EmbeddingSimilarityEvaluator` per task does
    the scoring; every distinct sentence is encoded once per call. Data are loaded and validated in ``__init__``,
    so a bad SentEval directory fails before any training starts.

    Args:
        senteval_dir: SentEval data directory (holding ``STS/`` and ``SICK/``); required when ``source="senteval"``.
        tasks: subset of :data:`~st_prompts.data.senteval.STS_TASKS`.
        source: ``"senteval"`` (read ``senteval_dir``) or ``"hub"``
            (:func:`~st_prompts.data.senteval.load_sts_from_hub`; numbers differ slightly from SentEval's files).
        show_progress_bar: ``None``: when logging at INFO or DEBUG.
        similarity: ``"cosine"`` (the protocol), or ``"dot"``, ``"euclidean"``, ``"manhattan"``.

    Attributes:
        tasks: the canonical task names, in evaluation order.
        pairs: ``{task: STSPairs}``, the test pairs of each task.

    Returns (when called):
        ``{f"{name}_{task.lower()}_spearman": ..., f"{name}_avg_spearman": ...}``, Spearman correlations as fractions
        (multiply by 100 for the papers' numbers). ``primary_metric`` is the average.

    Raises:
        DataNotFoundError / DataFormatError / ConfigurationError: at construction, for bad data or options.
    """

    def __init__(
        self,
        senteval_dir=None,
        tasks: Iterable[str] = STS_TASKS,
        source: str = "senteval",
        batch_size: int = 64,
        show_progress_bar: bool | None = None,
        name: str = "sts",
        similarity: str = "cosine",
    ):
        super().__init__()
        self.tasks = list(dict.fromkeys(normalize_task(t) for t in tasks))
        if not self.tasks:
            raise ConfigurationError("no STS task selected")
        if similarity not in ("cosine", "dot", "euclidean", "manhattan"):
            raise ConfigurationError(f"unknown similarity {similarity!r}; choose cosine, dot, euclidean or manhattan")
        self.source = source
        self.senteval_dir = senteval_dir
        self.batch_size = batch_size
        self.show_progress_bar = show_progress_bar
        self.name = name
        self.similarity = similarity
        self.pairs = _load_pairs(senteval_dir, self.tasks, "test", source)
        self.evaluators = {
            task: _CachedEmbeddingSimilarityEvaluator(
                pairs.sentences1,
                pairs.sentences2,
                pairs.scores,
                batch_size=batch_size,
                main_similarity=similarity,
                name=f"{name}_{task.lower()}" if name else task.lower(),
                show_progress_bar=show_progress_bar,
            )
            for task, pairs in self.pairs.items()
        }
        self.primary_metric = f"{name}_avg_spearman" if name else "avg_spearman"
        #: The most tokens per sentence the last call encoded (the model's full length, as SentEval).
        self.max_length: int | None = None

    #: Encodes without truncation below the model's limit (:func:`~st_prompts.modules.lengths.full_length`).
    encodes_full_length = True

    def __call__(
        self, model: SentenceTransformer, output_path: str | None = None, epoch: int = -1, steps: int = -1
    ) -> dict[str, float]:
        """Evaluate ``model`` on every task; per-task CSVs are written to ``output_path`` if given."""
        sentences = list(dict.fromkeys(s for p in self.pairs.values() for s in (*p.sentences1, *p.sentences2)))
        logger.info(f"STSSuiteEvaluator: encoding {len(sentences)} distinct sentences for {', '.join(self.tasks)}")
        show = self.show_progress_bar
        if show is None:
            show = logger.getEffectiveLevel() <= logging.INFO
        with full_length(model) as self.max_length:
            embeddings = model.encode(
                sentences, batch_size=self.batch_size, show_progress_bar=show, convert_to_numpy=True
            )
        cache = dict(zip(sentences, embeddings))
        metrics = {}
        try:
            for task, evaluator in self.evaluators.items():
                evaluator.cache = cache
                results = evaluator(model, output_path=output_path, epoch=epoch, steps=steps)
                metrics[f"{task.lower()}_spearman"] = float(results[evaluator.primary_metric])
        finally:
            for evaluator in self.evaluators.values():
                evaluator.cache = None
        metrics["avg_spearman"] = float(np.mean([metrics[f"{t.lower()}_spearman"] for t in self.tasks]))
        logger.info(
            "STS (Spearman x100, %s): %s",
            self.similarity,
            "  ".join(f"{TASK_LABELS[t]} {100 * metrics[f'{t.lower()}_spearman']:.2f}" for t in self.tasks)
            + f"  Avg. {100 * metrics['avg_spearman']:.2f}",
        )
        metrics = self.prefix_name_to_metrics(metrics, self.name)
        self.store_metrics_in_model_card_data(model, metrics, epoch, steps)
        return metrics

    @property
    def description(self) -> str:
        return "Semantic Similarity (SentEval STS suite)"

    def get_config_dict(self) -> dict:
        return {"tasks": self.tasks, "source": self.source, "similarity": self.similarity,
                "max_length": self.max_length}


class FullLengthEmbeddingSimilarityEvaluator(EmbeddingSimilarityEvaluator):
    """sentence-transformers' ``EmbeddingSimilarityEvaluator`` encoding at the model's full length
    (:func:`~st_prompts.modules.lengths.full_length`), as SentEval: the STS-B dev selection of a model trained at 32
    tokens sees every sentence whole. ``max_length`` is the length the last call used."""

    encodes_full_length = True
    max_length: int | None = None

    def __call__(self, model, output_path: str | None = None, epoch: int = -1, steps: int = -1) -> dict[str, float]:
        with full_length(model) as self.max_length:
            return super().__call__(model, output_path=output_path, epoch=epoch, steps=steps)

    def get_config_dict(self) -> dict:
        return {**super().get_config_dict(), "max_length": self.max_length}


def stsb_dev_evaluator(
    senteval_dir=None, batch_size: int = 64, name: str = "sts-dev", source: str = "senteval"
) -> FullLengthEmbeddingSimilarityEvaluator:
    """STS-B dev, the model-selection evaluator used during training (primary metric ``f"{name}_spearman_cosine"``),
    encoding every sentence whole (:class:`FullLengthEmbeddingSimilarityEvaluator`).

    ``source``: ``"senteval"`` (``STS/STSBenchmark/sts-dev.csv`` under ``senteval_dir``) or ``"hub"``
    (``sentence-transformers/stsb``).
    """
    pairs = _load_pairs(senteval_dir, ["STSBenchmark"], "dev", source)["STSBenchmark"]
    return FullLengthEmbeddingSimilarityEvaluator(
        pairs.sentences1, pairs.sentences2, pairs.scores, batch_size=batch_size, main_similarity="cosine", name=name
    )


def sts_table_rows(name: str = "sts", tasks: Iterable[str] = STS_TASKS) -> list[tuple[str, str]]:
    """(label, metric key) rows of the STS table: one per task, then ``Avg.``."""
    prefix = f"{name}_" if name else ""
    rows = [(TASK_LABELS[normalize_task(t)], f"{prefix}{normalize_task(t).lower()}_spearman") for t in tasks]
    return rows + [("Avg.", f"{prefix}avg_spearman")]


def format_results_table(
    results_by_model: Mapping[str, Mapping[str, float]],
    rows: Sequence[tuple] | None = None,
    name: str = "sts",
    scale: float = 100.0,
    digits: int = 2,
    title: str | None = None,
) -> str:
    """A plain-text table, one row per metric and one column per model, values ``x scale`` (x100 as in the papers).

    Args:
        results_by_model: ``{model: {metric key: value}}`` as returned by the evaluators.
        rows: ``(label, metric key)`` or ``(label, metric key, row scale)`` tuples to show; default: the STS rows
            (:func:`sts_table_rows` for ``name``) whose key appears in at least one model's results. A missing or
            NaN value is shown as ``-``.
        scale: factor applied to values of rows without their own scale.
    """
    if rows is None:
        rows = [r for r in sts_table_rows(name) if any(r[1] in res for res in results_by_model.values())]
    models = list(results_by_model)

    def cell(model: str, key: str, factor: float) -> str:
        value = results_by_model[model].get(key)
        if value is None or math.isnan(value):
            return "-"
        return f"{value * factor:.{digits}f}"

    header = ["", *models]
    body = [[row[0], *(cell(m, row[1], row[2] if len(row) > 2 else scale) for m in models)] for row in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
        for r in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(([title] if title else []) + lines)
