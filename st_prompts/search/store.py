"""Saving and loading an index directory, atomically.

A saved index is a directory holding ``index.faiss`` (the FAISS index), ``docs.jsonl`` (one ``{"id", "text"}`` per
row, in FAISS order), ``docs.offsets.npy`` (the byte offset of every line of ``docs.jsonl``, so that a memory-mapped
index reads only the documents it returns), ``meta.json`` (format, model identity, index type and parameters,
calibration, ...), ``probe.npy`` (the model's probe-sentence embeddings; absent for an index built from bare
embeddings) and, for an IVF-PQ index, ``vectors.npy`` (the normalised vectors in float16, for exact re-ranking). The
files are written into a temporary directory next to the target, which is then renamed into place, so an
interrupted save (or :meth:`~st_prompts.search.SemanticIndex.add` followed by a save) never leaves a half-written
index.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError
from st_prompts.search.faiss_index import INDEX_TYPES, apply_search_params, factory_string
from st_prompts.search.identity import ModelIdentity

if TYPE_CHECKING:  # pragma: no cover
    import faiss

logger = logging.getLogger(__name__)

FORMAT_NAME = "st-prompts-semantic-index"
FORMAT_VERSION = 2  # 2: docs.offsets.npy, vectors.npy (IVF-PQ); version-1 indexes still load
INDEX_FILE = "index.faiss"
DOCS_FILE = "docs.jsonl"
META_FILE = "meta.json"
PROBE_FILE = "probe.npy"
VECTORS_FILE = "vectors.npy"
OFFSETS_FILE = "docs.offsets.npy"
# Keys of meta.json written by make_meta() itself; any other key is kept in StoredIndex.info.
_CORE_META_KEYS = frozenset(
    {
        "format", "format_version", "model", "dimension", "num_docs", "index_type", "index_params",
        "faiss_factory", "metric", "normalization", "score", "duplicate_texts", "created",
        "st_prompts_version", "faiss_version", "vectors", "bytes_per_vector",
    }
)  # fmt: skip


@dataclass
class StoredIndex:
    """The parts of a saved index (see :func:`save_index_dir` / :func:`load_index_dir`).

    Attributes:
        faiss_index: the FAISS index (row ``i`` is document ``ids[i]``), search parameters applied.
        ids, texts: the documents, in FAISS order.
        index_type, index_params: ``"flat"``/``"ivf"``/``"hnsw"`` and the resolved parameters.
        model_identity: the encoding model, or ``None`` for an index built from bare embeddings.
        info: extra ``meta.json`` keys (e.g. ``id_source``, ``source``, ``calibration``).
        vectors: the re-ranking vectors of an IVF-PQ index (float16), else ``None``.
    """

    faiss_index: faiss.Index
    ids: list[int | str]
    texts: list[str]
    index_type: str
    index_params: dict[str, Any]
    model_identity: ModelIdentity | None = None
    info: dict[str, Any] | None = None
    vectors: np.ndarray | None = None


def make_meta(stored: StoredIndex) -> dict[str, Any]:
    """The ``meta.json`` content of ``stored``."""
    import faiss

    from st_prompts import __version__

    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model": stored.model_identity.to_json() if stored.model_identity is not None else None,
        "dimension": int(stored.faiss_index.d),
        "num_docs": len(stored.ids),
        "index_type": stored.index_type,
        "index_params": stored.index_params,
        "faiss_factory": factory_string(stored.index_type, stored.index_params),
        "metric": "inner_product",
        "normalization": "l2",
        "score": "cosine",
        "duplicate_texts": len(stored.texts) - len(set(stored.texts)),
        "bytes_per_vector": _bytes_per_vector(stored),
        "vectors": (
            {"file": VECTORS_FILE, "dtype": str(stored.vectors.dtype), "use": "exact re-ranking"}
            if stored.vectors is not None else None
        ),
        **(stored.info or {}),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "st_prompts_version": __version__,
        "faiss_version": getattr(faiss, "__version__", None),
    }


def _bytes_per_vector(stored: StoredIndex) -> dict[str, Any]:
    """What one vector costs: the FAISS codes + ids kept in RAM when searching (graph links of HNSW not included),
    and the re-ranking vector kept on disk (memory-mapped, read only for candidates)."""
    from st_prompts.search.faiss_index import code_bytes_per_vector

    out: dict[str, Any] = {"faiss_codes_and_ids": code_bytes_per_vector(stored.faiss_index, stored.index_type)}
    if stored.vectors is not None:
        out["rerank_vectors_on_disk"] = int(stored.vectors.dtype.itemsize * stored.vectors.shape[1])
    return out


def save_index_dir(stored: StoredIndex, directory: str | os.PathLike, *, overwrite: bool = True) -> Path:
    """Write ``stored`` to ``directory`` atomically; return the directory.

    An existing index at ``directory`` is replaced (unless ``overwrite=False``); an existing directory that is not
    empty and not an index is never touched (:class:`ConfigurationError`).
    """
    import faiss

    target = Path(directory)
    if target.exists():
        if not target.is_dir():
            raise ConfigurationError(f"cannot save the index to {target}: it exists and is not a directory")
        if not overwrite:
            raise ConfigurationError(f"{target} already exists (pass overwrite=True / --overwrite to replace it)")
        if any(target.iterdir()) and not (target / META_FILE).is_file():
            raise ConfigurationError(
                f"refusing to replace {target}: it is a non-empty directory that is not a semantic index"
            )
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        faiss.write_index(stored.faiss_index, str(tmp / INDEX_FILE))
        offsets = np.empty(len(stored.ids) + 1, dtype=np.int64)
        with (tmp / DOCS_FILE).open("wb") as handle:
            position = 0
            for row, (doc_id, text) in enumerate(zip(stored.ids, stored.texts)):
                offsets[row] = position
                line = (json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n").encode("utf-8")
                handle.write(line)
                position += len(line)
            offsets[-1] = position
        np.save(tmp / OFFSETS_FILE, offsets)
        if stored.vectors is not None:
            _save_array(tmp / VECTORS_FILE, stored.vectors)
        if stored.model_identity is not None:
            np.save(tmp / PROBE_FILE, stored.model_identity.probe_embeddings.astype(np.float32))
        with (tmp / META_FILE).open("w", encoding="utf-8") as handle:
            json.dump(make_meta(stored), handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        for name in os.listdir(tmp):
            _fsync(tmp / name)
        os.chmod(tmp, 0o755)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _save_array(path: Path, array: np.ndarray, rows_per_write: int = 65_536) -> None:
    """``np.save`` in pieces, so that a memory-mapped source is never read into RAM whole."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=array.dtype, shape=array.shape)
    for start in range(0, len(array), rows_per_write):
        out[start : start + rows_per_write] = array[start : start + rows_per_write]
    out.flush()
    del out


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` is moved aside first and restored if that fails."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def load_index_dir(directory: str | os.PathLike, *, mmap: bool = False) -> StoredIndex:
    """Read an index directory written by :func:`save_index_dir`, checking that it is complete and consistent.

    With ``mmap=True`` the FAISS index is read with ``faiss.IO_FLAG_MMAP`` (its inverted lists / codes stay in the
    file and are paged in on demand), ``vectors.npy`` is memory-mapped and the documents are :class:`LazyDocs` views
    that read ``docs.jsonl`` line by line through ``docs.offsets.npy``.

    Raises:
        DataNotFoundError: the directory does not exist.
        DataFormatError: it is not a complete, consistent semantic index (or was written by a newer version).
    """
    import faiss

    root = Path(directory)
    if not root.exists():
        raise DataNotFoundError(f"index directory not found: {root}")
    if not root.is_dir():
        raise DataFormatError(f"{root} is not an index directory (expected {META_FILE}, {INDEX_FILE}, ...)")
    for name in (META_FILE, INDEX_FILE, DOCS_FILE):
        if not (root / name).is_file():
            raise DataFormatError(f"{root} is not a complete semantic index: {name} is missing")
    meta = read_meta(root)
    try:
        faiss_index = faiss.read_index(str(root / INDEX_FILE), _mmap_flags(meta.get("index_type")) if mmap else 0)
    except RuntimeError as exc:
        raise DataFormatError(f"cannot read {root / INDEX_FILE}: {str(exc).strip().splitlines()[-1]}") from exc
    if mmap and (root / OFFSETS_FILE).is_file():
        docs = LazyDocs(root / DOCS_FILE, np.load(root / OFFSETS_FILE, mmap_mode="r"))
        ids, texts = docs.ids, docs.texts
    else:
        ids, texts = _read_docs(root / DOCS_FILE)
    if not (faiss_index.ntotal == len(ids) == meta.get("num_docs")):
        raise DataFormatError(
            f"{root} is inconsistent: {faiss_index.ntotal} vectors, {len(ids)} documents, "
            f"meta.json says {meta.get('num_docs')}"
        )
    identity = None
    if meta.get("model") is not None:
        if not (root / PROBE_FILE).is_file():
            raise DataFormatError(f"{root} is not a complete semantic index: {PROBE_FILE} is missing")
        identity = ModelIdentity.from_json(meta["model"], np.load(root / PROBE_FILE))
    index_type = meta["index_type"]
    params = dict(meta.get("index_params") or {})
    if index_type not in INDEX_TYPES:
        raise DataFormatError(f"{root / META_FILE}: unknown index_type {index_type!r}")
    if params:
        apply_search_params(faiss_index, index_type, params)
    vectors = None
    if meta.get("vectors"):
        path = root / meta["vectors"].get("file", VECTORS_FILE)
        if not path.is_file():
            raise DataFormatError(f"{root} is not a complete semantic index: {path.name} is missing")
        try:
            vectors = np.load(path, mmap_mode="r" if mmap else None)
        except (OSError, ValueError) as exc:
            raise DataFormatError(f"cannot read {path}: {exc}") from exc
        if vectors.ndim != 2 or vectors.shape != (len(ids), faiss_index.d):
            raise DataFormatError(f"{path} has shape {vectors.shape}, expected ({len(ids)}, {faiss_index.d})")
    info = {key: value for key, value in meta.items() if key not in _CORE_META_KEYS}
    return StoredIndex(faiss_index, ids, texts, index_type, params, identity, info, vectors)


def _mmap_flags(index_type: str | None) -> int:
    """FAISS read flags that map an index's bulk data instead of reading it (checked with faiss 1.15):
    ``IO_FLAG_MMAP`` maps the inverted lists of IVF / IVF-PQ (``OnDiskInvertedLists``); flat codes (also an HNSW
    graph's flat storage) need ``IO_FLAG_MMAP_IFC`` instead (``IO_FLAG_MMAP`` alone reads them into RAM)."""
    import faiss

    if index_type in ("ivf", "ivfpq"):
        return faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY
    return faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


class LazyDocs:
    """The documents of a saved index, read from ``docs.jsonl`` on demand (one seek + one line per access) through
    the byte offsets in ``docs.offsets.npy``: what a memory-mapped index uses instead of lists in RAM."""

    def __init__(self, path: Path, offsets: np.ndarray) -> None:
        self.path = path
        self.offsets = offsets
        self.ids = _LazyColumn(self, "id")
        self.texts = _LazyColumn(self, "text")
        self._handle = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def record(self, row: int) -> dict[str, Any]:
        if not 0 <= row < len(self):
            raise IndexError(row)
        if self._handle is None:
            self._handle = self.path.open("rb")
        self._handle.seek(int(self.offsets[row]))
        line = self._handle.read(int(self.offsets[row + 1] - self.offsets[row]))
        try:
            return json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataFormatError(f"{self.path}: bad record at row {row} ({exc})") from exc


class _LazyColumn:
    """A read-only sequence of one field of :class:`LazyDocs` (``ids`` or ``texts``)."""

    def __init__(self, docs: LazyDocs, key: str) -> None:
        self._docs = docs
        self._key = key

    def __len__(self) -> int:
        return len(self._docs)

    def __getitem__(self, row: int) -> Any:
        if isinstance(row, slice):
            return [self[i] for i in range(*row.indices(len(self)))]
        return self._docs.record(int(row))[self._key]

    def __iter__(self):
        for row in range(len(self)):
            yield self[row]


def read_meta(root: Path) -> dict[str, Any]:
    """The ``meta.json`` of the index directory ``root``, checked to describe a semantic index this version reads."""
    try:
        meta = json.loads((root / META_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataFormatError(f"{root / META_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataFormatError(f"{root / META_FILE} does not describe a st-prompts semantic index")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise DataFormatError(
            f"{root} was written by a newer st-prompts (format {meta['format_version']} > {FORMAT_VERSION})"
        )
    return meta


def _read_docs(path: Path) -> tuple[list[int | str], list[str]]:
    ids, texts = [], []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                record = json.loads(line)
                ids.append(record["id"])
                texts.append(record["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DataFormatError(f"{path}, line {number}: bad record ({exc})") from exc
    return ids, texts


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
