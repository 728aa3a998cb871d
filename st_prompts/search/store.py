"""Saving and loading an index directory atomically: ``index.faiss``, ``docs.jsonl`` + ``docs.offsets.npy`` (documents
in FAISS order), ``meta.json``, ``probe.npy`` (the model's probe embeddings), ``vectors.npy`` (IVF-PQ, for re-ranking).
Saves carry a manifest, replace only a folder it fully lists, take turns under a lock and get a new ``save_id`` (a
stale update is refused); :func:`load_index_dir` reads again if a save replaced the folder meanwhile."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from st_prompts import __version__
from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, first_line
from st_prompts.search.checks import (MMAP_HASH_LIMIT, bad_value, check_faiss_index, check_files, check_meta,
                                      check_model_record, record_files, whole)
from st_prompts.search.docfile import DocsWriter, LazyDocs, check_offsets, read_docs
from st_prompts.search.faiss_index import (INDEX_TYPES, PARAMETERS, apply_search_params, code_bytes_per_vector,
                                           factory_string)
from st_prompts.search.identity import ModelIdentity
from st_prompts.storage import (INDEX_KIND, MANIFEST_FILE, STAGING_MARKER, check_destination, check_replaceable,
                                contained_path, folder_lock, interrupted_save_hint, manifest_problem, replace_folder,
                                save_in_progress, write_manifest)

logger = logging.getLogger(__name__)

FORMAT_NAME = "st-prompts-semantic-index"
FORMAT_VERSION = 3  # 2: docs.offsets.npy, vectors.npy (IVF-PQ); 3: files (sizes, SHA-256); older ones still load
INDEX_FILE = "index.faiss"
DOCS_FILE = "docs.jsonl"
META_FILE = "meta.json"
PROBE_FILE = "probe.npy"
VECTORS_FILE = "vectors.npy"
OFFSETS_FILE = "docs.offsets.npy"
#: Every file an index saved without a manifest (by an older st-prompts) may hold.
INDEX_FILES = frozenset({INDEX_FILE, DOCS_FILE, META_FILE, PROBE_FILE, VECTORS_FILE, OFFSETS_FILE})
#: The files whose size and SHA-256 ``meta.json`` records (``files``, format 3 on), each written if the index has it.
RECORDED_FILES = (INDEX_FILE, DOCS_FILE, OFFSETS_FILE, VECTORS_FILE, PROBE_FILE)
_META_LIMIT = 16 << 20  # one is a few kilobytes: a larger one is damaged, not read into memory
_READ_RETRY_SECONDS = 5.0  # how long a reader retries while a save replaces the index under it
_OVERWRITE_HINT = "pass overwrite=True / --overwrite to replace it"
_CORE_META_KEYS = frozenset({  # keys of meta.json that make_meta() writes; any other is kept in StoredIndex.info
    "format", "format_version", "model", "dimension", "num_docs", "index_type", "index_params",
    "faiss_factory", "metric", "normalization", "score", "duplicate_texts", "created",
    "st_prompts_version", "faiss_version", "vectors", "bytes_per_vector", "save_id", "files",
})  # fmt: skip


@dataclass
class StoredIndex:
    """The parts of a saved index (as :class:`~st_prompts.search.SemanticIndex` holds them): ``info`` holds the
    extra ``meta.json`` keys, ``save_id`` the save it was read from (``None``: not read, or saved by an old version).
    """
    faiss_index: faiss.Index
    ids: list[int | str]
    texts: list[str]
    index_type: str
    index_params: dict[str, Any]
    model_identity: ModelIdentity | None = None
    info: dict[str, Any] | None = None
    vectors: np.ndarray | None = None
    save_id: str | None = None


def make_meta(stored: StoredIndex, save_id: str | None = None, files: dict[str, Any] | None = None, *,
              duplicate_texts: int | None = None) -> dict[str, Any]:
    """The ``meta.json`` content of ``stored`` (``save_id``: new by default; ``files``: from
    :func:`~st_prompts.search.checks.record_files`; ``duplicate_texts``: counted from ``stored.texts`` by default)."""
    # what one vector costs: FAISS codes + ids in RAM (no HNSW links), and the re-ranking vector on disk
    per_vector = {"faiss_codes_and_ids": code_bytes_per_vector(stored.faiss_index, stored.index_type)}
    if stored.vectors is not None:
        per_vector["rerank_vectors_on_disk"] = int(stored.vectors.dtype.itemsize * stored.vectors.shape[1])
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "model": stored.model_identity.to_json() if stored.model_identity is not None else None,
        "dimension": int(stored.faiss_index.d), "num_docs": len(stored.ids), "index_type": stored.index_type,
        "index_params": stored.index_params, "faiss_factory": factory_string(stored.index_type, stored.index_params),
        "metric": "inner_product", "normalization": "l2", "score": "cosine",
        "duplicate_texts": len(stored.texts) - len(set(stored.texts)) if duplicate_texts is None else duplicate_texts,
        "bytes_per_vector": per_vector,
        "vectors": ({"file": VECTORS_FILE, "dtype": str(stored.vectors.dtype), "use": "exact re-ranking"}
                    if stored.vectors is not None else None),
        **(stored.info or {}),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "save_id": save_id or uuid.uuid4().hex,
        "st_prompts_version": __version__, "faiss_version": getattr(faiss, "__version__", None),
        **({"files": files} if files is not None else {}),
    }


def index_folder_problem(folder: str | os.PathLike, *, legacy: bool = False) -> str | None:
    """``None`` if ``folder`` is a semantic index st-prompts wrote (its manifest lists everything in it); else why it
    may not be replaced. With ``legacy`` (saving back where it was loaded from), an index saved before manifests
    passes when it holds only an index's own files and a ``meta.json`` describing one.
    """
    folder = Path(folder)
    if legacy and not os.path.lexists(folder / MANIFEST_FILE):
        return _legacy_index_problem(folder)
    reason = manifest_problem(folder, index=True)
    if reason is not None and not os.path.lexists(folder / MANIFEST_FILE) and _legacy_index_problem(folder) is None:
        return (f"it has no {MANIFEST_FILE}, the proof that st-prompts wrote it (indexes saved by an older st-prompts "
                "get one at their next 'st-prompts index add', 'remove' or 'calibrate'; if it is such an index and "
                "you want it rebuilt, delete it yourself)")
    return reason


def _legacy_index_problem(folder: Path) -> str | None:
    """The ownership rule of indexes saved without a manifest (see :func:`index_folder_problem`)."""
    extra = sorted(entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else "")
                   for entry in folder.iterdir()
                   if entry.name not in INDEX_FILES | {STAGING_MARKER} or entry.is_symlink() or not entry.is_file())
    if extra:
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        return f"it holds files that are not part of a semantic index ({shown})"
    try:
        read_meta(folder)
    except (OSError, DataFormatError):
        return f"it is not a semantic index (no {META_FILE} describing one)"
    return None


def check_index_destination(directory: str | os.PathLike, overwrite: bool) -> None:
    """Refuse, before any work, a folder an index may not be saved to (the rules of :func:`save_index_dir`)."""
    check_replaceable(check_destination(directory), index_folder_problem, overwrite, "an index", _OVERWRITE_HINT)


def save_index_dir(stored: StoredIndex, directory: str | os.PathLike, *, overwrite: bool = True,
                   expected_save_id: str | None = None, updating: bool = False) -> tuple[Path, str]:
    """Write ``stored`` to ``directory`` atomically; return the directory and the new ``save_id``.

    An existing index is replaced (unless ``overwrite=False``) only when :func:`index_folder_problem` finds none
    (``updating``: ``stored`` was loaded from ``directory``), else :class:`ConfigurationError`; so is a save whose
    ``expected_save_id`` is no longer the one on disk.
    """
    save_id = uuid.uuid4().hex

    def write(tmp: Path) -> None:
        faiss.write_index(stored.faiss_index, str(tmp / INDEX_FILE))
        docs = DocsWriter(tmp / DOCS_FILE, tmp / OFFSETS_FILE, len(stored.ids))
        docs.add(stored.ids, stored.texts)
        docs.close()
        if stored.vectors is not None:
            _save_array(tmp / VECTORS_FILE, stored.vectors)
        finish_index_folder(tmp, stored, save_id)

    target = write_index_folder(directory, write, overwrite=overwrite, expected_save_id=expected_save_id,
                                updating=updating)
    return target, save_id


def finish_index_folder(tmp: Path, stored: StoredIndex, save_id: str, *, duplicate_texts: int | None = None) -> None:
    """Complete an index folder whose ``index.faiss``, documents (and vectors) are written: ``probe.npy``,
    ``meta.json`` and the manifest."""
    if stored.model_identity is not None:
        np.save(tmp / PROBE_FILE, stored.model_identity.probe_embeddings.astype(np.float32))
    with (tmp / META_FILE).open("w", encoding="utf-8") as handle:
        files = record_files(tmp, list(RECORDED_FILES))
        json.dump(make_meta(stored, save_id, files, duplicate_texts=duplicate_texts), handle, indent=2,
                  ensure_ascii=False)
        handle.write("\n")
    write_manifest(tmp, INDEX_KIND)  # the proof that st-prompts wrote it, listing every file written above


def write_index_folder(directory: str | os.PathLike, write: Callable[[Path], None], *, overwrite: bool,
                       expected_save_id: str | None = None, updating: bool = False) -> Path:
    """Put the folder that ``write(staging_folder)`` fills (ending with :func:`finish_index_folder`) at
    ``directory``, atomically and under its lock, with the rules of :func:`save_index_dir`."""
    ownership = partial(index_folder_problem, legacy=updating)
    target = Path(directory)
    with folder_lock(check_destination(target)):
        check_replaceable(check_destination(target), ownership, overwrite, "an index", _OVERWRITE_HINT)
        if expected_save_id is not None and (target / META_FILE).is_file() and (
                _read_save_id(target) != expected_save_id):
            raise ConfigurationError(f"the index at {directory} was changed by another process since it was loaded; "
                                     "load it again and redo the update (SemanticIndex.update() holds the index's "
                                     "lock from load to save)")
        replace_folder(target, write, ownership=ownership, overwrite=overwrite, what="an index",
                       overwrite_hint=_OVERWRITE_HINT, lock=False)
    return target


def _read_save_id(root: Path) -> str | None:
    try:
        return json.loads((root / META_FILE).read_text(encoding="utf-8")).get("save_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


def _save_array(path: Path, array: np.ndarray, rows_per_write: int = 65_536) -> None:
    """``np.save`` in pieces, so that a memory-mapped source is never read into RAM whole."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=array.dtype, shape=array.shape)
    for start in range(0, len(array), rows_per_write):
        out[start : start + rows_per_write] = array[start : start + rows_per_write]
    out.flush()


def load_index_dir(directory: str | os.PathLike, *, mmap: bool = False, verify: bool | None = None) -> StoredIndex:
    """Read an index directory written by :func:`save_index_dir`, checking that it is complete and consistent.

    ``mmap=True`` memory-maps the FAISS index, ``vectors.npy`` and the documents (:class:`LazyDocs`). Each file's
    SHA-256 is checked with ``verify=True``, none with ``False``; by default every file of a full load, those up to
    :data:`~st_prompts.search.checks.MMAP_HASH_LIMIT` of a memory-mapped one. No lock is taken: a read that a save
    overlapped (the folder's inode or ``save_id`` changed) is repeated.

    Raises:
        DataNotFoundError: the directory does not exist.
        DataFormatError: it is not a complete, consistent semantic index (or was written by a newer version), or one
            of its files is damaged.
    """
    root = Path(directory)
    deadline = time.monotonic() + _READ_RETRY_SECONDS
    while True:
        before = _snapshot(root)
        try:
            if before is None:
                raise FileNotFoundError(root)
            limit = (MMAP_HASH_LIMIT if mmap else None) if verify is None else (None if verify else -1)
            stored = _read_index(root, mmap, limit)
        except (FileNotFoundError, DataFormatError):
            # a missing folder is waited for only while a save holds its lock (not for a mistyped path)
            missing = before is None and not save_in_progress(root) and _snapshot(root) is None  # in this order
            if missing or _snapshot(root) == before and before is not None or time.monotonic() > deadline:
                if not root.exists():
                    raise DataNotFoundError(f"index directory not found: {root}{interrupted_save_hint(root)}")
                raise  # the folder did not change while it was read: it is damaged
            time.sleep(0.02)  # a save replaced it while it was read: read the new one
            continue
        if _snapshot(root) == before:
            return stored
        if time.monotonic() > deadline:  # pragma: no cover - a save every few milliseconds for seconds on end
            raise DataFormatError(f"{root} kept changing while it was read; try again")


def _snapshot(root: Path) -> tuple[int, int, str | None] | None:
    """The folder's inode, device and ``save_id`` (``None``: absent)."""
    try:
        status = os.stat(root)
    except OSError:
        return None
    return status.st_ino, status.st_dev, _read_save_id(root)


def _load_array(path: Path, mmap: bool = False) -> np.ndarray:
    """``np.load`` of an index file; a damaged file is a :class:`DataFormatError` naming it."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError, MemoryError) as exc:
        reason = first_line(exc, 200)
        raise DataFormatError(f"{path} is damaged ({reason}); rebuild the index") from exc


def _read_index(root: Path, mmap: bool, hash_limit: int | None) -> StoredIndex:
    """One read of every file of the index at ``root``, each checked."""
    if not root.is_dir():
        raise DataFormatError(f"{root} is not an index directory (expected {META_FILE}, {INDEX_FILE}, ...)")
    for name in (META_FILE, INDEX_FILE, DOCS_FILE):
        if not (root / name).is_file():
            raise DataFormatError(f"{root} is not a complete semantic index: {name} is missing")
    meta = read_meta(root)
    meta_path = root / META_FILE
    index_type = check_meta(meta_path, meta, INDEX_TYPES, PARAMETERS)
    check_files(root, meta_path, meta.get("files"), hash_limit=hash_limit, version=meta.get("format_version", 0),
                expected=RECORDED_FILES)  # sizes (and hashes) before any parsing
    try:
        # IO_FLAG_MMAP maps IVF lists; flat codes (also HNSW's storage) need IO_FLAG_MMAP_IFC (faiss 1.15)
        flags = faiss.IO_FLAG_MMAP if index_type in ("ivf", "ivfpq") else faiss.IO_FLAG_MMAP_IFC
        faiss_index = faiss.read_index(str(root / INDEX_FILE), flags | faiss.IO_FLAG_READ_ONLY if mmap else 0)
    except (RuntimeError, MemoryError, OverflowError) as exc:
        if not (root / INDEX_FILE).is_file():
            raise FileNotFoundError(root / INDEX_FILE) from exc
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        raise DataFormatError(f"cannot read {root / INDEX_FILE} ({reason}); the index is damaged: rebuild it") from exc
    params = dict(meta.get("index_params") or {})
    check_faiss_index(root / INDEX_FILE, meta_path, faiss_index, index_type, params)
    num_docs = meta["num_docs"]
    if faiss_index.ntotal != num_docs:
        raise DataFormatError(f"{root} is inconsistent: {INDEX_FILE} holds {faiss_index.ntotal} vectors, {META_FILE} "
                              f"says {num_docs}; rebuild the index")
    if mmap and (root / OFFSETS_FILE).is_file():
        offsets = _load_array(root / OFFSETS_FILE, mmap=True)
        docs = LazyDocs(root / DOCS_FILE, offsets)
        check_offsets(offsets, root / OFFSETS_FILE, num_docs, docs.size)
        ids, texts = docs.ids, docs.texts
    else:
        ids, texts = read_docs(root / DOCS_FILE)
    if not (faiss_index.ntotal == len(ids) == num_docs):
        raise DataFormatError(f"{root} is inconsistent: {faiss_index.ntotal} vectors, {len(ids)} documents, "
                              f"{META_FILE} says {num_docs}; rebuild the index")
    identity = None
    if meta.get("model") is not None:
        if not (root / PROBE_FILE).is_file():
            raise DataFormatError(f"{root} is not a complete semantic index: {PROBE_FILE} is missing")
        probe = _load_array(root / PROBE_FILE)
        check_model_record(meta_path, meta["model"], faiss_index.d, probe)
        identity = ModelIdentity.from_json(meta["model"], probe.astype(np.float32))
    apply_search_params(faiss_index, index_type, params)
    vectors = None
    if meta.get("vectors"):
        record = meta["vectors"]
        if not isinstance(record, dict):
            raise DataFormatError(f"{meta_path}: bad vectors record; rebuild the index")
        path = contained_path(root, record.get("file", VECTORS_FILE), f"{meta_path} (vectors.file)")
        if not path.is_file():
            raise DataFormatError(f"{root} is not a complete semantic index: {path.name} is missing")
        vectors = _load_array(path, mmap=mmap)
        if vectors.ndim != 2 or vectors.shape != (len(ids), faiss_index.d) or vectors.dtype.kind != "f":
            raise DataFormatError(f"{path} holds {vectors.dtype} values of shape {vectors.shape}, expected floats of "
                                  f"shape ({len(ids)}, {faiss_index.d}); rebuild the index")
    elif index_type == "ivfpq" and params["rerank"] > 0:
        raise DataFormatError(f"{meta_path}: an IVF-PQ index that re-ranks (index_params.rerank) records no vectors "
                              "file; rebuild the index")
    info = {key: value for key, value in meta.items() if key not in _CORE_META_KEYS}
    return StoredIndex(faiss_index, ids, texts, index_type, params, identity, info, vectors, meta.get("save_id"))


def read_meta(root: Path) -> dict[str, Any]:
    """The ``meta.json`` of the index directory ``root``, checked to describe a semantic index this version reads."""
    size = (root / META_FILE).stat().st_size
    if size > _META_LIMIT:
        raise DataFormatError(f"{root / META_FILE} is {size} bytes; an index's is a few kilobytes: it is damaged, "
                              "rebuild the index")
    try:
        meta = json.loads((root / META_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise DataFormatError(f"{root / META_FILE} is not valid JSON ({reason}); rebuild the index") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataFormatError(f"{root / META_FILE} does not describe a st-prompts semantic index")
    version = meta.get("format_version", 0)
    if not whole(version, 0, 2**31):
        raise bad_value(root / META_FILE, "format_version", version, "a whole number")
    if version > FORMAT_VERSION:
        raise DataFormatError(f"{root} was written by a newer st-prompts (format {version} > {FORMAT_VERSION}): "
                              "upgrade st-prompts to read it")
    return meta
