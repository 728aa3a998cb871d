"""Encoding a large corpus in chunks: resumable (each finished chunk cached, keyed by its texts and the model's
fingerprint), optionally over sentence-transformers' multi-process pool."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import numpy as np
from tqdm.auto import tqdm

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.numbers import positive_int
from st_prompts.search.embedding_files import texts_digest
from st_prompts.search.encoding import check_encode_length, encode_texts
from st_prompts.search.identity import ModelIdentity
from st_prompts.storage import write_file_atomic, write_json_atomic

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 10_000  # documents per cached chunk (one .npy file each)
_MANIFEST = "manifest.json"
_CACHE_FORMAT = "st-prompts-encoding-cache"


@dataclass
class ChunkedEncoding:
    """What :func:`encode_in_chunks` did: the L2-normalised float32 embeddings, one row per text, and the chunks
    encoded and read back from the cache."""

    embeddings: np.ndarray
    chunks_total: int
    chunks_encoded: int
    chunks_reused: int


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


def encode_in_chunks(model: SentenceTransformer, texts: Sequence[str], *, kind: str = "document", batch_size: int = 64,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, cache_dir: str | os.PathLike | None = None,
                     processes: int | None = None, pool: dict[str, Any] | None = None, progress: bool = True,
                     task: str | None = None) -> ChunkedEncoding:
    """Encode a (large) corpus chunk by chunk; with ``cache_dir``, every finished chunk is saved there (named after
    its texts' SHA-256; a cache made with another model or chunking is refused), so an interrupted run resumes.

    Args:
        kind: ``"document"`` or ``"query"`` (``model.encode_{kind}``; ``task``: ``encode(task=...)`` instead).
        processes: encode with sentence-transformers' multi-process pool of this many CPU workers. They are
            *spawned* and import the calling script again: guard its top level with ``if __name__ == "__main__":``.
        pool: an already started pool (e.g. over several GPUs), used and left running; overrides ``processes``.
    """
    texts = list(texts)
    check_encode_length(model)
    chunk_size = positive_int(chunk_size, "chunk_size")
    if processes is not None:
        processes = positive_int(processes, "processes")
    starts = list(range(0, len(texts), chunk_size))
    cache = Path(cache_dir) if cache_dir is not None else None
    dimension = None
    if cache is not None:
        identity = ModelIdentity.of(model, task=task)
        dimension = identity.dimension
        _check_manifest(cache, {"format": _CACHE_FORMAT, "model_fingerprint": identity.fingerprint,
                                "dimension": identity.dimension, "kind": kind, "chunk_size": chunk_size,
                                "normalization": "l2"})

    parts: list[np.ndarray] = []
    encoded = reused = 0
    own_pool = None
    bar = tqdm(total=len(texts), desc="Encoding queries" if kind == "query" else "Encoding documents", unit="doc",
               disable=not progress, dynamic_ncols=True)
    try:
        for number, start in enumerate(starts):
            chunk = texts[start : start + chunk_size]
            path = (cache / f"chunk-{number:06d}-{texts_digest(chunk).removeprefix('sha256:')[:16]}.npy"
                    if cache is not None else None)
            array = _load_chunk(path, len(chunk), dimension) if path is not None and path.exists() else None
            if array is not None:
                reused += 1
            else:
                if pool is None and processes is not None and processes > 1 and own_pool is None:
                    # each spawned worker gets its share of the CPU cores (else each starts a thread per core)
                    share = str(max(1, (os.cpu_count() or 1) // processes))
                    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share}):
                        own_pool = model.start_multi_process_pool(["cpu"] * processes)
                array = encode_texts(model, chunk, kind=kind, batch_size=batch_size, progress=False, task=task,
                                     pool=pool or own_pool)
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

