"""Encoding a large corpus in chunks: resumable (each finished chunk is cached, keyed by its texts and the model's
fingerprint) and optionally over sentence-transformers' multi-process pool."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.search.encoding import chat_template_errors, check_encode_length, l2_normalize
from st_prompts.search.identity import ModelIdentity
from st_prompts.storage import write_file_atomic, write_json_atomic

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

#: Documents per cached chunk of :func:`encode_in_chunks` (one ``.npy`` file each).
DEFAULT_CHUNK_SIZE = 10_000
_MANIFEST = "manifest.json"
_CACHE_FORMAT = "st-prompts-encoding-cache"


@dataclass
class ChunkedEncoding:
    """What :func:`encode_in_chunks` did.

    ``embeddings``: the L2-normalised float32 embeddings, one row per text, in order; ``chunks_reused``: chunks read
    back from the cache (encoded by an earlier, possibly interrupted, call).
    """

    embeddings: np.ndarray
    chunks_total: int
    chunks_encoded: int
    chunks_reused: int


def _texts_digest(texts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def _check_manifest(cache_dir: Path, expected: dict[str, Any]) -> None:
    """Create the cache's manifest, or check that an existing one describes the same model, side and chunking."""
    path = cache_dir / _MANIFEST
    if path.exists():
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataFormatError(f"{path} is not valid JSON: {exc}") from exc
        differing = sorted(key for key in expected if found.get(key) != expected[key])
        if differing:
            raise ConfigurationError(
                f"the encoding cache {cache_dir} was made with other settings ({', '.join(differing)} differ: "
                f"{', '.join(f'{k}={found.get(k)!r}' for k in differing)}); its chunks cannot be reused. Use another "
                "cache directory, or delete this one"
            )
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, expected)


def _load_chunk(path: Path, rows: int, dimension: int | None) -> np.ndarray | None:
    """A cached chunk, or ``None`` if it is unreadable or has the wrong shape (it is then encoded again)."""
    try:
        array = np.load(path)
    except (OSError, ValueError, EOFError) as exc:
        logger.warning("ignoring the unreadable cached chunk %s (%s); encoding it again", path, exc)
        return None
    if array.ndim != 2 or array.shape[0] != rows or (dimension is not None and array.shape[1] != dimension):
        logger.warning("ignoring the cached chunk %s of shape %s; encoding it again", path, array.shape)
        return None
    return array.astype(np.float32, copy=False)


@contextmanager
def _threads_per_worker(processes: int) -> Iterator[None]:
    """Give each worker process its share of the CPU cores (spawned workers read ``OMP_NUM_THREADS`` at start):
    without it, every worker would start as many threads as there are cores."""
    share = str(max(1, (os.cpu_count() or 1) // processes))
    previous = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for name in previous:
        os.environ[name] = share
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def encode_in_chunks(
    model: SentenceTransformer,
    texts: Sequence[str],
    *,
    kind: str = "document",
    batch_size: int = 64,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cache_dir: str | os.PathLike | None = None,
    processes: int | None = None,
    pool: dict[str, Any] | None = None,
    progress: bool = True,
    task: str | None = None,
) -> ChunkedEncoding:
    """Encode a (large) corpus chunk by chunk; with ``cache_dir``, every finished chunk is saved there, so that an
    interrupted run resumes where it stopped instead of encoding everything again.

    Args:
        kind: ``"document"`` or ``"query"`` (``model.encode_{kind}`` is used, as in :func:`encode_texts`).
        chunk_size: documents per chunk (one ``chunk-NNNNNN-<digest>.npy`` file each in ``cache_dir``). A chunk file
            is named after the SHA-256 of its texts, so a changed corpus never reuses a stale chunk.
        cache_dir: where to keep the chunks (and a ``manifest.json`` recording the model fingerprint, ``kind`` and
            ``chunk_size``; a cache made with another model or chunking is refused). ``None``: nothing is cached.
        processes: encode with sentence-transformers' multi-process pool of this many CPU workers
            (``model.start_multi_process_pool(["cpu"] * processes)``; each worker gets ``cpu_count // processes``
            threads). ``None`` or ``1``: in this process. The workers are *spawned* processes that import the
            calling script again: a script that uses this must guard its top level with
            ``if __name__ == "__main__":``.
        pool: an already started pool (``model.start_multi_process_pool(...)``, e.g. over several GPUs); it is used
            and left running. Overrides ``processes``.
        task: encode with this prompt set of a bank (``encode(task=...)``) instead of ``encode_{kind}``.
    """
    texts = list(texts)
    check_encode_length(model)
    chunk_size = _positive(chunk_size, "chunk_size")
    if processes is not None:
        processes = _positive(processes, "processes")
    starts = list(range(0, len(texts), chunk_size))
    cache = Path(cache_dir) if cache_dir is not None else None
    dimension = None
    if cache is not None:
        identity = ModelIdentity.of(model, task=task)
        dimension = identity.dimension
        _check_manifest(
            cache,
            {"format": _CACHE_FORMAT, "model_fingerprint": identity.fingerprint, "dimension": identity.dimension,
             "kind": kind, "chunk_size": chunk_size, "normalization": "l2"},
        )  # fmt: skip

    parts: list[np.ndarray] = []
    encoded = reused = 0
    own_pool = None
    bar = tqdm(total=len(texts), desc="Encoding queries" if kind == "query" else "Encoding documents", unit="doc", disable=not progress, dynamic_ncols=True)
    try:
        for number, start in enumerate(starts):
            chunk = texts[start : start + chunk_size]
            path = cache / f"chunk-{number:06d}-{_texts_digest(chunk)[:16]}.npy" if cache is not None else None
            array = _load_chunk(path, len(chunk), dimension) if path is not None and path.exists() else None
            if array is not None:
                reused += 1
            else:
                if pool is None and processes is not None and processes > 1 and own_pool is None:
                    with _threads_per_worker(processes):
                        own_pool = model.start_multi_process_pool(["cpu"] * processes)
                array = _encode_chunk(model, chunk, kind=kind, batch_size=batch_size, pool=pool or own_pool, task=task)
                if path is not None:  # atomically: a chunk file that exists is always complete
                    write_file_atomic(path, lambda handle: np.save(handle, array))
                encoded += 1
            parts.append(array)
            bar.update(len(chunk))
    finally:
        bar.close()
        if own_pool is not None:
            model.stop_multi_process_pool(own_pool)
    if reused:
        logger.info("encoding: %d of %d chunk(s) read from %s, %d encoded", reused, len(starts), cache, encoded)
    embeddings = np.concatenate(parts) if parts else np.zeros((0, dimension or 0), dtype=np.float32)
    return ChunkedEncoding(embeddings, len(starts), encoded, reused)


def _encode_chunk(
    model: SentenceTransformer, texts: list[str], *, kind: str, batch_size: int, pool: dict[str, Any] | None,
    task: str | None = None,
) -> np.ndarray:
    method = getattr(model, f"encode_{kind}", None) or model.encode
    kwargs: dict[str, Any] = {"batch_size": batch_size, "show_progress_bar": False, "convert_to_numpy": True}
    if pool is not None:
        kwargs["pool"] = pool
    if task is not None:
        method, kwargs["task"] = model.encode, task
    with chat_template_errors():
        return l2_normalize(method(texts, **kwargs))


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
