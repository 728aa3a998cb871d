"""Data for the search benchmarks: the real-text corpus and queries from the shared data, two synthetic sentence
generators (one for corpora, a different one for queries), and cached chunked encoding.

* **Real corpus**: every distinct sentence of ``train/wiki_sentences.txt``, ``train/nli_triplets.csv`` (all three
  columns), STS-B ``sts-train.csv`` (both sentences) and SICK ``SICK_train.txt`` (both sentences).
* **Real queries**: the distinct sentences of STS-B ``sts-dev.csv`` and SICK ``SICK_trial.txt`` that are *not* in
  the corpus (disjoint by exact text). The STS-B test excerpt is never read.
* **Synthetic corpus** (:func:`synthetic_sentences`, "generator A"): six declarative templates over word lists.
* **Synthetic queries** (:func:`synthetic_queries`, "generator B"): other templates (questions, requests, noun
  phrases) over partly different vocabulary, so queries are not drawn from the corpus's distribution.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_prompts.search.chunked import encode_in_chunks  # noqa: E402

#: recall@K of every search benchmark
K = 10


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50 / p99 / mean of latencies given in seconds, in milliseconds."""
    values = np.asarray(samples_s) * 1000.0
    return {"p50_ms": round(float(np.percentile(values, 50)), 4), "p99_ms": round(float(np.percentile(values, 99)), 4),
            "mean_ms": round(float(values.mean()), 4)}  # fmt: skip


def recalls(positions: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """recall@1 (is the exact best document first?) and recall@10 (overlap of the top 10 sets), by id."""
    r1 = float(np.mean(positions[:, 0] == truth[:, 0]))
    r10 = float(np.mean([len(set(a[a >= 0]) & set(b)) / K for a, b in zip(positions, truth)]))
    return {"recall_at_1": round(r1, 4), "recall_at_10": round(r10, 4)}


def latency(index, queries: np.ndarray, *, single: int, batch: int) -> dict:
    """Single-query latency over the first ``single`` queries and per-query latency of batches of ``batch``."""
    index.search_embeddings(queries[:batch], K)  # warm-up
    singles = []
    for row in queries[:single]:
        start = time.perf_counter()
        index.search_embeddings(row[None, :], K)
        singles.append(time.perf_counter() - start)
    batches = []
    for start_row in range(0, len(queries) - batch + 1, batch):
        start = time.perf_counter()
        index.search_embeddings(queries[start_row : start_row + batch], K)
        batches.append(time.perf_counter() - start)
    batched = percentiles(batches)
    batched["per_query_ms"] = round(batched["mean_ms"] / batch, 4)
    return {"single": percentiles(singles), "batched": batched}


def default_data_dir() -> Path:
    from common import default_data_dir as shared

    found = shared()
    return found if found is not None else Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _sts_sentences(path: Path) -> list[str]:
    out = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            columns = line.rstrip("\n").split("\t")
            out += [columns[5].strip(), columns[6].strip()]
    return out


def _sick_sentences(path: Path) -> list[str]:
    out = []
    with path.open(encoding="utf-8") as handle:
        next(handle)
        for line in handle:
            columns = line.rstrip("\n").split("\t")
            out += [columns[1].strip(), columns[2].strip()]
    return out


def _distinct(sentences) -> list[str]:
    seen: dict[str, None] = {}
    for sentence in sentences:
        if sentence and sentence not in seen:
            seen[sentence] = None
    return list(seen)


def real_corpus(data_dir: Path) -> tuple[list[str], dict[str, int]]:
    """The distinct real sentences (first occurrence order) and how many each source contributed (before dedup)."""
    wiki = [line.strip() for line in (data_dir / "train" / "wiki_sentences.txt").open(encoding="utf-8")]
    nli = []
    with (data_dir / "train" / "nli_triplets.csv").open(encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            nli += [row["sent0"].strip(), row["sent1"].strip(), row["hard_neg"].strip()]
    sts = _sts_sentences(data_dir / "senteval" / "STS" / "STSBenchmark" / "sts-train.csv")
    sick = _sick_sentences(data_dir / "senteval" / "SICK" / "SICK_train.txt")
    sources = {"wiki": wiki, "nli_triplets": nli, "stsb_train": sts, "sick_train": sick}
    counts = {name: len(_distinct(values)) for name, values in sources.items()}
    return _distinct(s for values in sources.values() for s in values), counts


def real_queries(data_dir: Path, corpus: list[str]) -> tuple[list[str], dict[str, int]]:
    """Distinct STS-B dev + SICK trial sentences not in ``corpus``."""
    in_corpus = set(corpus)
    sts = [s for s in _distinct(_sts_sentences(data_dir / "senteval" / "STS" / "STSBenchmark" / "sts-dev.csv"))
           if s not in in_corpus]  # fmt: skip
    sick = [s for s in _distinct(_sick_sentences(data_dir / "senteval" / "SICK" / "SICK_trial.txt"))
            if s not in in_corpus]  # fmt: skip
    queries = _distinct(sts + sick)
    return queries, {"stsb_dev": len(sts), "sick_trial": len(sick)}


# ------------------------------------------------------------------------------------------------ generator A (corpus)
_SUBJECTS = """cat dog child teacher farmer doctor pilot musician student chef scientist artist lawyer nurse driver
painter baker soldier engineer poet writer singer dancer athlete fisherman gardener banker judge sailor tourist
programmer journalist photographer librarian mechanic carpenter plumber firefighter astronaut detective""".split()
_ADJECTIVES = """old young tired happy angry quiet famous clever lazy brave curious nervous proud lonely busy
cheerful careful honest gentle friendly strange polite wealthy hungry sleepy""".split()
_VERBS = """reads writes paints repairs buys sells cooks cleans studies watches finds loses builds opens closes
carries throws catches draws visits explores photographs describes ignores admires borrows""".split()
_OBJECTS = """book letter car house boat painting song recipe bicycle computer garden bridge window door
newspaper guitar map clock camera ticket umbrella lamp violin sandwich kite telescope puzzle basket""".split()
_PLACES = """in the park|at the station|near the river|in the kitchen|at the market|in the library|on the beach|
in the mountains|at the airport|in the city centre|at school|in a small village|on the train|in the hospital|
at the museum|in the forest|on the roof|in the garage|at the harbour|in the desert""".replace("\n", "").split("|")
_TIMES = """every morning|on Sundays|late at night|after lunch|before dinner|during the storm|in winter|
in the summer|at dawn|once a year|right now|yesterday|last week|tomorrow""".replace("\n", "").split("|")
_TEMPLATES = (
    "The {adj} {subj} {verb} a {obj} {place} {time}.",
    "A {subj} {verb} the {adj} {obj} {place}.",
    "{time_cap}, the {subj} {verb} an old {obj}.",
    "Why does the {adj} {subj} always {verb_base} {place}?",
    "My {subj} {verb} the {obj} {time}, and the {subj2} {verb2} a {obj2}.",
    "{place_cap}, a {adj} {subj} {verb} a {adj2} {obj}.",
)


def _base_form(verb: str) -> str:
    if verb.endswith("ies"):
        return verb[:-3] + "y"
    if verb.endswith(("ches", "shes", "sses")):
        return verb[:-2]
    return verb[:-1]


def synthetic_sentences(n: int, seed: int) -> list[str]:
    """Generator A: ``n`` pseudo-natural declarative sentences from word lists with a seeded RNG (reproducible)."""
    rng = np.random.default_rng(seed)

    def pick(words):
        return words[int(rng.integers(len(words)))]

    sentences = []
    for _ in range(n):
        verb = pick(_VERBS)
        place, time_ = pick(_PLACES), pick(_TIMES)
        sentences.append(
            pick(_TEMPLATES).format(
                adj=pick(_ADJECTIVES), adj2=pick(_ADJECTIVES), subj=pick(_SUBJECTS), subj2=pick(_SUBJECTS),
                verb=verb, verb2=pick(_VERBS), verb_base=_base_form(verb),
                obj=pick(_OBJECTS), obj2=pick(_OBJECTS), place=place, time=time_,
                place_cap=place[0].upper() + place[1:], time_cap=time_[0].upper() + time_[1:],
            )
        )  # fmt: skip
    return sentences


# ----------------------------------------------------------------------------------------------- generator B (queries)
_Q_PEOPLE = """kids grandparents nurses farmers students tourists chefs pilots painters teachers neighbours
climbers fishermen musicians engineers""".split()
_Q_TOPICS = """an old violin|a broken bicycle|fresh bread|a lost umbrella|a wooden boat|a cheap camera|a rare book|
a garden shed|a noisy clock|a paper kite|a city map|a train ticket|winter boots|a chess set|a small telescope|
a birthday cake|a leaking roof|a flat tyre""".replace("\n", "").split("|")
_Q_ACTIONS = """fix|find|sell|clean|paint|carry|photograph|borrow|describe|build|choose|protect""".split("|")
_Q_CONTEXTS = """on a rainy day|without tools|on a budget|before a long trip|near the sea|in a tiny flat|
for beginners|after a storm|at night|in the countryside""".replace("\n", "").split("|")
_Q_TEMPLATES = (
    "how do {people} {action} {topic} {context}?",
    "where can I {action} {topic} {context}",
    "best way to {action} {topic}",
    "{topic_cap} {context}: what do {people} do with it?",
    "tips for {people} who want to {action} {topic}",
    "is it hard to {action} {topic} {context}?",
)


def synthetic_queries(n: int, seed: int) -> list[str]:
    """Generator B: ``n`` search-style queries (questions, requests, fragments) with other templates and partly
    other words than :func:`synthetic_sentences`, so they do not come from the corpus's distribution."""
    rng = np.random.default_rng(seed)

    def pick(words):
        return words[int(rng.integers(len(words)))]

    out = []
    for _ in range(n):
        topic = pick(_Q_TOPICS)
        out.append(
            pick(_Q_TEMPLATES).format(
                people=pick(_Q_PEOPLE), action=pick(_Q_ACTIONS), topic=topic, topic_cap=topic[0].upper() + topic[1:],
                context=pick(_Q_CONTEXTS),
            )
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------- encoding
def encode_cached(model, texts: list[str], *, kind: str, cache_dir: Path | None, name: str, batch_size: int = 64,
                  processes: int | None = None, chunk_size: int = 5_000) -> tuple[np.ndarray, dict]:
    """Encode with :func:`st_prompts.search.chunked.encode_in_chunks` (resumable chunks under ``cache_dir/name``),
    returning the embeddings and timing info. Reused chunks are not timed; the info says how many were encoded."""
    start, cpu_start = time.perf_counter(), time.process_time()
    result = encode_in_chunks(model, texts, kind=kind, batch_size=batch_size, chunk_size=chunk_size,
                              cache_dir=(cache_dir / name) if cache_dir is not None else None, processes=processes,
                              progress=True)  # fmt: skip
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    encoded_docs = min(len(texts), result.chunks_encoded * chunk_size)
    info = {
        "docs": len(texts),
        "chunks_total": result.chunks_total,
        "chunks_encoded": result.chunks_encoded,
        "chunks_reused": result.chunks_reused,
        "seconds_this_run": round(seconds, 2),
        "cpu_seconds_this_run_main_process": round(cpu_seconds, 2),
        "docs_per_s_this_run": round(encoded_docs / seconds, 1) if result.chunks_encoded and seconds > 0 else None,
        "processes": processes or 1,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    # Keep the timing of the run that encoded the chunks beside them, so that a re-run reports it too.
    if cache_dir is not None:
        import json

        sidecar = cache_dir / name / "timing.json"
        if result.chunks_encoded:
            history = json.loads(sidecar.read_text()) if sidecar.exists() else []
            sidecar.write_text(json.dumps(history + [info], indent=2))
        elif sidecar.exists():
            info["earlier_runs_that_encoded"] = json.loads(sidecar.read_text())
    return result.embeddings, info
