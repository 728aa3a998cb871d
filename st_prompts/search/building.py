"""Building a :class:`~st_prompts.search.SemanticIndex`: encode a validated corpus, build the FAISS index, calibrate."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from st_prompts.errors import BackboneMismatchError, DataFormatError
from st_prompts.numbers import positive_int
from st_prompts.search.calibration import resolve_target
from st_prompts.search.chunked import DEFAULT_CHUNK_SIZE, encode_in_chunks
from st_prompts.search.corpus import Corpus, corpus_from_documents, prepare_corpus, read_corpus_file
from st_prompts.search.encoding import encode_texts, l2_normalize, warn_over_length
from st_prompts.search.faiss_index import build_faiss_index, ivf_sq_distances, resolve_index_params
from st_prompts.search.identity import ModelIdentity
from st_prompts.search.streaming_build import build_index_from_embedding_files

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer


class IndexConstruction:
    """The constructors of :class:`~st_prompts.search.SemanticIndex` (a mixin: they build its instances)."""

    @classmethod
    def from_embeddings(cls, embeddings: Any, documents: Sequence[str], ids: Sequence[int | str] | None = None,
                        index_type: str = "flat", *, model: SentenceTransformer | None = None,
                        model_identity: ModelIdentity | None = None, show_progress_bar: bool = False,
                        target_recall: float | str | None = "auto", calibration_queries: Any = None,
                        **index_params: Any) -> Self:
        """Index precomputed embeddings (one row per document; they are L2-normalised here).

        Blank documents are refused (the rows must line up with ``documents``); ids default to 0-based positions.
        ``model`` / ``model_identity`` record which model produced the embeddings; without them only
        :meth:`search_embeddings` works, and ``calibration_queries`` must be embeddings. Other arguments: as in
        :meth:`build`.
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
        target = resolve_target(index_type, target_recall, index_params, calibration_queries)
        return assemble_index(cls, vectors, ids_list, documents, index_type, index_params, model=model,
                              model_identity=model_identity, show_progress_bar=show_progress_bar,
                              target_recall=target, calibration_queries=calibration_queries)

    @classmethod
    def from_embedding_files(cls, patterns: str | os.PathLike | Sequence[str | os.PathLike],
                             directory: str | os.PathLike, index_type: str = "flat", *, overwrite: bool = False,
                             target_recall: float | str | None = "auto", calibration_queries: Any = None,
                             show_progress_bar: bool = False, mmap: bool = False, **index_params: Any) -> Self:
        """Index embedding files (the Parquet parts ``st-prompts embed`` writes: files, folders of parts or glob
        patterns), save the index to ``directory`` and return it loaded from there (``mmap``: as in :meth:`load`).

        Nothing is encoded and the vectors are never all in memory (:mod:`st_prompts.search.streaming_build`); the
        index is the one :meth:`from_embeddings` would build from them. The parts' model becomes the index's. Other
        arguments: as for :meth:`build`.
        """
        if isinstance(patterns, (str, os.PathLike)):
            patterns = [patterns]
        build_index_from_embedding_files(
            cls, list(patterns), directory, index_type, overwrite=overwrite, target_recall=target_recall,
            calibration_queries=calibration_queries, show_progress_bar=show_progress_bar, **index_params)
        return cls.load(directory, mmap=mmap)

    @classmethod
    def build(cls, model: SentenceTransformer, documents: Any, ids: Sequence[int | str] | None = None,
              index_type: str = "flat", batch_size: int = 64, show_progress_bar: bool = True, *,
              text_column: str = "text", id_column: str | None = None, model_name: str | None = None,
              target_recall: float | str | None = "auto", calibration_queries: Any = None,
              encode_cache_dir: str | os.PathLike | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
              processes: int | None = None, task: str | None = None, **index_params: Any) -> Self:
        """Encode ``documents`` with ``model`` (``encode_document``) and index them.

        Args:
            documents: a list/iterable of strings, a ``datasets.Dataset`` (its ``text_column``; ids from
                ``id_column``) or a :class:`~st_prompts.search.corpus.Corpus` (what :meth:`from_file` reads).
            ids: one unique ``str``/``int`` id per document (default: 0-based positions).
            index_type: ``"flat"`` (exact), ``"ivf"``, ``"hnsw"`` or ``"ivfpq"`` (:mod:`st_prompts.search.faiss_index`).
            model_name: the name recorded for the model, by which a loaded index reloads it (prefer a hub id or an
                alias to a machine-specific path).
            target_recall: calibrate an approximate index to this recall@10 (:meth:`calibrate`); ``"auto"``: 0.95
                unless ``nprobe`` / ``ef_search`` is given; ``None``: no calibration.
            calibration_queries: query strings or embeddings to calibrate on (default: perturbed documents).
            encode_cache_dir: keep each finished chunk of ``chunk_size`` documents here, so that an interrupted
                build resumes (:func:`~st_prompts.search.chunked.encode_in_chunks`).
            processes: encode with sentence-transformers' multi-process pool of this many CPU workers.
            task: a bank's prompt set that encodes the documents and, at search time, the queries.
            **index_params: ``nlist``/``nprobe`` (IVF), ``m``/``ef_construction``/``ef_search`` (HNSW),
                ``nlist``/``nprobe``/``pq_m``/``opq``/``rerank`` (IVF-PQ).

        Raises:
            DataFormatError: empty corpus, duplicate ids, non-string documents, missing column.
            ConfigurationError: unknown ``index_type`` or parameter, ``nlist`` larger than the corpus, a bad target.
        """
        corpus = documents if isinstance(documents, Corpus) else corpus_from_documents(
            documents, ids, text_column=text_column, id_column=id_column)
        # Resolve parameters before the (long) encoding so that a bad option fails fast.
        identity = ModelIdentity.of(model, name=model_name, task=task)
        resolve_index_params(index_type, len(corpus.texts), index_params, identity.dimension)
        target = resolve_target(index_type, target_recall, index_params, calibration_queries)
        batch_size = positive_int(batch_size, "batch_size")
        longer = warn_over_length(model, corpus.texts)
        if encode_cache_dir is not None or (processes is not None and processes > 1):
            embeddings = encode_in_chunks(model, corpus.texts, kind="document", batch_size=batch_size,
                                          chunk_size=chunk_size, cache_dir=encode_cache_dir, processes=processes,
                                          progress=show_progress_bar, task=task).embeddings
        else:
            embeddings = encode_texts(model, corpus.texts, kind="document", batch_size=batch_size,
                                      progress=show_progress_bar, task=task)  # fmt: skip
        return assemble_index(cls, embeddings, corpus.ids, corpus.texts, index_type, index_params, model=model,
                              model_identity=identity, show_progress_bar=show_progress_bar, target_recall=target,
                              calibration_queries=calibration_queries,
                              info={"id_source": corpus.id_source, "source": corpus.source,
                                    "documents_over_length": longer})

    @classmethod
    def from_file(cls, model: SentenceTransformer, path: str | os.PathLike, text_column: str = "text",
                  id_column: str | None = None, *, encoding: str = "utf-8", **kw: Any) -> Self:
        """Encode and index the corpus in the file ``path`` (``**kw``: as for :meth:`build`).

        A ``.jsonl``/``.json``/``.csv``/``.parquet`` file is read with ``datasets`` (ids from ``id_column``, else row
        positions); anything else is a text file, one document per line, ids 1-based line numbers.
        """
        corpus = read_corpus_file(path, text_column=text_column, id_column=id_column, encoding=encoding)
        return cls.build(model, corpus, **kw)


def assemble_index(cls: type[IndexConstruction], vectors: np.ndarray, ids: list[int | str], texts: list[str],
                   index_type: str, index_params: dict[str, Any], *, model: SentenceTransformer | None,
                   model_identity: ModelIdentity | None, show_progress_bar: bool, target_recall: float | None = None,
                   calibration_queries: Any = None, info: dict[str, Any] | None = None) -> IndexConstruction:
    """Build the FAISS index over normalised ``vectors``, wrap it with the documents, and calibrate it."""
    if model_identity is not None and model_identity.dimension != vectors.shape[1]:
        raise BackboneMismatchError(f"embeddings have {vectors.shape[1]} dimensions but the model "
                                    f"{model_identity.name!r} produces {model_identity.dimension}")
    params = resolve_index_params(index_type, len(texts), index_params, vectors.shape[1])
    start = time.perf_counter()
    faiss_index = build_faiss_index(vectors, index_type, params, progress=show_progress_bar)
    info = dict(info or {})
    info["build_seconds"] = round(time.perf_counter() - start, 2)
    if index_type in ("ivf", "ivfpq"):
        sample = vectors[:: max(1, len(vectors) // 10_000)]
        info["ivf_training"] = {"mean_sq_distance": round(float(np.mean(ivf_sq_distances(faiss_index, sample))), 5)}
    stored_vectors = vectors.astype(np.float16) if index_type == "ivfpq" else None
    index = cls(faiss_index, ids, texts, index_type=index_type, index_params=params, model_identity=model_identity,
                model=model, info=info, vectors=stored_vectors)
    if target_recall is not None:
        index.calibrate(target_recall, calibration_queries, show_progress_bar=False)
    return index
