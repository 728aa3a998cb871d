""":class:`SemanticIndex`: build an index over a corpus, save/load it, search it (see :mod:`st_prompts.search`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError
from st_prompts.search._warnings import warn_at_caller
from st_prompts.search.corpus import Corpus, corpus_from_documents, prepare_corpus, read_corpus_file
from st_prompts.search.encoding import encode_texts, l2_normalize
from st_prompts.search.faiss_index import (
    apply_search_params,
    build_faiss_index,
    check_positive_int,
    resolve_index_params,
)
from st_prompts.search.identity import ModelIdentity, embedding_dimension
from st_prompts.search.store import StoredIndex, load_index_dir, save_index_dir

if TYPE_CHECKING:  # pragma: no cover
    import faiss
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)


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
    (texts) or :meth:`search_embeddings` (vectors). See :mod:`st_prompts.search` for the conventions (scores, ids,
    duplicates, ``k``).

    Attributes:
        index: the underlying ``faiss.Index`` (row ``i`` is document ``ids[i]``).
        ids: document ids, in FAISS order.
        texts: document texts, in FAISS order.
        index_type: ``"flat"``, ``"ivf"`` or ``"hnsw"``.
        index_params: the resolved parameters (e.g. ``{"nlist": 400, "nprobe": 32}``).
        model_identity: the :class:`ModelIdentity` of the encoding model, or ``None`` for an index built from bare
            embeddings.
        model: the model used to encode queries (``None`` until needed; loaded lazily from ``model_identity``).
        info: extra metadata saved in ``meta.json`` (e.g. ``id_source``).
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
    ) -> None:
        if index.ntotal != len(ids) or len(ids) != len(texts):
            raise DataFormatError(
                f"inconsistent index: {index.ntotal} vectors, {len(ids)} ids and {len(texts)} texts"
            )
        self.index = index
        self.ids = list(ids)
        self.texts = list(texts)
        self.index_type = index_type
        self.index_params = dict(index_params)
        self.model_identity = model_identity
        self.model = model
        self.info = dict(info or {})

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
        **index_params: Any,
    ) -> SemanticIndex:
        """Index precomputed embeddings (one row per document; they are L2-normalised here).

        Blank documents are *not* skipped here (the rows must line up with ``documents``); ids default to 0-based
        positions. ``model`` / ``model_identity`` record which model produced the embeddings (needed to search with
        texts and to check a model on :meth:`load`); without them only :meth:`search_embeddings` works.
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
        **index_params: Any,
    ) -> SemanticIndex:
        """Encode ``documents`` with ``model`` and index them.

        Args:
            model: the sentence-transformers model (documents go through ``encode_document``, so a model with a
                ``document`` prompt uses it).
            documents: a list/iterable of strings, or a ``datasets.Dataset`` (its ``text_column``; ids from
                ``id_column`` if given). A bare string is rejected (use :meth:`from_file` for a file).
            ids: one unique ``str``/``int`` id per document (default: 0-based positions).
            index_type: ``"flat"`` (exact), ``"ivf"`` or ``"hnsw"``.
            batch_size: encoding batch size.
            show_progress_bar: show progress bars while encoding and while adding to an approximate index.
            text_column / id_column: columns to use when ``documents`` is a dataset.
            model_name: the name to record for the model (default: derived from the model; ``minilm`` for the
                packaged MiniLM). :meth:`search` on a loaded index reloads the model by this name when no model is
                given, so prefer a hub id or an alias to a machine-specific path.
            **index_params: ``nlist``/``nprobe`` for IVF, ``m``/``ef_construction``/``ef_search`` for HNSW.

        Raises:
            DataFormatError: empty corpus, duplicate ids, non-string documents, missing column.
            ConfigurationError: unknown ``index_type`` or parameter, ``nlist`` larger than the corpus.
        """
        corpus = corpus_from_documents(documents, ids, text_column=text_column, id_column=id_column)
        return _index_corpus(
            cls, model, corpus, index_type, batch_size, show_progress_bar, model_name=model_name, **index_params
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

        ``**kw`` go to :meth:`build` (``index_type``, ``batch_size``, ``show_progress_bar``, ``model_name``, index
        parameters).

        Raises:
            DataNotFoundError: the file does not exist.
            DataFormatError: unreadable file, empty corpus, duplicate ids, missing column.
            ConfigurationError: ``id_column`` for a text file, bad options.
        """
        corpus = read_corpus_file(path, text_column=text_column, id_column=id_column, encoding=encoding)
        return _index_corpus(cls, model, corpus, **kw)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike, *, overwrite: bool = True) -> None:
        """Write the index to ``directory`` (``index.faiss``, ``docs.jsonl``, ``meta.json``, ``probe.npy``).

        The files are written into a temporary directory next to the target, which is then renamed into place, so
        an interrupted save never leaves a half-written index. An existing index at ``directory`` is replaced
        (unless ``overwrite=False``); an existing directory that is not empty and not an index is never touched.
        """
        stored = StoredIndex(
            self.index, self.ids, self.texts, self.index_type, self.index_params, self.model_identity, self.info
        )
        target = save_index_dir(stored, directory, overwrite=overwrite)
        logger.info("saved %s index of %d documents to %s", self.index_type, len(self), target)

    @classmethod
    def load(cls, directory: str | os.PathLike, model: SentenceTransformer | str | None = None) -> SemanticIndex:
        """Load an index saved by :meth:`save`.

        Args:
            directory: the index directory.
            model: optional model (or model name, loaded with :func:`st_prompts.loading.load_sentence_model`) to
                encode queries with. It is checked against the index's recorded model identity (dimension and probe
                fingerprint). Without it, the recorded model is loaded (and checked) at the first text search.

        Raises:
            DataNotFoundError: the directory does not exist.
            DataFormatError: it is not a complete, consistent semantic index.
            BackboneMismatchError: ``model`` is not the index's model.
        """
        stored = load_index_dir(directory)
        loaded = cls(
            stored.faiss_index,
            stored.ids,
            stored.texts,
            index_type=stored.index_type,
            index_params=stored.index_params,
            model_identity=stored.model_identity,
            info=stored.info,
        )
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

    def set_search_params(self, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Change the speed/recall trade-off of an approximate index (saved with the index)."""
        if nprobe is not None:
            if self.index_type != "ivf":
                raise ConfigurationError(f"nprobe applies to an 'ivf' index, this one is {self.index_type!r}")
            self.index_params["nprobe"] = min(check_positive_int(nprobe, "nprobe"), self.index_params["nlist"])
        if ef_search is not None:
            if self.index_type != "hnsw":
                raise ConfigurationError(f"ef_search applies to an 'hnsw' index, this one is {self.index_type!r}")
            self.index_params["ef_search"] = check_positive_int(ef_search, "ef_search")
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
        if not all(isinstance(query, str) for query in queries):
            raise ConfigurationError("queries must be a string or a list of strings")
        k = check_positive_int(k, "k")
        if not queries:
            return []
        if self.model is None:
            self.use_recorded_model()
        embeddings = encode_texts(self.model, queries, kind="query", batch_size=batch_size, progress=show_progress_bar)
        return self.search_embeddings(embeddings, k)

    def search_embeddings(self, query_embeddings: Any, k: int = 10) -> list[list[SearchHit]]:
        """Like :meth:`search` for precomputed query embeddings (one row per query; normalised here)."""
        k = check_positive_int(k, "k")
        queries = l2_normalize(query_embeddings)
        if queries.shape[1] != self.dimension:
            raise BackboneMismatchError(
                f"query embeddings have {queries.shape[1]} dimensions, the index has {self.dimension}"
            )
        if k > len(self):
            warn_at_caller(
                f"k={k} is larger than the corpus ({len(self)} documents); returning at most {len(self)} hits"
            )
            k = len(self)
        scores, positions = self.index.search(queries, k)
        return [
            [SearchHit(self.ids[pos], self.texts[pos], float(score)) for score, pos in zip(row_scores, row_positions)
             if pos >= 0]  # FAISS pads with -1 when too few candidates were visited
            for row_scores, row_positions in zip(scores, positions)
        ]  # fmt: skip

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


def _index_corpus(
    cls: type[SemanticIndex],
    model: SentenceTransformer,
    corpus: Corpus,
    index_type: str = "flat",
    batch_size: int = 64,
    show_progress_bar: bool = True,
    *,
    model_name: str | None = None,
    **index_params: Any,
) -> SemanticIndex:
    """Encode a validated corpus and index it (the common part of :meth:`SemanticIndex.build` and ``from_file``)."""
    # Resolve parameters before the (long) encoding so that a bad option fails fast.
    resolve_index_params(index_type, len(corpus.texts), index_params)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive integer, got {batch_size!r}")
    identity = ModelIdentity.of(model, name=model_name)
    embeddings = encode_texts(model, corpus.texts, kind="document", batch_size=batch_size, progress=show_progress_bar)
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
    )
    index.info["id_source"] = corpus.id_source
    index.info["source"] = corpus.source
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
) -> SemanticIndex:
    """Build the FAISS index over normalised ``vectors`` and wrap it with the documents and the model identity."""
    if model_identity is not None and model_identity.dimension != vectors.shape[1]:
        raise BackboneMismatchError(
            f"embeddings have {vectors.shape[1]} dimensions but the model {model_identity.name!r} produces "
            f"{model_identity.dimension}"
        )
    params = resolve_index_params(index_type, len(texts), index_params)
    faiss_index = build_faiss_index(vectors, index_type, params, progress=show_progress_bar)
    return cls(
        faiss_index,
        ids,
        texts,
        index_type=index_type,
        index_params=params,
        model_identity=model_identity,
        model=model,
    )
