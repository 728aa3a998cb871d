"""Checks of a saved index at read time: nothing in its files reaches FAISS, numpy or a printed line unchecked.

* :func:`check_meta` -- every key of ``meta.json`` a command reads: the index type, the document count, the search
  parameters (whole numbers in range: ``nprobe`` NaN, -5 or 1e30 is refused here, not in FAISS), the calibration,
  drift and training records, ``next_id``;
* :func:`check_faiss_index` -- the FAISS index is of the type ``meta.json`` says, with its parameters, and every label
  an IVF list or an HNSW graph holds is a row of the corpus (a label out of range would pick another document or
  read outside the documents);
* :func:`record_files` / :func:`check_files` -- the size and SHA-256 of every file of the index, recorded in
  ``meta.json`` (``files``) when it is written; sizes are checked at every read, the SHA-256 at every full read (the
  file is read whole then anyway), at a memory-mapped read for the files up to :data:`MMAP_HASH_LIMIT`, and by
  ``st-prompts index info --verify``. FAISS has no checksum of its own: a byte flipped in the vectors or codes of an
  index reads and searches without complaint.

Every failure is a :class:`~st_prompts.errors.DataFormatError` of one line naming the file, the key and what to do.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from st_prompts.errors import DataFormatError, shorten

#: The largest ``ef_search`` / ``ef_construction`` an HNSW index takes (FAISS allocates a heap of ``ef`` entries).
MAX_EF = 1 << 20
#: The largest count (documents, ids, re-ranking depth, k) an index file may record.
MAX_COUNT = 2**31 - 1
#: The largest HNSW ``m`` (neighbours per node; each node holds ``2·m`` links at level 0).
MAX_HNSW_M = 256
#: The largest embedding dimension.
MAX_DIMENSION = 1 << 16
REBUILD = "rebuild the index"
_CALIBRATION_FIX = ("delete the \"calibration\" entry of meta.json ('st-prompts index calibrate' measures it again) "
                    "or rebuild the index")
_BLOCK = 1 << 24
#: A memory-mapped load checks the SHA-256 of the files up to this size (a few hundred milliseconds each), larger
#: ones by size and structure only: hashing them would read what memory-mapping is there not to read.
MMAP_HASH_LIMIT = 256 << 20


def bad_value(path: Path, key: str, value: Any, expected: str, fix: str = REBUILD) -> DataFormatError:
    """The one-line error for a bad value of ``key`` in the file ``path``."""
    return DataFormatError(f"{path}: {key} is {shorten(value)}, expected {expected}; the index is damaged: {fix}")


def whole(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` is an ``int`` (not a bool) in ``[low, high]``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def real(value: Any, low: float, high: float) -> bool:
    """Whether ``value`` is a finite ``int``/``float`` (not a bool) in ``[low, high]``."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def _need_int(path: Path, key: str, value: Any, low: int, high: int, fix: str = REBUILD) -> int:
    if not whole(value, low, high):
        raise bad_value(path, key, value, f"a whole number from {low} to {high}", fix)
    return value


def _need_real(path: Path, key: str, value: Any, low: float, high: float, fix: str = REBUILD) -> float:
    if not real(value, low, high):
        raise bad_value(path, key, value, f"a finite number from {low} to {high}", fix)
    return float(value)


def _need_text(path: Path, key: str, value: Any, optional: bool = False, fix: str = REBUILD) -> None:
    if not (isinstance(value, str) or (optional and value is None)):
        raise bad_value(path, key, value, "a string" + (" or null" if optional else ""), fix)


def _need_dict(path: Path, key: str, value: Any, fix: str = REBUILD) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_value(path, key, value, "an object", fix)
    return value


# ---------------------------------------------------------------------------------------------------------- meta.json
def check_meta(path: Path, meta: dict[str, Any], index_types: tuple[str, ...], parameters: dict[str, set]) -> str:
    """Check the keys of ``meta.json`` (at ``path``) that the commands read; return the index type."""
    if "index_type" not in meta:
        raise DataFormatError(f"{path} has no index_type (one of {', '.join(index_types)}); the index is damaged: "
                              f"{REBUILD}")
    index_type = meta["index_type"]
    if index_type not in index_types:
        raise bad_value(path, "index_type", index_type, f"one of {', '.join(index_types)}")
    _need_int(path, "num_docs", meta.get("num_docs"), 1, MAX_COUNT)
    if meta.get("dimension") is not None:
        _need_int(path, "dimension", meta["dimension"], 1, MAX_DIMENSION)
    params = _need_dict(path, "index_params", meta.get("index_params") or {})
    check_params(path, index_type, params, parameters[index_type])
    for key in ("faiss_factory", "source", "id_source", "save_id"):
        if meta.get(key) is not None:
            _need_text(path, key, meta[key])
    for key in ("duplicate_texts", "documents_over_length"):
        if meta.get(key) is not None:
            _need_int(path, key, meta[key], 0, MAX_COUNT)
    if meta.get("next_id") is not None:
        _need_int(path, "next_id", meta["next_id"], 0, 2**63 - 1)
    if meta.get("build_seconds") is not None:
        _need_real(path, "build_seconds", meta["build_seconds"], 0, 1e9)
    if meta.get("bytes_per_vector") is not None:
        for key, value in _need_dict(path, "bytes_per_vector", meta["bytes_per_vector"]).items():
            _need_int(path, f"bytes_per_vector.{shorten(key, 40)}", value, 0, MAX_COUNT)
    if meta.get("ivf_training") is not None:
        record = _need_dict(path, "ivf_training", meta["ivf_training"])
        _need_real(path, "ivf_training.mean_sq_distance", record.get("mean_sq_distance"), 0, 4)
    if meta.get("drift") is not None:
        record = _need_dict(path, "drift", meta["drift"])
        for key in ("last_add_mean_sq_distance", "ratio_to_training"):
            _need_real(path, f"drift.{key}", record.get(key), 0, 1e300)
    if meta.get("calibration") is not None:
        check_calibration(path, meta["calibration"], index_type)
    return index_type


def check_params(path: Path, index_type: str, params: dict[str, Any], allowed: set) -> None:
    """The search parameters of ``meta.json``: exactly the keys of the type, each a whole number in range."""
    keys = set(params)
    if keys != allowed:
        missing, extra = sorted(allowed - keys), sorted(keys - allowed)
        what = (f"lacks {', '.join(missing)}" if missing else "") + ("; " if missing and extra else "") + \
            (f"has unknown keys {shorten(extra, 60)}" if extra else "")
        raise DataFormatError(f"{path}: index_params of a {index_type!r} index {what}; the index is damaged: {REBUILD}")
    ranges = {"nlist": (1, MAX_COUNT), "nprobe": (1, params.get("nlist") if whole(params.get("nlist"), 1, MAX_COUNT)
                                                 else MAX_COUNT),
              "m": (2, MAX_HNSW_M), "ef_construction": (1, MAX_EF), "ef_search": (1, MAX_EF),
              "pq_m": (1, MAX_DIMENSION), "rerank": (0, MAX_COUNT)}  # fmt: skip
    for key, value in params.items():
        if key == "opq":
            if not isinstance(value, bool):
                raise bad_value(path, "index_params.opq", value, "true or false")
        else:
            _need_int(path, f"index_params.{key}", value, *ranges[key])


def check_calibration(path: Path, record: Any, index_type: str) -> None:
    """The calibration record (shown by ``index info``, printed after ``build`` / ``calibrate``)."""
    fix = _CALIBRATION_FIX
    record = _need_dict(path, "calibration", record, fix)
    expected = {"ivf": "nprobe", "ivfpq": "nprobe", "hnsw": "ef_search"}.get(index_type)
    if expected is None or record.get("parameter") != expected:
        raise bad_value(path, "calibration.parameter", record.get("parameter"),
                        repr(expected) if expected else "no calibration (a flat index is exact)", fix)
    _need_int(path, "calibration.value", record.get("value"), 1, MAX_EF if expected == "ef_search" else MAX_COUNT, fix)
    _need_int(path, "calibration.k", record.get("k"), 1, MAX_COUNT, fix)
    _need_real(path, "calibration.measured_recall", record.get("measured_recall"), 0, 1, fix)
    if not real(record.get("target_recall"), 0, 1) or record["target_recall"] == 0:
        raise bad_value(path, "calibration.target_recall", record.get("target_recall"), "a number in (0, 1]", fix)
    if not isinstance(record.get("reached"), bool):
        raise bad_value(path, "calibration.reached", record.get("reached"), "true or false", fix)
    if record.get("lower_bound") is not None:
        _need_real(path, "calibration.lower_bound", record["lower_bound"], -1e6, 1, fix)
    for key in ("num_docs", "rerank"):
        if record.get(key) is not None:
            _need_int(path, f"calibration.{key}", record[key], 0, MAX_COUNT, fix)
    if record.get("caveat") is not None:
        _need_text(path, "calibration.caveat", record["caveat"], fix=fix)
    queries = _need_dict(path, "calibration.queries", record.get("queries") or {}, fix)
    if queries.get("count") is not None:
        _need_int(path, "calibration.queries.count", queries["count"], 0, MAX_COUNT, fix)
    if queries.get("kind") is not None:
        _need_text(path, "calibration.queries.kind", queries["kind"], fix=fix)


def check_model_record(path: Path, record: Any, dimension: int, probe: np.ndarray) -> None:
    """The ``model`` record of ``meta.json`` and its probe embeddings (``probe.npy``)."""
    record = _need_dict(path, "model", record)
    _need_text(path, "model.name", record.get("name"))
    if not record["name"] or len(record["name"]) > 4096:
        raise bad_value(path, "model.name", record["name"], "a model name or path")
    if record.get("dimension") != dimension:
        raise bad_value(path, "model.dimension", record.get("dimension"), f"{dimension} (the FAISS index's)")
    _need_text(path, "model.fingerprint", record.get("fingerprint"))
    for key in ("path", "task"):
        _need_text(path, f"model.{key}", record.get(key), optional=True)
    if record.get("max_seq_length") is not None:
        _need_int(path, "model.max_seq_length", record["max_seq_length"], 1, MAX_COUNT)
    if probe.ndim != 2 or probe.shape[1] != dimension or probe.dtype.kind != "f" or not np.all(np.isfinite(probe)):
        raise DataFormatError(f"{path.parent / 'probe.npy'} holds {probe.dtype} values of shape {probe.shape}, "
                              f"expected finite float32 values of shape (8, {dimension}); the index is damaged: "
                              f"{REBUILD}")


# -------------------------------------------------------------------------------------------------------- index.faiss
def _inner(index: faiss.Index) -> faiss.Index:
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):
        return faiss.downcast_index(index.index)
    return index


def check_faiss_index(file: Path, meta_path: Path, index: faiss.Index, index_type: str,
                      params: dict[str, Any]) -> None:
    """The FAISS index read from ``file`` is of ``index_type`` with ``params`` (from ``meta_path``), measures inner
    products, and every label of its IVF lists / HNSW graph is a row of the corpus."""
    inner = _inner(index)
    expected = {"flat": faiss.IndexFlat, "ivf": faiss.IndexIVFFlat, "hnsw": faiss.IndexHNSWFlat,
                "ivfpq": faiss.IndexIVFPQ}[index_type]  # fmt: skip
    pretransform = isinstance(faiss.downcast_index(index), faiss.IndexPreTransform)
    if not isinstance(inner, expected) or (pretransform and index_type != "ivfpq"):
        found = type(faiss.downcast_index(index)).__name__
        raise DataFormatError(f"{file} holds an index of class {found}, but {meta_path} says index_type "
                              f"{index_type!r}; the index is damaged: {REBUILD}")
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise DataFormatError(f"{file} does not measure inner products (metric {index.metric_type}); the index is "
                              f"damaged: {REBUILD}")
    if not 1 <= index.d <= MAX_DIMENSION:
        raise DataFormatError(f"{file} has dimension {index.d}; the index is damaged: {REBUILD}")
    if index_type in ("ivf", "ivfpq"):
        if inner.nlist != params["nlist"]:
            raise bad_value(meta_path, "index_params.nlist", params["nlist"],
                            f"{inner.nlist} (the lists of {file.name})")
        if index_type == "ivfpq" and (inner.pq.M != params["pq_m"] or pretransform != params["opq"]):
            raise bad_value(meta_path, "index_params.pq_m/opq", [params["pq_m"], params["opq"]],
                            f"[{inner.pq.M}, {str(pretransform).lower()}] (what {file.name} holds)")
        _check_ivf_labels(file, inner, index.ntotal)
    elif index_type == "hnsw":
        if inner.hnsw.nb_neighbors(1) != params["m"]:
            raise bad_value(meta_path, "index_params.m", params["m"], f"{inner.hnsw.nb_neighbors(1)} (what {file.name} "
                            "holds)")
        _check_hnsw_links(file, inner, index.ntotal)


def _check_ivf_labels(file: Path, ivf: faiss.IndexIVF, ntotal: int) -> None:
    """Every row ``0 .. ntotal-1`` is in exactly one inverted list, and no list holds another label."""
    invlists = ivf.invlists
    parts, total = [], 0
    for list_no in range(ivf.nlist):
        size = invlists.list_size(list_no)
        if not size:
            continue
        total += size
        if total > ntotal:
            break
        pointer = invlists.get_ids(list_no)
        try:
            labels = faiss.rev_swig_ptr(pointer, size).copy()
        finally:
            invlists.release_ids(list_no, pointer)
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= ntotal:
            raise DataFormatError(f"{file}: inverted list {list_no} holds the label {high if high >= ntotal else low}, "
                                  f"outside the index's {ntotal} rows; the index is damaged: {REBUILD}")
        parts.append(labels)
    if total != ntotal or (ntotal and np.any(np.bincount(np.concatenate(parts), minlength=ntotal) != 1)):
        raise DataFormatError(f"{file}: its inverted lists hold {total} labels for {ntotal} rows, not each row once; "
                              f"the index is damaged: {REBUILD}")


def _check_hnsw_links(file: Path, index: faiss.IndexHNSW, ntotal: int) -> None:
    """The HNSW graph's levels, offsets, links and entry point stay inside the index's rows and link table."""
    hnsw = index.hnsw
    levels = faiss.vector_to_array(hnsw.levels)
    offsets = faiss.vector_to_array(hnsw.offsets)
    links = hnsw.neighbors.size()
    problem = None
    if len(levels) != ntotal or len(offsets) != ntotal + 1 or index.storage.ntotal != ntotal:
        problem = f"{len(levels)} levels and {len(offsets)} offsets for {ntotal} rows"
    elif ntotal and (levels.min() < 1 or levels.max() != hnsw.max_level + 1
                     or levels.max() >= hnsw.cum_nneighbor_per_level.size()):
        problem = "a level outside the graph"
    elif offsets[0] != 0 or offsets[-1] != links or np.any(
            np.diff(offsets) != faiss.vector_to_array(hnsw.cum_nneighbor_per_level)[levels]):
        problem = "link offsets that do not match its levels"
    elif not -1 <= hnsw.entry_point < max(ntotal, 1) or (ntotal and hnsw.entry_point < 0):
        problem = f"the entry point {hnsw.entry_point}"
    elif links:
        table = faiss.rev_swig_ptr(hnsw.neighbors.data(), links)
        if table.min() < -1 or table.max() >= ntotal:
            problem = "links to rows outside the index"
    if problem:
        raise DataFormatError(f"{file}: its HNSW graph has {problem}; the index is damaged: {REBUILD}")


# ------------------------------------------------------------------------------------------------------ sizes, hashes
def file_digest(path: Path) -> str:
    """The SHA-256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def record_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``meta.json``'s ``files``: the size and SHA-256 of each of ``names`` in ``folder``."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": file_digest(folder / name)}
            for name in names if (folder / name).is_file()}


def check_files(folder: Path, meta_path: Path, record: Any, *, hash_limit: int | None, version: int = 0,
                expected: tuple[str, ...] = ()) -> None:
    """Each file ``meta.json`` records (``files``) has its recorded size and, if it is at most ``hash_limit`` bytes
    (``None``: any size), its SHA-256. An index saved before st-prompts recorded them (format ``version`` < 3) has no
    ``files`` entry: nothing to check. From format 3 on st-prompts records every file it writes, so a ``meta.json``
    without ``files``, or one that leaves out a file of ``expected`` the folder holds, was not written by st-prompts
    (a file could be swapped unseen): refused."""
    if record is None:
        if version >= 3:
            raise DataFormatError(f"{meta_path} records no files (sizes and SHA-256), which every index of format "
                                  f"{version} has: the index was not written by st-prompts; {REBUILD}")
        return
    record = _need_dict(meta_path, "files", record)
    for name, entry in record.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise bad_value(meta_path, "files", name, "file names of the index folder")
        entry = _need_dict(meta_path, f"files.{name}", entry)
        size = _need_int(meta_path, f"files.{name}.bytes", entry.get("bytes"), 0, 2**62)
        digest = entry.get("sha256")
        if not (isinstance(digest, str) and len(digest) == 64):
            raise bad_value(meta_path, f"files.{name}.sha256", digest, "a SHA-256 in hexadecimal")
        path = folder / name
        if not path.is_file():
            raise DataFormatError(f"{folder} is not a complete semantic index: {name} is missing")
        actual = path.stat().st_size
        if actual != size:
            raise DataFormatError(f"{path} is damaged: {actual} bytes, {meta_path.name} recorded {size} when it was "
                                  f"written (files.{name}.bytes); {REBUILD} or restore it from a copy")
        if (hash_limit is None or size <= hash_limit) and file_digest(path) != digest.lower():
            raise DataFormatError(f"{path} is damaged: its SHA-256 differs from the one {meta_path.name} recorded when "
                                  f"it was written (files.{name}.sha256); {REBUILD} or restore it from a copy")
    unrecorded = [name for name in expected if name not in record and (folder / name).is_file()]
    if version >= 3 and unrecorded:
        raise DataFormatError(f"{meta_path} records no size or SHA-256 for {', '.join(unrecorded)}, which st-prompts "
                              f"records for every file it writes: the index was changed by hand; {REBUILD}")
