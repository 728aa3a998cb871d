"""Semantic search over an encoded corpus with FAISS.

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

:meth:`SemanticIndex.build` indexes a list of strings or a ``datasets.Dataset`` column instead of a file, and
:meth:`SemanticIndex.from_embeddings` precomputed embeddings. Large corpora::

    index = SemanticIndex.from_file(model, "big.txt", index_type="ivfpq",      # <= 64 B/vector in RAM, re-ranked
                                    encode_cache_dir="big.cache", processes=2) # resumable, multi-process encoding
    index.save("big.index")
    index = SemanticIndex.load("big.index", mmap=True)                         # serves an index larger than RAM
    index.add(["a new document"]); index.remove([17]); index.calibrate(0.97)  # (on an index loaded without mmap)

Conventions (all documented here once, and relied upon by the CLI and the tests):

* **Scores are cosine similarities.** Corpus and query embeddings are always L2-normalised before they reach FAISS
  (whether or not the model ends with a ``Normalize`` module), and every index uses the inner-product metric. A model
  that differs from the index's model only by a final ``Normalize`` module is therefore compatible with it.
* **Index types.** ``"flat"`` (default, exact), ``"ivf"`` and ``"hnsw"`` (approximate, for large corpora),
  ``"ivfpq"`` (approximate and compressed: 48-byte product-quantization codes in RAM, the best 200 candidates
  re-scored exactly with float16 vectors memory-mapped from disk); their parameters and defaults are described in
  :mod:`st_prompts.search.faiss_index`.
* **Recall calibration.** An approximate index is built with a *target recall*: by default its ``nprobe`` /
  ``ef_search`` is set to the smallest value whose recall@10 against exact search reaches 0.95 (one-sided 95 % lower
  confidence bound) on 500 perturbed held-out documents, on 500 two-document blends *and* on 500 real sentences of
  another genre (SNLI captions shipped with the package), never below ``nprobe=64`` / ``ef_search=128``, a sample
  that needs no query from the user; ``calibration_queries=`` gives one's own queries instead (recommended when queries come from
  another distribution than the documents), ``target_recall=None`` or an explicit ``nprobe`` / ``ef_search`` turns
  it off. The calibration (target, measured recall, sample, chosen value) is saved in ``meta.json``.
* **Updates.** :meth:`SemanticIndex.add` / :meth:`SemanticIndex.remove` change an index in place (no retraining;
  ids and texts stay aligned with the FAISS rows; :meth:`SemanticIndex.save` writes it atomically). Documents added to
  an IVF index that lie far from its trained centroids trigger a warning.
* **Document ids.** 1-based line numbers for a text file (blank lines are skipped but keep their numbers, so
  ``sed -n 'IDp' corpus.txt`` prints the document); 0-based positions for a list or a dataset without ``id_column``;
  otherwise the given ids, which must be unique ``str`` or ``int`` values (duplicates are a
  :class:`~st_prompts.errors.DataFormatError`).
* **Blank documents** (empty or whitespace only) are skipped with a warning; a corpus with no non-blank document is a
  :class:`~st_prompts.errors.DataFormatError`.
* **Duplicate texts are kept**, each under its own id, with one warning saying how many there are: deduplicating
  silently would lose ids the caller may rely on. A search can then return the same text twice.
* **k larger than the corpus** is clamped to the corpus size with a warning. Slots FAISS leaves empty (id ``-1``,
  possible with IVF/HNSW when too few candidates are visited) are dropped, so a query may get fewer than ``k`` hits but
  never a made-up one.
* **Model identity.** ``meta.json`` records the model's name/path and dimension and a fingerprint of its embeddings of
  :data:`PROBE_SENTENCES` (:mod:`st_prompts.search.identity`). A model given to :meth:`SemanticIndex.load` (or used
  for a search) must have the same dimension and give the same probe embeddings (cosine ≥
  :data:`FINGERPRINT_MIN_COSINE` for every probe sentence, which tolerates CPU/GPU numeric noise), else
  :class:`~st_prompts.errors.BackboneMismatchError`. A model given by name is loaded with
  :func:`st_prompts.loading.load_sentence_model` (which decides whether to trust its code).

Layout: :mod:`~st_prompts.search.identity` (model identity), :mod:`~st_prompts.search.corpus` (reading corpora and
ids), :mod:`~st_prompts.search.encoding` (encoding and normalisation), :mod:`~st_prompts.search.chunked` (resumable
chunked encoding), :mod:`~st_prompts.search.faiss_index` (FAISS
types, parameters, build, re-ranking), :mod:`~st_prompts.search.calibration` (recall calibration and its query
sample), :mod:`~st_prompts.search.store` (atomic save/load, consistent reads), :mod:`~st_prompts.search.building`
(constructors), :mod:`~st_prompts.search.updates` (add/remove), :mod:`~st_prompts.search.index`
(:class:`SemanticIndex`).
"""

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
