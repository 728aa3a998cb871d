"""Building a saved index from embedding files (the Parquet parts ``st-prompts embed`` writes) without encoding
anything or holding all the vectors in memory: a first pass checks the ids and gathers the training sample (the rows
an in-memory build would train on), a second fills the FAISS index and writes the documents (and IVF-PQ's vectors)
straight into the staging folder. Calibration loads the model only for text queries."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm.auto import tqdm

from st_prompts.errors import ConfigurationError, DataFormatError, StPromptsError, first_line
from st_prompts.numbers import positive_int, whole
from st_prompts.search._warnings import warn_at_caller
from st_prompts.search.calibration import are_texts, resolve_target
from st_prompts.search.docfile import DocsWriter, LazyDocs
from st_prompts.search.embedding_files import EmbeddingFiles, open_parquet, part_record
from st_prompts.search.encoding import l2_normalize
from st_prompts.search.faiss_index import (add_vectors, ivf_sq_distances, new_faiss_index, resolve_index_params,
                                           train_faiss_index, training_rows)
from st_prompts.search.rowfile import NpyRows, NpyRowWriter
from st_prompts.search.store import (DOCS_FILE, INDEX_FILE, OFFSETS_FILE, VECTORS_FILE, StoredIndex,
                                     check_index_destination, finish_index_folder, write_index_folder)

DEFAULT_BATCH_ROWS = 4_096  # rows read from the parts at a time (larger batches cost memory, not time)
_FAISS_POINTS_PER_LIST = 256  # FAISS's k-means max_points_per_centroid: an IVF index's sample is drawn here


@dataclass
class EmbeddingFilesBuild:
    """What :func:`build_index_from_embedding_files` wrote (``calibration``, ``model``: ``None`` if none)."""

    directory: Path
    rows: int
    dimension: int
    index_type: str
    index_params: dict[str, Any]
    calibration: dict[str, Any] | None
    model: str | None
    parts: int
    seconds: float


def build_index_from_embedding_files(index_class: Any, patterns: Sequence[str | os.PathLike],
                                     directory: str | os.PathLike, index_type: str = "flat", *,
                                     overwrite: bool = False, target_recall: float | str | None = "auto",
                                     calibration_queries: Any = None, show_progress_bar: bool = True,
                                     batch_rows: int = DEFAULT_BATCH_ROWS, **index_params: Any) -> EmbeddingFilesBuild:
    """Index the embedding files named by ``patterns`` (files, folders of parts, glob patterns; every part with its
    texts) and save the index to ``directory`` as :meth:`SemanticIndex.save` does; the parts' model record becomes
    the index's (none: a vectors-only index). ``index_class``: :class:`~st_prompts.search.SemanticIndex` (passed in
    to keep the import graph acyclic); other arguments as for :meth:`SemanticIndex.build`.

    Raises:
        DataNotFoundError: a pattern names no file.
        DataFormatError: a part is damaged, parts disagree, an id is missing or repeated, a text or vector is bad.
        ConfigurationError: a bad index type, parameter or target; a destination that may not be replaced.
    """
    start = time.perf_counter()
    batch_rows = positive_int(batch_rows, "batch_rows")
    files = EmbeddingFiles.open(patterns)
    if files.rows == 0:
        raise DataFormatError("the embedding files hold no rows: there is no document to index")
    if not files.has_texts:
        raise DataFormatError("the embedding files hold no texts (a 'text' column), and an index returns its "
                              "documents: write them with their texts (st-prompts embed keeps them by default)")
    _check_one_origin(files.paths)
    identity = files.identity()
    params = resolve_index_params(index_type, files.rows, index_params, files.dimension)
    target = resolve_target(index_type, target_recall, index_params, calibration_queries)
    if identity is None and are_texts(calibration_queries):
        raise ConfigurationError("text calibration queries need the model that encoded the documents, and these "
                                 "embedding files record none: give query embeddings instead")
    check_index_destination(directory, overwrite)  # before the passes over the parts

    with _arrow_memory_returned():  # both passes and the write
        sample = _first_pass(files, _sample_rows(files.rows, index_type, params), batch_rows, show_progress_bar)
        faiss_index = new_faiss_index(files.dimension, index_type, params)
        info: dict[str, Any] = {"id_source": "column:id", "source": _describe_source(files.paths),
                                "embedding_files": {"parts": len(files.paths), "rows": files.rows}}
        if sample is not None:
            # consume: the sample is shrunk in place to PQ's subsample (see train_faiss_index), then dropped here
            train_faiss_index(faiss_index, sample, index_type, params, consume=True)
            del sample
        save_id = uuid.uuid4().hex
        outcome: dict[str, Any] = {}

        def write(tmp: Path) -> None:
            drift, duplicates = _fill(files, faiss_index, index_type, tmp, batch_rows, show_progress_bar)
            if drift is not None:
                mean = float(np.mean(ivf_sq_distances(faiss_index, drift)))
                info["ivf_training"] = {"mean_sq_distance": round(mean, 5)}
            info["build_seconds"] = round(time.perf_counter() - start, 2)
            docs = LazyDocs(tmp / DOCS_FILE, np.load(tmp / OFFSETS_FILE))
            vectors = NpyRows(tmp / VECTORS_FILE) if index_type == "ivfpq" else None
            try:
                resolved = dict(params)
                outcome["warnings"] = []
                if target is not None:
                    resolved, info["calibration"], outcome["warnings"] = _calibrate(
                        index_class, faiss_index, docs, vectors, index_type, params, identity, info, target,
                        calibration_queries)
                faiss.write_index(faiss_index, str(tmp / INDEX_FILE))
                stored = StoredIndex(faiss_index, docs.ids, docs.texts, index_type, resolved, identity, info, vectors)
                finish_index_folder(tmp, stored, save_id, duplicate_texts=duplicates)
            finally:
                docs.close()
                if vectors is not None:
                    vectors.close()
            outcome["params"] = resolved

        target_dir = write_index_folder(directory, write, overwrite=overwrite)
    for message in outcome["warnings"]:
        warn_at_caller(message)
    return EmbeddingFilesBuild(directory=target_dir, rows=files.rows, dimension=files.dimension, index_type=index_type,
                               index_params=outcome["params"], calibration=info.get("calibration"),
                               model=identity.name if identity is not None else None, parts=len(files.paths),
                               seconds=round(time.perf_counter() - start, 2))


@contextmanager
def _arrow_memory_returned() -> Iterator[None]:
    """Read the parts with a pyarrow memory pool that gives freed memory back at once (jemalloc with no decay, else
    the system's): the default one (mimalloc) keeps what a part's reading freed."""
    import pyarrow as pa

    previous = pa.default_memory_pool()
    try:
        pool = pa.jemalloc_memory_pool()
        pa.jemalloc_set_decay_ms(0)
    except NotImplementedError:  # a pyarrow built without jemalloc
        pool = pa.system_memory_pool()
    pa.set_memory_pool(pool)
    try:
        yield
    finally:
        pa.set_memory_pool(previous)


def _describe_source(paths: list[Path]) -> str:
    """``meta.json``'s ``source``: the parts' folder and how many, or the one file."""
    if len(paths) == 1:
        return str(paths[0])
    folders = sorted({str(path.parent) for path in paths})
    where = folders[0] if len(folders) == 1 else f"{folders[0]} and {len(folders) - 1} other folder(s)"
    return f"{len(paths)} embedding files in {where} ({paths[0].name} .. {paths[-1].name})"


def _check_one_origin(paths: list[Path]) -> None:
    """Refuse parts that name their model mixed with parts that do not (the index would claim it for all)."""
    named = [path for path in paths if (part_record(path) or {}).get("model") is not None]
    if named and len(named) != len(paths):
        unnamed = next(path for path in paths if path not in named)
        raise DataFormatError(f"{unnamed} records no model, unlike {named[0]}: vectors of unknown origin cannot be "
                              "indexed with the vectors of a known model")


def _sample_rows(n: int, index_type: str, params: dict[str, Any]) -> np.ndarray | None:
    """The rows an IVF / IVF-PQ index is trained on (``None``: no training); for IVF, the at most 256 per list FAISS's
    k-means would keep, drawn (seeded)."""
    if index_type not in ("ivf", "ivfpq"):
        return None
    rows = training_rows(n, index_type, params)
    if rows is None:
        limit = _FAISS_POINTS_PER_LIST * int(params["nlist"])
        rows = (np.arange(n) if n <= limit
                else np.sort(np.random.default_rng(1234).choice(n, size=limit, replace=False)))
    return rows


def _batches(files: EmbeddingFiles, batch_rows: int, *, texts: bool) -> Iterator[tuple[Path, list, list | None,
                                                                                         np.ndarray]]:
    """``(part, ids, texts, vectors)`` batches of every part in order."""
    for path in files.paths:
        with _damaged_part(path):
            for ids, part_texts, vectors in dataclasses.replace(files, paths=[path]).batches(batch_rows, texts=texts):
                yield path, ids, part_texts, vectors


@contextmanager
def _damaged_part(path: Path) -> Iterator[None]:
    """Make pyarrow's own errors (ArrowInvalid, OSError) for a damaged page a one-line error naming the part."""
    try:
        yield
    except StPromptsError:
        raise
    except Exception as error:
        raise DataFormatError(f"{path} is damaged: {first_line(error, 200)}") from None


def _first_pass(files: EmbeddingFiles, sample_rows: np.ndarray | None, batch_rows: int,
                progress: bool) -> np.ndarray | None:
    """Check every id (present, an integer or a string, unique across the parts) and gather the training sample
    (normalised, in row order). Only the ids are read when there is nothing to train."""
    sample = None if sample_rows is None else np.empty((len(sample_rows), files.dimension), dtype=np.float32)
    integer_ids: list[np.ndarray] = []
    string_ids: set[str] = set()
    row = taken = 0
    with tqdm(total=files.rows, desc="Checking ids" + (", sampling" if sample is not None else ""), unit="row",
              disable=not progress, dynamic_ncols=True) as bar:
        for path in files.paths:
            if sample is not None:
                batches = ((ids, vectors) for _, ids, _, vectors in
                           _batches(dataclasses.replace(files, paths=[path]), batch_rows, texts=False))
            else:
                batches = _id_batches(path, batch_rows)
            for ids, vectors in batches:
                _check_ids(path, ids, integer_ids, string_ids)
                if sample is not None:
                    end = np.searchsorted(sample_rows, row + len(ids))
                    wanted = sample_rows[taken:end] - row
                    if len(wanted):
                        sample[taken:end] = l2_normalize(vectors[wanted])
                    taken = int(end)
                row += len(ids)
                bar.update(len(ids))
    if integer_ids:
        values = np.sort(np.concatenate(integer_ids))
        twice = values[1:][values[1:] == values[:-1]]
        if len(twice):
            raise DataFormatError(f"the id {int(twice[0])} appears twice in the embedding files "
                                  f"({len(np.unique(twice))} id(s) do): ids must be unique")
    return sample


def _id_batches(path: Path, batch_rows: int) -> Iterator[tuple[list, None]]:
    with _damaged_part(path):
        for batch in open_parquet(path).iter_batches(batch_size=batch_rows, columns=["id"]):
            yield batch.column("id").to_pylist(), None


def _check_ids(path: Path, ids: list, integer_ids: list[np.ndarray], string_ids: set[str]) -> None:
    """Integer ids are gathered (8 bytes each) and checked for repeats at the end; string ids as they come."""
    integers = []
    for doc_id in ids:
        if isinstance(doc_id, str):
            if doc_id in string_ids:
                raise DataFormatError(f"{path}: the id {doc_id[:80]!r} appears twice in the embedding files: ids "
                                      "must be unique")
            string_ids.add(doc_id)
        elif whole(doc_id):
            integers.append(doc_id)
        else:
            raise DataFormatError(f"{path}: an id is {'missing' if doc_id is None else type(doc_id).__name__}; "
                                  "ids must be integers or strings")
    if integers:
        integer_ids.append(np.asarray(integers, dtype=np.int64))


def _fill(files: EmbeddingFiles, faiss_index: faiss.Index, index_type: str, folder: Path, batch_rows: int,
          progress: bool) -> tuple[np.ndarray | None, int]:
    """Second pass: add every vector (normalised) to ``faiss_index`` and write the documents (and IVF-PQ's vectors)
    into ``folder``. Returns the rows IVF's drift statistic is measured on (every ``n // 10,000``-th, as in memory;
    ``None`` for other types) and the count of duplicate texts."""
    n = files.rows
    docs = DocsWriter(folder / DOCS_FILE, folder / OFFSETS_FILE, n)
    vectors_out = NpyRowWriter(folder / VECTORS_FILE, n, files.dimension, np.float16) if index_type == "ivfpq" else None
    step = max(1, n // 10_000)
    drift = [] if index_type in ("ivf", "ivfpq") else None
    digests = np.empty(n, dtype=np.uint64)  # 8-byte hashes of the texts, to count duplicates without keeping them
    row = 0
    bar = tqdm(total=n, desc=f"Adding to {index_type} index", unit="row", disable=not progress, dynamic_ncols=True)
    try:
        for path, ids, texts, vectors in _batches(files, batch_rows, texts=True):
            for position, text in enumerate(texts):
                if not isinstance(text, str) or not text.strip():
                    raise DataFormatError(f"{path}, id {ids[position]!r}: the text is "
                                          f"{'missing' if text is None else 'blank'}; every document needs one")
                digests[row + position] = int.from_bytes(
                    hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
            normalised = l2_normalize(vectors)
            add_vectors(faiss_index, normalised, index_type, progress=False)
            docs.add(ids, texts)
            if vectors_out is not None:
                vectors_out.add(normalised.astype(np.float16))
            if drift is not None:
                first = (-row) % step
                drift.append(normalised[first::step].copy())  # a copy: a view would keep the whole batch alive
            row += len(ids)
            bar.update(len(ids))
    except BaseException:
        docs.discard()  # the staging folder holding them is removed by the save
        if vectors_out is not None:
            vectors_out.discard()
        raise
    finally:
        bar.close()
    docs.close()
    if vectors_out is not None:
        vectors_out.close()
    if faiss_index.ntotal != n:  # pragma: no cover - the parts changed between the passes
        raise DataFormatError(f"the embedding files changed while they were read ({faiss_index.ntotal} of {n} rows)")
    duplicates = int(n - len(np.unique(digests)))
    return (np.concatenate(drift) if drift else None), duplicates


def _calibrate(index_class: Any, faiss_index: faiss.Index, docs: LazyDocs, vectors: NpyRows | None, index_type: str,
               params: dict[str, Any], identity: Any, info: dict[str, Any], target: float,
               queries: Any) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Calibrate the new index on the files just written (no model loaded without text queries); returns the
    calibrated parameters, the record and the warnings to give."""
    wrapped = index_class(faiss_index, docs.ids, docs.texts, index_type=index_type, index_params=dict(params),
                          model_identity=identity if are_texts(queries) else None, info=dict(info), vectors=vectors,
                          read_only=True)
    with warnings.catch_warnings(record=True) as caught:  # given again once the save is done, at the caller's line
        warnings.simplefilter("always", UserWarning)
        record = wrapped.calibrate(target, queries)
    messages = list(dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, UserWarning)))
    return dict(wrapped.index_params), record, messages
