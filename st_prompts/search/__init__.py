"""Semantic search over an encoded corpus with FAISS (user guide: ``docs/search.md``).

:class:`SemanticIndex` encodes a corpus with a :class:`~sentence_transformers.SentenceTransformer`, puts the embeddings
in a FAISS index and answers queries with ranked :class:`SearchHit` s::

    from st_prompts.loading import load_sentence_model
    from st_prompts.search import SemanticIndex

    model = load_sentence_model("minilm")                              # the packaged all-MiniLM-L6-v2
    index = SemanticIndex.from_file(model, "corpus.txt")               # one document per line (or .jsonl/.csv/...)
    index.save("corpus.index")                                         # a directory, written atomically
    index = SemanticIndex.load("corpus.index", model=model)            # checks that ``model`` is the index's model
    for hit in index.search("how do cats sleep?", k=5)[0]:
        print(hit.score, hit.id, hit.text)

Conventions the CLI and the tests rely on:

* **Scores are cosine similarities.** Embeddings are always L2-normalised before they reach FAISS and every index uses
  the inner product, so a model that differs from the index's model only by a final ``Normalize`` is compatible.
* **Recall calibration.** An approximate index (``ivf``, ``hnsw``, ``ivfpq``; :mod:`~st_prompts.search.faiss_index`)
  gets the smallest ``nprobe`` / ``ef_search`` whose recall@10 reaches the target
  (:mod:`~st_prompts.search.calibration`), saved in ``meta.json``.
* **Document ids.** 1-based line numbers for a text file (blank lines keep their numbers, so ``sed -n 'IDp'`` prints
  the document); 0-based positions for a list; otherwise the given ids, unique ``str`` or ``int`` values.
* **Blank documents** are skipped with a warning; **duplicate texts are kept**, each under its own id (deduplicating
  silently would lose ids the caller may rely on); **k larger than the corpus** is clamped with a warning; slots FAISS
  leaves empty (id ``-1``) are dropped, so a query may get fewer than ``k`` hits but never a made-up one.
* **Model identity.** ``meta.json`` records the model's name, dimension and a fingerprint of its embeddings of
  :data:`PROBE_SENTENCES`; another model (cosine below :data:`FINGERPRINT_MIN_COSINE` on a probe) is a
  :class:`~st_prompts.errors.BackboneMismatchError` (:mod:`~st_prompts.search.identity`)."""

from st_prompts.utils import lazy_exports

# Imported on first use: `st-prompts index info` reads a saved index (store, faiss) without loading torch or
# sentence-transformers, which the model-facing parts (index, encoding) import.
_LAZY = {
    "DEFAULT_TARGET_RECALL": "st_prompts.search.calibration",
    "ChunkedEncoding": "st_prompts.search.chunked",
    "encode_in_chunks": "st_prompts.search.chunked",
    **{name: "st_prompts.search.faiss_index" for name in (
        "DEFAULT_EF_CONSTRUCTION", "DEFAULT_EF_SEARCH", "DEFAULT_HNSW_M", "DEFAULT_NPROBE", "DEFAULT_PQ_M",
        "DEFAULT_RERANK", "INDEX_TYPES")},
    "FINGERPRINT_MIN_COSINE": "st_prompts.search.identity",
    "PROBE_SENTENCES": "st_prompts.search.identity",
    "ModelIdentity": "st_prompts.search.identity",
    "SearchHit": "st_prompts.search.index",
    "SemanticIndex": "st_prompts.search.index",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
