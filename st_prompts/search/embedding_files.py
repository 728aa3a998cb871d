"""Embedding files, written by ``st-prompts embed``, read by ``index build --from-embeddings``: a folder of
``embed.json`` (the run) and ``part-NNNNN.parquet`` parts with the columns ``id`` (int64 or string), ``text`` (optional)
and ``vector`` (fixed-size list of float32, not normalised); each part's record (number, rows, dimension, model,
texts' SHA-256) is in its schema metadata under ``st_prompts``."""

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

from st_prompts.errors import DataFormatError, DataNotFoundError, first_line
from st_prompts.numbers import positive_int, whole
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
    """Write one part atomically; ``record``: its metadata (``rows``, ``dimension``, ``texts_sha256`` added here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[0] != len(ids) or (texts is not None and len(texts) != len(ids)):
        raise DataFormatError(f"a part needs one vector per id: {vectors.shape} for {len(ids)} ids")
    dimension = vectors.shape[1]
    id_array = (pa.array(list(ids), pa.int64()) if all(whole(i) for i in ids)
                else pa.array([str(i) for i in ids], pa.string()))
    columns = {"id": id_array}
    if texts is not None:
        columns["text"] = pa.array(list(texts), pa.string())
    columns["vector"] = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dimension)
    record = {**record, "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "rows": len(ids),
              "dimension": dimension, **({"texts_sha256": texts_digest(texts)} if texts is not None else {})}
    table = pa.table(columns).replace_schema_metadata({METADATA_KEY: json.dumps(record).encode("utf-8")})
    # row groups of ~16 MB of vectors, not one per part: a reader holds a group's whole column chunk while decoding
    group_rows = max(1024, (16 << 20) // (4 * max(1, dimension)))
    return write_file_atomic(path, lambda handle: pq.write_table(table, handle, row_group_size=group_rows))


def open_parquet(path: str | os.PathLike) -> Any:
    """``pyarrow.parquet.ParquetFile`` for reading a file once, batch by batch, with 1 MiB buffered reads and no
    pre-buffering (whose memory stays with the process)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)


def part_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The metadata record of a part, or ``None`` when ``path`` is not a readable part written by this module."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(path).metadata or {}
        record = json.loads(metadata[METADATA_KEY])
    except Exception:  # also pyarrow's own errors (ArrowInvalid: not a Parquet file, a truncated footer)
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT_NAME else None


def expand_paths(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """The part files named by ``patterns``: files, folders (their ``part-*.parquet``) and glob patterns, sorted within
    each pattern, each file once. Raises :class:`DataNotFoundError` for a pattern that names nothing."""
    found: list[Path] = []
    for pattern in patterns:
        text = os.fspath(pattern)
        # a folder's parts, else the glob's matches (of a path without wildcards: itself, if it exists)
        candidates = Path(text).glob("part-*.parquet") if os.path.isdir(text) else map(Path, glob.glob(text))
        matches = sorted(m for m in candidates if m.is_file())
        if not matches:
            raise DataNotFoundError(f"no embedding file matches {text!r}")
        found += [m for m in matches if m not in found]
    return found


@dataclass
class EmbeddingFiles:
    """A set of parts that belong together: one dimension, one model (or none recorded)."""

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
        """``(ids, texts, vectors)`` of up to ``rows`` rows at a time, part after part (``texts=False``: no texts)."""
        rows = positive_int(rows, "rows")
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
