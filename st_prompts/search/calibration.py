"""Recall calibration of an approximate index: the smallest ``nprobe`` / ``ef_search`` whose recall@10 against exact
search reaches a target on a sample of queries (tie-aware recall, one-sided lower confidence bound per kind of
query), and the default query sample (perturbed held-out documents, blends, foreign sentences)."""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import faiss
import numpy as np

from st_prompts.errors import ConfigurationError
from st_prompts.numbers import positive_int
from st_prompts.search._warnings import warn_at_caller
from st_prompts.search.checks import MAX_COUNT, MAX_EF, SEARCH_PARAMETER
from st_prompts.search.encoding import l2_normalize
from st_prompts.search.faiss_index import (APPROXIMATE_TYPES, DEFAULT_EF_SEARCH, DEFAULT_NPROBE, apply_search_params,
                                           check_target_recall)

logger = logging.getLogger(__name__)

#: Default recall@10 an approximate index is calibrated to at build time.
DEFAULT_TARGET_RECALL = 0.95
#: Default number of calibration queries.
DEFAULT_CALIBRATION_QUERIES = 500
#: ``k`` of the calibrated recall@k.
CALIBRATION_K = 10
#: What a calibration without a model (and without query embeddings) can promise
#: (benchmarks/results/search_vectors_only.md).
VECTORS_ONLY_CAVEAT = (
    "calibrated without a model, on perturbed document vectors and blends of documents: the recall promise holds for "
    "queries like the documents, not for real queries of another kind (Wikipedia searched with STS-B sentences: "
    "recall@10 0.90 at the calibrated nprobe). Give calibration_queries=<embeddings of real queries>, or build the "
    "index with its model"
)


def exact_top_k(vectors: np.ndarray, queries: np.ndarray, k: int, rows: int = 16_384) -> np.ndarray:
    """The exact k-th best cosine of each query, the threshold of a hit (``vectors`` searched ``rows`` at a time, so
    that memory never holds them all in float32)."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    best = np.full((len(queries), k), -np.inf, dtype=np.float32)
    for start in range(0, len(vectors), rows):
        flat = faiss.IndexFlatIP(vectors.shape[1])
        flat.add(np.ascontiguousarray(vectors[start : start + rows], dtype=np.float32))
        scores, _ = flat.search(queries, min(k, flat.ntotal))
        merged = np.concatenate([best, scores], axis=1)
        best = -np.sort(-merged, axis=1)[:, :k]
    return best[:, k - 1]


def tie_aware_recall(positions: np.ndarray, queries: np.ndarray, vectors: np.ndarray, kth: np.ndarray) -> np.ndarray:
    """Per-query recall@k of ``positions`` (n_queries × k, -1 = empty): the fraction of slots holding a document whose
    exact cosine is at least the exact k-th best one (``kth``) minus 1e-6."""
    k = positions.shape[1]
    valid = positions >= 0
    gathered = np.asarray(vectors[np.where(valid, positions, 0).ravel()], dtype=np.float32)
    gathered = gathered.reshape(positions.shape[0], k, -1)
    exact = np.einsum("qkd,qd->qk", gathered, queries.astype(np.float32))
    hits = valid & (exact >= kth[:, None] - 1e-6)
    return hits.sum(axis=1) / k


#: z of the one-sided 95 % confidence bound calibration applies to each query group's mean recall.
CONFIDENCE_Z = 1.645


def recall_lower_bound(per_query: np.ndarray) -> float:
    """One-sided 95 % lower confidence bound of the mean of per-query recalls (normal approximation)."""
    if len(per_query) < 2:
        return float(np.mean(per_query))
    return float(np.mean(per_query) - CONFIDENCE_Z * np.std(per_query, ddof=1) / np.sqrt(len(per_query)))


def smallest_value_meeting_target(search: Callable[[np.ndarray, int, int], np.ndarray], queries: np.ndarray,
                                  vectors: np.ndarray, *, target: float, low: int, high: int, k: int = CALIBRATION_K,
                                  groups: np.ndarray | None = None
                                  ) -> tuple[int, dict[str, Any], list[tuple[int, float]]]:
    """The smallest search parameter value in ``[low, high]`` that meets ``target`` on every query group.

    ``search(queries, k, value)`` returns the result positions with the parameter at ``value``. A value meets the
    target when the one-sided 95 % lower confidence bound of each group's mean recall@k (``groups``: a label per
    query) is at least ``target``. Recall grows with the parameter: doubling from ``low``, then bisection. Returns
    ``(value, stats, [(value, mean recall), ...] tried)`` (``high`` when even it misses the target).
    """
    k = min(k, len(vectors))
    kth = exact_top_k(vectors, queries, k)
    labels = np.zeros(len(queries), dtype=int) if groups is None else np.asarray(groups)
    names = list(dict.fromkeys(labels.tolist()))
    tried: dict[int, dict[str, Any]] = {}

    def stats(value: int) -> dict[str, Any]:
        if value not in tried:
            per_query = tie_aware_recall(search(queries, k, value), queries, vectors, kth)
            by_group = {name: per_query[labels == name] for name in names}
            tried[value] = {
                "recall": float(np.mean(per_query)),
                "criterion": min(recall_lower_bound(values) for values in by_group.values()),
                "groups": {str(name): round(float(np.mean(values)), 4) for name, values in by_group.items()},
            }
            logger.debug("calibration: %d -> %s", value, tried[value])
        return tried[value]

    def meets(value: int) -> bool:
        return stats(value)["criterion"] >= target

    value, failed = low, None
    while not meets(value) and value < high:
        failed, value = value, min(high, value * 2)
    if meets(value) and failed is not None:
        lo, hi = failed, value  # lo misses the target, hi meets it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid
        value = hi
    return value, tried[value], sorted((v, s["recall"]) for v, s in tried.items())


class IndexCalibration:
    """The calibration of :class:`~st_prompts.search.SemanticIndex` (a mixin)."""

    def calibrate(self, target_recall: float = DEFAULT_TARGET_RECALL, queries: Any = None, *,
                  sample_size: int = DEFAULT_CALIBRATION_QUERIES, seed: int = 0, batch_size: int = 64,
                  show_progress_bar: bool = False) -> dict[str, Any]:
        """Set the search parameter (``nprobe``, or ``ef_search`` for HNSW) of an approximate index to the smallest
        value whose tie-aware recall@10 against exact search reaches ``target_recall`` on a sample of queries; record
        the calibration in ``info["calibration"]`` and return it. IVF-PQ's ``rerank`` is doubled (up to 4 times) when
        even visiting every list misses the target.

        Args:
            queries: query strings or an array of query embeddings. Default: ``sample_size`` documents drawn with
                ``seed`` and perturbed, as many blends of two documents and (with a model) foreign sentences; every
                group must reach the target, never below the former defaults (``nprobe`` 64, ``ef_search`` 128).

        Raises:
            ConfigurationError: a flat index (exact, nothing to calibrate), a bad target or query sample.
        """
        if self.index_type not in APPROXIMATE_TYPES:
            raise ConfigurationError(f"a {self.index_type!r} index is exact: there is nothing to calibrate")
        target = check_target_recall(target_recall)
        start = time.perf_counter()
        query_vectors, groups, sample = calibration_queries(self, queries, sample_size, seed, batch_size,
                                                            show_progress_bar)
        vectors = self.exact_vectors()
        parameter = SEARCH_PARAMETER[self.index_type]
        k = min(CALIBRATION_K, len(self))
        low, high = _search_range(self, parameter, k, default_sample=queries is None)
        current = dict(self.index_params)

        def trial(params: dict[str, Any]) -> tuple[int, dict[str, Any], list]:
            def search(q: np.ndarray, kk: int, value: int) -> np.ndarray:
                return self.search_positions(q, kk, {**params, parameter: value})[1]

            return smallest_value_meeting_target(search, query_vectors, vectors, target=target, low=low, high=high, k=k,
                                                 groups=groups)

        value, stats, tried = trial(current)
        if self.index_type == "ivfpq" and stats["criterion"] < target and current.get("rerank"):
            for _ in range(4):  # even every list misses the target: re-rank deeper
                current["rerank"] = min(len(self), current["rerank"] * 2)
                value, stats, tried = trial(current)
                if stats["criterion"] >= target or current["rerank"] >= len(self):
                    break
        current[parameter] = value
        reached = stats["criterion"] >= target
        record = {
            "target_recall": target, "k": k, "parameter": parameter, "value": value,
            "measured_recall": round(stats["recall"], 4), "recall_by_query_kind": stats["groups"],
            "lower_bound": round(stats["criterion"], 4),
            "criterion": "one-sided 95% lower confidence bound of the mean recall@k of every query kind >= target",
            "reached": reached, "queries": sample, "num_docs": len(self),
            **({"rerank": current["rerank"]} if self.index_type == "ivfpq" else {}),
            "tried": [[v, round(r, 4)] for v, r in tried], "seconds": round(time.perf_counter() - start, 2),
        }
        warning = None
        if not reached:
            warning = (f"calibration did not reach recall@{k} {target}: the best found is {stats['recall']:.4f} (lower "
                       f"bound {stats['criterion']:.4f}) with {parameter}={value}"
                       + (" (and rerank={})".format(current["rerank"]) if "rerank" in current else ""))
        else:
            logger.info("calibrated %s=%d: recall@%d %.4f (lower bound %.4f >= %.3f) on %d queries", parameter, value,
                        k, stats["recall"], stats["criterion"], target, sample["count"])
        if sample["kind"].startswith("perturbed_vectors"):
            record["caveat"] = VECTORS_ONLY_CAVEAT
            warning = f"{warning}; {VECTORS_ONLY_CAVEAT}" if warning else VECTORS_ONLY_CAVEAT
        self.index_params = current
        apply_search_params(self.index, self.index_type, self.index_params)
        self.info["calibration"] = record
        if warning:
            warn_at_caller(warning)
        return record


def _search_range(index: IndexCalibration, parameter: str, k: int, default_sample: bool) -> tuple[int, int]:
    """The values of ``parameter`` calibration may choose from; with the default sample (a model of real queries),
    never below the former defaults, which held up better on real queries (benchmarks/results/search_real.md)."""
    if parameter == "nprobe":
        high = int(index.index_params["nlist"])
        return (min(high, DEFAULT_NPROBE) if default_sample else 1), high
    return (max(k, DEFAULT_EF_SEARCH) if default_sample else k), min(MAX_EF, max(4096, len(index)))


def calibration_queries(index, queries: Any, sample_size: int, seed: int, batch_size: int,
                        progress: bool) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
    """The calibration query vectors, their group labels (``None``: one group) and a description of them."""
    if queries is None:
        sample_size = min(positive_int(sample_size, "sample_size", MAX_COUNT), len(index))
        rng = np.random.default_rng(seed)
        rows = np.sort(rng.choice(len(index), size=sample_size, replace=False))
        if index.model is not None or (index.model_identity is not None and not index.read_only):
            texts = [perturb_text(index.texts[row], rng) for row in rows]
            perturbed = index.encode_queries(texts, batch_size=batch_size, progress=progress)
            first_kind = "perturbed_documents"
        else:
            base = np.asarray(index.exact_vectors()[rows], dtype=np.float32)
            perturbed, first_kind = perturb_vectors(base, rng), "perturbed_vectors"
        pairs = rng.choice(len(index), size=(sample_size, 2))
        vectors = index.exact_vectors()
        blends = l2_normalize(np.asarray(vectors[pairs[:, 0]], dtype=np.float32)
                              + np.asarray(vectors[pairs[:, 1]], dtype=np.float32))  # fmt: skip
        parts, kinds = [perturbed, blends], [first_kind, "document_blends"]
        if first_kind == "perturbed_documents":
            # real sentences of another genre (SNLI captions): real queries fall between the documents' clusters
            foreign = foreign_sentences(sample_size, rng)
            parts.append(index.encode_queries(foreign, batch_size=batch_size, progress=progress))
            kinds.append("foreign_sentences")
        groups = np.concatenate([np.array([kind] * len(part)) for kind, part in zip(kinds, parts)])
        sample = {"kind": "+".join(kinds), "count": int(len(groups)), "seed": seed}
        return np.concatenate(parts), groups, sample
    if are_texts(queries):
        vectors = index.encode_queries(list(queries), batch_size=batch_size, progress=progress)
        return vectors, None, {"kind": "given_texts", "count": len(queries)}
    if isinstance(queries, str) or (isinstance(queries, (list, tuple)) and not queries):
        raise ConfigurationError("calibration queries must be a non-empty list of strings or an embedding array")
    vectors = index.check_query_embeddings(queries)
    if not len(vectors):
        raise ConfigurationError("calibration queries must not be empty")
    return vectors, None, {"kind": "given_embeddings", "count": int(len(vectors))}


def are_texts(queries: Any) -> bool:
    """Whether calibration ``queries`` are query strings (else embeddings, or nothing)."""
    return isinstance(queries, (list, tuple)) and bool(queries) and all(isinstance(q, str) for q in queries)


def foreign_sentences(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct real sentences of another genre (the bundled SNLI hypotheses), drawn with ``rng``."""
    path = resources.files("st_prompts") / "resources" / "demo" / "nli_triplets.csv"
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))[1:]
    sentences = sorted({text.strip() for row in rows for text in row[1:3] if text.strip()})
    picks = rng.choice(len(sentences), size=min(count, len(sentences)), replace=False)
    return [sentences[i] for i in sorted(picks)]


def perturb_text(text: str, rng: np.random.Generator) -> str:
    """A query-like variant of a document: a random contiguous 60-80 % of its words, about 10 % of them dropped."""
    words = text.split()
    if len(words) < 3:
        return text
    keep = max(2, int(round(len(words) * rng.uniform(0.6, 0.8))))
    start = int(rng.integers(0, len(words) - keep + 1))
    window = words[start : start + keep]
    kept = [word for word in window if rng.random() >= 0.1]
    return " ".join(kept if len(kept) >= 2 else window)


def perturb_vectors(vectors: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Query-like variants of document vectors: isotropic Gaussian noise of norm ~0.75 (cosine ~0.8), renormalised."""
    noise = rng.standard_normal(vectors.shape).astype(np.float32) / np.sqrt(vectors.shape[1])
    return l2_normalize(vectors + 0.75 * noise)


def resolve_target(index_type: str, target_recall: Any, params: dict[str, Any], queries: Any) -> float | None:
    """The calibration target of a build: ``"auto"`` -> 0.95 for an approximate index without an explicit search
    parameter, else none."""
    explicit = [name for name in ("nprobe", "ef_search") if params.get(name) is not None]
    if queries is not None and index_type not in APPROXIMATE_TYPES:
        raise ConfigurationError(f"calibration_queries apply to an approximate index; a {index_type!r} index is exact")
    if isinstance(target_recall, str):
        if target_recall != "auto":
            raise ConfigurationError(f"target_recall must be a number in (0, 1], 'auto' or None, got {target_recall!r}")
        if index_type not in APPROXIMATE_TYPES or explicit:
            if queries is not None and index_type in APPROXIMATE_TYPES:
                raise ConfigurationError("calibration_queries were given but no calibration runs: "
                                         f"{', '.join(explicit)} was set explicitly")  # fmt: skip
            return None
        return DEFAULT_TARGET_RECALL
    if target_recall is None:
        return None
    target = check_target_recall(target_recall)
    if index_type not in APPROXIMATE_TYPES:
        raise ConfigurationError(f"target_recall applies to an approximate index; a {index_type!r} index is exact")
    if explicit:
        raise ConfigurationError(f"give either target_recall or {', '.join(explicit)}, not both: calibration sets it")
    return target
