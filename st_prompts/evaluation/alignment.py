"""Alignment and uniformity of sentence embeddings (Wang & Isola, 2020), as SimCSE and D2CSE report them on STS-B.

On L2-normalised embeddings ``f``:

* **alignment** = mean over positive pairs ``(x, y)`` of ``||f(x) - f(y)||^2``; the positive pairs are the STS pairs
  with gold score >= 4 (``positive_threshold``, inclusive; identical-sentence pairs are kept, at distance 0);
* **uniformity** = ``log`` of the mean over all unordered pairs ``i < j`` of distinct sentences of the split
  (both columns) of ``exp(-2 ||f(x_i) - f(x_j)||^2)``, i.e. SimCSE's
  ``torch.pdist(x, p=2).pow(2).mul(-2).exp().mean().log()``.

Lower is better for both. Uniformity is computed by blocks of rows (``chunk_size``) with a running log-sum-exp
in float64, so a few thousand sentences never need the full distance matrix at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.evaluation.pairs import PairsEvaluator

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from typing_extensions import Unpack

    from st_prompts.evaluation.pairs import PairsOptions


def _as_float64(x: Any) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    if t.ndim != 2:
        raise DataFormatError(f"expected a 2-D array of embeddings (rows = sentences), got shape {tuple(t.shape)}")
    return t.detach().to("cpu", torch.float64)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def alignment_loss(x: Any, y: Any, alpha: float = 2.0, normalize: bool = True) -> float:
    """Mean ``||x_i - y_i||^alpha`` over the rows of ``x`` and ``y`` (positive pairs); lower is better.

    ``x``, ``y``: ``(n, dim)``, the two sides of each pair; ``alpha``: 2 in SimCSE / D2CSE; ``normalize``: L2-normalise
    the rows first (the metric is defined on the unit sphere)."""
    x, y = _as_float64(x), _as_float64(y)
    if x.shape != y.shape or x.shape[0] == 0:
        raise DataFormatError(f"alignment needs two non-empty arrays of the same shape, got {x.shape} and {y.shape}")
    if normalize:
        x, y = _normalize(x), _normalize(y)
    return float((x - y).norm(dim=1).pow(alpha).mean())


def uniformity_loss(x: Any, t: float = 2.0, normalize: bool = True, chunk_size: int = 1024) -> float:
    """``log`` mean over all pairs ``i < j`` of ``exp(-t ||x_i - x_j||^2)``; lower is better.

    Computed by blocks of ``chunk_size`` rows: peak memory is ``chunk_size x n`` floats, not ``n x n``.

    ``x``: ``(n, dim)`` with ``n >= 2`` (pass distinct sentences: duplicates add 0-distance pairs); ``t``: 2 in SimCSE /
    D2CSE."""
    if chunk_size < 1:
        raise ConfigurationError(f"chunk_size must be >= 1, got {chunk_size}")
    x = _as_float64(x)
    n = x.shape[0]
    if n < 2:
        raise DataFormatError(f"uniformity needs at least 2 embeddings, got {n}")
    if normalize:
        x = _normalize(x)
    sq_norms = (x * x).sum(dim=1)
    block_lse = []
    for start in range(0, n - 1, chunk_size):
        stop = min(start + chunk_size, n)
        rows = x[start:stop]
        # Distances from rows start..stop-1 to every column j >= start; keep only j > i.
        sq_dist = sq_norms[start:stop, None] + sq_norms[None, start:] - 2.0 * rows @ x[start:].T
        sq_dist = sq_dist.clamp_min(0.0)
        cols = torch.arange(start, n)[None, :]
        keep = cols > torch.arange(start, stop)[:, None]
        block_lse.append(torch.logsumexp((-t * sq_dist)[keep], dim=0))
    num_pairs = n * (n - 1) // 2
    return float(torch.logsumexp(torch.stack(block_lse), dim=0) - math.log(num_pairs))


class AlignmentUniformityEvaluator(PairsEvaluator):
    """Alignment and uniformity (lower is better) of a model's embeddings on an STS split.

    Results (``name`` prefix omitted when ``name`` is empty): ``{name}_alignment`` and ``{name}_uniformity``.
    ``greater_is_better`` is ``False``: both metrics are losses, so a trainer keeping the best checkpoint by this
    evaluator keeps the lowest ``primary_metric``. The primary metric is ``main_metric`` (alignment by default).
    Neither metric alone is a sound model-selection criterion (a collapsed encoder has perfect alignment, a random
    one good uniformity); they are meant to be read together, e.g. with
    :func:`st_prompts.plots.plot_alignment_uniformity`.

    Args:
        sentences1, sentences2, scores: the pairs of the split and their gold scores.
        positive_threshold: pairs with gold score ``>=`` this are positives for alignment (4.0, on the 0-5 scale;
            for ``SICKRelatedness``, scored 1-5, the default keeps its meaning).
        main_metric: ``"alignment"`` or ``"uniformity"``, the primary metric.
        **options: ``name``, ``batch_size``, ``show_progress_bar`` and ``write_csv`` (a row per call in
            ``Alignment-Uniformity_evaluation_{name}_results.csv``), as for every
            :class:`~st_prompts.evaluation.pairs.PairsEvaluator`.

    Attributes:
        num_positive_pairs, num_sentences: sizes of the set-up, for reports.
        task, split: see :class:`~st_prompts.evaluation.pairs.PairsEvaluator` (set by ``from_senteval``).

    Raises:
        DataFormatError: if no pair reaches ``positive_threshold`` or the split has fewer than two distinct sentences.
    """

    csv_prefix = "Alignment-Uniformity_evaluation"

    def __init__(
        self,
        sentences1: Sequence[str],
        sentences2: Sequence[str],
        scores: Sequence[float],
        *,
        positive_threshold: float = 4.0,
        main_metric: Literal["alignment", "uniformity"] = "alignment",
        chunk_size: int = 1024,
        **options: Unpack[PairsOptions],
    ) -> None:
        super().__init__(sentences1, sentences2, scores, **options)
        if main_metric not in ("alignment", "uniformity"):
            raise ConfigurationError(f"main_metric must be 'alignment' or 'uniformity', got {main_metric!r}")
        if chunk_size < 1:
            raise ConfigurationError(f"chunk_size must be >= 1, got {chunk_size}")
        self.positive_threshold = float(positive_threshold)
        self.chunk_size = chunk_size
        self.greater_is_better = False
        self.primary_metric = main_metric

        self.sentences = list(dict.fromkeys(s for pair in zip(sentences1, sentences2) for s in pair))
        index = {s: i for i, s in enumerate(self.sentences)}
        positives = [(index[s1], index[s2]) for s1, s2, sc in zip(sentences1, sentences2, scores)
                     if float(sc) >= self.positive_threshold]
        if not positives:
            raise DataFormatError(
                f"{self._where()}no positive pair (gold score >= {self.positive_threshold:g}) for alignment"
            )
        if len(self.sentences) < 2:
            raise DataFormatError(
                f"{self._where()}uniformity needs at least 2 distinct sentences, got {len(self.sentences)}"
            )
        self._pos_left = torch.tensor([i for i, _ in positives])
        self._pos_right = torch.tensor([j for _, j in positives])
        self.num_positive_pairs = len(positives)
        self.num_sentences = len(self.sentences)
        self.csv_headers = ["epoch", "steps", "alignment", "uniformity"]

    def compute(self, model: SentenceTransformer) -> dict[str, float]:
        """Encode the distinct sentences once and return ``{"alignment": ..., "uniformity": ...}`` (no prefix)."""
        emb = model.encode(
            self.sentences, batch_size=self.batch_size, show_progress_bar=self.show_progress_bar, convert_to_tensor=True
        )
        emb = _normalize(_as_float64(emb))
        return {
            "alignment": alignment_loss(emb[self._pos_left], emb[self._pos_right], normalize=False),
            "uniformity": uniformity_loss(emb, normalize=False, chunk_size=self.chunk_size),
        }

    def describe(self, metrics: dict[str, float]) -> str:
        """The log line of a call: set-up sizes and both values."""
        return (
            f"Alignment/uniformity{f' on {self.name}' if self.name else ''} ({self.num_positive_pairs} positive pairs, "
            f"{self.num_sentences} distinct sentences): alignment {metrics['alignment']:.4f}, "
            f"uniformity {metrics['uniformity']:.4f}"
        )

    def get_config_dict(self) -> dict[str, Any]:
        """Options that differ from the defaults (shown in model cards)."""
        return {} if self.positive_threshold == 4.0 else {"positive_threshold": self.positive_threshold}
