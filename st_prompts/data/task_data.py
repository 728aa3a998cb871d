"""Training data of a prompt set from a CSV, TSV or JSON-lines file, its shape read off the columns: a numeric
``score``/``label`` column and two text columns are scored pairs, else three, two or one text columns are triplets,
pairs or sentences. A SentEval STS-B or SICK file is scored pairs, its scores rescaled to 0-1."""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass

from datasets import Dataset

from st_prompts.data.senteval import SICK_COLUMNS, read_sick_file, read_stsb_file
from st_prompts.errors import DataFormatError, DataNotFoundError
from st_prompts.utils import check_utf8

#: The data shapes and the loss each trains with by default.
KINDS = {"scored-pairs": "cosent", "triplets": "mnrl", "pairs": "mnrl", "sentences": "dcpcse"}
#: Which shapes each loss can train on.
LOSS_KINDS = {"cosent": ("scored-pairs",), "mnrl": ("pairs", "triplets"), "dcpcse": ("sentences", "pairs", "triplets")}
_SCORE_NAMES = ("score", "label", "similarity", "relatedness")


@dataclass
class TaskData:
    """A training file read for a prompt set: its shape and a dataset in the column order the losses take."""

    kind: str
    dataset: Dataset
    path: str


def read_task_file(path: str | os.PathLike, limit: int | None = None) -> TaskData:
    """Read ``path`` (``.csv``, ``.tsv``, ``.jsonl``/``.json``, ``.txt``) into a :class:`TaskData`.

    Raises DataNotFoundError (no such file) or DataFormatError (anything wrong with it, with its line number).
    """
    path = str(path)
    if not os.path.isfile(path):
        raise DataNotFoundError(f"No training file at {path!r}.")
    extension = os.path.splitext(path)[1].lower()
    check_utf8(path)  # one line naming the line, not a UnicodeDecodeError traceback
    senteval = _senteval_format(path) if extension in (".csv", ".tsv", ".txt") else None
    if senteval is not None:
        return _read_senteval(path, senteval, limit)
    if extension in (".csv", ".tsv"):
        columns, rows = _read_delimited(path, "\t" if extension == ".tsv" else ",")
    elif extension in (".jsonl", ".json"):
        columns, rows = _read_jsonl(path)
    elif extension == ".txt":
        columns, rows = _read_lines(path)
    else:
        raise DataFormatError(f"{path}: expected a .csv, .tsv, .jsonl or .txt file of pairs, scored pairs, triplets "
                              "or sentences.")
    if not rows:
        raise DataFormatError(f"{path}: no rows.")
    rows = rows[:limit]
    scores = [c for c in columns if c.lower() in _SCORE_NAMES]
    texts = [c for c in columns if c not in scores]
    if len(scores) > 1:
        raise DataFormatError(f"{path}: more than one score column ({', '.join(scores)}).")
    if scores:
        if len(texts) != 2:
            raise DataFormatError(f"{path}: scored pairs need two text columns besides {scores[0]!r}, found "
                                  f"{len(texts)}.")
        score = scores[0]
        values = []
        for number, row in enumerate(rows, start=2):
            try:
                value = float(row[score])
            except (TypeError, ValueError):
                raise DataFormatError(f"{path}, row {number}: score {row[score]!r} is not a number.") from None
            if not math.isfinite(value):
                raise DataFormatError(f"{path}, row {number}: score {row[score]!r} is not finite.")
            values.append(value)
        data = {"sentence1": [str(r[texts[0]]) for r in rows], "sentence2": [str(r[texts[1]]) for r in rows],
                "score": values}
        return TaskData("scored-pairs", Dataset.from_dict(data), path)
    if len(texts) == 1:
        sentences = [str(r[texts[0]]) for r in rows]
        return TaskData("sentences", Dataset.from_dict({"anchor": sentences, "positive": sentences}), path)
    if len(texts) in (2, 3):
        names = ("anchor", "positive", "negative")[: len(texts)]
        data = {name: [str(r[column]) for r in rows] for name, column in zip(names, texts)}
        return TaskData("triplets" if len(texts) == 3 else "pairs", Dataset.from_dict(data), path)
    raise DataFormatError(f"{path}: {len(texts)} text columns; expected 1 (sentences), 2 (pairs, with a score column "
                          "for scored pairs) or 3 (triplets).")


#: Where each SentEval format's gold scores lie.
_SENTEVAL_RANGES = {"stsb": (0.0, 5.0), "sick": (1.0, 5.0)}


def _senteval_format(path: str) -> str | None:
    """``"stsb"`` (no header: 7 tab-separated fields, the fifth a number), ``"sick"`` (its header), or ``None``."""
    with open(path, encoding="utf-8-sig") as handle:
        first = handle.readline().rstrip("\r\n")
    fields = first.split("\t")
    if set(SICK_COLUMNS) <= {field.strip() for field in fields}:
        return "sick"
    if len(fields) >= 7:
        try:
            float(fields[4])
        except ValueError:
            return None
        return "stsb"
    return None


def _read_senteval(path: str, kind: str, limit: int | None) -> TaskData:
    """A SentEval STS-B or SICK file as scored pairs, its scores rescaled to 0-1 (:data:`_SENTEVAL_RANGES`)."""
    pairs = read_stsb_file(path) if kind == "stsb" else read_sick_file(path)
    if not len(pairs):
        raise DataFormatError(f"{path}: no rows.")
    low, high = _SENTEVAL_RANGES[kind]
    data = {"sentence1": pairs.sentences1[:limit], "sentence2": pairs.sentences2[:limit],
            "score": [(score - low) / (high - low) for score in pairs.scores[:limit]]}
    return TaskData("scored-pairs", Dataset.from_dict(data), path)


def _read_lines(path: str) -> tuple[list[str], list[dict]]:
    """One sentence per non-blank line (SimCSE's ``wiki1m_for_simcse.txt``), as one column."""
    with open(path, encoding="utf-8-sig") as handle:
        rows = [{"sentence": line.strip()} for line in handle if line.strip()]
    return ["sentence"], rows


def _read_delimited(path: str, delimiter: str) -> tuple[list[str], list[dict]]:
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        header = next(reader, None)
        if not header:
            return [], []
        rows = []
        for number, fields in enumerate(reader, start=2):
            if not fields:
                continue
            if len(fields) != len(header):
                raise DataFormatError(f"{path}, line {number}: {len(fields)} fields, the header has {len(header)}.")
            rows.append(dict(zip(header, fields)))
    return header, rows


def _read_jsonl(path: str) -> tuple[list[str], list[dict]]:
    columns: list[str] | None = None
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DataFormatError(f"{path}, line {number}: not JSON ({exc}).") from None
            if not isinstance(row, dict):
                raise DataFormatError(f"{path}, line {number}: expected an object of columns.")
            if columns is None:
                columns = list(row)
            elif list(row) != columns:
                raise DataFormatError(f"{path}, line {number}: columns {list(row)} differ from the first line's "
                                      f"{columns}.")
            rows.append(row)
    return columns or [], rows
