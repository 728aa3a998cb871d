"""Benchmark of :mod:`st_prompts.search`: encoding, index build, recall of the approximate indexes, query latency.

Run by hand (not part of the test suite)::

    python benchmarks/search.py                                # --sizes 10000 100000
    python benchmarks/search.py --sizes 10000 --out-dir /tmp/bench --cache-dir /tmp/bench-cache

For each corpus size it

1. generates synthetic sentences from word lists with a seeded RNG (and 1,000 held-out query sentences),
2. encodes them with the real packaged all-MiniLM-L6-v2 (``minilm``) and reports the encoding time and docs/s
   (every document is really encoded; ``--cache-dir`` keeps the embeddings so that a re-run skips this step),
3. builds a flat (exact), an IVF and an HNSW index from the embeddings (``SemanticIndex.from_embeddings``) and
   reports the build time, the process RSS growth and the serialized index size,
4. reports recall@10 of IVF and HNSW against the exact search, with the defaults and over a sweep of
   ``nprobe`` / ``ef_search``,
5. reports query latency (FAISS search only, embeddings precomputed): single-query p50/p99 and batched (batches of
   ``--batch-queries`` queries) p50/p99 per batch, plus end-to-end single-query latency (encode + search).

Results go to ``OUT_DIR/search.json`` and ``OUT_DIR/search.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_prompts.loading import load_sentence_model  # noqa: E402
from st_prompts.search import DEFAULT_EF_SEARCH, DEFAULT_NPROBE, SemanticIndex  # noqa: E402

K = 10
NPROBE_SWEEP = (4, 8, 16, 32, 64, 128)
EF_SEARCH_SWEEP = (16, 32, 64, 128, 256)

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
    """``n`` pseudo-natural sentences built from word lists with a seeded RNG (reproducible)."""
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


def rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    return psutil.Process().memory_info().rss


def percentiles(samples_s: list[float]) -> dict[str, float]:
    values = np.asarray(samples_s) * 1000.0
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
            "mean_ms": float(values.mean())}  # fmt: skip


def recall_at_k(approx: list[list], exact: list[list]) -> float:
    hits = [len({h.id for h in a} & {h.id for h in e}) / max(1, len(e)) for a, e in zip(approx, exact)]
    return float(np.mean(hits))


def encode(model, texts: list[str], *, kind: str, batch_size: int, cache: Path | None, label: str):
    """Encode (or read the cache), returning (embeddings, encoding info).

    The encoding time measured when the cache was written is kept next to it and reported again (flagged
    ``"from_cache": true``), so a re-run with ``--cache-dir`` still reports the real encoding speed.
    """
    sidecar = cache.with_suffix(".json") if cache is not None else None
    if cache is not None and cache.exists():
        print(f"  {label}: embeddings read from {cache}")
        info = json.loads(sidecar.read_text()) if sidecar.exists() else {"seconds": None}
        return np.load(cache), {**info, "from_cache": True}
    method = getattr(model, f"encode_{kind}")
    start, cpu_start = time.perf_counter(), time.process_time()
    embeddings = method(texts, batch_size=batch_size, show_progress_bar=True, convert_to_numpy=True)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    embeddings = np.asarray(embeddings, dtype=np.float32)
    info = {"seconds": seconds, "cpu_seconds": cpu_seconds, "load_average_after": [round(x, 2) for x in os.getloadavg()], "from_cache": False}
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, embeddings)
        sidecar.write_text(json.dumps(info))
    return embeddings, info


def latency(index: SemanticIndex, queries: np.ndarray, *, single: int, batch: int) -> dict:
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
    batched["per_query_ms"] = batched["mean_ms"] / batch
    batched["batch_size"] = batch
    return {"single": percentiles(singles), "batched": batched}


def bench_size(model, n: int, args) -> dict:
    print(f"\n=== {n} documents ===")
    docs = synthetic_sentences(n, seed=n)
    queries = synthetic_sentences(args.queries, seed=10**9 + 7)
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    doc_emb, enc_info = encode(model, docs, kind="document", batch_size=args.batch_size,
                            cache=cache_dir / f"docs-{n}.npy" if cache_dir else None, label="documents")  # fmt: skip
    query_emb, _ = encode(model, queries, kind="query", batch_size=args.batch_size,
                          cache=cache_dir / f"queries-{args.queries}.npy" if cache_dir else None, label="queries")  # fmt: skip
    result: dict = {
        "num_docs": n,
        "num_queries": len(queries),
        "unique_docs": len(set(docs)),
        "mean_words_per_doc": float(np.mean([len(d.split()) for d in docs])),
        "encoding": {
            **enc_info,
            "docs_per_s": n / enc_info["seconds"] if enc_info["seconds"] else None,
            "batch_size": args.batch_size,
        },
        "indexes": {},
    }
    if enc_info["seconds"]:
        print(f"  encoding: {enc_info['seconds']:.1f} s ({n / enc_info['seconds']:.0f} docs/s)")

    import faiss

    exact_results = None
    for index_type in ("flat", "ivf", "hnsw"):
        gc.collect()
        rss0 = rss_bytes()
        start = time.perf_counter()
        index = SemanticIndex.from_embeddings(doc_emb, docs, index_type=index_type, show_progress_bar=False)
        build_s = time.perf_counter() - start
        rss1 = rss_bytes()
        size = int(faiss.serialize_index(index.index).nbytes)
        entry = {
            "params": dict(index.index_params),
            "build_seconds": build_s,
            "rss_delta_mb": (rss1 - rss0) / 2**20 if rss0 is not None else None,
            "index_size_mb": size / 2**20,
        }
        results = index.search_embeddings(query_emb, K)
        if index_type == "flat":
            exact_results = results
        else:
            entry["recall_at_10"] = recall_at_k(results, exact_results)
            sweep_name, sweep_values = ("nprobe", NPROBE_SWEEP) if index_type == "ivf" else ("ef_search", EF_SEARCH_SWEEP)
            sweep = []
            for value in sweep_values:
                index.set_search_params(**{sweep_name: value})
                start = time.perf_counter()
                approx = index.search_embeddings(query_emb, K)
                elapsed = time.perf_counter() - start
                sweep.append({sweep_name: index.index_params[sweep_name], "recall_at_10": recall_at_k(approx, exact_results),
                              "batched_ms_per_query": 1000 * elapsed / len(query_emb)})  # fmt: skip
            entry["sweep"] = sweep
            index.set_search_params(**{sweep_name: entry["params"][sweep_name]})
        entry["latency"] = latency(index, query_emb, single=args.single_queries, batch=args.batch_queries)
        print(f"  {index_type:5s} build {build_s:7.2f} s  size {entry['index_size_mb']:7.1f} MiB  "
              f"recall@10 {entry.get('recall_at_10', 1.0):.4f}  single p50 {entry['latency']['single']['p50_ms']:.3f} ms  "
              f"p99 {entry['latency']['single']['p99_ms']:.3f} ms  params {entry['params']}")  # fmt: skip
        result["indexes"][index_type] = entry
        del index
    # End to end: one query string -> encode -> exact search.
    index = SemanticIndex.from_embeddings(doc_emb, docs, index_type="flat", model=model)
    index.search(queries[0], K)
    e2e = []
    for query in queries[: args.e2e_queries]:
        start = time.perf_counter()
        index.search(query, K)
        e2e.append(time.perf_counter() - start)
    result["end_to_end_single_query_flat"] = percentiles(e2e)
    print(f"  end-to-end single query (encode + flat search): p50 {result['end_to_end_single_query_flat']['p50_ms']:.1f} ms")
    return result


def write_markdown(report: dict, path: Path) -> None:
    env = report["environment"]
    lines = [
        "# Semantic search benchmark (`benchmarks/search.py`)",
        "",
        f"Model: packaged all-MiniLM-L6-v2 (384 dims), CPU. Machine: {env['cpu_count']} CPU cores "
        f"({env['platform']}), torch threads {env['torch_threads']}, faiss threads {env['faiss_threads']}, "
        f"faiss {env['faiss_version']}. Load average at start: {env['load_average']}.",
        "",
        "Corpus: synthetic sentences generated from word lists with a seeded RNG (6 templates); queries: "
        f"{report['config']['queries']} held-out synthetic sentences. Every document is really encoded with MiniLM "
        "(no extrapolation). Recall@10 is measured against the exact `IndexFlatIP` search on the same embeddings. "
        "Latencies are FAISS search only (query embeddings precomputed) unless stated; k = 10.",
        "",
        "Timings depend heavily on how busy the machine is: a load average above the number of cores means other jobs "
        "shared the CPUs, and then absolute times (encoding above all) are pessimistic; recall figures are not "
        "affected.",
        "",
        "## Encoding",
        "",
        "| docs | unique | words/doc | encode wall time (s) | docs/s (wall) | CPU time (s) | docs per CPU-s "
        "| load avg after |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        enc = r["encoding"]
        secs = f"{enc['seconds']:.1f}" if enc["seconds"] else "-"
        rate = f"{enc['docs_per_s']:.0f}" if enc["docs_per_s"] else "-"
        load = enc.get("load_average_after", "-")
        cpu = enc.get("cpu_seconds")
        cpu_cols = f"{cpu:.1f} | {r['num_docs'] / cpu:.0f}" if cpu else "- | -"
        lines.append(
            f"| {r['num_docs']} | {r['unique_docs']} | {r['mean_words_per_doc']:.1f} | {secs} | {rate} | {cpu_cols} "
            f"| {load} |"
        )
    lines += [
        "",
        "## Index build, size, recall and latency",
        "",
        "| docs | index | params | build (s) | RSS Δ (MiB) | size (MiB) | recall@10 | single p50 (ms) | single p99 (ms) "
        "| batch p50 (ms) | batch p99 (ms) | batched per query (ms) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        for name, e in r["indexes"].items():
            lat = e["latency"]
            params = ", ".join(f"{k}={v}" for k, v in e["params"].items()) or "-"
            rss = f"{e['rss_delta_mb']:.1f}" if e["rss_delta_mb"] is not None else "-"
            recall = f"{e['recall_at_10']:.4f}" if "recall_at_10" in e else "1 (exact)"
            lines.append(
                f"| {r['num_docs']} | {name} | {params} | {e['build_seconds']:.2f} | {rss} | {e['index_size_mb']:.1f} "
                f"| {recall} | {lat['single']['p50_ms']:.3f} | {lat['single']['p99_ms']:.3f} "
                f"| {lat['batched']['p50_ms']:.2f} | {lat['batched']['p99_ms']:.2f} | {lat['batched']['per_query_ms']:.4f} |"
            )
    batch = report["config"]["batch_queries"]
    lines += ["", f"Batched = batches of {batch} queries; single = one query per call.", "",
              "## Recall@10 vs. search-time parameter", ""]  # fmt: skip
    for r in report["results"]:
        for name in ("ivf", "hnsw"):
            e = r["indexes"][name]
            key = "nprobe" if name == "ivf" else "ef_search"
            row = " | ".join(f"{s[key]}: {s['recall_at_10']:.4f} ({s['batched_ms_per_query']:.3f} ms/q)" for s in e["sweep"])
            lines.append(f"- {r['num_docs']} docs, {name} ({key}: recall (batched ms/query)): {row}")
    lines += ["", "## End-to-end single query (encode with MiniLM + exact search)", ""]
    for r in report["results"]:
        e2e = r["end_to_end_single_query_flat"]
        lines.append(f"- {r['num_docs']} docs: p50 {e2e['p50_ms']:.1f} ms, p99 {e2e['p99_ms']:.1f} ms")
    lines += ["", f"Defaults at the time of the run: IVF nprobe={DEFAULT_NPROBE}, HNSW ef_search={DEFAULT_EF_SEARCH}.", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--batch-size", type=int, default=64, help="encoding batch size")
    parser.add_argument("--queries", type=int, default=1000, help="held-out queries for recall and batched latency")
    parser.add_argument("--single-queries", type=int, default=300, help="queries timed one at a time")
    parser.add_argument("--batch-queries", type=int, default=100, help="queries per batch for batched latency")
    parser.add_argument("--e2e-queries", type=int, default=100, help="queries timed end to end (encode + search)")
    parser.add_argument("--faiss-threads", type=int, default=None, help="OpenMP threads for FAISS (default: all)")
    parser.add_argument("--cache-dir", default=None, help="keep/reuse embeddings here (.npy) to skip re-encoding")
    args = parser.parse_args(argv)

    import faiss
    import torch

    if args.faiss_threads:
        faiss.omp_set_num_threads(args.faiss_threads)
    model = load_sentence_model(args.model)
    report = {
        "benchmark": "st_prompts.search",
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "environment": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "faiss_threads": faiss.omp_get_max_threads(),
            "faiss_version": faiss.__version__,
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
        "defaults": {"nprobe": DEFAULT_NPROBE, "ef_search": DEFAULT_EF_SEARCH},
        "results": [],
    }
    warnings.filterwarnings("ignore", message=".*repeat the text of an earlier one.*")  # synthetic duplicates
    for n in args.sizes:
        report["results"].append(bench_size(model, n, args))
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "search.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        write_markdown(report, args.out_dir / "search.md")
    print(f"\nwrote {args.out_dir / 'search.json'} and {args.out_dir / 'search.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
