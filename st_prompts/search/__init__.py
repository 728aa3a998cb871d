"""Semantic search over an encoded corpus with FAISS (user guide and conventions: ``docs/search.md``).

:class:`SemanticIndex` puts a corpus's L2-normalised embeddings in an inner-product FAISS index (scores are cosines),
answers queries with ranked :class:`SearchHit` s, and records its model's identity (:class:`ModelIdentity`)."""

from st_prompts.utils import lazy_exports

# imported on first use: `st-prompts index info` reads a saved index without loading torch or sentence-transformers
_LAZY = {name: f"st_prompts.search.{module}" for module, names in (
    ("calibration", ("DEFAULT_TARGET_RECALL",)), ("chunked", ("ChunkedEncoding", "encode_in_chunks")),
    ("faiss_index", ("DEFAULT_EF_CONSTRUCTION", "DEFAULT_EF_SEARCH", "DEFAULT_HNSW_M", "DEFAULT_NPROBE", "DEFAULT_PQ_M",
                     "DEFAULT_RERANK", "INDEX_TYPES")),
    ("identity", ("FINGERPRINT_MIN_COSINE", "PROBE_SENTENCES", "ModelIdentity")),
    ("index", ("SearchHit", "SemanticIndex"))) for name in names}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
