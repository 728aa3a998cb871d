""":class:`SemanticIndex`: build an index over a corpus, save/load it, search it (see :mod:`st_prompts.search`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError
from st_prompts.search._warnings import warn_at_caller
from st_prompts.search.corpus import Corpus, corpus_from_documents, prepare_corpus, read_corpus_file
from st_prompts.search.encoding import DEFAULT_CHUNK_SIZE, encode_in_chunks, encode_texts, l2_normalize
from st_prompts.search.faiss_index import (
    APPROXIMATE_TYPES,
    CALIBRATION_K,
    DEFAULT_CALIBRATION_QUERIES,
    DEFAULT_EF_SEARCH,
    DEFAULT_NPROBE,
    DEFAULT_TARGET_RECALL,
    DRIFT_WARN_RATIO,
    SEARCH_PARAMETER,
    add_vectors,
    apply_search_params,
    build_faiss_index,
    calibrate,
    check_positive_int,
    check_target_recall,
    ivf_sq_distances,
    remove_rows,
    resolve_index_params,
)
from st_prompts.search.identity import ModelIdentity, embedding_dimension
from st_prompts.search.store import StoredIndex, load_index_dir, save_index_dir
from st_prompts.storage import folder_lock

if TYPE_CHECKING:  # pragma: no cover
    import faiss
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

#: What a calibration without a model (and without query embeddings) can promise, measured on the shared data: the
#: all-MiniLM-L6-v2 vectors of 11,914 Wikipedia sentences, 500 STS-B dev sentences as real queries, IVF with 305
#: lists. Perturbed document vectors and blends reach the target at nprobe 64, where those real queries get recall@10
#: 0.900 (0.963 needs nprobe 128); no query made from the document vectors alone was as hard as real queries of
#: another genre (benchmarks/results/search_vectors_only.md).
VECTORS_ONLY_CAVEAT = (
    "calibrated without a model, on perturbed document vectors and blends of documents: the recall promise holds for "
    "queries like the documents, not for real queries of another kind (Wikipedia searched with STS-B sentences: "
    "recall@10 0.90 at the calibrated nprobe). Give calibration_queries=<embeddings of real queries>, or build the "
    "index with its model"
)


class SearchHit(NamedTuple):
    """One search result: the document's id and text and its cosine similarity to the query."""

    id: int | str
    text: str
    score: float


class SemanticIndex:
    """A FAISS index over the L2-normalised embeddings of a corpus, with the documents' ids and texts.

    Build one with :meth:`build` (a list of strings or a ``datasets.Dataset``), :meth:`from_file` (a text file with
    one document per line, or a ``.jsonl``/``.json``/``.csv``/``.parquet`` dataset file) or, from precomputed
    embeddings, :meth:`from_embeddings`; persist it with :meth:`save` / :meth:`load`; query it with :meth:`search`
    (texts) or :meth:`search_embeddings` (vectors); update it with :meth:`add` / :meth:`remove`; tune an approximate
    index with :meth:`calibrate`. See :mod:`st_prompts.search` for the conventions (scores, ids, duplicates, ``k``).

    Attributes:
        index: the underlying ``faiss.Index`` (row ``i`` is document ``ids[i]``).
        ids: document ids, in FAISS order (a read-only lazy sequence for an index loaded with ``mmap=True``).
        texts: document texts, in FAISS order (likewise).
        index_type: ``"flat"``, ``"ivf"``, ``"hnsw"`` or ``"ivfpq"``.
        index_params: the resolved parameters (e.g. ``{"nlist": 400, "nprobe": 32}``).
        model_identity: the :class:`ModelIdentity` of the encoding model, or ``None`` for an index built from bare
            embeddings.
        model: the model used to encode queries (``None`` until needed; loaded lazily from ``model_identity``).
        vectors: the original (normalised) vectors of an ``"ivfpq"`` index, float16, used to re-rank candidates
            exactly (a read-only memory map for a loaded index); ``None`` for the other types, whose FAISS index
            holds them.
        info: extra metadata saved in ``meta.json`` (e.g. ``id_source``, ``calibration``).
    """

    def __init__(
        self,
        index: faiss.Index,
        ids: Sequence[int | str],
        texts: Sequence[str],
        *,
        index_type: str,
        index_params: dict[str, Any],
        model_identity: ModelIdentity | None = None,
        model: SentenceTransformer | None = None,
        info: dict[str, Any] | None = None,
        vectors: np.ndarray | None = None,
        read_only: bool = False,
    ) -> None:
        if index.ntotal != len(ids) or len(ids) != len(texts):
            raise DataFormatError(
                f"inconsistent index: {index.ntotal} vectors, {len(ids)} ids and {len(texts)} texts"
            )
        if vectors is not None and len(vectors) != len(ids):
            raise DataFormatError(f"inconsistent index: {len(vectors)} stored vectors for {len(ids)} documents")
        if index_type == "ivfpq" and vectors is None and int(index_params.get("rerank", 0)) > 0:
            raise DataFormatError("an IVF-PQ index with re-ranking needs its stored vectors")
        self.index = index
        self.ids = ids if read_only else list(ids)
        self.texts = texts if read_only else list(texts)
        self.index_type = index_type
        self.index_params = dict(index_params)
        self.model_identity = model_identity
        self.model = model
        self.info = dict(info or {})
        self.vectors = vectors
        self.read_only = read_only
        self._positions: dict[int | str, int] | None = None
        #: ``(folder, save_id)`` of the save this index was loaded from or last saved to: saving back to that folder
        #: is refused if another process saved it meanwhile.
        self._saved_as: tuple[str, str | None] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_embeddings(
        cls,
        embeddings: Any,
        documents: Sequence[str],
        ids: Sequence[int | str] | None = None,
        index_type: str = "flat",
        *,
        model: SentenceTransformer | None = None,
        model_identity: ModelIdentity | None = None,
        show_progress_bar: bool = False,
        target_recall: float | str | None = "auto",
        calibration_queries: Any = None,
        **index_params: Any,
    ) -> SemanticIndex:
        """Index precomputed embeddings (one row per document; they are L2-normalised here).

        Blank documents are *not* skipped here (the rows must line up with ``documents``); ids default to 0-based
        positions. ``model`` / ``model_identity`` record which model produced the embeddings (needed to search with
        texts and to check a model on :meth:`load`); without them only :meth:`search_embeddings` works.
        ``target_recall`` / ``calibration_queries``: as in :meth:`build` (without a model, the default calibration
        queries are perturbed document *vectors*, and ``calibration_queries`` must be embeddings).
        """
        documents = list(documents)
        if not documents:
            raise DataFormatError("the corpus is empty: there is no document to index")
        vectors = l2_normalize(embeddings)
        if vectors.shape[0] != len(documents):
            raise DataFormatError(f"got {vectors.shape[0]} embeddings for {len(documents)} documents")
        if any(isinstance(text, str) and not text.strip() for text in documents):
            raise DataFormatError("from_embeddings() needs non-blank documents (their rows cannot be dropped here)")
        ids_list, documents = prepare_corpus(documents, ids, source="corpus", id_kind="position")
        if model is not None and model_identity is None:
            model_identity = ModelIdentity.of(model)
        target = _resolve_target(index_type, target_recall, index_params, calibration_queries)
        return _assemble(
            cls,
            vectors,
            ids_list,
            documents,
            index_type,
            index_params,
            model=model,
            model_identity=model_identity,
            show_progress_bar=show_progress_bar,
            target_recall=target,
            calibration_queries=calibration_queries,
        )

    @classmethod
    def build(
        cls,
        model: SentenceTransformer,
        documents: Any,
        ids: Sequence[int | str] | None = None,
        index_type: str = "flat",
        batch_size: int = 64,
        show_progress_bar: bool = True,
        *,
        text_column: str = "text",
        id_column: str | None = None,
        model_name: str | None = None,
        target_recall: float | str | None = "auto",
        calibration_queries: Any = None,
        encode_cache_dir: str | os.PathLike | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        processes: int | None = None,
        **index_params: Any,
    ) -> SemanticIndex:
        """Encode ``documents`` with ``model`` and index them.

        Args:
            model: the sentence-transformers model (documents go through ``encode_document``, so a model with a
                ``document`` prompt uses it).
            documents: a list/iterable of strings, or a ``datasets.Dataset`` (its ``text_column``; ids from
                ``id_column`` if given). A bare string is rejected (use :meth:`from_file` for a file).
            ids: one unique ``str``/``int`` id per document (default: 0-based positions).
            index_type: ``"flat"`` (exact), ``"ivf"``, ``"hnsw"`` or ``"ivfpq"`` (see
                :mod:`st_prompts.search.faiss_index`).
            batch_size: encoding batch size.
            show_progress_bar: show progress bars while encoding and while adding to an approximate index.
            text_column / id_column: columns to use when ``documents`` is a dataset.
            model_name: the name to record for the model (default: derived from the model; ``minilm`` for the
                packaged MiniLM). :meth:`search` on a loaded index reloads the model by this name when no model is
                given, so prefer a hub id or an alias to a machine-specific path.
            target_recall: calibrate the search parameter of an approximate index (``nprobe`` / ``ef_search``) to
                the smallest value reaching this recall@10 against exact search (see :meth:`calibrate`). ``"auto"``
                (default): :data:`~st_prompts.search.faiss_index.DEFAULT_TARGET_RECALL` (0.95) for an approximate
                index unless ``nprobe`` / ``ef_search`` is given explicitly; ``None``: no calibration (the given or
                default parameter is used as is).
            calibration_queries: the queries to calibrate on: a list of query strings (encoded with
                ``encode_query``) or an array of query embeddings. Default: perturbed held-out documents.
            encode_cache_dir: encode in chunks of ``chunk_size`` documents and keep each finished chunk in this
                directory, so that an interrupted build resumes instead of encoding everything again (see
                :func:`~st_prompts.search.encoding.encode_in_chunks`).
            chunk_size: documents per cached chunk.
            processes: encode with sentence-transformers' multi-process pool of this many CPU workers.
            **index_params: ``nlist``/``nprobe`` for IVF; ``m``/``ef_construction``/``ef_search`` for HNSW;
                ``nlist``/``nprobe``/``pq_m``/``opq``/``rerank`` for IVF-PQ.

        Raises:
            DataFormatError: empty corpus, duplicate ids, non-string documents, missing column.
            ConfigurationError: unknown ``index_type`` or parameter, ``nlist`` larger than the corpus, a bad target.
        """
        corpus = corpus_from_documents(documents, ids, text_column=text_column, id_column=id_column)
        return _index_corpus(
            cls,
            model,
            corpus,
            index_type,
            batch_size,
            show_progress_bar,
            model_name=model_name,
            target_recall=target_recall,
            calibration_queries=calibration_queries,
            encode_cache_dir=encode_cache_dir,
            chunk_size=chunk_size,
            processes=processes,
            **index_params,
        )

    @classmethod
    def from_file(
        cls,
        model: SentenceTransformer,
        path: str | os.PathLike,
        text_column: str = "text",
        id_column: str | None = None,
        *,
        encoding: str = "utf-8",
        **kw: Any,
    ) -> SemanticIndex:
        """Encode and index the corpus in the file ``path``.

        * ``.jsonl``/``.json``/``.csv``/``.parquet``: read with ``datasets``; the documents are the ``text_column``,
          ids come from ``id_column`` (default: 0-based row positions).
        * anything else: a text file (``encoding``) with one document per line; lines are stripped, ids are 1-based
          line numbers, blank lines are skipped (keeping their numbers, so ``sed -n 'IDp' FILE`` prints a document).

        ``**kw`` go to :meth:`build` (``index_type``, ``batch_size``, ``show_progress_bar``, ``model_name``,
        ``target_recall``, ``calibration_queries``, ``encode_cache_dir``, ``processes``, index parameters).

        Raises:
            DataNotFoundError: the file does not exist.
            DataFormatError: unreadable file, empty corpus, duplicate ids, missing column.
            ConfigurationError: ``id_column`` for a text file, bad options.
        """
        corpus = read_corpus_file(path, text_column=text_column, id_column=id_column, encoding=encoding)
        return _index_corpus(cls, model, corpus, **kw)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike, *, overwrite: bool = True) -> None:
        """Write the index to ``directory`` (``index.faiss``, ``docs.jsonl``, ``meta.json``, ``probe.npy``, and
        ``vectors.npy`` for an IVF-PQ index).

        The files are written into a hidden folder next to the target, which is then renamed into place, so an
        interrupted save never leaves a half-written index (see :mod:`st_prompts.search.store`). An existing index at
        ``directory`` is replaced (unless ``overwrite=False``); a folder holding anything but an index's own files is
        never touched. Saving back to the folder this index was loaded from is refused if another process saved it
        meanwhile (its update would be lost): use :meth:`update` to load, change and save under the index's lock.
        """
        stored = StoredIndex(
            self.index, self.ids, self.texts, self.index_type, self.index_params, self.model_identity, self.info,
            self.vectors,
        )  # fmt: skip
        expected = None
        if self._saved_as is not None and self._saved_as[0] == os.path.realpath(directory):
            expected = self._saved_as[1]
        target, save_id = save_index_dir(stored, directory, overwrite=overwrite, expected_save_id=expected)
        self._saved_as = (os.path.realpath(target), save_id)
        logger.info("saved %s index of %d documents to %s", self.index_type, len(self), target)

    @classmethod
    @contextmanager
    def update(
        cls, directory: str | os.PathLike, model: SentenceTransformer | str | None = None
    ) -> Iterator[SemanticIndex]:
        """Load the index at ``directory``, let the caller change it, and save it, holding the index's lock
        throughout, so that concurrent updates take turns and each one starts from the latest saved state::

            with SemanticIndex.update("corpus.index") as index:
                index.add(["a new document"])

        Nothing is saved if the block raises. ``model``: as for :meth:`load`.
        """
        with folder_lock(directory):
            index = cls.load(directory, model)
            yield index
            index.save(directory, overwrite=True)

    @classmethod
    def load(
        cls, directory: str | os.PathLike, model: SentenceTransformer | str | None = None, *, mmap: bool = False
    ) -> SemanticIndex:
        """Load an index saved by :meth:`save`.

        Args:
            directory: the index directory.
            model: optional model (or model name, loaded with :func:`st_prompts.loading.load_sentence_model`) to
                encode queries with. It is checked against the index's recorded model identity (dimension and probe
                fingerprint). Without it, the recorded model is loaded (and checked) at the first text search.
            mmap: memory-map the index instead of reading it into RAM: the FAISS index is read with
                ``faiss.IO_FLAG_MMAP`` (IVF / IVF-PQ inverted lists and flat codes stay on disk and are paged in by
                the OS as searches touch them), the re-ranking vectors with ``numpy.load(mmap_mode="r")``, and the
                documents are read from ``docs.jsonl`` only for the hits. An index larger than RAM can so still be
                searched. The loaded index is read-only (:meth:`add` / :meth:`remove` raise).

        Raises:
            DataNotFoundError: the directory does not exist.
            DataFormatError: it is not a complete, consistent semantic index.
            BackboneMismatchError: ``model`` is not the index's model.
        """
        stored = load_index_dir(directory, mmap=mmap)
        loaded = cls(
            stored.faiss_index,
            stored.ids,
            stored.texts,
            index_type=stored.index_type,
            index_params=stored.index_params,
            model_identity=stored.model_identity,
            info=stored.info,
            vectors=stored.vectors,
            read_only=mmap,
        )
        loaded._saved_as = (os.path.realpath(directory), stored.save_id)
        if model is not None:
            loaded.set_model(model)
        return loaded

    # ------------------------------------------------------------------ querying
    def set_model(
        self,
        model: SentenceTransformer | str,
        *,
        device: str | None = None,
        trust_remote_code: bool | None = None,
    ) -> None:
        """Use ``model`` to encode queries, after checking that it matches the index's model.

        ``model`` is a model object or a name/path, loaded with :func:`st_prompts.loading.load_sentence_model`
        (``device`` and ``trust_remote_code`` apply to that loading only).

        Raises:
            BackboneMismatchError: the model's dimension or probe embeddings differ from the index's model.
        """
        if isinstance(model, (str, os.PathLike)):
            from st_prompts.loading import load_sentence_model

            model = load_sentence_model(str(model), trust_remote_code, device=device)
        if self.model_identity is not None:
            self.model_identity.check_compatible(ModelIdentity.of(model))
        elif embedding_dimension(model) not in (None, self.dimension):
            raise BackboneMismatchError(
                f"the model produces {embedding_dimension(model)}-dimensional embeddings, the index has "
                f"{self.dimension} dimensions"
            )
        self.model = model

    def use_recorded_model(self, *, device: str | None = None, trust_remote_code: bool | None = None) -> None:
        """Load the model recorded in the index (by name, or by its recorded local path) and use it for queries.

        Raises:
            ConfigurationError: the index was built from bare embeddings and records no model.
        """
        if self.model_identity is None:
            raise ConfigurationError(
                "this index was built from bare embeddings and has no model: pass one with set_model()/load(), "
                "or use search_embeddings()"
            )
        name = self.model_identity.loadable_name()
        logger.info("loading the index's model %r", name)
        self.set_model(name, device=device, trust_remote_code=trust_remote_code)

    def set_search_params(
        self, *, nprobe: int | None = None, ef_search: int | None = None, rerank: int | None = None
    ) -> None:
        """Change the speed/recall trade-off of an approximate index (saved with the index). A calibration recorded
        in :attr:`info` stays there, but no longer describes the parameters in use (``index info`` says so)."""
        if nprobe is not None:
            if self.index_type not in ("ivf", "ivfpq"):
                raise ConfigurationError(f"nprobe applies to an 'ivf' or 'ivfpq' index, this one is {self.index_type!r}")
            self.index_params["nprobe"] = min(check_positive_int(nprobe, "nprobe"), self.index_params["nlist"])
        if ef_search is not None:
            if self.index_type != "hnsw":
                raise ConfigurationError(f"ef_search applies to an 'hnsw' index, this one is {self.index_type!r}")
            self.index_params["ef_search"] = check_positive_int(ef_search, "ef_search")
        if rerank is not None:
            if self.index_type != "ivfpq":
                raise ConfigurationError(f"rerank applies to an 'ivfpq' index, this one is {self.index_type!r}")
            if isinstance(rerank, bool) or not isinstance(rerank, (int, np.integer)) or rerank < 0:
                raise ConfigurationError(f"rerank must be a non-negative integer (0 = off), got {rerank!r}")
            if rerank and self.vectors is None:
                raise ConfigurationError("this IVF-PQ index keeps no vectors to re-rank with")
            self.index_params["rerank"] = int(rerank)
        apply_search_params(self.index, self.index_type, self.index_params)

    def search(
        self,
        queries: str | Sequence[str],
        k: int = 10,
        *,
        batch_size: int = 64,
        show_progress_bar: bool = False,
    ) -> list[list[SearchHit]]:
        """Return the ``k`` nearest documents of each query, best first, as :class:`SearchHit` (id, text, cosine).

        ``queries`` is a string or a list of strings; the result always has one list per query. Queries are encoded
        with ``encode_query`` of the index's model (loaded by :meth:`use_recorded_model` on first use if the index
        has none yet). ``k`` is clamped to the corpus size with a warning.
        """
        single = isinstance(queries, str)
        queries = [queries] if single else list(queries)
        check_queries(queries)
        k = check_positive_int(k, "k")
        if not queries:
            return []
        embeddings = self._encode_queries(queries, batch_size=batch_size, progress=show_progress_bar)
        return self.search_embeddings(embeddings, k)

    def search_embeddings(self, query_embeddings: Any, k: int = 10) -> list[list[SearchHit]]:
        """Like :meth:`search` for precomputed query embeddings (one row per query; normalised here)."""
        k = check_positive_int(k, "k")
        queries = self._check_query_embeddings(query_embeddings)
        if k > len(self):
            warn_at_caller(
                f"k={k} is larger than the corpus ({len(self)} documents); returning at most {len(self)} hits"
            )
            k = len(self)
        scores, positions = self._search_vectors(queries, k)
        return [
            [SearchHit(self.ids[pos], self.texts[pos], float(score)) for score, pos in zip(row_scores, row_positions)
             if pos >= 0]  # FAISS pads with -1 when too few candidates were visited
            for row_scores, row_positions in zip(scores, positions)
        ]  # fmt: skip

    def _check_query_embeddings(self, query_embeddings: Any) -> np.ndarray:
        queries = l2_normalize(query_embeddings)
        if queries.shape[1] != self.dimension:
            raise BackboneMismatchError(
                f"query embeddings have {queries.shape[1]} dimensions, the index has {self.dimension}"
            )
        return queries

    def _encode_queries(self, queries: list[str], *, batch_size: int, progress: bool) -> np.ndarray:
        if self.model is None:
            self.use_recorded_model()
        return encode_texts(self.model, queries, kind="query", batch_size=batch_size, progress=progress)

    def _search_vectors(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS search (then exact re-ranking of the IVF-PQ candidates): scores and row positions (-1 = none)."""
        rerank = int(self.index_params.get("rerank", 0)) if self.index_type == "ivfpq" else 0
        if not rerank or self.vectors is None:
            return self.index.search(queries, k)
        candidates = min(max(rerank, k), len(self))
        _, positions = self.index.search(queries, candidates)
        return rerank_exactly(queries, positions, self.vectors, k)

    # ------------------------------------------------------------------ calibration
    def calibrate(
        self,
        target_recall: float = DEFAULT_TARGET_RECALL,
        queries: Any = None,
        *,
        sample_size: int = DEFAULT_CALIBRATION_QUERIES,
        seed: int = 0,
        batch_size: int = 64,
        show_progress_bar: bool = False,
    ) -> dict[str, Any]:
        """Set the search parameter of an approximate index to the smallest value whose recall@10 against exact
        search reaches ``target_recall`` on a sample of queries; record the calibration in :attr:`info`
        (``info["calibration"]``, saved in ``meta.json`` and shown by ``st-prompts index info``) and return it.

        The parameter is ``nprobe`` for ``"ivf"`` and ``"ivfpq"`` (whose re-ranking depth ``rerank`` is doubled, up to
        4 times, when even visiting every list misses the target), ``ef_search`` for ``"hnsw"``. Recall is tie-aware
        (see :mod:`st_prompts.search.faiss_index`).

        Args:
            target_recall: the recall@10 to reach, in (0, 1].
            queries: the query sample: a list of query strings (encoded with the index's model), or an array of query
                embeddings. Default (``None``): ``sample_size`` documents drawn with ``seed`` and *perturbed* so that
                they are not copies of indexed documents: each text keeps a random contiguous 60-80 % of its words
                and loses about 10 % of those at random, then is encoded as a query; an index without a model
                perturbs the document vectors instead (Gaussian noise, cosine ~0.8 to the original). The default sample
                also holds ``sample_size`` blends of two documents and (with a model) ``sample_size`` real sentences
                of another genre (SNLI captions shipped with the package); every group must reach the target, and the
                parameter never goes below the former fixed defaults (``nprobe`` 64 or all lists, ``ef_search`` 128).
            sample_size: number of default queries per group (at most the corpus size).
            seed: seed of the default sample.

        Returns:
            the calibration record: ``target_recall``, ``k``, ``parameter``, ``value``, ``measured_recall``,
            ``reached``, the query sample (``queries``: kind, count, seed), ``num_docs``, ``rerank`` (IVF-PQ),
            ``tried`` (every value tried and its recall) and ``seconds``.

        Raises:
            ConfigurationError: a flat index (exact, nothing to calibrate), a bad target or query sample.
        """
        import time

        if self.index_type not in APPROXIMATE_TYPES:
            raise ConfigurationError(f"a {self.index_type!r} index is exact: there is nothing to calibrate")
        target = check_target_recall(target_recall)
        start = time.perf_counter()
        query_vectors, groups, sample = self._calibration_queries(
            queries, sample_size, seed, batch_size, show_progress_bar
        )
        vectors = self._exact_vectors()
        parameter = SEARCH_PARAMETER[self.index_type]
        k = min(CALIBRATION_K, len(self))

        def run(current: dict[str, Any]) -> tuple[int, dict[str, Any], list]:
            def search(q: np.ndarray, kk: int, value: int) -> np.ndarray:
                apply_search_params(self.index, self.index_type, {**current, parameter: value})
                saved = dict(self.index_params)
                self.index_params.update(current)
                try:
                    return self._search_vectors(q, kk)[1]
                finally:
                    self.index_params = saved

            # Never below the former fixed defaults (nprobe 64, ef_search 128): the default sample only models real
            # queries, and on real queries from another genre than the corpus those defaults held up better than
            # values calibrated below them (benchmarks/results/search_real.md).
            if parameter == "nprobe":
                high = int(self.index_params["nlist"])
                low = min(high, DEFAULT_NPROBE) if queries is None else 1
            else:
                high = max(4096, len(self))
                low = max(k, DEFAULT_EF_SEARCH) if queries is None else k
            return calibrate(search, query_vectors, vectors, target=target, low=low, high=high, k=k, groups=groups)

        current = dict(self.index_params)
        value, stats, tried = run(current)
        if self.index_type == "ivfpq" and stats["criterion"] < target and current.get("rerank"):
            for _ in range(4):
                current["rerank"] = min(len(self), current["rerank"] * 2)
                value, stats, tried = run(current)
                if stats["criterion"] >= target or current["rerank"] >= len(self):
                    break
        current[parameter] = value
        self.index_params = current
        apply_search_params(self.index, self.index_type, self.index_params)
        reached = stats["criterion"] >= target
        record = {
            "target_recall": target,
            "k": k,
            "parameter": parameter,
            "value": value,
            "measured_recall": round(stats["recall"], 4),
            "recall_by_query_kind": stats["groups"],
            "lower_bound": round(stats["criterion"], 4),
            "criterion": "one-sided 95% lower confidence bound of the mean recall@k of every query kind >= target",
            "reached": reached,
            "queries": sample,
            "num_docs": len(self),
            **({"rerank": current["rerank"]} if self.index_type == "ivfpq" else {}),
            "tried": [[v, round(r, 4)] for v, r in tried],
            "seconds": round(time.perf_counter() - start, 2),
        }
        if sample["kind"].startswith("perturbed_vectors"):
            record["caveat"] = VECTORS_ONLY_CAVEAT
            warn_at_caller(VECTORS_ONLY_CAVEAT)
        self.info["calibration"] = record
        if not reached:
            warn_at_caller(
                f"calibration did not reach recall@{k} {target}: the best found is {stats['recall']:.4f} (lower "
                f"bound {stats['criterion']:.4f}) with {parameter}={value}"
                + (" (and rerank={})".format(current["rerank"]) if "rerank" in current else "")
            )
        else:
            logger.info("calibrated %s=%d: recall@%d %.4f (lower bound %.4f >= %.3f) on %d queries", parameter, value,
                        k, stats["recall"], stats["criterion"], target, sample["count"])  # fmt: skip
        return record

    def _calibration_queries(
        self, queries: Any, sample_size: int, seed: int, batch_size: int, progress: bool
    ) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        """The calibration query vectors, their group labels (``None``: one group) and a description of them."""
        if queries is None:
            sample_size = min(check_positive_int(sample_size, "sample_size"), len(self))
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(len(self), size=sample_size, replace=False))
            if self.model is not None or (self.model_identity is not None and not self.read_only):
                texts = [perturb_text(self.texts[row], rng) for row in rows]
                perturbed = self._encode_queries(texts, batch_size=batch_size, progress=progress)
                first_kind = "perturbed_documents"
            else:
                base = np.asarray(self._exact_vectors()[rows], dtype=np.float32)
                perturbed, first_kind = perturb_vectors(base, rng), "perturbed_vectors"
            pairs = rng.choice(len(self), size=(sample_size, 2))
            vectors = self._exact_vectors()
            blends = l2_normalize(np.asarray(vectors[pairs[:, 0]], dtype=np.float32)
                                  + np.asarray(vectors[pairs[:, 1]], dtype=np.float32))  # fmt: skip
            parts, kinds = [perturbed, blends], [first_kind, "document_blends"]
            if first_kind == "perturbed_documents":
                # Real sentences of another genre than most corpora (image captions of SNLI, shipped with st_prompts):
                # users query with their own words, and such queries fall between the documents' clusters.
                foreign = foreign_sentences(sample_size, rng)
                parts.append(self._encode_queries(foreign, batch_size=batch_size, progress=progress))
                kinds.append("foreign_sentences")
            groups = np.concatenate([np.array([kind] * len(part)) for kind, part in zip(kinds, parts)])
            sample = {"kind": "+".join(kinds), "count": int(len(groups)), "seed": seed}
            return np.concatenate(parts), groups, sample
        if isinstance(queries, (list, tuple)) and queries and all(isinstance(q, str) for q in queries):
            vectors = self._encode_queries(list(queries), batch_size=batch_size, progress=progress)
            return vectors, None, {"kind": "given_texts", "count": len(queries)}
        if isinstance(queries, str) or (isinstance(queries, (list, tuple)) and not queries):
            raise ConfigurationError("calibration queries must be a non-empty list of strings or an embedding array")
        vectors = self._check_query_embeddings(queries)
        if not len(vectors):
            raise ConfigurationError("calibration queries must not be empty")
        return vectors, None, {"kind": "given_embeddings", "count": int(len(vectors))}

    def _exact_vectors(self) -> np.ndarray:
        """The normalised vectors of every row (the stored ones for IVF-PQ; reconstructed from FAISS otherwise)."""
        if self.vectors is not None:
            return self.vectors
        return reconstruct_all(self.index, self.index_type)

    # ------------------------------------------------------------------ updates
    def add(
        self,
        documents: Sequence[str],
        ids: Sequence[int | str] | None = None,
        *,
        embeddings: Any = None,
        batch_size: int = 64,
        show_progress_bar: bool = False,
    ) -> list[int | str]:
        """Add documents without rebuilding; return their ids.

        The documents are encoded with the index's model (``encode_document``), unless ``embeddings`` gives their
        vectors. Ids: the given ones (unique, and not already in the index), else, when every existing id is an
        integer, the integers following the largest one. Blank documents are an error here (their ids would be
        ambiguous). An IVF / IVF-PQ index keeps its trained lists: when the new documents lie much farther from the
        centroids than the training documents did (mean squared distance more than
        :data:`~st_prompts.search.faiss_index.DRIFT_WARN_RATIO` times the training one), a warning says so
        (recall can drop: recalibrate with :meth:`calibrate`, or rebuild). Nothing is written to disk until
        :meth:`save`, which replaces the index atomically.

        Raises:
            ConfigurationError: a read-only (memory-mapped) index, non-integer existing ids without ``ids``.
            DataFormatError: blank or non-string documents, duplicate or existing ids, wrong embedding count.
        """
        self._check_writable("add to")
        documents = list(documents)
        if not documents:
            return []
        if isinstance(documents, str) or not all(isinstance(d, str) and d.strip() for d in documents):
            raise DataFormatError("add() needs a list of non-blank strings")
        if ids is None:
            if not all(isinstance(i, int) for i in self.ids):
                raise ConfigurationError("this index has non-integer ids: pass the new documents' ids")
            first = self.next_id()
            ids = list(range(first, first + len(documents)))
        new_ids, documents = prepare_corpus(documents, ids, source="added documents", id_kind="position")
        positions = self._position_map()
        clashes = [i for i in new_ids if i in positions]
        if clashes:
            shown = ", ".join(repr(i) for i in clashes[:5]) + (", ..." if len(clashes) > 5 else "")
            raise DataFormatError(f"{len(clashes)} id(s) of the added documents are already in the index: {shown}")
        if embeddings is None:
            if self.model is None:
                self.use_recorded_model()
            vectors = encode_texts(self.model, documents, kind="document", batch_size=batch_size,
                                   progress=show_progress_bar)  # fmt: skip
        else:
            vectors = l2_normalize(embeddings)
            if vectors.shape[0] != len(documents):
                raise DataFormatError(f"got {vectors.shape[0]} embeddings for {len(documents)} documents")
        if vectors.shape[1] != self.dimension:
            raise BackboneMismatchError(f"embeddings have {vectors.shape[1]} dimensions, the index has {self.dimension}")
        if self.index_type in ("ivf", "ivfpq"):
            self._check_drift(vectors)
        add_vectors(self.index, vectors, self.index_type, progress=show_progress_bar)
        if self.vectors is not None:
            self.vectors = np.concatenate([np.asarray(self.vectors), vectors.astype(self.vectors.dtype)])
        start = len(self.ids)
        self.ids.extend(new_ids)
        self.texts.extend(documents)
        for offset, doc_id in enumerate(new_ids):
            positions[doc_id] = start + offset
        self._remember_next_id()
        self.info["updated"] = True
        return new_ids

    def remove(self, ids: Sequence[int | str]) -> int:
        """Remove the documents with these ids; return how many were removed. The other documents keep their ids
        and texts (and their order). IVF / IVF-PQ lists and flat indexes delete in place; an HNSW graph (FAISS cannot
        delete from one) is rebuilt from the remaining vectors. Nothing is written to disk until :meth:`save`.

        Raises:
            ConfigurationError: a read-only (memory-mapped) index.
            DataFormatError: an unknown id, or removing every document (an index cannot be empty).
        """
        self._check_writable("remove from")
        if isinstance(ids, (str, int)):
            ids = [ids]
        wanted = list(dict.fromkeys(ids))
        positions = self._position_map()
        unknown = [i for i in wanted if i not in positions]
        if unknown:
            shown = ", ".join(repr(i) for i in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise DataFormatError(f"{len(unknown)} id(s) are not in the index: {shown}")
        if not wanted:
            return 0
        if len(wanted) >= len(self):
            raise DataFormatError("removing every document would leave the index empty; build a new index instead")
        self._remember_next_id()  # before the largest id may go: ids are never handed out twice
        rows = np.array(sorted(positions[i] for i in wanted), dtype=np.int64)
        self.index = remove_rows(self.index, rows, self.index_type, self._exact_vectors, self.index_params)
        apply_search_params(self.index, self.index_type, self.index_params)
        keep = np.ones(len(self.ids), dtype=bool)
        keep[rows] = False
        if self.vectors is not None:
            self.vectors = np.asarray(self.vectors)[keep]
        self.ids = [doc_id for doc_id, kept in zip(self.ids, keep) if kept]
        self.texts = [text for text, kept in zip(self.texts, keep) if kept]
        self._positions = None
        self.info["updated"] = True
        return len(rows)

    def next_id(self) -> int:
        """The integer id :meth:`add` gives the next document: above every id this index has ever held, so that an
        id that was removed is never handed out again (kept in ``meta.json`` as ``next_id``)."""
        largest = max((i for i in self.ids if isinstance(i, int) and not isinstance(i, bool)), default=-1)
        return max(int(self.info.get("next_id", 0)), largest + 1)

    def _remember_next_id(self) -> None:
        if all(isinstance(i, int) for i in self.ids):
            self.info["next_id"] = self.next_id()

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ConfigurationError(
                f"cannot {what} an index loaded with mmap=True (read-only); load it without mmap to update it"
            )

    def _position_map(self) -> dict[int | str, int]:
        if self._positions is None:
            self._positions = {doc_id: row for row, doc_id in enumerate(self.ids)}
        return self._positions

    def _check_drift(self, vectors: np.ndarray) -> None:
        reference = (self.info.get("ivf_training") or {}).get("mean_sq_distance")
        if not reference:
            return
        added = float(np.mean(ivf_sq_distances(self.index, vectors)))
        ratio = added / reference
        self.info["drift"] = {"last_add_mean_sq_distance": round(added, 5), "ratio_to_training": round(ratio, 3)}
        if ratio > DRIFT_WARN_RATIO:
            warn_at_caller(
                f"the added documents lie far from the IVF centroids: mean squared distance {added:.3f}, "
                f"{ratio:.1f}x that of the documents the lists were trained on ({reference:.3f}); they come from "
                "another distribution, so recall may drop: recalibrate (calibrate()) or rebuild the index"
            )

    # ------------------------------------------------------------------ misc
    @property
    def dimension(self) -> int:
        """Embedding dimension of the index."""
        return int(self.index.d)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        model = self.model_identity.name if self.model_identity is not None else None
        return (
            f"SemanticIndex(type={self.index_type!r}, params={self.index_params}, docs={len(self)}, "
            f"dim={self.dimension}, model={model!r})"
        )


def check_queries(queries: Sequence[Any]) -> None:
    """Refuse queries that are not strings, or are empty or blank (they would match arbitrary documents)."""
    if not all(isinstance(query, str) for query in queries):
        raise ConfigurationError("queries must be a string or a list of strings")
    blank = [number for number, query in enumerate(queries, start=1) if not query.strip()]
    if blank:
        which = "the query" if len(queries) == 1 else f"query {', '.join(map(str, blank[:5]))}"
        raise ConfigurationError(f"{which} is empty: give the text to search for")


def foreign_sentences(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct real sentences shipped with st_prompts (the SNLI hypotheses of the bundled demo data:
    short image captions), drawn with ``rng``: the default calibration's model of queries from another genre."""
    import csv
    from importlib import resources

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


def rerank_exactly(
    queries: np.ndarray, positions: np.ndarray, vectors: np.ndarray, k: int, batch: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """Re-score candidate rows (``positions``, -1 = none) with the exact cosine against ``vectors`` (read only for
    the candidates, so a memory-mapped array stays on disk) and keep the best ``k`` of each query."""
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
    import faiss

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


def _resolve_target(index_type: str, target_recall: Any, params: dict[str, Any], queries: Any) -> float | None:
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


def _index_corpus(
    cls: type[SemanticIndex],
    model: SentenceTransformer,
    corpus: Corpus,
    index_type: str = "flat",
    batch_size: int = 64,
    show_progress_bar: bool = True,
    *,
    model_name: str | None = None,
    target_recall: float | str | None = "auto",
    calibration_queries: Any = None,
    encode_cache_dir: str | os.PathLike | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    processes: int | None = None,
    **index_params: Any,
) -> SemanticIndex:
    """Encode a validated corpus and index it (the common part of :meth:`SemanticIndex.build` and ``from_file``)."""
    # Resolve parameters before the (long) encoding so that a bad option fails fast.
    identity = ModelIdentity.of(model, name=model_name)
    resolve_index_params(index_type, len(corpus.texts), index_params, identity.dimension)
    target = _resolve_target(index_type, target_recall, index_params, calibration_queries)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive integer, got {batch_size!r}")
    if encode_cache_dir is not None or (processes is not None and processes > 1):
        embeddings = encode_in_chunks(
            model, corpus.texts, kind="document", batch_size=batch_size, chunk_size=chunk_size,
            cache_dir=encode_cache_dir, processes=processes, progress=show_progress_bar,
        ).embeddings  # fmt: skip
    else:
        embeddings = encode_texts(model, corpus.texts, kind="document", batch_size=batch_size,
                                  progress=show_progress_bar)  # fmt: skip
    index = _assemble(
        cls,
        embeddings,
        corpus.ids,
        corpus.texts,
        index_type,
        index_params,
        model=model,
        model_identity=identity,
        show_progress_bar=show_progress_bar,
        target_recall=target,
        calibration_queries=calibration_queries,
        info={"id_source": corpus.id_source, "source": corpus.source},
    )
    return index


def _assemble(
    cls: type[SemanticIndex],
    vectors: np.ndarray,
    ids: list[int | str],
    texts: list[str],
    index_type: str,
    index_params: dict[str, Any],
    *,
    model: SentenceTransformer | None,
    model_identity: ModelIdentity | None,
    show_progress_bar: bool,
    target_recall: float | None = None,
    calibration_queries: Any = None,
    info: dict[str, Any] | None = None,
) -> SemanticIndex:
    """Build the FAISS index over normalised ``vectors``, wrap it with the documents and the model identity, and
    calibrate it when a target recall is given."""
    import time

    if model_identity is not None and model_identity.dimension != vectors.shape[1]:
        raise BackboneMismatchError(
            f"embeddings have {vectors.shape[1]} dimensions but the model {model_identity.name!r} produces "
            f"{model_identity.dimension}"
        )
    params = resolve_index_params(index_type, len(texts), index_params, vectors.shape[1])
    start = time.perf_counter()
    faiss_index = build_faiss_index(vectors, index_type, params, progress=show_progress_bar)
    info = dict(info or {})
    info["build_seconds"] = round(time.perf_counter() - start, 2)
    if index_type in ("ivf", "ivfpq"):
        sample = vectors[:: max(1, len(vectors) // 10_000)]
        info["ivf_training"] = {"mean_sq_distance": round(float(np.mean(ivf_sq_distances(faiss_index, sample))), 5)}
    stored_vectors = vectors.astype(np.float16) if index_type == "ivfpq" else None
    index = cls(
        faiss_index,
        ids,
        texts,
        index_type=index_type,
        index_params=params,
        model_identity=model_identity,
        model=model,
        info=info,
        vectors=stored_vectors,
    )
    if target_recall is not None:
        index.calibrate(target_recall, calibration_queries, show_progress_bar=False)
    return index
