"""Embedding files: a corpus's vectors in Parquet parts, written by ``st-prompts embed`` and read by
``st-prompts index build --from-embeddings`` (and anything else that reads Parquet: Ray Data, pandas, DuckDB).

An embedding folder holds ``embed.json`` (the run: input, model identity, options, part size) and one
``part-NNNNN.parquet`` per ``part_rows`` input rows, each with the columns ``id`` (int64 or string), ``text``
(string; absent when the run kept no texts) and ``vector`` (a fixed-size list of float32, the model's output as
``encode`` gives it: not normalised). Every part carries its own record in the Parquet schema metadata (key
``st_prompts``: part number, first row, rows, dimension, the model's fingerprint and a SHA-256 of its texts), so a part
read alone says what it is, and a resumed run can tell a finished part from a foreign or stale one.

Parquet, and not this package's own ``.npy`` parts, because every engine that scales out reads it (pyarrow is already
installed: ``datasets`` requires it); the writer and reader are pyarrow's, this module only fixes the schema.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, first_line
from st_prompts.search.identity import ModelIdentity
from st_prompts.storage import write_file_atomic

RUN_FILE = "embed.json"
PART_PATTERN = "part-{:05d}.parquet"
FORMAT_NAME = "st-prompts-embeddings"
FORMAT_VERSION = 1
METADATA_KEY = b"st_prompts"


def part_name(number: int) -> str:
    """The file name of part ``number`` (``part-00003.parquet``)."""
    return PART_PATTERN.format(number)


def texts_digest(texts: Sequence[str]) -> str:
    """SHA-256 of ``texts`` (each length-prefixed, so that ``["ab"]`` and ``["a", "b"]`` differ)."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return f"sha256:{digest.hexdigest()}"


def identity_record(identity: ModelIdentity) -> dict[str, Any]:
    """``identity`` as JSON, its probe embeddings included (a few kilobytes), so that a part names its model fully."""
    return {**identity.to_json(), "probe_embeddings": np.asarray(identity.probe_embeddings, np.float32).tolist()}


def identity_from_record(record: dict[str, Any]) -> ModelIdentity:
    """The :class:`ModelIdentity` that :func:`identity_record` wrote."""
    return ModelIdentity.from_json(record, np.asarray(record["probe_embeddings"], dtype=np.float32))


def write_part(path: str | os.PathLike, ids: Sequence[int | str], texts: Sequence[str] | None, vectors: np.ndarray,
               record: dict[str, Any]) -> Path:
    """Write one part atomically (a crash leaves no part or a whole one). ``record``: this part's metadata (see the
    module docstring); ``rows``, ``dimension`` and ``texts_sha256`` are filled in here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[0] != len(ids) or (texts is not None and len(texts) != len(ids)):
        raise DataFormatError(f"a part needs one vector per id: {vectors.shape} for {len(ids)} ids")
    dimension = vectors.shape[1]
    id_array = (pa.array(list(ids), pa.int64()) if all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                else pa.array([str(i) for i in ids], pa.string()))
    columns = {"id": id_array}
    if texts is not None:
        columns["text"] = pa.array(list(texts), pa.string())
    columns["vector"] = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dimension)
    record = {**record, "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "rows": len(ids),
              "dimension": dimension, **({"texts_sha256": texts_digest(texts)} if texts is not None else {})}
    table = pa.table(columns).replace_schema_metadata({METADATA_KEY: json.dumps(record).encode("utf-8")})
    # Row groups of ~16 MB of vectors, not pyarrow's default (a part in one group): a reader holds a whole column
    # chunk of a group while it decodes a batch of it, 154 MB for a part of 100,000 384-dimensional vectors
    group_rows = max(1024, (16 << 20) // (4 * max(1, dimension)))
    return write_file_atomic(path, lambda handle: pq.write_table(table, handle, row_group_size=group_rows))


def open_parquet(path: str | os.PathLike) -> Any:
    """``pyarrow.parquet.ParquetFile`` for reading a file once, batch by batch: no pre-buffering (pyarrow's default
    fetches whole column chunks ahead and its memory stays with the process: reading 4 parts of 100,000
    384-dimensional vectors left RSS 230 MB above the start, 70 MB this way; 2026-11-29, pyarrow 26) and 1 MiB
    buffered reads (for a local disk, where pre-buffering saves no round trips)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)


def part_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The metadata record of a part, or ``None`` when ``path`` is not a readable part written by this module."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(path).metadata or {}
        record = json.loads(metadata[METADATA_KEY])
    except (OSError, KeyError, ValueError, TypeError, AttributeError):
        return None
    except Exception:  # pyarrow's own errors (ArrowInvalid: not a Parquet file, a truncated footer) are not OSErrors
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT_NAME else None


def expand_paths(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """The part files named by ``patterns``: files, folders (their ``part-*.parquet``) and glob patterns, sorted within
    each pattern, each file once. Raises :class:`DataNotFoundError` for a pattern that names nothing."""
    found: list[Path] = []
    for pattern in patterns:
        text = os.fspath(pattern)
        if os.path.isdir(text):
            matches = sorted(Path(text).glob("part-*.parquet"))
        else:
            matches = sorted(Path(p) for p in glob.glob(text)) if glob.has_magic(text) else (
                [Path(text)] if os.path.exists(text) else [])
        matches = [m for m in matches if m.is_file()]
        if not matches:
            raise DataNotFoundError(f"no embedding file matches {text!r}")
        found += [m for m in matches if m not in found]
    return found


@dataclass
class EmbeddingFiles:
    """A set of parts that belong together: one dimension, one model (or none recorded), ids unique across parts is
    the reader's business (an index build checks it)."""

    paths: list[Path]
    dimension: int
    rows: int
    has_texts: bool
    model: dict[str, Any] | None

    @classmethod
    def open(cls, patterns: Sequence[str | os.PathLike]) -> EmbeddingFiles:
        """Check the parts named by ``patterns`` (:func:`expand_paths`) agree, reading only their footers."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        paths = expand_paths(patterns)
        dimension = rows = None
        has_texts = model = None
        total = 0
        for path in paths:
            try:
                schema = pq.read_schema(path)
                rows = pq.ParquetFile(path).metadata.num_rows
            except Exception as error:  # pyarrow raises ArrowInvalid (not OSError) for a damaged footer
                raise DataFormatError(f"{path} is not a readable Parquet file: {first_line(error)}") from None
            field = schema.field("vector") if "vector" in schema.names else None
            if field is None or "id" not in schema.names or not (
                    pa.types.is_fixed_size_list(field.type) or pa.types.is_list(field.type)):
                raise DataFormatError(f"{path} has no 'id' and 'vector' (a list of floats) columns: {schema.names}")
            record = part_record(path) or {}
            part_dimension = (field.type.list_size if pa.types.is_fixed_size_list(field.type)
                              else record.get("dimension"))
            if not isinstance(part_dimension, int) or part_dimension < 1:
                raise DataFormatError(f"{path}: 'vector' is a variable-length list; write it as a fixed-size list")
            if dimension is not None and part_dimension != dimension:
                raise DataFormatError(f"{path} holds {part_dimension}-dimensional vectors, the files before it "
                                      f"{dimension}-dimensional")
            part_model = record.get("model")
            if model is not None and part_model is not None and part_model.get("fingerprint") != model.get(
                    "fingerprint"):
                raise DataFormatError(f"{path} was encoded by another model ({part_model.get('name')!r}) than the "
                                      f"files before it ({model.get('name')!r})")
            texts_here = "text" in schema.names
            if has_texts is not None and texts_here != has_texts:
                raise DataFormatError(f"{path} {'has' if texts_here else 'lacks'} a 'text' column, unlike the "
                                      f"files before it")
            dimension, has_texts, model = part_dimension, texts_here, model or part_model
            total += rows
        return cls(paths=paths, dimension=int(dimension), rows=total, has_texts=bool(has_texts), model=model)

    def identity(self) -> ModelIdentity | None:
        """The recorded model's identity, or ``None`` (vectors of unknown origin: searchable with vectors only)."""
        return identity_from_record(self.model) if self.model and "probe_embeddings" in self.model else None

    def batches(self, rows: int = 65_536, *, texts: bool = True) -> Iterator[tuple[list[Any], list[str] | None,
                                                                                      np.ndarray]]:
        """``(ids, texts, vectors)`` of up to ``rows`` rows at a time, part after part, in file order: memory holds one
        batch, never a whole part. ``texts=False`` skips reading the text column."""
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ConfigurationError(f"rows must be a positive integer, got {rows!r}")
        columns = ["id", "vector"] + (["text"] if texts and self.has_texts else [])
        for path in self.paths:
            for batch in open_parquet(path).iter_batches(batch_size=rows, columns=columns):
                vector = batch.column("vector")
                flat = vector.flatten().to_numpy(zero_copy_only=False)
                if vector.null_count or flat.size != len(batch) * self.dimension:
                    raise DataFormatError(f"{path} holds a missing or short vector")
                values = flat.astype(np.float32, copy=False).reshape(len(batch), self.dimension)
                if not np.isfinite(values).all():
                    raise DataFormatError(f"{path} holds a NaN or infinite vector value")
                text_column = batch.column("text").to_pylist() if "text" in columns else None
                yield batch.column("id").to_pylist(), text_column, values
