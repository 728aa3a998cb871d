"""Figures of the D2CSE analysis: cosine similarity per gold-score bucket, and the alignment-uniformity plane. Drawn on
a bare :class:`matplotlib.figure.Figure` (no ``pyplot``) and written as PNG atomically; each returns the path."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.storage import write_file_atomic

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from st_prompts.data.senteval import STSPairs

#: Gold-score buckets of the D2CSE figure: [0, 1), [1, 2), [2, 3), [3, 4), [4, 5] (the last one closed).
DEFAULT_SCORE_BUCKETS: tuple[tuple[float, float], ...] = ((0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.0))

_DPI = 150


def _check_png_path(out_path: str | os.PathLike) -> Path:
    path = Path(out_path)
    if path.suffix.lower() != ".png":
        raise ConfigurationError(f"figures are written as PNG: the output path must end in .png, got {str(path)!r}")
    if path.is_dir():
        raise ConfigurationError(f"output path {str(path)!r} is a directory")
    return path


def save_png(fig: Figure, out_path: str | os.PathLike) -> Path:
    """Write ``fig`` to ``out_path`` as PNG atomically."""
    path = _check_png_path(out_path)
    FigureCanvasAgg(fig)
    return write_file_atomic(path, lambda handle: fig.savefig(handle, format="png", dpi=_DPI))


def add_note(fig: Figure, note: str) -> None:
    """Small print under the axes, wrapped to the figure width."""
    width_chars = int(fig.get_figwidth() * 72 / (8 * 0.55))  # 8-pt text, ~0.55 em per character
    # A figure-level x label, so that the constrained layout makes room for it below the axes.
    fig.supxlabel(textwrap.fill(note, width_chars), x=0.01, ha="left", fontsize=8, color="0.3")


def _check_buckets(buckets: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    checked = [(float(lo), float(hi)) for lo, hi in buckets]
    if not checked:
        raise ConfigurationError("at least one gold-score bucket is needed")
    for (lo, hi), nxt in zip(checked, checked[1:] + [None]):
        if not lo < hi:
            raise ConfigurationError(f"bucket ({lo:g}, {hi:g}): the lower bound must be below the upper bound")
        if nxt is not None and nxt[0] < hi:
            raise ConfigurationError(f"buckets must be sorted and must not overlap: ({lo:g}, {hi:g}) then {nxt}")
    return checked


def bucket_label(low: float, high: float, last: bool) -> str:
    """``"[low, high)"``, or ``"[low, high]"`` for the last bucket (which includes its upper bound)."""
    return f"[{low:g}, {high:g}{']' if last else ')'}"


def assign_buckets(scores: Sequence[float],
                   buckets: Sequence[tuple[float, float]] = DEFAULT_SCORE_BUCKETS) -> np.ndarray:
    """Index of the bucket of each score (``low <= s < high``; ``<= high`` in the last bucket), ``-1`` if none."""
    checked = _check_buckets(buckets)
    s = np.asarray(scores, dtype=float)
    out = np.full(s.shape, -1, dtype=int)
    for b, (lo, hi) in enumerate(checked):
        upper = s <= hi if b == len(checked) - 1 else s < hi
        out[(out == -1) & (s >= lo) & upper] = b
    return out


def pair_cosine_similarities(model: SentenceTransformer, sentences1: Sequence[str], sentences2: Sequence[str],
                             batch_size: int = 64, show_progress_bar: bool | None = None) -> np.ndarray:
    """Cosine similarity of ``model``'s embeddings of each pair (each distinct sentence is encoded once)."""
    if len(sentences1) != len(sentences2):
        raise DataFormatError(f"sentences1 and sentences2 differ in length: {len(sentences1)} vs {len(sentences2)}")
    index = {s: i for i, s in enumerate(dict.fromkeys((*sentences1, *sentences2)))}
    from st_prompts.modules.lengths import full_length

    with full_length(model):  # sentences whole, as the STS protocol encodes them
        emb = model.encode(list(index), batch_size=batch_size, show_progress_bar=show_progress_bar,
                           convert_to_numpy=True)
    emb = np.asarray(emb, dtype=np.float64)
    emb /= np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)
    return np.sum(emb[[index[s] for s in sentences1]] * emb[[index[s] for s in sentences2]], axis=1)


def _named_models(model_or_models: Any) -> dict[str, Any]:
    if isinstance(model_or_models, Mapping):
        if not model_or_models:
            raise ConfigurationError("no model given")
        return {str(name): model for name, model in model_or_models.items()}
    return {"model": model_or_models}


def plot_similarity_by_score(model_or_models: SentenceTransformer | Mapping[str, SentenceTransformer], pairs: STSPairs,
                             out_path: str | os.PathLike,
                             buckets: Sequence[tuple[float, float]] = DEFAULT_SCORE_BUCKETS, *,
                             dataset_label: str | None = None, title: str | None = None, batch_size: int = 64,
                             show_progress_bar: bool | None = None) -> Path:
    """Box plots of the predicted cosine similarity of STS ``pairs`` (with ``sentences1``, ``sentences2``,
    ``scores``) per gold-score bucket (the D2CSE figure); several models (``{label: model}``) side by side.
    ``buckets``: ``(low, high)``, the last one closed; ``dataset_label`` is named in the default title."""
    _check_png_path(out_path)
    models = _named_models(model_or_models)
    if len(pairs.sentences1) == 0:
        raise DataFormatError("no sentence pair to plot")
    sims = {name: pair_cosine_similarities(model, pairs.sentences1, pairs.sentences2, batch_size, show_progress_bar)
            for name, model in models.items()}
    return plot_similarity_values_by_score(sims, pairs.scores, out_path, buckets, dataset_label=dataset_label,
                                           title=title)


def plot_similarity_values_by_score(similarities: Mapping[str, Sequence[float]], scores: Sequence[float],
                                    out_path: str | os.PathLike,
                                    buckets: Sequence[tuple[float, float]] = DEFAULT_SCORE_BUCKETS, *,
                                    dataset_label: str | None = None, title: str | None = None) -> Path:
    """Like :func:`plot_similarity_by_score`, from precomputed similarities ``{label: one value per pair}``."""
    checked = _check_buckets(buckets)
    if not similarities:
        raise ConfigurationError("no model given")
    scores_arr = np.asarray(scores, dtype=float)
    if scores_arr.size == 0:
        raise DataFormatError("no sentence pair to plot")
    for name, values in similarities.items():
        if len(values) != scores_arr.size:
            raise DataFormatError(f"{name}: {len(values)} similarities for {scores_arr.size} gold scores")
    which = assign_buckets(scores_arr, checked)
    counts = [int((which == b).sum()) for b in range(len(checked))]
    if sum(counts) == 0:
        labels = [bucket_label(lo, hi, False) for lo, hi in checked]
        raise DataFormatError(f"no gold score falls in the buckets {labels} (scores range from {scores_arr.min():g} "
                              f"to {scores_arr.max():g})")
    outside = int((which == -1).sum())

    n_models = len(similarities)
    box_width = 0.8 / n_models  # each bucket's group of boxes is 0.8 wide
    fig = Figure(figsize=(max(7.0, 1.5 + len(checked) * (0.7 + 0.55 * n_models)), 5.2), layout="constrained")
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(n_models)]
    for m, (name, values) in enumerate(similarities.items()):
        values = np.asarray(values, dtype=float)
        filled = [b for b in range(len(checked)) if counts[b]]
        offset = (m - (n_models - 1) / 2) * box_width
        ax.boxplot([values[which == b] for b in filled], positions=[b + offset for b in filled],
                   widths=box_width * 0.8, patch_artist=True, manage_ticks=False,
                   boxprops={"facecolor": colors[m], "alpha": 0.55, "edgecolor": "black"},
                   medianprops={"color": "black", "linewidth": 1.5},
                   flierprops={"marker": ".", "markersize": 3, "markerfacecolor": colors[m],
                               "markeredgecolor": colors[m]})
    ax.set_xticks(range(len(checked)))
    ax.set_xticklabels([f"{bucket_label(lo, hi, b == len(checked) - 1)}\nn={counts[b]}"
                        for b, (lo, hi) in enumerate(checked)])
    ax.set_xlim(-0.6, len(checked) - 0.4)
    ax.set_xlabel("Gold similarity score of the pair (human rating), bucketed; n = pairs in the bucket")
    ax.set_ylabel("Predicted cosine similarity of the two sentence embeddings")
    ax.grid(axis="y", alpha=0.3)
    default_title = "Predicted similarity vs. gold similarity" + (f" ({dataset_label})" if dataset_label else "")
    ax.set_title(title or default_title)
    if n_models > 1:
        handles = [Patch(facecolor=colors[m], alpha=0.55, edgecolor="black", label=name)
                   for m, name in enumerate(similarities)]
        ax.legend(handles=handles, title="Model", loc="upper left")
    note = "Box: middle 50% of pairs; line: median; whiskers: 1.5 x IQR; dots: outliers."
    if outside:
        note += f" {outside} pair(s) with a score outside the buckets are not shown."
    if n_models == 1:
        note = f"Model: {next(iter(similarities))}. " + note
    add_note(fig, note)
    return save_png(fig, out_path)


def plot_alignment_uniformity(points: Mapping[str, tuple[float, float]], out_path: str | os.PathLike, *,
                              title: str | None = None, dataset_label: str | None = None,
                              note: str | None = "Embeddings L2-normalised; positive pairs: gold score >= 4 "
                                                 "(Wang & Isola, 2020; SimCSE).") -> Path:
    """Scatter of models in the alignment-uniformity plane (as in SimCSE's Figure 2; lower left is better), each point
    labelled. ``points``: ``{label: (alignment, uniformity)}``; ``note``: small print under the figure (or ``None``)."""
    _check_png_path(out_path)
    if not points:
        raise ConfigurationError("no point to plot")
    labels, align, unif = [], [], []
    for label, value in points.items():
        try:
            a, u = (float(v) for v in value)
        except (TypeError, ValueError) as exc:
            raise DataFormatError(f"{label}: expected (alignment, uniformity), got {value!r}") from exc
        if not (math.isfinite(a) and math.isfinite(u)):
            raise DataFormatError(f"{label}: alignment and uniformity must be finite, got ({a}, {u})")
        labels.append(str(label))
        align.append(a)
        unif.append(u)

    fig = Figure(figsize=(7.0, 5.5), layout="constrained")
    ax = fig.add_subplot()
    for i, label in enumerate(labels):
        ax.scatter(unif[i], align[i], s=70, color=f"C{i % 10}", edgecolor="black", zorder=3, label=label)
        ax.annotate(label, (unif[i], align[i]), xytext=(7, 6), textcoords="offset points", fontsize=9)
    # Pad the limits so labels stay inside the axes, even for a single point.
    for values, setter in ((unif, ax.set_xlim), (align, ax.set_ylim)):
        lo, hi = min(values), max(values)
        pad = max((hi - lo) * 0.25, abs(hi) * 0.05, 1e-3)
        setter(lo - pad, hi + pad)
    ax.set_xlabel(r"Uniformity: $\log\ \mathrm{E}\,[e^{-2\|f(x)-f(y)\|^2}]$ over all sentence pairs  (lower is better)")
    ax.set_ylabel(r"Alignment: $\mathrm{E}\,\|f(x)-f(y)\|^2$ over positive pairs  (lower is better)")
    ax.grid(alpha=0.3)
    ax.annotate("better", xy=(0.04, 0.05), xytext=(0.17, 0.17), xycoords="axes fraction", textcoords="axes fraction",
                arrowprops={"arrowstyle": "->", "color": "0.35"}, color="0.35", ha="center", va="center")
    default_title = "Alignment and uniformity of sentence embeddings" + (f" ({dataset_label})" if dataset_label else "")
    ax.set_title(title or default_title)
    if len(labels) > 1:
        ax.legend(title="Model", loc="upper right", fontsize=8)
    if note:
        add_note(fig, note)
    return save_png(fig, out_path)
