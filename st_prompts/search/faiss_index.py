"""The FAISS side of an index: types (``flat``, ``ivf``, ``hnsw``, ``ivfpq``; described in ``docs/search.md``), their
parameters and defaults, the factory string, building, updates (add / remove) and drift checks. Every index uses the
inner product on L2-normalised vectors, so scores are cosine similarities.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import faiss
import numpy as np
from tqdm.auto import tqdm

from st_prompts.errors import ConfigurationError
from st_prompts.numbers import positive_int
from st_prompts.search.checks import MAX_COUNT, MAX_EF, MAX_HNSW_M

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "ivf", "hnsw", "ivfpq")
APPROXIMATE_TYPES = ("ivf", "hnsw", "ivfpq")  # those with a search-time parameter that calibration sets
DEFAULT_NPROBE = 64  # IVF lists visited per query when no target recall is given
DEFAULT_HNSW_M = 32  # neighbours per node of an HNSW graph
DEFAULT_EF_CONSTRUCTION = 80
DEFAULT_EF_SEARCH = 128  # when no target recall is given
DEFAULT_PQ_M = 48  # bytes per IVF-PQ code (384 dims / 48 = 8 dims per sub-quantizer)
#: IVF-PQ candidates re-scored exactly (0 = off): 200 keeps a calibrated index above recall 0.95 on real text
#: (``benchmarks/results/search_real.md``).
DEFAULT_RERANK = 200
#: Warn when documents added to an IVF index are on average this many times farther from their nearest centroid
#: (squared distance) than the training documents.
DRIFT_WARN_RATIO = 1.5
PARAMETERS = {"flat": set(), "ivf": {"nlist", "nprobe"}, "hnsw": {"m", "ef_construction", "ef_search"},
              "ivfpq": {"nlist", "nprobe", "pq_m", "opq", "rerank"}}
_MAXIMA = {"m": MAX_HNSW_M, "ef_construction": MAX_EF, "ef_search": MAX_EF}  # FAISS allocates ef heap entries


def check_target_recall(value: Any) -> float:
    """``value`` as a ``float`` in (0, 1], else :class:`ConfigurationError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not 0 < float(value) <= 1:
        raise ConfigurationError(f"target_recall must be a number in (0, 1], got {value!r}")
    return float(value)


def default_nlist(n: int, index_type: str = "ivf") -> int:
    """``4·sqrt(n)`` lists (IVF-PQ: ``2·sqrt(n)``, as PQ codes are cheap to scan and k-means stays affordable), at
    most ``n // 39`` (FAISS wants 39 training points per centroid), at least 1."""
    return max(1, min(int(round((4 if index_type == "ivf" else 2) * math.sqrt(n))), n // 39))


def resolve_index_params(index_type: str, n: int, params: dict[str, Any],
                         dimension: int | None = None) -> dict[str, Any]:
    """Fill in the defaults of ``index_type`` for ``n`` documents and validate the given values (``None``: not given;
    ``dimension``, when known, is checked against ``pq_m``)."""
    if index_type not in INDEX_TYPES:
        raise ConfigurationError(f"unknown index_type {index_type!r}; choose one of {', '.join(INDEX_TYPES)}")
    allowed = PARAMETERS[index_type]
    params = {key: value for key, value in params.items() if value is not None}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigurationError(f"unknown parameter(s) for a {index_type!r} index: {', '.join(unknown)}"
                                 + (f" (accepted: {', '.join(sorted(allowed))})" if allowed else ""))
    for key, value in params.items():
        if key == "opq":
            if not isinstance(value, (bool, np.bool_)):
                raise ConfigurationError(f"opq must be True or False, got {value!r}")
        elif key == "rerank":
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= MAX_COUNT:
                raise ConfigurationError(f"rerank must be a whole number from 0 (off) to {MAX_COUNT}, got "
                                         f"{str(value)[:40]}")
        else:
            positive_int(value, key, _MAXIMA.get(key, MAX_COUNT))
    if index_type in ("ivf", "ivfpq"):
        nlist = int(params.get("nlist", default_nlist(n, index_type)))
        if "nlist" in params and nlist > n:
            raise ConfigurationError(f"an IVF index with nlist={nlist} needs at least {nlist} documents to train "
                                     f"(ideally {39 * nlist}); the corpus has {n}. Use a smaller nlist, or "
                                     "index_type='flat'")
        nprobe = min(int(params.get("nprobe", DEFAULT_NPROBE)), nlist)
        if index_type == "ivf":
            return {"nlist": nlist, "nprobe": nprobe}
        pq_m = int(params.get("pq_m", DEFAULT_PQ_M))
        if dimension is not None and dimension % pq_m:
            raise ConfigurationError(f"pq_m={pq_m} must divide the embedding dimension {dimension} (e.g. "
                                     f"{', '.join(str(m) for m in (8, 16, 24, 32, 48, 64, 96) if dimension % m == 0)})")
        if n < 256:
            raise ConfigurationError(f"an IVF-PQ index needs at least 256 documents to train its 256-centroid "
                                     f"sub-quantizers (ideally thousands); the corpus has {n}. Use index_type='flat' "
                                     "or 'hnsw'")
        return {"nlist": nlist, "nprobe": nprobe, "pq_m": pq_m, "opq": bool(params.get("opq", False)),
                "rerank": int(params.get("rerank", DEFAULT_RERANK))}
    if index_type == "hnsw":
        return {"m": int(params.get("m", DEFAULT_HNSW_M)),
                "ef_construction": int(params.get("ef_construction", DEFAULT_EF_CONSTRUCTION)),
                "ef_search": int(params.get("ef_search", DEFAULT_EF_SEARCH))}
    return {}


def factory_string(index_type: str, params: dict[str, Any]) -> str:
    """The ``faiss.index_factory`` description of an index (``"Flat"``, ``"IVF400,Flat"``, ``"HNSW32,Flat"``,
    ``"OPQ48,IVF1024,PQ48np"``)."""
    if index_type == "ivf":
        return f"IVF{params['nlist']},Flat"
    if index_type == "hnsw":
        return f"HNSW{params['m']},Flat"
    if index_type == "ivfpq":
        opq = f"OPQ{params['pq_m']}," if params.get("opq") else ""
        # "np": no polysemous training (a code-permutation annealing FAISS otherwise runs; slow, and unused here)
        return f"{opq}IVF{params['nlist']},PQ{params['pq_m']}np"
    return "Flat"


def apply_search_params(index: faiss.Index, index_type: str, params: dict[str, Any]) -> None:
    """Set the search-time parameters (``nprobe`` of IVF / IVF-PQ, ``ef_search`` of HNSW) on a FAISS index."""
    if index_type in ("ivf", "ivfpq"):
        faiss.extract_index_ivf(index).nprobe = int(params["nprobe"])
    elif index_type == "hnsw":
        faiss.downcast_index(index).hnsw.efSearch = int(params["ef_search"])


def code_bytes_per_vector(index: faiss.Index, index_type: str) -> int:
    """Bytes per vector the FAISS index keeps for its codes and ids (graph links not included)."""
    if index_type in ("ivf", "ivfpq"):
        return int(faiss.extract_index_ivf(index).code_size) + 8  # + the int64 id stored in the inverted list
    return int(index.d) * 4


def build_faiss_index(embeddings: np.ndarray, index_type: str, params: dict[str, Any], *,
                      progress: bool) -> faiss.Index:
    """Create, train (IVF / IVF-PQ, seeded) and fill a FAISS index with normalised ``embeddings``."""
    n, dim = embeddings.shape
    index = new_faiss_index(dim, index_type, params)
    if index_type in ("ivf", "ivfpq"):
        rows = training_rows(n, index_type, params)
        if rows is None:
            train_faiss_index(index, embeddings, index_type, params)
        else:  # embeddings[rows] is a copy of our own, which the training may shrink in place
            train_faiss_index(index, embeddings[rows], index_type, params, consume=True)
    add_vectors(index, embeddings, index_type, progress=progress)
    return index


def new_faiss_index(dimension: int, index_type: str, params: dict[str, Any]) -> faiss.Index:
    """An empty inner-product FAISS index of ``index_type``, configured but not trained."""
    index = faiss.index_factory(dimension, factory_string(index_type, params), faiss.METRIC_INNER_PRODUCT)
    if index_type in ("ivf", "ivfpq"):
        faiss.extract_index_ivf(index).cp.seed = 1234
        outer = faiss.downcast_index(index)
        if isinstance(outer, faiss.IndexPreTransform):  # OPQ: 10 alternations instead of FAISS's 50 (slow on CPU)
            faiss.downcast_VectorTransform(outer.chain.at(0)).niter = 10
    elif index_type == "hnsw":
        faiss.downcast_index(index).hnsw.efConstruction = int(params["ef_construction"])
    apply_search_params(index, index_type, params)
    return index


def training_rows(n: int, index_type: str, params: dict[str, Any]) -> np.ndarray | None:
    """The sorted rows (of ``n``) an IVF / IVF-PQ index is trained on (``None``: all), seeded so that a build from
    memory or from embedding files trains on the same sample. IVF-PQ takes 64 points per list (at least 20k): FAISS's
    256 per list would make a 1M-document build spend most of its time in k-means."""
    if index_type != "ivfpq":
        return None
    limit = max(20_000, 64 * int(params["nlist"]))
    if n <= limit:
        return None
    return np.sort(np.random.default_rng(1234).choice(n, size=limit, replace=False))


def train_faiss_index(index: faiss.Index, training: np.ndarray, index_type: str, params: dict[str, Any], *,
                      consume: bool = False) -> None:
    """Train an IVF / IVF-PQ index made by :func:`new_faiss_index` on ``training`` (normalised vectors).

    IVF-PQ without OPQ is trained as ``index.train`` would, bit for bit, but with less memory
    (:func:`_train_ivfpq_in_two_steps`). ``consume``: ``training`` is the caller's own scratch array (C-contiguous
    float32, no other reference), which may be shrunk in place."""
    if index_type == "ivfpq":
        # FAISS asks for 39 points per PQ centroid (~10k) and prints a warning below that; a small corpus
        # (>= 256 documents, checked in resolve_index_params) trains fine with fewer.
        pq = faiss.downcast_index(faiss.extract_index_ivf(index)).pq
        pq.cp.min_points_per_centroid = max(1, min(39, len(training) // 256))
    logger.info("training %s index (%d lists) on %d vectors", index_type, params["nlist"], len(training))
    outer = faiss.downcast_index(index)
    if index_type != "ivfpq" or not isinstance(outer, faiss.IndexIVFPQ):
        # IVF: no encoder to train; OPQ: FAISS trains the rotation first and encodes the whole set through it
        index.train(np.ascontiguousarray(training, dtype=np.float32))
        return
    _train_ivfpq_in_two_steps(outer, training, consume)


def _train_ivfpq_in_two_steps(index: faiss.IndexIVFPQ, training: np.ndarray, consume: bool) -> None:
    """``IndexIVF::train`` of FAISS 1.15 (coarse k-means, then PQ on the residuals of its seeded subsample) with the
    residuals computed in place, and, with ``consume``, the subsample gathered in place: the training set and a copy
    of the subsample are never held together."""
    x = np.ascontiguousarray(training, dtype=np.float32)
    n, dim = x.shape
    index.train_q1(n, faiss.swig_ptr(x), False, index.metric_type)
    limit = int(index.train_encoder_num_vectors())
    if n > limit:  # FAISS's subsample: the first `limit` rows of rand_perm(n, 1234), in that order
        perm = np.empty(n, dtype=np.int32)
        faiss.rand_perm(faiss.swig_ptr(perm), n, 1234)
        wanted = perm[:limit].astype(np.int64)
        del perm
        if consume and x is training and x.flags.owndata:
            sub = _gather_first_rows(x, wanted)
        else:
            sub = x[wanted]
    else:
        sub = x if consume and x is training else x.copy()  # the residuals overwrite it
    del x
    count = len(sub)
    _, assign = index.quantizer.search(sub, 1)
    assign = np.ascontiguousarray(assign[:, 0])
    centroids = index.quantizer.reconstruct_n(0, index.nlist)
    for start in range(0, count, 8192):  # in blocks: centroids[assign] of the whole subsample would be 100 MB
        sub[start : start + 8192] -= centroids[assign[start : start + 8192]]
    index.train_encoder(count, faiss.swig_ptr(sub), faiss.swig_ptr(assign))
    index.is_trained = True


def _gather_first_rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``x[rows]`` written into ``x``'s first ``len(rows)`` rows (``rows`` distinct), the rest given back; returns
    ``x``. Only the source rows a write would overwrite before they are read are copied aside."""
    count = len(rows)
    early = rows < count  # sources inside the target region: a write may overwrite them first
    aside_targets = np.flatnonzero(early)
    aside = x[rows[aside_targets]]
    direct = np.flatnonzero(~early)
    for start in range(0, len(direct), 4096):  # sources at or past `count` are never written to
        targets = direct[start : start + 4096]
        x[targets] = x[rows[targets]]
    x[aside_targets] = aside
    del aside
    x.resize((count, x.shape[1]), refcheck=False)  # the caller holds no other reference (``consume``)
    return x


def add_vectors(index: faiss.Index, embeddings: np.ndarray, index_type: str, *, progress: bool) -> None:
    """Add ``embeddings`` (normalised) to a trained index, in chunks with a progress bar when there are many."""
    n = len(embeddings)
    chunk = n if index_type == "flat" else 10_000
    starts = range(0, n, max(1, chunk))
    if progress and len(starts) > 1:
        starts = tqdm(starts, desc=f"Adding to {index_type} index", unit="chunk")
    for start in starts:
        index.add(np.ascontiguousarray(embeddings[start : start + chunk], dtype=np.float32))


def remove_rows(index: faiss.Index, rows: np.ndarray, index_type: str, exact_vectors: Callable[[], np.ndarray],
                params: dict[str, Any]) -> faiss.Index:  # fmt: skip
    """Remove the given row positions from ``index``, the remaining rows keeping their order, renumbered ``0 ..
    n-1``; return the index (for HNSW, which FAISS cannot delete from, a new one built from ``exact_vectors()``)."""
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    if index_type == "flat":
        index.remove_ids(faiss.IDSelectorBatch(rows))  # IndexFlat compacts, keeping the order
        return index
    if index_type == "hnsw":
        vectors = np.delete(exact_vectors(), rows, axis=0)
        return build_faiss_index(np.ascontiguousarray(vectors, dtype=np.float32), "hnsw", params, progress=False)
    ivf = faiss.extract_index_ivf(index)
    removed = ivf.remove_ids(faiss.IDSelectorBatch(rows))
    if removed != len(rows):  # pragma: no cover - would mean the lists and the caller's rows disagree
        raise RuntimeError(f"removed {removed} vectors from the IVF lists, expected {len(rows)}")
    invlists = ivf.invlists
    for list_no in range(ivf.nlist):
        size = invlists.list_size(list_no)
        if size:
            ids = faiss.rev_swig_ptr(invlists.get_ids(list_no), size)  # a writable view of the list's ids
            ids -= np.searchsorted(rows, ids)  # renumber: minus the number of removed rows before each id
    if isinstance(index, faiss.IndexPreTransform) or faiss.downcast_index(index) is not ivf:
        index.ntotal = ivf.ntotal
    return index


def ivf_sq_distances(index: faiss.Index, vectors: np.ndarray) -> np.ndarray:
    """Squared distance of each (normalised) vector to its nearest IVF centroid (after the OPQ rotation, if any)."""
    ivf = faiss.extract_index_ivf(index)
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    outer = faiss.downcast_index(index)
    if isinstance(outer, faiss.IndexPreTransform):
        for position in range(outer.chain.size()):
            x = faiss.downcast_VectorTransform(outer.chain.at(position)).apply(x)
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
    norms = np.sum(centroids * centroids, axis=1)
    similarities, assigned = ivf.quantizer.search(x, 1)
    sq = np.sum(x * x, axis=1) + norms[assigned[:, 0]] - 2 * similarities[:, 0]
    return np.maximum(sq, 0.0)


def rerank_exactly(queries: np.ndarray, positions: np.ndarray, vectors: np.ndarray, k: int,
                   batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Re-score candidate rows (``positions``, -1 = none) with the exact cosine against ``vectors`` (only their rows
    read) and keep the best ``k`` of each query."""
    n_queries, candidates = positions.shape
    out_scores = np.full((n_queries, k), -np.inf, dtype=np.float32)
    out_positions = np.full((n_queries, k), -1, dtype=np.int64)
    for start in range(0, n_queries, batch):
        pos = positions[start : start + batch]
        valid = pos >= 0
        rows = np.where(valid, pos, 0)
        flat = rows.ravel()
        order = np.argsort(flat, kind="stable")  # read the rows in file order
        gathered = np.empty((flat.size, vectors.shape[1]), dtype=np.float32)
        gathered[order] = np.asarray(vectors[flat[order]], dtype=np.float32)
        scores = np.einsum("qcd,qd->qc", gathered.reshape(*pos.shape, -1), queries[start : start + batch])
        scores[~valid] = -np.inf
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        out_scores[start : start + batch, : top.shape[1]] = np.take_along_axis(scores, top, axis=1)
        chosen = np.take_along_axis(pos, top, axis=1)
        chosen[~np.isfinite(out_scores[start : start + batch, : top.shape[1]])] = -1
        out_positions[start : start + batch, : top.shape[1]] = chosen
    return out_scores, out_positions


def reconstruct_all(index: faiss.Index, index_type: str) -> np.ndarray:
    """Every stored vector of a flat, HNSW or IVF-Flat index, by row (IVF: read from the inverted lists)."""
    if index_type == "flat":
        return index.reconstruct_n(0, index.ntotal)
    if index_type == "hnsw":
        return faiss.downcast_index(index).storage.reconstruct_n(0, index.ntotal)
    if index_type == "ivf":
        ivf = faiss.extract_index_ivf(index)
        out = np.empty((index.ntotal, index.d), dtype=np.float32)
        invlists = ivf.invlists
        for list_no in range(ivf.nlist):
            size = invlists.list_size(list_no)
            if not size:
                continue
            ids = faiss.rev_swig_ptr(invlists.get_ids(list_no), size).copy()
            codes = faiss.rev_swig_ptr(invlists.get_codes(list_no), size * ivf.code_size).copy()
            out[ids] = codes.view(np.float32).reshape(size, index.d)
        return out
    raise ConfigurationError(f"the vectors of an {index_type!r} index cannot be reconstructed exactly")
