"""Reading a corpus (a list, a ``datasets.Dataset`` column, a text file, a dataset file) and its document ids: 1-based
line numbers for a text file, 0-based positions otherwise, or the given unique ids. Blank documents are skipped with
a warning; duplicate texts are kept, each under its own id."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, shorten
from st_prompts.search._warnings import warn_at_caller
from st_prompts.utils import check_utf8

DATASET_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class Corpus:
    """A validated corpus: non-blank texts with unique ids, the file they came from (or ``"corpus"``), and how the
    ids were made (``"line_number"``, ``"position"``, ``"given"`` or ``"column:<name>"``)."""
    ids: list[int | str]
    texts: list[str]
    source: str
    id_source: str


def is_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a ``datasets.Dataset``, without importing ``datasets`` (~75 MB of RSS)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(obj, module.Dataset)


def corpus_from_documents(documents: Any, ids: Iterable[Any] | None = None, *, text_column: str = "text",
                          id_column: str | None = None, source: str = "corpus") -> Corpus:
    """A :class:`Corpus` from a list/iterable of strings or a ``datasets.Dataset`` (``text_column``, ``id_column``);
    ids default to 0-based positions."""
    if isinstance(documents, (str, bytes, os.PathLike)):
        raise ConfigurationError("documents must be a list of strings or a datasets.Dataset; to index a file use "
                                 "SemanticIndex.from_file()")
    if is_dataset(documents):
        if ids is not None:
            raise ConfigurationError("pass either ids or id_column for a dataset, not both")
        columns = documents.column_names
        for column in (text_column, id_column):
            if column is not None and column not in columns:
                raise DataFormatError(f"{source}: no column {column!r} in the dataset (columns: {', '.join(columns)})")
        ids = documents[id_column] if id_column is not None else None
        documents = documents[text_column]
    id_source = f"column:{id_column}" if id_column is not None else ("given" if ids is not None else "position")
    kept_ids, kept_texts = prepare_corpus(documents, ids, source=source, id_kind="position")
    return Corpus(kept_ids, kept_texts, source, id_source)


def read_corpus_file(path: str | os.PathLike, *, text_column: str = "text", id_column: str | None = None,
                     encoding: str = "utf-8") -> Corpus:
    """Read a corpus file: ``.jsonl``/``.json``/``.csv``/``.parquet`` through ``datasets`` (``text_column``,
    ``id_column``; ids = 0-based rows by default), anything else as ``encoding`` text with one document per line
    (stripped; ids = 1-based line numbers)."""
    path = Path(path)
    if path.suffix.lower() in DATASET_SUFFIXES:
        dataset = _load_dataset_file(path)
        return corpus_from_documents(dataset, text_column=text_column, id_column=id_column, source=str(path))
    if id_column is not None:
        raise ConfigurationError(f"--id-column needs a dataset file (.jsonl/.csv/.parquet), not {path}")
    lines = _read_text_file(path, encoding)
    ids, texts = prepare_corpus(lines, None, source=str(path), id_kind="line_number")
    return Corpus(ids, texts, str(path), "line_number")


def prepare_corpus(texts: Iterable[Any], ids: Iterable[Any] | None, *, source: str,
                   id_kind: str) -> tuple[list[int | str], list[str]]:
    """Validate a corpus: drop blank documents (warning), reject duplicate ids, warn about duplicate texts; without
    ``ids``, number the documents by ``id_kind`` (``"line_number"`` or ``"position"``)."""
    texts = list(texts)
    if ids is None:
        ids = list(range(1, len(texts) + 1)) if id_kind == "line_number" else list(range(len(texts)))
    else:
        ids = list(ids)
        if len(ids) != len(texts):
            raise DataFormatError(f"{source}: got {len(ids)} ids for {len(texts)} documents")
    kept_ids: list[int | str] = []
    kept_texts: list[str] = []
    blank = 0
    for i, (doc_id, text) in enumerate(zip(ids, texts)):
        if text is None or (isinstance(text, str) and not text.strip()):
            blank += 1
            continue
        if not isinstance(text, str):
            raise DataFormatError(f"{source}: document {i} is a {type(text).__name__}, not a string: {text!r:.80}")
        if isinstance(doc_id, np.generic):
            doc_id = doc_id.item()
        if isinstance(doc_id, bool) or not isinstance(doc_id, (int, str)):
            raise DataFormatError(f"document ids must be str or int, got {type(doc_id).__name__} "
                                  f"({shorten(doc_id, 60)}) (document {i} of {source})")
        kept_ids.append(doc_id)
        kept_texts.append(text)
    if not kept_texts:
        raise DataFormatError(f"{source} is empty: it has no non-blank document to index")
    if blank:
        warn_at_caller(f"{source}: skipped {blank} blank document(s)")
    seen: set[int | str] = set()
    duplicates = [doc_id for doc_id in kept_ids if doc_id in seen or seen.add(doc_id)]
    if duplicates:
        shown = ", ".join(shorten(d, 60) for d in duplicates[:5]) + (", ..." if len(duplicates) > 5 else "")
        raise DataFormatError(f"{source}: document ids must be unique; {len(duplicates)} duplicate(s): {shown}")
    duplicate_texts = len(kept_texts) - len(set(kept_texts))
    if duplicate_texts:
        warn_at_caller(f"{source}: {duplicate_texts} document(s) repeat the text of an earlier one; they are kept, "
                       "each under its own id")
    return kept_ids, kept_texts


def _read_text_file(path: Path, encoding: str) -> list[str]:
    if not path.exists():
        raise DataNotFoundError(f"corpus file not found: {path}")
    if path.is_dir():
        raise DataFormatError(f"corpus must be a text file with one document per line, got a directory: {path}")
    try:
        with path.open(encoding=encoding, newline=None) as handle:
            return [line.rstrip("\n").strip() for line in handle]
    except UnicodeDecodeError as exc:
        if encoding.replace("-", "").lower() == "utf8":
            check_utf8(path)  # names the line
        raise DataFormatError(f"{path} is not a {encoding} text file ({exc.reason})") from exc


def _load_dataset_file(path: Path) -> Any:
    """Load a .jsonl/.json/.csv/.parquet file as a :class:`datasets.Dataset`."""
    if not path.exists():
        raise DataNotFoundError(f"corpus file not found: {path}")
    if path.is_dir():
        raise DataFormatError(f"corpus must be a dataset file, got a directory: {path}")
    if path.suffix.lower() != ".parquet":
        check_utf8(path)  # datasets would log errors and fail with a traceback (JSON lines) or several lines (CSV)
    import datasets

    loader = getattr(datasets.Dataset, f"from_{DATASET_SUFFIXES[path.suffix.lower()]}")  # from_json, from_csv, ...
    try:
        return loader(str(path))
    except Exception as exc:  # datasets raises many different errors for a malformed file
        raise DataFormatError(f"cannot read {path} as a dataset: {shorten(str(exc), 300)}") from exc


def check_queries(queries: Sequence[Any]) -> None:
    """Refuse queries that are not strings, or are empty or blank (they would match arbitrary documents)."""
    if not all(isinstance(query, str) for query in queries):
        raise ConfigurationError("queries must be a string or a list of strings")
    blank = [number for number, query in enumerate(queries, start=1) if not query.strip()]
    if blank:
        which = "the query" if len(queries) == 1 else f"query {', '.join(map(str, blank[:5]))}"
        raise ConfigurationError(f"{which} is empty: give the text to search for")
