"""Alignment and uniformity (Wang & Isola, 2020) as SimCSE and D2CSE report them on STS-B, on L2-normalised
embeddings: alignment the mean ``||f(x) - f(y)||^2`` over positive pairs (gold score >= 4), uniformity SimCSE's
``torch.pdist(x, p=2).pow(2).mul(-2).exp().mean().log()`` over the split's distinct sentences. Lower is better."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

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


def alignment_loss(x: Any, y: Any, alpha: float = 2.0, normalize: bool = True) -> float:
    """Mean ``||x_i - y_i||^alpha`` over the rows of ``x`` and ``y`` (``(n, dim)``: the two sides of positive pairs,
    L2-normalised first with ``normalize``); lower is better."""
    x, y = _as_float64(x), _as_float64(y)
    if x.shape != y.shape or x.shape[0] == 0:
        raise DataFormatError(f"alignment needs two non-empty arrays of the same shape, got {x.shape} and {y.shape}")
    if normalize:
        x, y = F.normalize(x, dim=1), F.normalize(y, dim=1)
    return float((x - y).norm(dim=1).pow(alpha).mean())


def uniformity_loss(x: Any, t: float = 2.0, normalize: bool = True, chunk_size: int = 1024) -> float:
    """``log`` mean over all pairs ``i < j`` of ``exp(-t ||x_i - x_j||^2)`` (``x``: ``(n, dim)``, ``n >= 2``, distinct
    sentences); lower is better. Computed by blocks of ``chunk_size`` rows, not the ``n x n`` matrix at once."""
    if chunk_size < 1:
        raise ConfigurationError(f"chunk_size must be >= 1, got {chunk_size}")
    x = _as_float64(x)
    n = x.shape[0]
    if n < 2:
        raise DataFormatError(f"uniformity needs at least 2 embeddings, got {n}")
    if normalize:
        x = F.normalize(x, dim=1)
    sq_norms = (x * x).sum(dim=1)
    block_lse = []
    for start in range(0, n - 1, chunk_size):
        stop = min(start + chunk_size, n)
        # Distances from rows start..stop-1 to every column j >= start; keep only j > i.
        sq_dist = (sq_norms[start:stop, None] + sq_norms[None, start:] - 2.0 * x[start:stop] @ x[start:].T).clamp_min(0)
        keep = torch.arange(start, n)[None, :] > torch.arange(start, stop)[:, None]
        block_lse.append(torch.logsumexp((-t * sq_dist)[keep], dim=0))
    return float(torch.logsumexp(torch.stack(block_lse), dim=0) - math.log(n * (n - 1) // 2))


class AlignmentUniformityEvaluator(PairsEvaluator):
    """Alignment and uniformity (``{name}_alignment``, ``{name}_uniformity``: lower is better, so
    ``greater_is_better`` is false) of a model's embeddings on an STS split.

    Pairs scored ``>= positive_threshold`` are the positives; ``main_metric`` is the primary metric. Neither alone
    is a sound selection criterion (a collapsed encoder aligns perfectly): read them together, e.g. with
    :func:`st_prompts.plots.plot_alignment_uniformity`.
    """

    csv_prefix = "Alignment-Uniformity_evaluation"

    def __init__(self, sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float], *,
                 positive_threshold: float = 4.0, main_metric: Literal["alignment", "uniformity"] = "alignment",
                 chunk_size: int = 1024, **options: Unpack[PairsOptions]) -> None:
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
            raise DataFormatError(f"{self._where()}no positive pair (gold score >= {self.positive_threshold:g}) for "
                                  "alignment")
        if len(self.sentences) < 2:
            raise DataFormatError(f"{self._where()}uniformity needs at least 2 distinct sentences, got "
                                  f"{len(self.sentences)}")
        self._pos_left, self._pos_right = torch.tensor(positives).T
        self.num_positive_pairs = len(positives)
        self.num_sentences = len(self.sentences)
        self.csv_headers = ["epoch", "steps", "alignment", "uniformity"]

    def compute(self, model: SentenceTransformer) -> dict[str, float]:
        """Encode the distinct sentences once and return ``{"alignment": ..., "uniformity": ...}`` (no prefix)."""
        emb = model.encode(self.sentences, batch_size=self.batch_size, show_progress_bar=self.show_progress_bar,
                           convert_to_tensor=True)
        emb = F.normalize(_as_float64(emb), dim=1)
        return {"alignment": alignment_loss(emb[self._pos_left], emb[self._pos_right], normalize=False),
                "uniformity": uniformity_loss(emb, normalize=False, chunk_size=self.chunk_size)}

    def describe(self, metrics: dict[str, float]) -> str:
        """The log line of a call: set-up sizes and both values."""
        return (f"Alignment/uniformity{f' on {self.name}' if self.name else ''} ({self.num_positive_pairs} positive "
                f"pairs, {self.num_sentences} distinct sentences): alignment {metrics['alignment']:.4f}, "
                f"uniformity {metrics['uniformity']:.4f}")

    def get_config_dict(self) -> dict[str, Any]:
        """Options that differ from the defaults (shown in model cards)."""
        return {} if self.positive_threshold == 4.0 else {"positive_threshold": self.positive_threshold}
