"""Readers for the STS evaluation data in the SentEval directory layout, read as SentEval reads them
(:data:`EXPECTED_LAYOUT`: UTF-8, tab-separated, no CSV quoting, a blank gold line skips its pair, whitespace runs
joined); problems raise DataNotFoundError or DataFormatError (file and line)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, first_line

#: The seven STS tasks of the SentEval/SimCSE protocol, in the order the papers report them.
STS_TASKS = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness")

#: SentEval's official subsets per year (``senteval/sts.py``); STS13 has no SMT subset (it is not distributed).
STS_SUBSETS = {
    "STS12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "STS13": ("FNWN", "headlines", "OnWN"),
    "STS14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "STS15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "STS16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}

#: Short names used in tables (as in the SimCSE paper).
TASK_LABELS = {**{task: task for task in STS_SUBSETS}, "STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R"}

SPLITS = ("train", "dev", "test")
_SPLIT_ALIASES = {"validation": "dev", "trial": "dev"}
_STSB_FILES = {"train": "sts-train.csv", "dev": "sts-dev.csv", "test": "sts-test.csv"}
_SICK_FILES = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}
SICK_COLUMNS = ("sentence_A", "sentence_B", "relatedness_score")  # what a SICK file is read by
_TASK_ALIASES = {"stsb": "STSBenchmark", "sts-b": "STSBenchmark", "sickr": "SICKRelatedness",
                 "sick-r": "SICKRelatedness"}

EXPECTED_LAYOUT = (
    "expected the SentEval layout: DIR/STS/STS12-en-test/STS.input.<subset>.txt + STS.gs.<subset>.txt "
    "(likewise STS13..STS16-en-test), DIR/STS/STSBenchmark/sts-{train,dev,test}.csv, "
    "DIR/SICK/SICK_{train,trial,test_annotated}.txt"
)


@dataclass(frozen=True)
class STSPairs:
    """Scored sentence pairs of one STS task and split: gold ``scores`` (0-5; SICK 1-5) and the subset name of each
    pair (e.g. ``"MSRpar"``; ``"all"`` for tasks without subsets)."""

    sentences1: list[str]
    sentences2: list[str]
    scores: list[float]
    subsets: list[str]

    def __post_init__(self) -> None:
        n = len(self.sentences1)
        if not (len(self.sentences2) == len(self.scores) == len(self.subsets) == n):
            raise ValueError("STSPairs fields must all have the same length")

    def __len__(self) -> int:
        return len(self.scores)

    @property
    def subset_names(self) -> list[str]:
        """The distinct subset names, in order of first appearance."""
        return list(dict.fromkeys(self.subsets))

    def subset(self, name: str) -> STSPairs:
        """The pairs of one subset (e.g. ``pairs.subset("headlines")``); ConfigurationError if it has none."""
        keep = [i for i, s in enumerate(self.subsets) if s == name]
        if not keep:
            raise ConfigurationError(f"no subset {name!r}; available: {', '.join(self.subset_names)}")
        return STSPairs([self.sentences1[i] for i in keep], [self.sentences2[i] for i in keep],
                        [self.scores[i] for i in keep], [name] * len(keep))


def normalize_task(task: str) -> str:
    """Canonical task name (one of :data:`STS_TASKS`), accepting any case and ``STSB``/``STS-B``/``SICK-R``."""
    canonical = {**{t.lower(): t for t in STS_TASKS}, **_TASK_ALIASES}.get(str(task).lower())
    if canonical is not None:
        return canonical
    raise ConfigurationError(f"unknown STS task {task!r}; choose from {', '.join(STS_TASKS)}")


def _split(split: str) -> str:
    split = _SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise ConfigurationError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    return split


def _normalize_split(task: str, split: str) -> str:
    split = _split(split)
    if task in STS_SUBSETS and split != "test":
        raise ConfigurationError(f"{task} only has a test split (asked for {split!r})")
    return split


def _task_files(task: str, split: str) -> list[Path]:
    """Paths (relative to the SentEval directory) that ``load_sts(task, split)`` reads."""
    if task in STS_SUBSETS:
        folder = Path("STS") / f"{task}-en-test"
        return [folder / f"STS.{kind}.{subset}.txt" for subset in STS_SUBSETS[task] for kind in ("input", "gs")]
    if task == "STSBenchmark":
        return [Path("STS") / "STSBenchmark" / _STSB_FILES[split]]
    return [Path("SICK") / _SICK_FILES[split]]


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (universal newlines, trailing newline dropped, BOM ignored)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise DataNotFoundError(f"cannot read {path}: {exc.strerror or exc}") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


#: Gold similarity scores of STS12-16, STS-B (0-5) and SICK-R (1-5).
SCORE_RANGE = (0.0, 5.0)


def _parse_score(value: str, path: Path, lineno: int) -> float:
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise DataFormatError(f"{path}:{lineno}: score {value!r} is not a number")
    if not SCORE_RANGE[0] <= score <= SCORE_RANGE[1]:
        raise DataFormatError(f"{path}:{lineno}: score {value!r} is outside {SCORE_RANGE[0]:g}-{SCORE_RANGE[1]:g}, the "
                              "range of STS and SICK gold scores")
    return score


def _tokens(sentence: str) -> str:
    # SentEval: s.split(); SimCSE's batcher: " ".join(tokens)
    return " ".join(sentence.split())


def _load_sts_year(root: Path, task: str) -> STSPairs:
    s1, s2, scores, subsets = [], [], [], []
    paths = [root / path for path in _task_files(task, "test")]  # each subset's input file, then its gold file
    for subset, input_path, gold_path in zip(STS_SUBSETS[task], paths[::2], paths[1::2]):
        inputs, golds = _read_lines(input_path), _read_lines(gold_path)
        if len(inputs) != len(golds):
            raise DataFormatError(f"{input_path} has {len(inputs)} lines but {gold_path} has {len(golds)}: gold scores "
                                  "must be line-aligned with the input pairs (a blank gold line for an unscored pair)")
        for lineno, (line, gold) in enumerate(zip(inputs, golds), start=1):
            fields = line.rstrip("\r").split("\t")
            if len(fields) != 2:
                raise DataFormatError(f"{input_path}:{lineno}: expected 2 tab-separated sentences, found "
                                      f"{len(fields)} field(s)")
            gold = gold.strip()
            if not gold:  # not scored
                continue
            scores.append(_parse_score(gold, gold_path, lineno))
            s1.append(_tokens(fields[0]))
            s2.append(_tokens(fields[1]))
            subsets.append(subset)
    return STSPairs(s1, s2, scores, subsets)


def _scored_rows(path: Path, lines: list[str], start: int, columns: tuple[int, int, int], expected: str) -> STSPairs:
    """The pairs of ``lines`` (numbered from ``start``, blank ones skipped): the fields ``columns`` (sentence 1,
    sentence 2, score) of each tab-separated line; a line too short for them is refused as ``expected``."""
    width = max(columns) + 1
    s1, s2, scores = [], [], []
    for lineno, line in enumerate(lines, start=start):
        if not line.strip():
            continue
        fields = line.strip().split("\t")
        if len(fields) < width:
            raise DataFormatError(f"{path}:{lineno}: expected {expected}, found {len(fields)}")
        scores.append(_parse_score(fields[columns[2]], path, lineno))
        s1.append(_tokens(fields[columns[0]]))
        s2.append(_tokens(fields[columns[1]]))
    return STSPairs(s1, s2, scores, ["all"] * len(scores))


def read_stsb_file(path) -> STSPairs:
    """One STS Benchmark file as SentEval distributes it (``sts-test.csv``, ...), read as :func:`load_sts` does."""
    path = Path(path)
    return _scored_rows(path, _read_lines(path), 1, (5, 6, 4), "at least 7 tab-separated columns (genre, file, year, "
                        "id, score, sentence1, sentence2)")


def read_sick_file(path) -> STSPairs:
    """One SICK file as SentEval distributes it (``SICK_train.txt``, ...), read as :func:`load_sts` does."""
    path = Path(path)
    lines = _read_lines(path)
    if not lines:
        raise DataFormatError(f"{path}: empty file (expected a header row and data rows)")
    header = [h.strip() for h in lines[0].strip().split("\t")]
    if any(col not in header for col in SICK_COLUMNS):
        raise DataFormatError(f"{path}:1: header must contain the columns {', '.join(SICK_COLUMNS)}; found {header}")
    columns = tuple(header.index(col) for col in SICK_COLUMNS)
    return _scored_rows(path, lines[1:], 2, columns, f"{len(header)} tab-separated columns ({', '.join(header)})")


def _layout_hint(root: Path) -> str:
    """Suggest a sub-directory when the user pointed one level too high (e.g. SentEval's ``data/``)."""
    if (root / "STS12-en-test").is_dir() or (root / "STSBenchmark").is_dir() or (root / "SICK_train.txt").is_file():
        return f" (did you mean {root.parent}?)"
    for candidate in (root / "downstream", root / "senteval", root / "data" / "downstream", root / "data" / "senteval"):
        if (candidate / "STS").is_dir() or (candidate / "SICK").is_dir():
            return f" (did you mean {candidate}?)"
    return ""


def _check_files(senteval_dir, tasks, split: str) -> tuple[Path, list[tuple[str, str]]]:
    """Existence checks; returns the directory and the canonical (task, split) pairs."""
    if senteval_dir is None:
        raise ConfigurationError("no SentEval directory given (or load the tasks from the hub instead)")
    root = Path(senteval_dir).expanduser()
    plan = [(t, _normalize_split(t, split)) for t in map(normalize_task, tasks)]
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise DataNotFoundError(f"SentEval directory {root} {what}; {EXPECTED_LAYOUT}")
    missing = []  # a whole missing folder is reported once, as "FOLDER/"
    for path in (p for task, sp in plan for p in _task_files(task, sp)):
        if (root / path).is_file():
            continue
        item = str(path)
        while path.parent != Path(".") and not (root / path.parent).is_dir():
            path = path.parent
            item = f"{path}/"
        if item not in missing:
            missing.append(item)
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise DataNotFoundError(f"SentEval directory {root} is missing {shown}{_layout_hint(root)}; {EXPECTED_LAYOUT}")
    return root, plan


def load_sts(senteval_dir, task: str, split: str = "test") -> STSPairs:
    """Read one STS task from a SentEval directory (the folder holding ``STS/`` and ``SICK/``).

    ``split``: ``"test"`` (the only split of STS12-16), ``"dev"`` or ``"train"``. STS12-16's subsets are concatenated
    in SentEval's order.
    """
    root, [(task, split)] = _check_files(senteval_dir, [task], split)
    if task in STS_SUBSETS:
        pairs = _load_sts_year(root, task)
    else:
        pairs = (read_stsb_file if task == "STSBenchmark" else read_sick_file)(root / _task_files(task, split)[0])
    if len(pairs) == 0:
        raise DataFormatError(f"{task} {split} in {root} has no scored pairs")
    return pairs


def check_senteval_dir(senteval_dir, tasks=STS_TASKS, split: str = "test") -> Path:
    """Validate a SentEval directory up front, before any model work: every file of ``tasks`` must exist (the missing
    ones named in one error) and parse. Returns the directory as a :class:`~pathlib.Path`."""
    root, plan = _check_files(senteval_dir, tasks, split)
    for task, sp in plan:
        load_sts(root, task, sp)
    return root


#: Hugging Face datasets used by :func:`load_sts_from_hub` (all with columns sentence1, sentence2, score).
HUB_DATASETS = {**{task: f"mteb/{task.lower()}-sts" for task in STS_SUBSETS},
                "STSBenchmark": "sentence-transformers/stsb", "SICKRelatedness": "mteb/sickr-sts"}
_HUB_SPLITS = {"train": "train", "dev": "validation", "test": "test"}


def load_sts_from_hub(task: str, split: str = "test") -> STSPairs:
    """Load an STS task (:data:`HUB_DATASETS`) from the Hugging Face hub (needs network access).

    The hub copies differ from SentEval's files (untokenized text, all of SICK, STS-B scaled to 0-1), so use a
    SentEval directory to compare with the papers. Every pair has subset ``"all"``.
    """
    task = normalize_task(task)
    split = _split(split)
    if task != "STSBenchmark" and split != "test":
        raise ConfigurationError(f"{task} is only available as a test split on the hub (asked for {split!r})")
    repo = HUB_DATASETS[task]
    import datasets

    try:
        data = datasets.load_dataset(repo, split=_HUB_SPLITS[split])
    except Exception as exc:  # network / hub errors come in many types; report one clear line
        raise DataNotFoundError(f"could not load {repo} ({_HUB_SPLITS[split]}) from the Hugging Face hub: "
                                f"{first_line(exc)}") from exc
    missing = [c for c in ("sentence1", "sentence2", "score") if c not in data.column_names]
    if missing:
        raise DataFormatError(f"{repo}: missing column(s) {', '.join(missing)} (has {', '.join(data.column_names)})")
    scores = [float(s) for s in data["score"]]
    return STSPairs(list(data["sentence1"]), list(data["sentence2"]), scores, ["all"] * len(scores))
