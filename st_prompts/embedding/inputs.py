"""Reading a corpus to embed in parts, never whole: a text file (one document a line), JSON lines or Parquet. A part
is ``part_rows`` consecutive input rows (blank ones dropped but counted), so part ``k`` always covers the same rows;
it has a *locator* (a byte or row range: a Ray worker reads it alone) and a digest of its rows (:func:`rows_digest`).
Ids: 1-based line numbers (text), 0-based rows (JSON lines, Parquet) or the ``id_column``'s."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, shorten
from st_prompts.search.embedding_files import open_parquet

#: Input kinds by file suffix; any other file is a text file with one document a line.
SUFFIX_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class InputSource:
    """Where the documents come from and which columns hold them (columns: JSON lines and Parquet only)."""

    path: str
    kind: str  # "text", "jsonl" or "parquet"
    text_column: str = "text"
    id_column: str | None = None
    task_column: str | None = None

    @classmethod
    def of(cls, path: str | os.PathLike, text_column: str = "text", id_column: str | None = None,
           task_column: str | None = None) -> InputSource:
        """Check ``path`` and the columns for its kind (one-line errors) and describe it."""
        path = Path(path)
        if not path.exists():
            raise DataNotFoundError(f"input file not found: {path}")
        if path.is_dir():
            raise DataFormatError(f"the input must be a file (text, .jsonl or .parquet), got a folder: {path}")
        kind = SUFFIX_KINDS.get(path.suffix.lower(), "text")
        if path.suffix.lower() == ".csv":
            raise ConfigurationError(f"{path}: CSV is not read in parts; convert it to .parquet or .jsonl")
        if kind == "text" and (id_column is not None or task_column is not None or text_column != "text"):
            raise ConfigurationError(f"--text-column, --id-column and --task-column need a .jsonl or .parquet input, "
                                     f"not the text file {path}")
        source = cls(os.path.abspath(path), kind, text_column, id_column, task_column)
        if kind == "parquet":
            _check_parquet_columns(source)
        return source

    def columns(self) -> list[str]:
        """The columns read from a JSON-lines or Parquet input."""
        return [c for c in (self.text_column, self.id_column, self.task_column) if c is not None]


@dataclass
class InputPart:
    """One part of the input: its kept rows (blank documents dropped) and where it lies in the file."""

    number: int
    first_row: int  # 0-based input row of its first row (blank or not)
    input_rows: int  # input rows it covers, blank ones included
    ids: list[int | str]
    texts: list[str]
    tasks: list[str | None] | None  # one per kept row with a task column, else None
    locator: dict[str, int] = field(default_factory=dict)
    blank: int = 0

    @property
    def digest(self) -> str:
        """:func:`rows_digest` of this part's rows."""
        return rows_digest(self.ids, self.texts, self.tasks)


def rows_digest(ids: Sequence[int | str], texts: Sequence[str], tasks: Sequence[str | None] | None) -> str:
    """SHA-256 of the rows (each id, text and task JSON-encoded and length-prefixed): equal digests, equal rows."""
    digest = hashlib.sha256()
    for i, (doc_id, text) in enumerate(zip(ids, texts)):
        data = json.dumps([doc_id, text, tasks[i] if tasks is not None else None], ensure_ascii=False).encode(
            "utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    digest.update(len(ids).to_bytes(8, "little"))
    return f"sha256:{digest.hexdigest()}"


def read_parts(source: InputSource, part_rows: int) -> Iterator[InputPart]:
    """The input's parts in order, ``part_rows`` input rows each (the last one shorter): one part in memory."""
    if source.kind == "parquet":
        yield from _parquet_parts(source, part_rows)
    else:
        yield from _line_parts(source, part_rows)


def read_part(source: InputSource, number: int, first_row: int, locator: dict[str, int]) -> InputPart:
    """Part ``number`` alone, from its locator (what a Ray worker reads; the file must be at the same path there)."""
    if source.kind == "parquet":
        start, stop = locator["row_start"], locator["row_stop"]
        table = _read_rows(open_parquet(source.path), source, start, stop)
        return _table_part(source, number, start, table)
    with open(source.path, "rb") as handle:
        handle.seek(locator["byte_start"])
        data = handle.read(locator["byte_stop"] - locator["byte_start"])
    lines = data.splitlines(keepends=True)
    return _lines_part(source, number, first_row, lines, locator)


# ---------------------------------------------------------------------------------------------- text, JSON lines
def _line_parts(source: InputSource, part_rows: int) -> Iterator[InputPart]:
    """Parts of a text or JSON-lines file, read in binary so that each part knows its byte range."""
    number = first_row = offset = start = 0
    lines: list[bytes] = []
    with open(source.path, "rb") as handle:
        for raw in handle:
            lines.append(raw)
            offset += len(raw)
            if len(lines) == part_rows:
                yield _lines_part(source, number, first_row, lines, {"byte_start": start, "byte_stop": offset})
                number, first_row, start, lines = number + 1, first_row + part_rows, offset, []
    if lines or number == 0:
        yield _lines_part(source, number, first_row, lines, {"byte_start": start, "byte_stop": offset})


def _lines_part(source: InputSource, number: int, first_row: int, lines: list[bytes],
                locator: dict[str, int]) -> InputPart:
    def rows() -> Iterator[tuple[Any, Any, Any]]:
        for row, raw in enumerate(lines, start=first_row):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataFormatError(f"{source.path}, line {row + 1}: not UTF-8 ({exc.reason})") from None
            if source.kind == "text":
                yield row + 1, line.strip(), None
            else:
                yield _json_row(source, line, row) if line.strip() else (None, None, None)

    return _part(source, number, first_row, len(lines), rows(), dict(locator))


def _part(source: InputSource, number: int, first_row: int, input_rows: int, rows: Iterable[tuple[Any, Any, Any]],
          locator: dict[str, int]) -> InputPart:
    """The part holding ``(id, text, task)`` rows, blank documents dropped (counted), checked."""
    ids, texts, tasks, blank = [], [], [] if source.task_column is not None else None, 0
    for doc_id, text, task in rows:
        if text is None or (isinstance(text, str) and not text.strip()):
            blank += 1
            continue
        ids.append(doc_id)
        texts.append(text)
        if tasks is not None:
            tasks.append(task)
    return _checked(InputPart(number, first_row, input_rows, ids, texts, tasks, locator, blank), source)


def _json_row(source: InputSource, line: str, row: int) -> tuple[Any, Any, Any]:
    where = f"{source.path}, line {row + 1}"
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise DataFormatError(f"{where}: not a JSON object ({reason})") from None
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: a JSON line must be an object with a {source.text_column!r} field")
    for column in source.columns():
        if column not in record:
            raise DataFormatError(f"{where}: no field {column!r} (fields: {shorten(', '.join(record), 200)})")
    doc_id = record[source.id_column] if source.id_column is not None else row
    task = record[source.task_column] if source.task_column is not None else None
    return doc_id, record[source.text_column], task


# ---------------------------------------------------------------------------------------------- Parquet
def _check_parquet_columns(source: InputSource) -> None:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(source.path).names
    except Exception as exc:  # pyarrow's ArrowInvalid for a file that is not Parquet is no OSError
        raise DataFormatError(f"{source.path} is not a readable Parquet file: {shorten(str(exc), 200)}") from None
    for column in source.columns():
        if column not in names:
            raise DataFormatError(f"{source.path}: no column {column!r} (columns: {shorten(', '.join(names), 200)})")


def _parquet_parts(source: InputSource, part_rows: int) -> Iterator[InputPart]:
    """Parts of a Parquet file: its record batches re-cut to ``part_rows`` rows (row groups have their own sizes)."""
    import pyarrow as pa

    reader = open_parquet(source.path)
    pending: list[Any] = []
    held = number = first_row = 0
    for batch in reader.iter_batches(batch_size=min(part_rows, 65_536), columns=source.columns()):
        pending.append(batch)
        held += len(batch)
        while held >= part_rows:
            table = pa.Table.from_batches(pending)
            yield _table_part(source, number, first_row, table.slice(0, part_rows))
            rest = table.slice(part_rows)
            pending, held = rest.to_batches(), len(rest)
            number, first_row = number + 1, first_row + part_rows
    if held or number == 0:
        table = pa.Table.from_batches(pending) if pending else None
        yield _table_part(source, number, first_row, table)


def _read_rows(reader: Any, source: InputSource, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a Parquet file, reading only the row groups that hold them."""
    groups, first, position = [], None, 0
    for group in range(reader.metadata.num_row_groups):
        rows = reader.metadata.row_group(group).num_rows
        if position + rows > start and position < stop:
            groups.append(group)
            first = position if first is None else first
        position += rows
    if not groups:
        return None
    return reader.read_row_groups(groups, columns=source.columns()).slice(start - first, stop - start)


def _table_part(source: InputSource, number: int, first_row: int, table: Any) -> InputPart:
    rows = 0 if table is None else table.num_rows
    column = (lambda name: table.column(name).to_pylist()) if table is not None else (lambda name: [])
    texts = column(source.text_column)
    ids = column(source.id_column) if source.id_column is not None else range(first_row, first_row + rows)
    tasks = column(source.task_column) if source.task_column is not None else [None] * rows
    locator = {"row_start": first_row, "row_stop": first_row + rows}
    return _part(source, number, first_row, rows, zip(ids, texts, tasks), locator)


# ---------------------------------------------------------------------------------------------- checks
def _checked(part: InputPart, source: InputSource) -> InputPart:
    """Refuse a text that is not a string, an id that is not an int or a str, a task that is not a name, or an id
    repeated within the part."""
    for i, (doc_id, text) in enumerate(zip(part.ids, part.texts)):
        if not isinstance(text, str):
            raise DataFormatError(f"{source.path}: the {source.text_column!r} of the document with id "
                                  f"{shorten(doc_id, 60)} is a {type(text).__name__}, not a string")
        if isinstance(doc_id, bool) or not isinstance(doc_id, (int, str)):
            raise DataFormatError(f"{source.path}: document ids must be int or str, got {type(doc_id).__name__} "
                                  f"({shorten(doc_id, 60)}) in part {part.number}")
        if part.tasks is not None:
            task = part.tasks[i]
            if task is not None and not isinstance(task, str):
                raise DataFormatError(f"{source.path}: the task of the document with id {shorten(doc_id, 60)} is a "
                                      f"{type(task).__name__}, not a prompt set's name")
            if isinstance(task, str) and not task.strip():
                part.tasks[i] = None
    if len(set(part.ids)) != len(part.ids):
        seen: set[Any] = set()
        repeated = next(i for i in part.ids if i in seen or seen.add(i))
        raise DataFormatError(f"{source.path}: the id {shorten(repeated, 60)} appears twice (part {part.number}); "
                              "document ids must be unique")
    return part
