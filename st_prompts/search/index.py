""":class:`SemanticIndex`: build an index over a corpus, save/load it, search it (conventions: ``docs/search.md``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError
from st_prompts.numbers import positive_int
from st_prompts.search._warnings import warn_at_caller
from st_prompts.search.building import IndexConstruction
from st_prompts.search.calibration import IndexCalibration
from st_prompts.search.checks import MAX_COUNT, MAX_EF
from st_prompts.search.corpus import check_queries
from st_prompts.search.encoding import check_encode_length, encode_texts, l2_normalize
from st_prompts.search.faiss_index import apply_search_params, reconstruct_all, rerank_exactly
from st_prompts.search.identity import ModelIdentity, embedding_dimension
from st_prompts.search.store import StoredIndex, load_index_dir, save_index_dir
from st_prompts.search.updates import IndexUpdates
from st_prompts.storage import folder_lock

if TYPE_CHECKING:  # pragma: no cover
    import faiss
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)


class SearchHit(NamedTuple):
    """One search result: the document's id and text and its cosine similarity to the query."""
    id: int | str
    text: str
    score: float


class SemanticIndex(IndexConstruction, IndexCalibration, IndexUpdates):
    """A FAISS index over the L2-normalised embeddings of a corpus, with the documents' ids and texts.

    Build one with :meth:`build`, :meth:`from_file` or :meth:`from_embeddings`; persist it with :meth:`save` /
    :meth:`load`; query it with :meth:`search` / :meth:`search_embeddings`; update it with :meth:`add` /
    :meth:`remove`; tune an approximate index with :meth:`calibrate` (conventions: ``docs/search.md``).

    Attributes:
        index: the ``faiss.Index`` (row ``i`` is document ``ids[i]``); ``ids``, ``texts`` in that order (read-only
            lazy sequences for an index loaded with ``mmap=True``).
        index_type, index_params: ``"flat"``, ``"ivf"``, ``"hnsw"`` or ``"ivfpq"`` and its resolved parameters.
        model_identity: the encoding model's :class:`ModelIdentity` (``None``: built from bare embeddings).
        model: the model encoding queries (loaded lazily from ``model_identity``).
        vectors: an ``"ivfpq"`` index's normalised float16 vectors, for exact re-ranking (else ``None``).
        info: extra metadata saved in ``meta.json`` (e.g. ``id_source``, ``calibration``).
    """

    def __init__(self, index: faiss.Index, ids: Sequence[int | str], texts: Sequence[str], *, index_type: str,
                 index_params: dict[str, Any], model_identity: ModelIdentity | None = None,
                 model: SentenceTransformer | None = None, info: dict[str, Any] | None = None,
                 vectors: np.ndarray | None = None, read_only: bool = False) -> None:
        if index.ntotal != len(ids) or len(ids) != len(texts):
            raise DataFormatError(f"inconsistent index: {index.ntotal} vectors, {len(ids)} ids and {len(texts)} texts")
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
        # (folder, save_id) it was loaded from or saved to: saving back is refused if another process saved meanwhile
        self._saved_as: tuple[str, str | None] | None = None

    def save(self, directory: str | os.PathLike, *, overwrite: bool = True) -> None:
        """Write the index to ``directory``, atomically (:func:`~st_prompts.search.store.save_index_dir`).

        An existing index is replaced (unless ``overwrite=False``) only if st-prompts wrote it. Saving back is refused
        if another process saved the folder meanwhile: use :meth:`update` to load, change and save under its lock.
        """
        stored = StoredIndex(self.index, self.ids, self.texts, self.index_type, self.index_params, self.model_identity,
                             self.info, self.vectors)
        updating = self._saved_as is not None and self._saved_as[0] == os.path.realpath(directory)
        expected = self._saved_as[1] if updating else None
        target, save_id = save_index_dir(stored, directory, overwrite=overwrite, expected_save_id=expected,
                                         updating=updating)
        self._saved_as = (os.path.realpath(target), save_id)
        logger.debug("saved %s index of %d documents to %s", self.index_type, len(self), target)

    @classmethod
    @contextmanager
    def update(cls, directory: str | os.PathLike, model: SentenceTransformer | str | None = None
               ) -> Iterator[SemanticIndex]:
        """Load the index at ``directory``, let the caller change it, and save it, under the index's lock::

            with SemanticIndex.update("corpus.index") as index:
                index.add(["a new document"])

        Nothing is saved if the block raises. ``model``: as for :meth:`load`.
        """
        with folder_lock(directory):
            index = cls.load(directory, model)
            yield index
            index.save(directory, overwrite=True)

    @classmethod
    def load(cls, directory: str | os.PathLike, model: SentenceTransformer | str | None = None, *,
             mmap: bool = False) -> SemanticIndex:
        """Load an index saved by :meth:`save`.

        Args:
            model: a model (or name) to encode queries with, checked against the index's recorded model; by default
                the recorded model is loaded at the first text search.
            mmap: memory-map the index instead of reading it into RAM, so an index larger than RAM can be searched
                (read-only: :meth:`add` / :meth:`remove` raise).

        Raises:
            DataNotFoundError: the directory does not exist.
            DataFormatError: it is not a complete, consistent semantic index.
            BackboneMismatchError: ``model`` is not the index's model.
        """
        stored = load_index_dir(directory, mmap=mmap)
        loaded = cls(stored.faiss_index, stored.ids, stored.texts, index_type=stored.index_type,
                     index_params=stored.index_params, model_identity=stored.model_identity, info=stored.info,
                     vectors=stored.vectors, read_only=mmap)
        loaded._saved_as = (os.path.realpath(directory), stored.save_id)
        if model is not None:
            loaded.set_model(model)
        return loaded

    def set_model(self, model: SentenceTransformer | str, *, device: str | None = None,
                  trust_remote_code: bool | None = None) -> None:
        """Use ``model`` (a model, or a name/path loaded with ``device`` and ``trust_remote_code``) to encode queries,
        after checking that it matches the index's model (else :class:`BackboneMismatchError`)."""
        if isinstance(model, (str, os.PathLike)):
            # imported here: they import torch and sentence-transformers, which a vectors-only index never needs
            from st_prompts.loading import load_sentence_model
            from st_prompts.modules.chat_templates import guard_chat_templates

            name = str(model)
            identity = self.model_identity  # queries encoded as the documents were: quantized, or in their dtype
            model = guard_chat_templates(load_sentence_model(
                name, trust_remote_code, device=device, quantize=identity.quantize if identity else None,
                dtype=identity.dtype if identity else None))
            check_encode_length(model, name if len(name) <= 100 else name[:99] + "…")
        if self.model_identity is not None:
            self.model_identity.check_compatible(ModelIdentity.of(model, task=self.model_identity.task))
        elif embedding_dimension(model) not in (None, self.dimension):
            raise BackboneMismatchError(f"the model produces {embedding_dimension(model)}-dimensional embeddings, the "
                                        f"index has {self.dimension} dimensions")
        self.model = model

    def use_recorded_model(self, *, device: str | None = None, trust_remote_code: bool | None = None) -> None:
        """Load the model recorded in the index and use it for queries (ConfigurationError if it records none)."""
        if self.model_identity is None:
            raise ConfigurationError("this index was built from bare embeddings and has no model: pass one with "
                                     "set_model()/load(), or use search_embeddings()")
        name = self.model_identity.loadable_name()
        logger.debug("loading the index's model %r", name)
        self.set_model(name, device=device, trust_remote_code=trust_remote_code)

    def set_search_params(self, *, nprobe: int | None = None, ef_search: int | None = None,
                          rerank: int | None = None) -> None:
        """Change the speed/recall trade-off of an approximate index (saved with the index). A calibration recorded
        in :attr:`info` stays there, but no longer describes the parameters in use (``index info`` says so)."""
        if nprobe is not None:
            if self.index_type not in ("ivf", "ivfpq"):
                raise ConfigurationError(f"nprobe applies to an 'ivf' or 'ivfpq' index, this one is "
                                         f"{self.index_type!r}")
            self.index_params["nprobe"] = min(positive_int(nprobe, "nprobe", MAX_COUNT), self.index_params["nlist"])
        if ef_search is not None:
            if self.index_type != "hnsw":
                raise ConfigurationError(f"ef_search applies to an 'hnsw' index, this one is {self.index_type!r}")
            self.index_params["ef_search"] = positive_int(ef_search, "ef_search", MAX_EF)
        if rerank is not None:
            if self.index_type != "ivfpq":
                raise ConfigurationError(f"rerank applies to an 'ivfpq' index, this one is {self.index_type!r}")
            if isinstance(rerank, bool) or not isinstance(rerank, (int, np.integer)) or not 0 <= rerank <= MAX_COUNT:
                raise ConfigurationError(f"rerank must be a non-negative integer (0 = off), got {rerank!r}")
            if rerank and self.vectors is None:
                raise ConfigurationError("this IVF-PQ index keeps no vectors to re-rank with")
            self.index_params["rerank"] = int(rerank)
        apply_search_params(self.index, self.index_type, self.index_params)

    def search(self, queries: str | Sequence[str], k: int = 10, *, batch_size: int = 64,
               show_progress_bar: bool = False, task: str | None = None) -> list[list[SearchHit]]:
        """Return the ``k`` nearest documents of each query, best first, as :class:`SearchHit` (id, text, cosine).

        ``queries`` is a string or a list of strings; the result has one list per query. Queries are encoded as the
        index's documents were (``encode_query``, or its ``task``'s prompt set: a ``task`` given must be that one).
        ``k`` is clamped to the corpus size with a warning.
        """
        recorded = self.model_identity.task if self.model_identity is not None else None
        if task is not None and task != recorded:
            raise BackboneMismatchError(f"this index was encoded with the prompt set {recorded!r}: its queries must be "
                                        f"too, not {task!r}")
        single = isinstance(queries, str)
        queries = [queries] if single else list(queries)
        check_queries(queries)
        k = positive_int(k, "k", MAX_COUNT)
        if not queries:
            return []
        embeddings = self.encode_queries(queries, batch_size=batch_size, progress=show_progress_bar)
        return self.search_embeddings(embeddings, k)

    def search_embeddings(self, query_embeddings: Any, k: int = 10) -> list[list[SearchHit]]:
        """Like :meth:`search` for precomputed query embeddings (one row per query; normalised here)."""
        k = positive_int(k, "k", MAX_COUNT)
        queries = self.check_query_embeddings(query_embeddings)
        if k > len(self):
            warn_at_caller(f"k={k} is larger than the corpus ({len(self)} documents); returning at most "
                           f"{len(self)} hits")
            k = len(self)
        scores, positions = self.search_positions(queries, k)
        if positions.size and (positions.min() < -1 or positions.max() >= len(self)):
            where = os.path.join(self._saved_as[0], "index.faiss") if self._saved_as else "the FAISS index"
            row = int(positions.max()) if positions.max() >= len(self) else int(positions.min())
            raise DataFormatError(f"{where} returned the row {row} for an index of {len(self)} documents: it is "
                                  "damaged; rebuild the index")
        return [[SearchHit(self.ids[pos], self.texts[pos], float(score))
                 for score, pos in zip(row_scores, row_positions) if pos >= 0]  # FAISS pads with -1
                for row_scores, row_positions in zip(scores, positions)]

    def check_query_embeddings(self, query_embeddings: Any) -> np.ndarray:
        """``query_embeddings`` L2-normalised, checked to have the index's dimension."""
        queries = l2_normalize(query_embeddings)
        if queries.shape[1] != self.dimension:
            raise BackboneMismatchError(f"query embeddings have {queries.shape[1]} dimensions, the index has "
                                        f"{self.dimension}")
        return queries

    def encode_queries(self, queries: list[str], *, batch_size: int = 64, progress: bool = False) -> np.ndarray:
        """Encode query texts with the index's model (``encode_query``; loaded from the index on first use)."""
        if self.model is None:
            self.use_recorded_model()
        task = self.model_identity.task if self.model_identity is not None else None
        return encode_texts(self.model, queries, kind="query", batch_size=batch_size, progress=progress, task=task)

    def search_positions(self, queries: np.ndarray, k: int, params: dict[str, Any] | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, row positions)`` of normalised query vectors (-1: too few found), IVF-PQ candidates re-ranked;
        ``params`` (e.g. ``{"nprobe": 8}``) apply to this search only."""
        if params is not None:
            apply_search_params(self.index, self.index_type, params)
        try:
            settings = self.index_params if params is None else params
            rerank = int(settings.get("rerank", 0)) if self.index_type == "ivfpq" else 0
            if not rerank or self.vectors is None:
                return self.index.search(queries, k)
            _, positions = self.index.search(queries, min(max(rerank, k), len(self)))
            return rerank_exactly(queries, positions, self.vectors, k)
        finally:
            if params is not None:
                apply_search_params(self.index, self.index_type, self.index_params)

    def exact_vectors(self) -> np.ndarray:
        """The normalised vectors of every row (the stored ones for IVF-PQ; reconstructed from FAISS otherwise)."""
        if self.vectors is not None:
            return self.vectors
        return reconstruct_all(self.index, self.index_type)

    @property
    def dimension(self) -> int:
        """Embedding dimension of the index."""
        return int(self.index.d)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        model = self.model_identity.name if self.model_identity is not None else None
        return (f"SemanticIndex(type={self.index_type!r}, params={self.index_params}, docs={len(self)}, "
                f"dim={self.dimension}, model={model!r})")
