"""The shared base of the evaluators that score a model on the sentence pairs of one STS split: the checked input,
the encoding options, :meth:`~PairsEvaluator.from_senteval`, and a sentence-transformers evaluator's ``__call__``
(compute, log, append to a CSV file, prefix the names, store them in the model card)."""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from sentence_transformers.base.evaluation.evaluator import BaseEvaluator

from st_prompts.data.senteval import load_sts
from st_prompts.errors import DataFormatError
from st_prompts.modules.lengths import full_length

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from typing_extensions import Self

logger = logging.getLogger(__name__)


class PairsOptions(TypedDict, total=False):
    """The options every :class:`PairsEvaluator` takes (subclasses accept them as ``**options``)."""
    name: str
    batch_size: int
    show_progress_bar: bool | None
    write_csv: bool


def check_pair_lengths(sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float]) -> None:
    """Raise DataFormatError unless the three sequences have the same length."""
    if not (len(sentences1) == len(sentences2) == len(scores)):
        raise DataFormatError(f"sentences1, sentences2 and scores must have the same length, got "
                              f"{len(sentences1)}, {len(sentences2)} and {len(scores)}")


class PairsEvaluator(BaseEvaluator):
    """Base class of evaluators over the sentence pairs of an STS split and their gold scores.

    Subclasses set :attr:`csv_prefix` and ``csv_headers``, and implement :meth:`compute` (metrics without the name
    prefix) and :meth:`describe`. ``name`` prefixes the result keys; ``write_csv`` appends a row to
    ``{csv_prefix}_{name}_results.csv`` in ``output_path`` at each call; ``task`` and ``split`` are set by
    :meth:`from_senteval`.
    """

    csv_prefix: str = "Pairs_evaluation"
    encodes_full_length = True  # no truncation below the model's limit (modules.lengths.full_length)

    def __init__(self, sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float], *,
                 name: str = "", batch_size: int = 32, show_progress_bar: bool | None = False,
                 write_csv: bool = True) -> None:
        super().__init__()
        check_pair_lengths(sentences1, sentences2, scores)
        self.name = name
        self.batch_size = batch_size
        self.show_progress_bar = show_progress_bar
        self.write_csv = write_csv
        self.task: str | None = None
        self.split: str | None = None
        self.max_length: int | None = None  # the tokens per sentence the last call encoded at most
        self.csv_file = self.csv_prefix + (f"_{name}" if name else "") + "_results.csv"

    @classmethod
    def from_senteval(cls, senteval_dir: str | os.PathLike, task: str = "STSBenchmark", split: str = "test",
                      **kwargs: Any) -> Self:
        """Build the evaluator from a SentEval data directory (``name`` defaults to ``"{task}-{split}"``)."""
        pairs = load_sts(senteval_dir, task, split)
        kwargs.setdefault("name", f"{task}-{split}")
        evaluator = cls(pairs.sentences1, pairs.sentences2, pairs.scores, **kwargs)
        evaluator.task, evaluator.split = task, split
        return evaluator

    def _where(self) -> str:
        """``"{name}: "`` to start an error message with, or nothing when the evaluator has no name."""
        return f"{self.name}: " if self.name else ""

    def compute(self, model: SentenceTransformer) -> dict[str, float]:
        """The metrics of ``model``, without the ``name`` prefix."""
        raise NotImplementedError

    def describe(self, metrics: dict[str, float]) -> str:
        """One log line about the set-up and the results of a call."""
        values = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items())
        return f"{type(self).__name__}{f' on {self.name}' if self.name else ''}: {values}"

    def __call__(self, model: SentenceTransformer, output_path: str | None = None, epoch: int = -1,
                 steps: int = -1) -> dict[str, float]:
        """Compute the metrics of ``model`` at its full length, log them, write them to the CSV file, return them."""
        with full_length(model) as self.max_length:
            metrics = self.compute(model)
        logger.info(self.describe(metrics))
        if output_path is not None and self.write_csv:
            self._append_csv(Path(output_path), [epoch, steps, *metrics.values()])
        metrics = self.prefix_name_to_metrics(metrics, self.name)
        if hasattr(model, "model_card_data"):
            self.store_metrics_in_model_card_data(model, metrics, epoch, steps)
        return metrics

    def _append_csv(self, output_path: Path, row: list[Any]) -> None:
        os.makedirs(output_path, exist_ok=True)
        csv_path = output_path / self.csv_file
        new_file = not csv_path.is_file()
        with open(csv_path, "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if new_file:
                writer.writerow(self.csv_headers)
            writer.writerow(row)
