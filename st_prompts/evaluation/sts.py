"""The SentEval/SimCSE STS protocol on sentence-transformers' EmbeddingSimilarityEvaluator: Spearman of gold scores and
cosine similarities on each test split of STS12-16, STS-B and SICK-R, and their average; selection on STS-B dev.
Sentences are encoded whole, as SentEval's (:func:`~st_prompts.modules.lengths.full_length`; ``max_length``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from sentence_transformers.base.evaluation.evaluator import BaseEvaluator
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

from st_prompts.data.senteval import (STS_TASKS, TASK_LABELS, STSPairs, check_senteval_dir, load_sts,
                                      load_sts_from_hub, normalize_task)
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
    """EmbeddingSimilarityEvaluator that takes its embeddings from ``self.cache`` (sentence -> vector) when set."""

    cache: dict[str, np.ndarray] | None = None

    def embed_inputs(self, model, sentences, **kwargs) -> np.ndarray:
        if self.cache is None:
            return super().embed_inputs(model, sentences, **kwargs)
        return np.stack([self.cache[s] for s in sentences])


class STSSuiteEvaluator(BaseEvaluator):
    """The SentEval/SimCSE STS suite: Spearman of cosine similarity on each task's test split, and their average.

    Data are loaded and validated in ``__init__`` (from ``senteval_dir``, or ``source="hub"``), so bad data fail
    before any training; every distinct sentence is encoded once per call. Returns
    ``{f"{name}_{task.lower()}_spearman": ..., f"{name}_avg_spearman": ...}`` as fractions (the primary metric is the
    average); ``show_progress_bar=None``: when logging at INFO.
    """

    def __init__(self, senteval_dir=None, tasks: Iterable[str] = STS_TASKS, source: str = "senteval",
                 batch_size: int = 64, show_progress_bar: bool | None = None, name: str = "sts",
                 similarity: str = "cosine"):
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
        self.evaluators = {task: _CachedEmbeddingSimilarityEvaluator(
            pairs.sentences1, pairs.sentences2, pairs.scores, batch_size=batch_size, main_similarity=similarity,
            name=f"{name}_{task.lower()}" if name else task.lower(), show_progress_bar=show_progress_bar)
            for task, pairs in self.pairs.items()}
        self.primary_metric = f"{name}_avg_spearman" if name else "avg_spearman"
        self.max_length: int | None = None  # the tokens per sentence the last call encoded at most

    #: Encodes without truncation below the model's limit (:func:`~st_prompts.modules.lengths.full_length`).
    encodes_full_length = True

    def __call__(self, model: SentenceTransformer, output_path: str | None = None, epoch: int = -1,
                 steps: int = -1) -> dict[str, float]:
        """Evaluate ``model`` on every task; per-task CSVs are written to ``output_path`` if given."""
        sentences = list(dict.fromkeys(s for p in self.pairs.values() for s in (*p.sentences1, *p.sentences2)))
        logger.info(f"STSSuiteEvaluator: encoding {len(sentences)} distinct sentences for {', '.join(self.tasks)}")
        show = logger.getEffectiveLevel() <= logging.INFO if self.show_progress_bar is None else self.show_progress_bar
        with full_length(model) as self.max_length:
            embeddings = model.encode(sentences, batch_size=self.batch_size, show_progress_bar=show,
                                      convert_to_numpy=True)
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
        logger.info("STS (Spearman x100, %s): %s", self.similarity,
                    "  ".join(f"{TASK_LABELS[t]} {100 * metrics[f'{t.lower()}_spearman']:.2f}" for t in self.tasks)
                    + f"  Avg. {100 * metrics['avg_spearman']:.2f}")
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
    """``EmbeddingSimilarityEvaluator`` at the model's full length, as SentEval (``max_length``: the last)."""

    encodes_full_length = True
    max_length: int | None = None

    def __call__(self, model, output_path: str | None = None, epoch: int = -1, steps: int = -1) -> dict[str, float]:
        with full_length(model) as self.max_length:
            return super().__call__(model, output_path=output_path, epoch=epoch, steps=steps)

    def get_config_dict(self) -> dict:
        return {**super().get_config_dict(), "max_length": self.max_length}


def stsb_dev_evaluator(senteval_dir=None, batch_size: int = 64, name: str = "sts-dev",
                       source: str = "senteval") -> FullLengthEmbeddingSimilarityEvaluator:
    """STS-B dev, the model-selection evaluator of training (primary metric ``{name}_spearman_cosine``)."""
    pairs = _load_pairs(senteval_dir, ["STSBenchmark"], "dev", source)["STSBenchmark"]
    return FullLengthEmbeddingSimilarityEvaluator(pairs.sentences1, pairs.sentences2, pairs.scores,
                                                  batch_size=batch_size, main_similarity="cosine", name=name)


def sts_table_rows(name: str = "sts", tasks: Iterable[str] = STS_TASKS) -> list[tuple[str, str]]:
    """(label, metric key) rows of the STS table: one per task, then ``Avg.``."""
    prefix = f"{name}_" if name else ""
    rows = [(TASK_LABELS[normalize_task(t)], f"{prefix}{normalize_task(t).lower()}_spearman") for t in tasks]
    return rows + [("Avg.", f"{prefix}avg_spearman")]


def format_results_table(results_by_model: Mapping[str, Mapping[str, float]], rows: Sequence[tuple] | None = None,
                         name: str = "sts", scale: float = 100.0, digits: int = 2, title: str | None = None) -> str:
    """A plain-text table, one row per metric and one column per model (``{model: {metric key: value}}``), values
    ``x scale`` (``-``: missing or NaN).

    ``rows``: ``(label, metric key)`` or ``(label, metric key, row scale)`` tuples; default: the STS rows
    (:func:`sts_table_rows`) found in at least one model's results.
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
    lines = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
             for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(([title] if title else []) + lines)
