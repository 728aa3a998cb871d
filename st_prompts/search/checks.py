"""Checks of a saved index at read time: nothing in its files reaches FAISS, numpy or a printed line unchecked
(:func:`check_meta`, :func:`check_faiss_index`, :func:`check_files`: sizes and SHA-256, as FAISS has no checksum).
Every failure is a one-line :class:`~st_prompts.errors.DataFormatError` naming the file, the key and what to do."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from st_prompts.errors import DataFormatError, shorten
from st_prompts.numbers import real, whole

MAX_EF = 1 << 20  # the largest ef_search / ef_construction (FAISS allocates a heap of ef entries)
MAX_COUNT = 2**31 - 1  # the largest count (documents, ids, re-ranking depth, k) an index file may record
MAX_HNSW_M = 256  # each node holds 2·m links at level 0
MAX_DIMENSION = 1 << 16
SEARCH_PARAMETER = {"ivf": "nprobe", "hnsw": "ef_search", "ivfpq": "nprobe"}  # the one calibration sets
REBUILD = "rebuild the index"
_CALIBRATION_FIX = ("delete the \"calibration\" entry of meta.json ('st-prompts index calibrate' measures it again) "
                    "or rebuild the index")
_BLOCK = 1 << 24
#: A memory-mapped load checks the SHA-256 of the files up to this size; hashing larger ones would read what
#: memory-mapping is there not to read.
MMAP_HASH_LIMIT = 256 << 20


def bad_value(path: Path, key: str, value: Any, expected: str, fix: str = REBUILD) -> DataFormatError:
    """The one-line error for a bad value of ``key`` in the file ``path``."""
    return DataFormatError(f"{path}: {key} is {shorten(value)}, expected {expected}; the index is damaged: {fix}")


def _need_int(path: Path, key: str, value: Any, low: int, high: int, fix: str = REBUILD, *,
              absent: bool = False) -> int:
    """``value``, a whole number in ``[low, high]`` (or ``None`` with ``absent``)."""
    if not (whole(value, low, high) or (absent and value is None)):
        raise bad_value(path, key, value, f"a whole number from {low} to {high}", fix)
    return value


def _need_real(path: Path, key: str, value: Any, low: float, high: float, fix: str = REBUILD, *,
               absent: bool = False) -> None:
    if not (real(value, low, high) or (absent and value is None)):
        raise bad_value(path, key, value, f"a finite number from {low} to {high}", fix)


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
    _need_int(path, "dimension", meta.get("dimension"), 1, MAX_DIMENSION, absent=True)
    params = _need_dict(path, "index_params", meta.get("index_params") or {})
    check_params(path, index_type, params, parameters[index_type])
    for key in ("faiss_factory", "source", "id_source", "save_id"):
        if meta.get(key) is not None:
            _need_text(path, key, meta[key])
    for key in ("duplicate_texts", "documents_over_length"):
        _need_int(path, key, meta.get(key), 0, MAX_COUNT, absent=True)
    _need_int(path, "next_id", meta.get("next_id"), 0, 2**63 - 1, absent=True)
    _need_real(path, "build_seconds", meta.get("build_seconds"), 0, 1e9, absent=True)
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
    expected = SEARCH_PARAMETER.get(index_type)
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
    _need_real(path, "calibration.lower_bound", record.get("lower_bound"), -1e6, 1, fix, absent=True)
    for key in ("num_docs", "rerank"):
        _need_int(path, f"calibration.{key}", record.get(key), 0, MAX_COUNT, fix, absent=True)
    if record.get("caveat") is not None:
        _need_text(path, "calibration.caveat", record["caveat"], fix=fix)
    queries = _need_dict(path, "calibration.queries", record.get("queries") or {}, fix)
    _need_int(path, "calibration.queries.count", queries.get("count"), 0, MAX_COUNT, fix, absent=True)
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
    _need_int(path, "model.max_seq_length", record.get("max_seq_length"), 1, MAX_COUNT, absent=True)
    if probe.ndim != 2 or probe.shape[1] != dimension or probe.dtype.kind != "f" or not np.all(np.isfinite(probe)):
        raise DataFormatError(f"{path.parent / 'probe.npy'} holds {probe.dtype} values of shape {probe.shape}, "
                              f"expected finite float32 values of shape (8, {dimension}); the index is damaged: "
                              f"{REBUILD}")


# -------------------------------------------------------------------------------------------------------- index.faiss
def check_faiss_index(file: Path, meta_path: Path, index: faiss.Index, index_type: str,
                      params: dict[str, Any]) -> None:
    """The FAISS index read from ``file`` is of ``index_type`` with ``params`` (from ``meta_path``), measures inner
    products, and every label of its IVF lists / HNSW graph is a row of the corpus."""
    outer = faiss.downcast_index(index)
    pretransform = isinstance(outer, faiss.IndexPreTransform)
    inner = faiss.downcast_index(outer.index) if pretransform else outer
    expected = {"flat": faiss.IndexFlat, "ivf": faiss.IndexIVFFlat, "hnsw": faiss.IndexHNSWFlat,
                "ivfpq": faiss.IndexIVFPQ}[index_type]  # fmt: skip
    if not isinstance(inner, expected) or (pretransform and index_type != "ivfpq"):
        found = type(outer).__name__
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
    (``None``: any size), its SHA-256. From format 3 on, a ``meta.json`` without ``files``, or leaving out a file of
    ``expected`` the folder holds, is refused (a file could be swapped unseen)."""
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
