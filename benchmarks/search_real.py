"""Real-text benchmark of :mod:`st_prompts.search`: does every approximate index type keep recall@10 >= 0.95 with
its *defaults* when the queries are real sentences from another distribution than the corpus?

Run by hand (not part of the test suite)::

    python benchmarks/search_real.py                                  # --data-dir ../shared/data
    python benchmarks/search_real.py --cache-dir /tmp/search-bench-cache --out-dir /tmp/out

* Corpus: every distinct real sentence of the shared data (Wikipedia, NLI triplets, STS-B train, SICK train; see
  ``benchmarks/search_data.py``). Queries: the distinct STS-B dev and SICK trial sentences that are not in the corpus.
  The corpus is deduplicated, so a document id stands for one distinct text and matching results by id is matching
  them by text.
* Model: the packaged all-MiniLM-L6-v2; documents through ``encode_document``, queries through ``encode_query``
  (cached, resumable chunks with ``--cache-dir``).
* For each approximate type (``ivf``, ``hnsw``, ``ivfpq``) the index is built the way a user gets it by default:
  ``SemanticIndex.from_embeddings(doc_embeddings, corpus, index_type=..., model=model)``, i.e. calibrated to
  recall@10 0.95 on the default sample (perturbed held-out documents + two-document blends + SNLI captions shipped
  with the package, never below nprobe 64 / ef_search 128; no benchmark query is seen). Recall@1 and recall@10 are then measured on the real queries against exact ``IndexFlatIP`` search.
* Also reported: the same types with the old fixed defaults (no calibration), the recall of the real queries over a
  sweep of the search parameter (the smallest value that really reaches 0.95), calibration on a user sample (half of
  the real queries) evaluated on the other half, and IVF-PQ with OPQ.
* Latency: FAISS search (+ exact re-ranking for IVF-PQ) + result wrapping, query embeddings precomputed; single
  queries (p50/p99) and batches of 100. Memory: FAISS codes + ids per vector in RAM, re-ranking vectors on disk,
  serialized size, process RSS growth while building.

Results go to ``OUT_DIR/search_real.json`` and ``OUT_DIR/search_real.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search_data import K, default_data_dir, encode_cached, latency, real_corpus, real_queries, recalls  # noqa: E402

SWEEPS = {"ivf": ("nprobe", (16, 32, 48, 64, 96, 128, 192, 256)),
          "hnsw": ("ef_search", (16, 24, 32, 48, 64, 96, 128, 192)),
          "ivfpq": ("nprobe", (16, 32, 48, 64, 96, 128, 192, 256))}  # fmt: skip


def rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    return psutil.Process().memory_info().rss


def serialized_mb(index) -> float:
    import faiss

    return float(faiss.serialize_index(index.index).nbytes) / 2**20


def positions_of(index, queries: np.ndarray) -> np.ndarray:
    return index.search_positions(queries, K)[1]


def describe(index, queries, truth, args, *, build_s: float, rss_delta: int | None, timed: bool = True) -> dict:
    from st_prompts.search.faiss_index import code_bytes_per_vector

    entry = {
        "params": dict(index.index_params),
        "build_seconds_total": round(build_s, 2),
        "faiss_build_seconds": index.info.get("build_seconds"),
        "calibration": {k: v for k, v in (index.info.get("calibration") or {}).items() if k != "criterion"} or None,
        **recalls(positions_of(index, queries), truth),
        "bytes_per_vector_in_ram": code_bytes_per_vector(index.index, index.index_type),
        "rerank_bytes_per_vector_on_disk": (index.vectors.dtype.itemsize * index.vectors.shape[1]
                                            if index.vectors is not None else None),  # fmt: skip
        "serialized_index_mb": round(serialized_mb(index), 2),
        "rss_delta_mb": round(rss_delta / 2**20, 1) if rss_delta is not None else None,
    }
    if timed:
        entry["latency"] = latency(index, queries, single=args.single_queries, batch=args.batch_queries)
    return entry


def issue_setting(data_dir: Path, corpus: list[str], doc_emb: np.ndarray, model, args) -> dict:
    """The setting of issue 12's figures: the distinct Wikipedia sentences as the corpus, the first 500 distinct
    STS-B dev sentences as queries; the previous fixed defaults vs. this version's calibrated defaults."""
    from search_data import _distinct, _sts_sentences

    from st_prompts.search import SemanticIndex

    wiki = set(_distinct(line.strip() for line in (data_dir / "train" / "wiki_sentences.txt").open(encoding="utf-8")))
    rows = [i for i, text in enumerate(corpus) if text in wiki]
    docs, vectors = [corpus[i] for i in rows], doc_emb[rows]
    queries = _distinct(_sts_sentences(data_dir / "senteval" / "STS" / "STSBenchmark" / "sts-dev.csv"))[:500]
    query_emb, _ = encode_cached(model, queries, kind="query", cache_dir=args.cache_dir, name="issue-queries")
    exact = SemanticIndex.from_embeddings(vectors, docs)
    truth = positions_of(exact, query_emb)
    out = {"corpus": len(docs), "queries": len(queries), "indexes": {}}
    for index_type in ("ivf", "hnsw", "ivfpq"):
        for label, kwargs in (("fixed defaults (previous version)", {"target_recall": None}),
                              ("calibrated defaults (this version)", {"model": model})):  # fmt: skip
            if index_type == "ivfpq" and "target_recall" in kwargs:
                continue  # no IVF-PQ in the previous version
            index = SemanticIndex.from_embeddings(vectors, docs, index_type=index_type, **kwargs)
            out["indexes"][f"{index_type}: {label}"] = {"params": dict(index.index_params),
                                                         **recalls(positions_of(index, query_emb), truth)}  # fmt: skip
            print(f"issue setting, {index_type} {label}: {out['indexes'][f'{index_type}: {label}']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="shared data (default: ../shared/data)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--cache-dir", type=Path, default=None, help="keep/reuse encoded chunks here")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--batch-size", type=int, default=64, help="encoding batch size")
    parser.add_argument("--processes", type=int, default=None, help="encoding worker processes")
    parser.add_argument("--single-queries", type=int, default=300, help="queries timed one at a time")
    parser.add_argument("--batch-queries", type=int, default=100, help="queries per batch for batched latency")
    parser.add_argument("--faiss-threads", type=int, default=None, help="OpenMP threads for FAISS (default: all)")
    parser.add_argument("--issue-setting-only", action="store_true",
                        help="only (re)measure the issue's setting and add it to an existing OUT_DIR/search_real.json")
    args = parser.parse_args(argv)

    import faiss
    import torch

    from st_prompts.loading import load_sentence_model
    from st_prompts.search import DEFAULT_EF_SEARCH, DEFAULT_NPROBE, SemanticIndex

    if args.faiss_threads:
        faiss.omp_set_num_threads(args.faiss_threads)
    data_dir = args.data_dir or default_data_dir()
    command = "python benchmarks/search_real.py " + " ".join(argv if argv is not None else sys.argv[1:])
    model = load_sentence_model(args.model)
    corpus, corpus_counts = real_corpus(data_dir)
    queries, query_counts = real_queries(data_dir, corpus)
    print(f"corpus {len(corpus)} distinct sentences {corpus_counts}; queries {len(queries)} {query_counts}")
    doc_emb, doc_info = encode_cached(model, corpus, kind="document", cache_dir=args.cache_dir, name="real-corpus",
                                      batch_size=args.batch_size, processes=args.processes)  # fmt: skip
    query_emb, query_info = encode_cached(model, queries, kind="query", cache_dir=args.cache_dir,
                                          name="real-queries", batch_size=args.batch_size)  # fmt: skip
    report = {
        "benchmark": "st_prompts.search real text",
        "command": command.strip(),
        "environment": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "faiss_threads": faiss.omp_get_max_threads(),
            "faiss_version": faiss.__version__,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "data": {"corpus": len(corpus), "corpus_sources_distinct": corpus_counts, "queries": len(queries),
                 "query_sources": query_counts, "matching": "by id on a deduplicated corpus (= by text)"},  # fmt: skip
        "encoding": {"documents": doc_info, "queries": query_info},
        "fixed_defaults_of_the_previous_version": {"nprobe": DEFAULT_NPROBE, "ef_search": DEFAULT_EF_SEARCH},
        "indexes": {},
    }

    if args.issue_setting_only:
        path = args.out_dir / "search_real.json"
        report = json.loads(path.read_text(encoding="utf-8"))
        report["issue_setting"] = issue_setting(data_dir, corpus, doc_emb, model, args)
        report["issue_setting"]["command"] = command.strip()
        report["issue_setting"]["load_average"] = [round(x, 2) for x in os.getloadavg()]
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        write_markdown(report, args.out_dir / "search_real.md")
        return 0
    report["issue_setting"] = issue_setting(data_dir, corpus, doc_emb, model, args)

    # Exact reference.
    gc.collect()
    rss0, start = rss_bytes(), time.perf_counter()
    exact = SemanticIndex.from_embeddings(doc_emb, corpus, model=model)
    build_s = time.perf_counter() - start
    truth = positions_of(exact, query_emb)
    report["indexes"]["flat"] = describe(exact, query_emb, truth, args, build_s=build_s,
                                         rss_delta=(rss_bytes() - rss0) if rss0 else None)  # fmt: skip
    print(f"flat: {report['indexes']['flat']['latency']['single']}")
    del exact

    for index_type in ("ivf", "hnsw", "ivfpq"):
        gc.collect()
        rss0, start = rss_bytes(), time.perf_counter()
        index = SemanticIndex.from_embeddings(doc_emb, corpus, index_type=index_type, model=model)
        build_s = time.perf_counter() - start
        entry = describe(index, query_emb, truth, args, build_s=build_s,
                         rss_delta=(rss_bytes() - rss0) if rss0 else None)  # fmt: skip
        name, values = SWEEPS[index_type]
        sweep = []
        for value in values:
            index.set_search_params(**{name: value})
            sweep.append({name: index.index_params[name], **recalls(positions_of(index, query_emb), truth)})
        entry["real_query_sweep"] = sweep
        entry["smallest_swept_value_reaching_0_95"] = next(
            (s[name] for s in sweep if s["recall_at_10"] >= 0.95), None
        )
        report["indexes"][index_type] = entry
        print(f"{index_type}: {entry['params']} recall@1 {entry['recall_at_1']} recall@10 {entry['recall_at_10']} "
              f"calibration {entry['calibration']['value']} (measured {entry['calibration']['measured_recall']}) "
              f"build {entry['build_seconds_total']} s", flush=True)  # fmt: skip

        # The previous fixed defaults, no calibration.
        fixed = SemanticIndex.from_embeddings(doc_emb, corpus, index_type=index_type, target_recall=None)
        report["indexes"][f"{index_type} (fixed defaults, no calibration)"] = {
            "params": dict(fixed.index_params), **recalls(positions_of(fixed, query_emb), truth)}  # fmt: skip
        # A user-supplied calibration sample: even-numbered real queries; evaluated on the odd-numbered ones.
        index.calibrate(0.95, query_emb[0::2])
        record = index.info["calibration"]
        report["indexes"][f"{index_type} (calibrated on half of the real queries, evaluated on the other half)"] = {
            "params": dict(index.index_params), "calibration_value": record["value"],
            "calibration_recall": record["measured_recall"],
            **recalls(positions_of(index, query_emb[1::2]), truth[1::2])}  # fmt: skip
        del index, fixed

    gc.collect()
    start = time.perf_counter()
    opq = SemanticIndex.from_embeddings(doc_emb, corpus, index_type="ivfpq", model=model, opq=True)
    report["indexes"]["ivfpq + OPQ"] = describe(opq, query_emb, truth, args, build_s=time.perf_counter() - start,
                                                rss_delta=None)  # fmt: skip
    del opq
    gc.collect()
    start = time.perf_counter()
    norerank = SemanticIndex.from_embeddings(doc_emb, corpus, index_type="ivfpq", model=model, rerank=0)
    report["indexes"]["ivfpq without re-ranking"] = describe(norerank, query_emb, truth, args, timed=False,
                                                             build_s=time.perf_counter() - start, rss_delta=None)  # fmt: skip
    report["environment"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "search_real.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    write_markdown(report, args.out_dir / "search_real.md")
    print(f"wrote {args.out_dir / 'search_real.json'} and {args.out_dir / 'search_real.md'}")
    return 0


def _fmt(value, digits=4):
    return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


def write_markdown(report: dict, path: Path) -> None:
    env, data = report["environment"], report["data"]
    lines = [
        "# Real-text search benchmark (`benchmarks/search_real.py`)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {env['cpu_count']} CPU cores ({env['platform']}), shared with other jobs: load average "
        f"{env['load_average_at_start']} at start, {env.get('load_average_at_end')} at the end (1/5/15 min; above 2 "
        f"means the cores were oversubscribed, so **timings are noisy and pessimistic**; recall is not affected). "
        f"torch threads {env['torch_threads']}, faiss threads {env['faiss_threads']}, faiss {env['faiss_version']}. "
        "Model: packaged all-MiniLM-L6-v2 (384 dims).",
        "",
        f"Corpus: **{data['corpus']:,} distinct real sentences** (distinct per source: "
        + ", ".join(f"{k} {v:,}" for k, v in data["corpus_sources_distinct"].items())
        + f"). Queries: **{data['queries']:,} real sentences** not in the corpus (STS-B dev "
        f"{data['query_sources']['stsb_dev']:,}, SICK trial {data['query_sources']['sick_trial']:,}). Results are "
        "matched by id on the deduplicated corpus, which is matching by text. Recall is measured against exact "
        "`IndexFlatIP` search over the same embeddings; k = 10. No benchmark query is used for the default "
        "calibration (it samples perturbed corpus documents, two-document blends and SNLI captions shipped with the "
        "package).",
        "",
        "## Defaults of every index type (calibrated at build time to recall@10 0.95)",
        "",
        "| index | params after calibration | recall@1 | recall@10 | calibration sample recall | build + calibration "
        "(s) | single p50 (ms) | single p99 (ms) | batched per query (ms) | RAM B/vector (codes + ids) | re-rank B/vector "
        "on disk | index size (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("flat", "ivf", "hnsw", "ivfpq", "ivfpq + OPQ"):
        e = report["indexes"][name]
        params = ", ".join(f"{k}={v}" for k, v in e["params"].items()) or "- (exact)"
        cal = e["calibration"]
        cal_text = (f"{cal['measured_recall']:.4f} ({cal['parameter']}={cal['value']}, {cal['seconds']} s)"
                    if cal else "-")  # fmt: skip
        lat = e["latency"]
        lines.append(
            f"| {name} | {params} | {e['recall_at_1']:.4f} | **{e['recall_at_10']:.4f}** | {cal_text} "
            f"| {e['build_seconds_total']:.1f} | {lat['single']['p50_ms']:.3f} | {lat['single']['p99_ms']:.3f} "
            f"| {lat['batched']['per_query_ms']:.4f} | {e['bytes_per_vector_in_ram']} "
            f"| {_fmt(e['rerank_bytes_per_vector_on_disk'])} | {e['serialized_index_mb']:.1f} |"
        )
    e = report["indexes"]["ivfpq without re-ranking"]
    lines += [
        "",
        f"IVF-PQ without re-ranking (`rerank=0`, calibrated the same way, to {e['params']}): recall@1 "
        f"{e['recall_at_1']:.4f}, recall@10 {e['recall_at_10']:.4f}"
        + ("" if (e["calibration"] or {}).get("reached", True) else " (calibration could not reach the target)")
        + ". RAM B/vector counts the FAISS codes and the int64 id of each inverted-list entry (HNSW: the float "
        "vector, graph links not counted; the index size column includes them). IVF-PQ's float16 re-ranking vectors "
        "(`vectors.npy`) are read from disk, memory-mapped, only for the candidates.",
        "",
        "## Without calibration, and with a user-supplied calibration sample",
        "",
        "| index | params | recall@1 | recall@10 |",
        "|---|---|---:|---:|",
    ]
    for name, e in report["indexes"].items():
        if "fixed defaults" in name or "half of the real queries" in name:
            params = ", ".join(f"{k}={v}" for k, v in e["params"].items())
            lines.append(f"| {name} | {params} | {e['recall_at_1']:.4f} | {e['recall_at_10']:.4f} |")
    issue = report.get("issue_setting")
    if issue:
        lines += [
            "",
            f"## The issue's setting: {issue['corpus']:,} distinct Wikipedia sentences, {issue['queries']} distinct "
            "STS-B dev queries",
            "",
            *([f"Measured separately with `{issue['command']}` (load average {issue.get('load_average')})", ""]
              if issue.get("command") else []),  # fmt: skip
            "| index | params | recall@1 | recall@10 |",
            "|---|---|---:|---:|",
        ]
        for name, e in issue["indexes"].items():
            params = ", ".join(f"{k}={v}" for k, v in e["params"].items())
            lines.append(f"| {name} | {params} | {e['recall_at_1']:.4f} | {e['recall_at_10']:.4f} |")
    lines += ["", "## Recall of the real queries against the search parameter", ""]
    for name in ("ivf", "hnsw", "ivfpq"):
        e = report["indexes"][name]
        key = SWEEPS[name][0]
        row = " | ".join(f"{s[key]}: {s['recall_at_10']:.4f}" for s in e["real_query_sweep"])
        lines.append(f"- {name} ({key}: recall@10): {row}; calibrated value {e['params'][key]}, smallest swept value "
                     f"reaching 0.95: {e['smallest_swept_value_reaching_0_95']}")  # fmt: skip
    enc = report["encoding"]["documents"]
    lines += [
        "",
        "## Encoding",
        "",
        f"{enc['docs']:,} documents in {enc['chunks_total']} chunks ({enc['chunks_encoded']} encoded by this run, "
        f"{enc['chunks_reused']} read from the cache of an earlier run"
        + (f"; {enc['docs_per_s_this_run']} docs/s with {enc['processes']} process(es), load average after "
           f"{enc['load_average_after']}" if enc["docs_per_s_this_run"] else "")  # fmt: skip
        + ")."
        + "".join(f" The run that encoded them: {run['seconds_this_run']} s, {run['docs_per_s_this_run']} docs/s with "
                  f"{run['processes']} worker process(es) of sentence-transformers' pool, load average after "
                  f"{run['load_average_after']} (the CPU was shared)."
                  for run in enc.get("earlier_runs_that_encoded", [])),  # fmt: skip
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
