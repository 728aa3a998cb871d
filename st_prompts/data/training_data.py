"""Training data in SimCSE's formats: one sentence per line (unsupervised) and ``sent0,sent1,hard_neg`` NLI triplets."""

from __future__ import annotations

import csv
import logging
import random
from collections import Counter
from importlib import resources
from pathlib import Path

import huggingface_hub
from datasets import Dataset

from st_prompts.errors import DataFormatError, DataNotFoundError
from st_prompts.utils import check_utf8

logger = logging.getLogger(__name__)

#: Hub repository holding SimCSE's full training files (1M Wikipedia sentences, 275k NLI triplets).
SIMCSE_HUB_REPO = "princeton-nlp/datasets-for-simcse"
WIKI_FILE = "wiki1m_for_simcse.txt"
NLI_FILE = "nli_for_simcse.csv"


def _existing(path: str | Path) -> Path:
    """``path`` if it is a UTF-8 text file (:func:`st_prompts.utils.check_utf8`), else a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"Training file not found: {path}")
    check_utf8(path)
    return path


def _subsample(rows: list, limit: int | None, seed: int) -> list:
    if limit is not None and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit)
    return rows


def read_sentences(path: str | Path, limit: int | None = None, seed: int = 42) -> list[str]:
    """Non-empty lines of a text file (SimCSE's ``wiki1m_for_simcse.txt`` format), optionally a random subset."""
    with open(_existing(path), encoding="utf-8") as f:
        sentences = [line.strip() for line in f if line.strip()]
    if not sentences:
        raise DataFormatError(f"{path} holds no sentence (one sentence per line expected).")
    return _subsample(sentences, limit, seed)


def read_csv_rows(path: str | Path, *headers: tuple[str, ...]) -> tuple[tuple[str, ...], list[list[str]]]:
    """Read a CSV file: which of the accepted ``headers`` (their first columns, lower-cased) it has, and its rows
    (blank lines skipped). Another header, or a row with another number of fields, is a DataFormatError."""
    with open(_existing(path), encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = [h.strip().lower() for h in (next(reader, None) or [])]
        known = next((h for h in headers if tuple(header[: len(h)]) == h), None)
        if known is None:
            expected = " or ".join(f"'{','.join(h)}'" for h in headers)
            raise DataFormatError(f"{path}: expected a header {expected}, got {','.join(header)!r}.")
        rows = []
        line = reader.line_num
        for row in reader:
            if row and len(row) != len(header):
                raise DataFormatError(f"{path}, line {line + 1}: expected {len(header)} fields ({','.join(header)}), "
                                      f"got {len(row)}; quote fields that contain commas.")
            if row:
                rows.append(row)
            line = reader.line_num
    return known, rows


_TRIPLET_HEADER = ("sent0", "sent1", "hard_neg")
_PAIR_HEADER = ("premise", "hypothesis", "label")


def read_nli_triplets(path: str | Path, limit: int | None = None, seed: int = 42) -> list[tuple[str, str, str]]:
    """Rows of a ``sent0,sent1,hard_neg`` CSV (SimCSE's ``nli_for_simcse.csv``): premise, entailment, contradiction."""
    _, rows = read_csv_rows(path, _TRIPLET_HEADER)
    triplets = [(row[0], row[1], row[2]) for row in rows]
    if not triplets:
        raise DataFormatError(f"{path} holds no triplet.")
    return _subsample(triplets, limit, seed)


def unsupervised_dataset(sentences: list[str]) -> Dataset:
    """Unsupervised SimCSE pairs: every sentence paired with itself (dropout makes the two views differ)."""
    return Dataset.from_dict({"anchor": list(sentences), "positive": list(sentences)})


def supervised_dataset(triplets: list[tuple[str, str, str]]) -> Dataset:
    """Supervised SimCSE triplets: (premise, entailment as positive, contradiction as hard negative)."""
    columns = ("anchor", "positive", "negative")
    return Dataset.from_dict({name: [t[i] for t in triplets] for i, name in enumerate(columns)})


def bundled_data_dir() -> Path:
    """The small data set shipped inside the package (``st_prompts/resources/demo``), a ``--data-dir``."""
    return Path(str(resources.files("st_prompts") / "resources" / "demo"))


def download_simcse_file(filename: str) -> Path:
    """Download one of SimCSE's training files from the hub (DataNotFoundError offline, saying how to do without)."""
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id=SIMCSE_HUB_REPO, filename=filename, repo_type="dataset"))
    except Exception as exc:  # offline, firewalled, HF_HUB_OFFLINE=1, ...: all end the same way for the user
        raise DataNotFoundError(
            f"Could not download {filename} from the Hugging Face dataset {SIMCSE_HUB_REPO!r} ({type(exc).__name__}). "
            "Without network access, pass --data-dir DIR with DIR/train/wiki_sentences.txt (one sentence per line) or "
            "DIR/train/nli_triplets.csv (sent0,sent1,hard_neg), or use --scale cpu, which defaults to the small data "
            "set bundled with st_prompts.") from exc


def load_training_dataset(supervised: bool, data_dir: str | Path | None = None, limit: int | None = None,
                          seed: int = 42) -> Dataset:
    """The SimCSE-format training set for a run: ``train/wiki_sentences.txt`` or ``train/nli_triplets.csv`` below
    ``data_dir``, or without one SimCSE's full files from the hub."""
    if supervised:
        return supervised_dataset(read_nli_triplets(nli_path(data_dir), limit, seed))
    return unsupervised_dataset(read_sentences(sentences_path(data_dir), limit, seed))


#: Binary NLI labels of DiffAug's classifier: entailment = 1, contradiction = 0 (neutral and other labels are skipped).
NLI_PAIR_LABELS = {"entailment": 1, "contradiction": 0}


def sample_fraction(rows: list, fraction: float, seed: int) -> list:
    """A random share ``fraction`` (0 < fraction <= 1) of ``rows``, at least one, drawn with ``seed``."""
    if not 0.0 < fraction <= 1.0:
        raise DataFormatError(f"label_fraction must be in (0, 1], got {fraction}.")
    if fraction >= 1.0:
        return rows
    count = max(1, round(len(rows) * fraction))
    return random.Random(seed).sample(rows, count)


def read_nli_pairs(path: str | Path, limit: int | None = None, seed: int = 42,
                   fraction: float = 1.0) -> tuple[list[tuple[str, str, int]], Counter]:
    """Labelled NLI pairs ``(premise, hypothesis, label)`` with entailment = 1 and contradiction = 0, and a
    ``Counter`` of the labels skipped (any other: neutral, ``-``, ...).

    Reads SimCSE's triplets (``sent0,sent1,hard_neg``: two pairs a row) or labelled pairs
    (``premise,hypothesis,label``); at most ``limit`` rows, then a share ``fraction`` of them, drawn with ``seed``.
    """
    header, rows = read_csv_rows(path, _TRIPLET_HEADER, _PAIR_HEADER)
    rows = sample_fraction(_subsample(rows, limit, seed), fraction, seed)
    skipped: Counter = Counter()
    if header == _TRIPLET_HEADER:
        pairs = [pair for p, e, c, *_ in rows for pair in ((p, e, 1), (p, c, 0))]
    else:
        pairs = []
        for premise, hypothesis, label, *_ in rows:
            key = label.strip().lower()
            if key in NLI_PAIR_LABELS:
                pairs.append((premise, hypothesis, NLI_PAIR_LABELS[key]))
            else:
                skipped[label.strip()] += 1
    if skipped:
        logger.info(f"{path}: skipped {sum(skipped.values()):,} NLI rows whose label is neither entailment nor "
                    f"contradiction ({', '.join(f'{k!r}: {v:,}' for k, v in skipped.most_common())}).")
    if not pairs:
        raise DataFormatError(f"{path} holds no entailment or contradiction pair.")
    return pairs, skipped


def _training_file(data_dir: str | Path | None, name: str, hub_file: str) -> Path:
    """``DATA_DIR/train/NAME`` (or ``DATA_DIR/NAME``), or SimCSE's hub file ``hub_file`` without a data folder."""
    if data_dir is None:
        return download_simcse_file(hub_file)
    base = Path(data_dir)
    base = base / "train" if (base / "train").is_dir() else base
    return base / name


def nli_path(data_dir: str | Path | None) -> Path:
    """``DATA_DIR/train/nli_triplets.csv`` (or ``DATA_DIR/nli_triplets.csv``), or SimCSE's hub file without one."""
    return _training_file(data_dir, "nli_triplets.csv", NLI_FILE)


def sentences_path(data_dir: str | Path | None) -> Path:
    """``DATA_DIR/train/wiki_sentences.txt`` (or ``DATA_DIR/wiki_sentences.txt``), or SimCSE's hub file."""
    return _training_file(data_dir, "wiki_sentences.txt", WIKI_FILE)
