"""Scale benchmark of :mod:`st_prompts.search`: build time, memory and latency at 100k and 1M documents, with recall
against exact search for queries that do not come from the corpus's generator.

Run by hand (not part of the test suite)::

    python benchmarks/search.py --cache-dir /tmp/search-bench-cache            # --sizes 100000 1000000
    python benchmarks/search.py --sizes 100000 --cache-dir /tmp/search-bench-cache --out-dir /tmp/out

What is real and what is synthetic (also written into the report):

* **Documents, 100k**: the 44,056 distinct real sentences of the shared data (see ``search_data.py``) plus synthetic
  sentences from *generator A* (six declarative templates over word lists) up to 100,000; **every document is really
  encoded** with the packaged MiniLM (chunked, resumable, ``--cache-dir``).
* **Documents, 1M**: those 100,000 real encodings plus 900,000 **synthetic vectors derived from them** (not
  encodings of any text): ``normalize(x_a + 0.6 * (x_b - x_c))`` for random encoded documents a, b, c, i.e. a
  document plus data-shaped noise (cosine ~0.8 to ``x_a``), so that the 1M set keeps the real embeddings' spread and
  topics at 10x the density. Encoding 1M sentences was not done (the measured encoding speed gives the
  extrapolated time).
* **Queries**: two sets, neither from generator A: the real STS-B dev + SICK trial sentences not in the corpus, and
  1,000 search-style queries from *generator B* (other templates and partly other words).

For each index type (at 1M only the exact reference and IVF-PQ, the type meant for that size) it reports the FAISS
build time and the calibration time of the default build, recall@1/@10 of each query set against exact search,
single-query and batched latency (FAISS search + exact re-ranking for IVF-PQ + result wrapping, query embeddings
precomputed), bytes per vector in RAM (FAISS codes + ids) and on disk, and, for IVF-PQ, the memory of a *fresh process*
that loads the saved index with ``mmap=True`` and serves queries (RssAnon = heap, RssFile = mapped file pages, which
the OS can evict), optionally inside a memory cgroup smaller than the index files (``--memory-limit-mb``).

Results go to ``OUT_DIR/search.json`` and ``OUT_DIR/search.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search_data import (  # noqa: E402
    K,
    default_data_dir,
    encode_cached,
    latency,
    percentiles,
    real_corpus,
    real_queries,
    recalls,
    synthetic_queries,
    synthetic_sentences,
)


def rss_mb() -> float | None:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    return psutil.Process().memory_info().rss / 2**20


def exact_truth(vectors: np.ndarray, query_sets: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    import faiss

    start = time.perf_counter()
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    build = time.perf_counter() - start
    truth, times = {}, []
    for name, queries in query_sets.items():
        start = time.perf_counter()
        truth[name] = flat.search(queries, K)[1]
        times.append((time.perf_counter() - start) / len(queries))
    single = []
    for row in next(iter(query_sets.values()))[:50]:
        start = time.perf_counter()
        flat.search(row[None, :], K)
        single.append(time.perf_counter() - start)
    info = {"build_seconds": round(build, 2), "batched_ms_per_query": round(1000 * float(np.mean(times)), 3),
            "single": percentiles(single), "bytes_per_vector_in_ram": 4 * vectors.shape[1]}  # fmt: skip
    return truth, info


def derived_vectors(base: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` synthetic vectors ``normalize(x_a + 0.6 (x_b - x_c))`` from random rows of ``base`` (documented above)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, base.shape[1]), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        a, b, c = (rng.integers(len(base), size=m) for _ in range(3))
        chunk = base[a] + 0.6 * (base[b] - base[c])
        chunk /= np.linalg.norm(chunk, axis=1, keepdims=True)
        out[start : start + m] = chunk
    return out


PROBE = r"""
import json, sys, time, numpy as np
sys.path.insert(0, {repo!r})
def status():
    fields = {{}}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields
out = {{"start": status()}}
from st_prompts.search import SemanticIndex
import faiss
out["imported"] = status()
t = time.perf_counter()
index = SemanticIndex.load({index_dir!r}, mmap=True)
out["load_seconds"] = round(time.perf_counter() - t, 3)
out["loaded"] = status()
queries = np.load({queries!r})
lat = []
for row in queries:
    t = time.perf_counter(); hits = index.search_embeddings(row[None, :], 10); lat.append(time.perf_counter() - t)
out["after_queries"] = status()
out["queries"] = len(queries)
out["single_p50_ms"] = float(np.percentile(np.array(lat) * 1000, 50))
out["single_p99_ms"] = float(np.percentile(np.array(lat) * 1000, 99))
out["first_hit"] = [hits[0][0].id, hits[0][0].text[:60]]
print("PROBE" + json.dumps(out))
"""


def evict_from_page_cache(index_dir: Path) -> None:
    """Drop the index files' pages from the OS page cache (``posix_fadvise(DONTNEED)``, these files only), so that
    the probe reads them from disk and its memory cgroup is charged for what it maps."""
    for path in index_dir.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def serve_probe(index_dir: Path, queries: np.ndarray, memory_limit_mb: int | None) -> dict:
    """Load the saved index with mmap=True in a fresh process (optionally inside a cgroup-v1 memory limit) and search."""
    queries_file = index_dir.parent / "probe-queries.npy"
    np.save(queries_file, queries)
    evict_from_page_cache(index_dir)
    code = PROBE.format(repo=str(Path(__file__).resolve().parents[1]), index_dir=str(index_dir),
                        queries=str(queries_file))  # fmt: skip
    cgroup = None
    preexec = None
    result: dict = {"memory_limit_mb": None}
    if memory_limit_mb:
        cgroup = Path("/sys/fs/cgroup/memory") / f"st-prompts-search-probe-{os.getpid()}"
        try:
            cgroup.mkdir()
            (cgroup / "memory.limit_in_bytes").write_text(str(memory_limit_mb * 2**20))
            procs = cgroup / "cgroup.procs"
            preexec = lambda: procs.write_text(str(os.getpid()))  # noqa: E731 - runs in the child before exec
            result["memory_limit_mb"] = memory_limit_mb
        except OSError as exc:
            result["memory_limit_error"] = str(exc)
            cgroup = None
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=preexec,
                              timeout=1800)  # fmt: skip
    finally:
        if cgroup is not None:
            try:
                result["cgroup_max_usage_mb"] = round(int((cgroup / "memory.max_usage_in_bytes").read_text()) / 2**20, 1)
                result["cgroup_failcnt"] = int((cgroup / "memory.failcnt").read_text())
            except OSError:
                pass
            for _ in range(20):
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.5)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE")]
    if proc.returncode != 0 or not lines:
        result["error"] = f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        return result
    result.update(json.loads(lines[-1][5:]))
    return result


def file_sizes(index_dir: Path) -> dict[str, float]:
    return {p.name: round(p.stat().st_size / 2**20, 2) for p in sorted(index_dir.iterdir())}


def bench_size(n: int, docs: list[str], vectors: np.ndarray, query_sets: dict[str, np.ndarray], model, args,
               types: tuple[str, ...]) -> dict:  # fmt: skip
    from st_prompts.search import SemanticIndex
    from st_prompts.search.faiss_index import code_bytes_per_vector

    print(f"\n=== {n:,} documents ===", flush=True)
    truth, exact_info = exact_truth(vectors, query_sets)
    result = {"num_docs": n, "exact_flat": exact_info, "indexes": {}}
    print(f"  exact: {exact_info}", flush=True)
    first_queries = next(iter(query_sets.values()))
    for index_type in types:
        gc.collect()
        rss0, start = rss_mb(), time.perf_counter()
        index = SemanticIndex.from_embeddings(vectors, docs, index_type=index_type, model=model,
                                              show_progress_bar=False)  # fmt: skip
        total = time.perf_counter() - start
        calibration = {k: v for k, v in index.info["calibration"].items() if k != "criterion"}
        entry = {
            "params": dict(index.index_params),
            "faiss_build_seconds": index.info["build_seconds"],
            "calibration_seconds": calibration["seconds"],
            "build_total_seconds": round(total, 2),
            "rss_delta_mb": round(rss_mb() - rss0, 1) if rss0 is not None else None,
            "calibration": calibration,
            "bytes_per_vector_in_ram": code_bytes_per_vector(index.index, index_type),
            "recall": {name: recalls(index.search_positions(q, K)[1], truth[name]) for name, q in query_sets.items()},
            "latency": latency(index, first_queries, single=args.single_queries, batch=args.batch_queries),
        }
        # A user-supplied calibration sample: half of each query set, evaluated on its other half.
        entry["calibrated_on_own_queries"] = {}
        for name, queries in query_sets.items():
            record = index.calibrate(0.95, queries[0::2])
            entry["calibrated_on_own_queries"][name] = {
                "params": dict(index.index_params), "calibration_recall": record["measured_recall"],
                **recalls(index.search_positions(queries[1::2], K)[1], truth[name][1::2])}  # fmt: skip
        index.calibrate(0.95)  # back to the default calibration before saving
        with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
            start = time.perf_counter()
            index.save(Path(tmp) / "idx")
            entry["save_seconds"] = round(time.perf_counter() - start, 2)
            entry["files_mb"] = file_sizes(Path(tmp) / "idx")
            if index_type == "ivfpq":
                del index
                gc.collect()
                entry["mmap_serving"] = serve_probe(Path(tmp) / "idx", first_queries[: args.single_queries], None)
                if args.memory_limit_mb:
                    entry["mmap_serving_in_memory_cgroup"] = serve_probe(
                        Path(tmp) / "idx", first_queries[: args.single_queries], args.memory_limit_mb
                    )
        result["indexes"][index_type] = entry
        print(f"  {index_type}: {entry['params']} build {entry['faiss_build_seconds']} s + calibration "
              f"{entry['calibration_seconds']} s, recall {entry['recall']}, single p50 "
              f"{entry['latency']['single']['p50_ms']} ms, {entry['bytes_per_vector_in_ram']} B/vector, files "
              f"{entry['files_mb']}", flush=True)  # fmt: skip
        if "mmap_serving" in entry:
            print(f"  mmap serving: {entry['mmap_serving']}", flush=True)
            print(f"  in cgroup: {entry.get('mmap_serving_in_memory_cgroup')}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--data-dir", type=Path, default=None, help="shared data (default: ../shared/data)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--cache-dir", type=Path, default=None, help="keep/reuse encoded chunks here")
    parser.add_argument("--work-dir", type=Path, default=None, help="where saved indexes go while measured")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--batch-size", type=int, default=64, help="encoding batch size")
    parser.add_argument("--processes", type=int, default=None, help="encoding worker processes")
    parser.add_argument("--single-queries", type=int, default=300, help="queries timed one at a time")
    parser.add_argument("--batch-queries", type=int, default=100, help="queries per batch for batched latency")
    parser.add_argument("--memory-limit-mb", type=int, default=None,
                        help="also serve the saved IVF-PQ index from a process in a cgroup-v1 memory limit (root)")
    args = parser.parse_args(argv)

    import faiss
    import torch

    from st_prompts.loading import load_sentence_model

    command = "python benchmarks/search.py " + " ".join(argv if argv is not None else sys.argv[1:])
    data_dir = args.data_dir or default_data_dir()
    model = load_sentence_model(args.model)
    real, _ = real_corpus(data_dir)
    real_q, _ = real_queries(data_dir, real)
    base_n = 100_000 if max(args.sizes) > len(real) else len(real)  # encoded documents: real + generator A
    synthetic = synthetic_sentences(base_n - len(real), seed=2024)
    docs = real + synthetic
    real_emb, real_info = encode_cached(model, real, kind="document", cache_dir=args.cache_dir, name="real-corpus",
                                        batch_size=args.batch_size, processes=args.processes)  # fmt: skip
    syn_emb, syn_info = encode_cached(model, synthetic, kind="document", cache_dir=args.cache_dir,
                                      name="synthetic-a-100k", batch_size=args.batch_size,
                                      processes=args.processes)  # fmt: skip
    vectors = np.concatenate([real_emb, syn_emb])
    query_sets = {
        "real (STS-B dev + SICK trial)": encode_cached(model, real_q, kind="query", cache_dir=args.cache_dir,
                                                       name="real-queries")[0],
        "synthetic generator B": encode_cached(model, synthetic_queries(1000, seed=7), kind="query",
                                               cache_dir=args.cache_dir, name="synthetic-b-queries")[0],
    }  # fmt: skip
    encoded = [i for i in (real_info, syn_info)]
    docs_per_s = [r.get("docs_per_s_this_run") or (r.get("earlier_runs_that_encoded") or [{}])[-1].get("docs_per_s_this_run")
                  for r in encoded]  # fmt: skip
    report = {
        "benchmark": "st_prompts.search scale",
        "command": command.strip(),
        "environment": {
            "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "faiss_threads": faiss.omp_get_max_threads(),
            "faiss_version": faiss.__version__, "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },  # fmt: skip
        "data": {
            "real_documents": len(real), "synthetic_generator_a_documents": len(synthetic),
            "derived_vectors_formula": "normalize(x_a + 0.6 * (x_b - x_c)), a, b, c uniform over the encoded documents",
            "queries": {name: len(q) for name, q in query_sets.items()},
        },  # fmt: skip
        "encoding": {"real": real_info, "synthetic_generator_a": syn_info,
                     "docs_per_s_measured": docs_per_s},  # fmt: skip
        "results": [],
    }
    for n in sorted(args.sizes):
        if n <= len(vectors):
            size_vectors, size_docs = vectors[:n], docs[:n]
            kind = "all encoded (real + generator A)"
            types = ("ivf", "hnsw", "ivfpq")
        else:
            extra = derived_vectors(vectors, n - len(vectors), seed=n)
            size_vectors = np.concatenate([vectors, extra])
            size_docs = docs + [f"synthetic vector {i} (derived, no text)" for i in range(len(extra))]
            kind = f"{len(vectors):,} encoded + {len(extra):,} derived synthetic vectors"
            types = ("ivfpq",)
            del extra
        result = bench_size(n, size_docs, size_vectors, query_sets, model, args, types)
        result["documents"] = kind
        rate = min(r for r in docs_per_s if r)
        result["extrapolated_encoding_seconds_at_measured_rate"] = round(n / rate)
        report["results"].append(result)
        report["environment"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "search.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        write_markdown(report, args.out_dir / "search.md")
        del size_vectors, size_docs
        gc.collect()
    print(f"\nwrote {args.out_dir / 'search.json'} and {args.out_dir / 'search.md'}")
    return 0


def write_markdown(report: dict, path: Path) -> None:
    env, data = report["environment"], report["data"]
    qnames = list(data["queries"])
    lines = [
        "# Search at scale: 100k and 1M documents (`benchmarks/search.py`)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {env['cpu_count']} CPU cores ({env['platform']}), **shared with other jobs**: load average "
        f"{env['load_average_at_start']} at start, {env.get('load_average_at_end')} at the end (1/5/15 min; above 2 "
        "the cores were oversubscribed, so timings are noisy and pessimistic; recall is not affected). faiss "
        f"{env['faiss_version']}, {env['faiss_threads']} faiss threads. Model: packaged all-MiniLM-L6-v2 (384 dims).",
        "",
        "**What is real, what is synthetic.** 100k: "
        f"{data['real_documents']:,} distinct real sentences + {data['synthetic_generator_a_documents']:,} synthetic "
        "sentences from generator A (declarative templates), **all really encoded**. 1M: those 100k encodings + "
        f"900k **derived synthetic vectors** ({data['derived_vectors_formula']}; no text, not encodings). Queries come "
        "from no corpus generator: "
        + ", ".join(f"{name} ({count:,})" for name, count in data["queries"].items())
        + ". Every index is the default build (calibrated to recall@10 0.95 on perturbed held-out documents + "
        "two-document blends + SNLI captions shipped with the package, never below nprobe 64 / ef_search 128; no "
        "benchmark query seen). Recall is against exact `IndexFlatIP` search on the same "
        "vectors.",
        "",
        "| docs | documents | index | params (after calibration) | FAISS build (s) | calibration (s) "
        f"| recall@1 / @10: {qnames[0]} | recall@1 / @10: {qnames[1]} | single p50 (ms) | single p99 (ms) "
        "| batched per query (ms) | RAM B/vector (codes + ids) | files on disk (MiB) |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        ex = r["exact_flat"]
        lines.append(
            f"| {r['num_docs']:,} | {r['documents']} | flat (exact reference) | - | {ex['build_seconds']} | - | 1 / 1 "
            f"| 1 / 1 | {ex['single']['p50_ms']:.2f} | {ex['single']['p99_ms']:.2f} | {ex['batched_ms_per_query']:.3f} "
            f"| {ex['bytes_per_vector_in_ram']} | - |"
        )
        for name, e in r["indexes"].items():
            params = ", ".join(f"{k}={v}" for k, v in e["params"].items())
            rec = [e["recall"][q] for q in qnames]
            files = ", ".join(f"{k} {v}" for k, v in e["files_mb"].items() if v >= 0.1)
            lat = e["latency"]
            lines.append(
                f"| {r['num_docs']:,} | {r['documents']} | {name} | {params} | {e['faiss_build_seconds']} "
                f"| {e['calibration_seconds']} | {rec[0]['recall_at_1']:.4f} / **{rec[0]['recall_at_10']:.4f}** "
                f"| {rec[1]['recall_at_1']:.4f} / **{rec[1]['recall_at_10']:.4f}** | {lat['single']['p50_ms']:.3f} "
                f"| {lat['single']['p99_ms']:.3f} | {lat['batched']['per_query_ms']:.4f} "
                f"| {e['bytes_per_vector_in_ram']} | {files} |"
            )
    lines += [
        "",
        "### Calibrated on a sample of the queries' own distribution",
        "",
        "Each query set split in two: `index.calibrate(0.95, queries[0::2])`, recall measured on `queries[1::2]` "
        "(the route for users whose queries differ from their documents).",
        "",
        "| docs | index | query set | params | recall@1 | recall@10 |",
        "|---:|---|---|---|---:|---:|",
    ]
    for r in report["results"]:
        for name, e in r["indexes"].items():
            for qname, c in e.get("calibrated_on_own_queries", {}).items():
                params = ", ".join(f"{k}={v}" for k, v in c["params"].items() if k in ("nprobe", "ef_search", "rerank"))
                lines.append(f"| {r['num_docs']:,} | {name} | {qname} | {params} | {c['recall_at_1']:.4f} "
                             f"| {c['recall_at_10']:.4f} |")  # fmt: skip
    lines += [
        "",
        "RAM B/vector: the FAISS codes + the int64 id of each inverted-list entry (IVF, IVF-PQ), or the float32 vector "
        "(flat, HNSW; HNSW's graph links come on top, see the file size). IVF-PQ also keeps float16 vectors for exact "
        "re-ranking in `vectors.npy` **on disk** (768 B/vector), memory-mapped and read only for the candidates.",
        "",
        "## Serving a saved IVF-PQ index memory-mapped (fresh process, `SemanticIndex.load(dir, mmap=True)`)",
        "",
        "| docs | files (MiB) | memory limit | load (s) | RssAnon after load (MiB) | RssFile after load (MiB) "
        "| RssAnon after queries | RssFile after queries | single p50 / p99 (ms) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        e = r["indexes"].get("ivfpq")
        if not e:
            continue
        total = sum(e["files_mb"].values())
        for key in ("mmap_serving", "mmap_serving_in_memory_cgroup"):
            p = e.get(key)
            if not p:
                continue
            if "error" in p:
                lines.append(f"| {r['num_docs']:,} | {total:.0f} | {p.get('memory_limit_mb')} | error: "
                             f"{p['error'][:200]} | | | | | |")  # fmt: skip
                continue
            limit = f"{p['memory_limit_mb']} MiB cgroup (peak {p.get('cgroup_max_usage_mb')} MiB)" if p.get(
                "memory_limit_mb") else "none"  # fmt: skip
            lines.append(
                f"| {r['num_docs']:,} | {total:.0f} | {limit} | {p['load_seconds']} | {p['loaded']['RssAnon']:.0f} "
                f"| {p['loaded']['RssFile']:.0f} | {p['after_queries']['RssAnon']:.0f} "
                f"| {p['after_queries']['RssFile']:.0f} | {p['single_p50_ms']:.2f} / {p['single_p99_ms']:.2f} |"
            )
    lines += [
        "",
        "RssAnon is the process's own heap (Python, numpy, faiss, the IVF-PQ centroids and anything FAISS reads "
        "into RAM); RssFile counts pages of the mapped files (inverted lists, `vectors.npy`, `docs.jsonl`) that are "
        "resident right now, which the OS evicts under memory pressure. The baseline of a Python process with numpy "
        "and faiss imported is included. The index files are dropped from the page cache (`posix_fadvise` "
        "DONTNEED, these files only) before each probe, so the cgroup is charged for the pages the probe maps. "
        "Where the files are larger than the cgroup's limit, the index serves all the same: mapped pages are evicted "
        "and read again as needed (compare the files and the peak columns).",
        "",
        "## Encoding",
        "",
    ]
    enc = report["encoding"]
    for name in ("real", "synthetic_generator_a"):
        info = enc[name]
        runs = info.get("earlier_runs_that_encoded") or ([info] if info.get("chunks_encoded") else [])
        for run in runs:
            lines.append(f"- {name}: {run['docs']:,} documents, {run['seconds_this_run']} s wall, "
                         f"{run['docs_per_s_this_run']} docs/s with {run['processes']} process(es), load average "
                         f"after {run['load_average_after']}")  # fmt: skip
    for r in report["results"]:
        lines.append(f"- **Extrapolated**, not measured: encoding {r['num_docs']:,} documents at the slowest measured "
                     f"rate would take ~{r['extrapolated_encoding_seconds_at_measured_rate'] / 3600:.1f} h on this "
                     "shared machine (MiniLM on a quiet 2-core CPU runs at very roughly 500 docs/s, i.e. "
                     f"~{r['num_docs'] / 500 / 60:.0f} min).")  # fmt: skip
    lines += ["", VECTOR_DB_LINK, ""]
    path.write_text("\n".join(lines), encoding="utf-8")


#: Kept in the generated page: the vector databases are measured by benchmarks/vector_db.py, on a page of its own.
VECTOR_DB_LINK = ("## Vector databases\n\nMilvus Lite, LanceDB and Qdrant next to FAISS on the same vectors "
                  "(recall@10, queries/s, build time, disk): [vector_db.md](vector_db.md), generated by "
                  "`benchmarks/vector_db.py`.")


if __name__ == "__main__":
    sys.exit(main())
