"""The FAISS side of an index: index types, their parameters and defaults, the factory string, building.

Every index uses the inner-product metric on L2-normalised vectors, so scores are cosine similarities.

* ``"flat"`` (default, exact: ``IndexFlatIP``);
* ``"ivf"`` (``IVF{nlist},Flat``: k-means trained inverted lists; ``nlist`` defaults to ``4·sqrt(n)``, capped at
  ``n // 39`` so that each centroid gets the 39 training points FAISS asks for, ``nprobe`` to
  :data:`DEFAULT_NPROBE`). An *explicit* ``nlist`` larger than the corpus is a
  :class:`~st_prompts.errors.ConfigurationError`; the default adapts to small corpora (down to a single list, i.e.
  an exact search);
* ``"hnsw"`` (``HNSW{M},Flat`` graph; ``M`` = :data:`DEFAULT_HNSW_M`, ``ef_construction`` =
  :data:`DEFAULT_EF_CONSTRUCTION`, ``ef_search`` = :data:`DEFAULT_EF_SEARCH`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from st_prompts.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import faiss

logger = logging.getLogger(__name__)

#: Index types accepted by :meth:`SemanticIndex.build <st_prompts.search.SemanticIndex.build>` and friends.
INDEX_TYPES = ("flat", "ivf", "hnsw")
#: Default number of inverted lists visited per query by an IVF index (tuned with ``benchmarks/search.py``).
DEFAULT_NPROBE = 64
#: Default number of neighbours per node of an HNSW graph.
DEFAULT_HNSW_M = 32
#: Default size of the candidate list while building an HNSW graph.
DEFAULT_EF_CONSTRUCTION = 80
#: Default size of the candidate list while searching an HNSW graph (tuned with ``benchmarks/search.py``).
DEFAULT_EF_SEARCH = 128
#: Parameters each index type accepts.
_PARAMETERS = {"flat": set(), "ivf": {"nlist", "nprobe"}, "hnsw": {"m", "ef_construction", "ef_search"}}


def check_positive_int(value: Any, name: str) -> int:
    """``value`` as an ``int`` if it is a positive integer (not a bool), else :class:`ConfigurationError`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def resolve_index_params(index_type: str, n: int, params: dict[str, Any]) -> dict[str, Any]:
    """Fill in the defaults of ``index_type`` for a corpus of ``n`` documents and validate the given values
    (``None`` values count as not given)."""
    if index_type not in INDEX_TYPES:
        raise ConfigurationError(f"unknown index_type {index_type!r}; choose one of {', '.join(INDEX_TYPES)}")
    allowed = _PARAMETERS[index_type]
    params = {key: value for key, value in params.items() if value is not None}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigurationError(
            f"unknown parameter(s) for a {index_type!r} index: {', '.join(unknown)}"
            + (f" (accepted: {', '.join(sorted(allowed))})" if allowed else "")
        )
    for key, value in params.items():
        check_positive_int(value, key)
    if index_type == "ivf":
        if "nlist" in params:
            nlist = int(params["nlist"])
            if nlist > n:
                raise ConfigurationError(
                    f"an IVF index with nlist={nlist} needs at least {nlist} documents to train (ideally "
                    f"{39 * nlist}); the corpus has {n}. Use a smaller nlist, or index_type='flat'"
                )
        else:
            nlist = max(1, min(int(round(4 * math.sqrt(n))), n // 39))
        nprobe = min(int(params.get("nprobe", DEFAULT_NPROBE)), nlist)
        return {"nlist": nlist, "nprobe": nprobe}
    if index_type == "hnsw":
        return {
            "m": int(params.get("m", DEFAULT_HNSW_M)),
            "ef_construction": int(params.get("ef_construction", DEFAULT_EF_CONSTRUCTION)),
            "ef_search": int(params.get("ef_search", DEFAULT_EF_SEARCH)),
        }
    return {}


def factory_string(index_type: str, params: dict[str, Any]) -> str:
    """The ``faiss.index_factory`` description of an index (``"Flat"``, ``"IVF400,Flat"``, ``"HNSW32,Flat"``)."""
    if index_type == "ivf":
        return f"IVF{params['nlist']},Flat"
    if index_type == "hnsw":
        return f"HNSW{params['m']},Flat"
    return "Flat"


def apply_search_params(index: faiss.Index, index_type: str, params: dict[str, Any]) -> None:
    """Set the search-time parameters (``nprobe`` of IVF, ``ef_search`` of HNSW) on a FAISS index."""
    import faiss

    if index_type == "ivf":
        faiss.extract_index_ivf(index).nprobe = int(params["nprobe"])
    elif index_type == "hnsw":
        faiss.downcast_index(index).hnsw.efSearch = int(params["ef_search"])


def build_faiss_index(
    embeddings: np.ndarray, index_type: str, params: dict[str, Any], *, progress: bool
) -> faiss.Index:
    """Create, train (IVF, seeded) and fill an inner-product FAISS index with ``embeddings`` (already normalised)."""
    import faiss

    n, dim = embeddings.shape
    index = faiss.index_factory(dim, factory_string(index_type, params), faiss.METRIC_INNER_PRODUCT)
    if index_type == "ivf":
        logger.info("training IVF index (%d lists) on %d vectors", params["nlist"], n)
        faiss.extract_index_ivf(index).cp.seed = 1234
        index.train(embeddings)
    elif index_type == "hnsw":
        faiss.downcast_index(index).hnsw.efConstruction = int(params["ef_construction"])
    apply_search_params(index, index_type, params)
    chunk = n if index_type == "flat" else 10_000
    starts = range(0, n, chunk)
    if progress and len(starts) > 1:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"Adding to {index_type} index", unit="chunk")
    for start in starts:
        index.add(embeddings[start : start + chunk])
    return index
