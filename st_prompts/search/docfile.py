"""The documents of a saved index: ``docs.jsonl`` (one ``{"id", "text"}`` object per row, in FAISS order), read whole
(:func:`read_docs`) or record by record through the byte offsets of ``docs.offsets.npy`` (:class:`LazyDocs`); every
record is checked as it is read."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from st_prompts.errors import DataFormatError

_FIX = "the index is damaged: rebuild it"


def parse_record(raw: bytes | str, path: Path, where: str) -> tuple[int | str, str]:
    """``(id, text)`` of one line of ``docs.jsonl`` (``where``: "line N" or "row N", for the message)."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError (bytes), nesting too deep
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise DataFormatError(f"{path}, {where}: not a JSON record ({reason}); {_FIX}") from None
    if not isinstance(record, dict) or "id" not in record or "text" not in record:
        raise DataFormatError(f"{path}, {where}: not an object with an id and a text; {_FIX}")
    doc_id, text = record["id"], record["text"]
    if isinstance(doc_id, bool) or not isinstance(doc_id, (int, str)) or not isinstance(text, str):
        raise DataFormatError(f"{path}, {where}: the id must be a string or an integer and the text a string; {_FIX}")
    return doc_id, text


def read_docs(path: Path) -> tuple[list[int | str], list[str]]:
    """Every ``(id, text)`` of ``docs.jsonl``, checked (ids unique)."""
    ids, texts = [], []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            doc_id, text = parse_record(line, path, f"line {number}")
            ids.append(doc_id)
            texts.append(text)
    if len(set(ids)) != len(ids):
        raise DataFormatError(f"{path}: {len(ids) - len(set(ids))} document id(s) appear twice; {_FIX}")
    return ids, texts


def check_offsets(offsets: np.ndarray, path: Path, rows: int, size: int) -> None:
    """``docs.offsets.npy`` (at ``path``): ``rows + 1`` increasing byte offsets from 0 to the size of ``docs.jsonl``."""
    if (offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) != rows + 1 or int(offsets[0]) != 0
            or int(offsets[-1]) != size or np.any(np.diff(offsets) <= 0)):
        raise DataFormatError(f"{path} does not match docs.jsonl (one of them is damaged or truncated); rebuild the "
                              "index")


class DocsWriter:
    """Writes ``docs.jsonl`` and its ``docs.offsets.npy`` for ``rows`` documents, a batch at a time."""

    def __init__(self, path: Path, offsets_path: Path, rows: int) -> None:
        self.offsets_path = offsets_path
        self.offsets = np.empty(rows + 1, dtype=np.int64)
        self.row = 0
        self.position = 0
        self._handle = path.open("wb")

    def add(self, ids: Iterable[int | str], texts: Iterable[str]) -> None:
        """Append one ``{"id", "text"}`` line per document."""
        for doc_id, text in zip(ids, texts):
            if self.row >= len(self.offsets) - 1:
                raise DataFormatError(f"more documents than the {len(self.offsets) - 1} announced")
            self.offsets[self.row] = self.position
            line = (json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n").encode("utf-8")
            self._handle.write(line)
            self.position += len(line)
            self.row += 1

    def discard(self) -> None:
        """Close ``docs.jsonl`` unfinished (a failed build; its staging folder is removed)."""
        self._handle.close()

    def close(self) -> None:
        """Finish both files (every announced document must have been added)."""
        self._handle.close()
        if self.row != len(self.offsets) - 1:
            raise DataFormatError(f"{self.row} documents written, {len(self.offsets) - 1} announced")
        self.offsets[-1] = self.position
        np.save(self.offsets_path, self.offsets)


class LazyDocs:
    """The documents of a saved index, read from ``docs.jsonl`` on demand (one seek + one line per access)."""

    def __init__(self, path: Path, offsets: np.ndarray) -> None:
        self.path = path
        self.offsets = offsets
        self.ids = _LazyColumn(self, 0)
        self.texts = _LazyColumn(self, 1)
        self._handle = path.open("rb")  # now: a save that later replaces the index cannot mix in its documents
        self.size = os.fstat(self._handle.fileno()).st_size

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def close(self) -> None:
        """Close ``docs.jsonl`` (a garbage-collected view closes it too)."""
        self._handle.close()

    def record(self, row: int) -> tuple[int | str, str]:
        """``(id, text)`` of ``row``, checked."""
        if not 0 <= row < len(self):
            raise IndexError(row)
        self._handle.seek(int(self.offsets[row]))
        line = self._handle.read(int(self.offsets[row + 1] - self.offsets[row]))
        return parse_record(line, self.path, f"row {row}")


class _LazyColumn(Sequence):
    """A read-only sequence of one field of :class:`LazyDocs` (``ids`` or ``texts``)."""

    def __init__(self, docs: LazyDocs, field: int) -> None:
        self._docs = docs
        self._field = field

    def __len__(self) -> int:
        return len(self._docs)

    def __getitem__(self, row: Any) -> Any:
        if isinstance(row, slice):
            return [self[i] for i in range(*row.indices(len(self)))]
        return self._docs.record(int(row))[self._field]
