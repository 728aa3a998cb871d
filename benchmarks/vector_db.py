"""Vector databases next to FAISS, on the same vectors: which one should an index outgrow one machine into?

Run by hand (not part of the test suite)::

    nice -n 5 python benchmarks/vector_db.py                      # --data-dir ../shared/data --synthetic 50000
    nice -n 5 python benchmarks/vector_db.py --sets synthetic --append   # one set again, the other's results kept

* **Real set**: the distinct sentences of ``train/wiki_sentences.txt`` of the shared data (Wikipedia), 500 of them
  held out at random (seed 0) as queries, the rest the corpus; encoded with the packaged all-MiniLM-L6-v2
  (documents with ``encode_document``, queries with ``encode_query``; cached with ``--cache-dir``).
* **Synthetic set** (``--synthetic N``): N vectors derived from the real encodings, ``normalize(x_a + 0.6 * (x_b -
  x_c))`` for random real documents a, b, c (as ``benchmarks/search.py`` does for 1M): data-shaped, clustered like
  the real embeddings, not encodings of any text. Queries: the same 500 real held-out queries.
* Every engine gets the same L2-normalised float32 vectors and inner-product (cosine) search, k = 10. Recall@10 is the
  overlap with exact brute-force (numpy) top 10. Queries/s: one query per call (the first ``--single`` queries) and
  batches of 100 (all queries), client-side wall time including the client's result objects, query vectors
  precomputed. Build: insert + index build (+ load) wall time. Disk: the bytes of the folder the engine wrote.
* Engines in embedded mode: FAISS through :class:`st_prompts.search.SemanticIndex` (flat, and IVF / HNSW as the
  package builds them by default: calibrated to recall@10 0.95), Milvus Lite (``pymilvus`` + ``milvus-lite``; FLAT,
  and IVF_FLAT / HNSW with FAISS's calibrated parameters), LanceDB (no index = exact scan, IVF_FLAT with FAISS's
  nlist / nprobe, IVF_HNSW_SQ), Qdrant local mode (``QdrantClient(path=...)``: exact scan; the local mode has no
  HNSW).

Results go to ``OUT_DIR/vector_db.json`` and ``OUT_DIR/vector_db.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search_data import default_data_dir, encode_cached  # noqa: E402

K = 10
BATCH = 100
INSERT_BATCH = 5_000


def folder_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def recall_at_k(found: list[list[int]], truth: np.ndarray) -> float:
    return float(np.mean([len(set(f[:K]) & set(t.tolist())) / K for f, t in zip(found, truth)]))


def measure(entries: list[dict], queries: np.ndarray, single: int, rounds: int) -> None:
    """Time every entry's search ``rounds`` times, interleaved (round 1 of each engine, then round 2, ...), after one
    warm-up pass each: one query per call over the first ``single`` queries, then batches of ``BATCH`` over all.
    Each entry gets the median, min and max queries/s and the ids of its batched run; the ids of every round must
    be the same (a search that changes its answers between rounds is reported, not averaged over)."""
    for entry in entries:  # warm-up: first-call costs (loading, caches) are not a query's
        entry["one"](queries[0])
        entry["many"](queries[:BATCH])
        entry.update(single_rounds=[], batched_rounds=[], ids=None, stable=True, single_and_batched_agree=None)
    for _ in range(rounds):
        for entry in entries:
            start = time.perf_counter()
            single_ids = [entry["one"](q) for q in queries[:single]]
            entry["single_rounds"].append(single / (time.perf_counter() - start))
            start = time.perf_counter()
            batch_ids: list[list[int]] = []
            for first in range(0, len(queries), BATCH):
                batch_ids += entry["many"](queries[first:first + BATCH])
            entry["batched_rounds"].append(len(queries) / (time.perf_counter() - start))
            if entry["ids"] is not None and batch_ids != entry["ids"]:
                entry["stable"] = False
            entry["ids"] = batch_ids
            entry["single_and_batched_agree"] = float(np.mean([a == b for a, b in zip(single_ids, batch_ids)]))
            entry.setdefault("load_during", []).append(load()[0])


def speed_summary(entry: dict) -> dict:
    def stats(values):
        return {"median": round(float(np.median(values)), 1), "min": round(min(values), 1),
                "max": round(max(values), 1)}

    return {"qps_single": stats(entry["single_rounds"]), "qps_batched": stats(entry["batched_rounds"]),
            "rounds": len(entry["single_rounds"]), "ids_same_every_round": entry["stable"],
            "single_and_batched_agree": entry["single_and_batched_agree"], "load_during": entry["load_during"]}


# ---------------------------------------------------------------------------------------------------------------- FAISS
def run_faiss(kind: str, vectors, texts, queries, folder: Path, single: int) -> dict:
    from st_prompts.search import SemanticIndex

    start = time.perf_counter()
    index = SemanticIndex.from_embeddings(vectors, texts, index_type=kind)
    build_s = time.perf_counter() - start
    index.save(folder)
    one = lambda q: [h.id for h in index.search_embeddings(q[None], K)[0]]  # noqa: E731
    many = lambda qs: [[h.id for h in row] for row in index.search_embeddings(qs, K)]  # noqa: E731
    return {"engine": "FAISS (SemanticIndex)", "index": kind, "params": dict(index.index_params),
            "build_s": round(build_s, 2), "disk_bytes": folder_bytes(folder), "one": one, "many": many,
            "close": lambda: None}


# --------------------------------------------------------------------------------------------------------------- Milvus
def run_milvus(kind: str, params: dict, search: dict, vectors, texts, queries, folder: Path, single: int) -> dict:
    from pymilvus import DataType, MilvusClient

    folder.mkdir(parents=True)
    client = MilvusClient(str(folder / "bench.db"))
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("text", DataType.VARCHAR, max_length=65_535)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=vectors.shape[1])
    index_params = client.prepare_index_params()
    # nested under "params": Milvus Lite 3 ignores build parameters spread out (it would build nlist=128)
    index_params.add_index(field_name="vector", index_type=kind, metric_type="IP", params={"params": params})
    start = time.perf_counter()
    client.create_collection("bench", schema=schema, index_params=index_params)
    for first in range(0, len(vectors), INSERT_BATCH):
        rows = [{"id": i, "text": texts[i], "vector": vectors[i]} for i in range(first, min(first + INSERT_BATCH,
                                                                                             len(vectors)))]
        client.insert("bench", rows)
    client.flush("bench")
    client.load_collection("bench")
    while client.describe_index("bench", "vector").get("pending_index_rows"):  # the index builds in the background
        time.sleep(0.05)
    search_params = {"metric_type": "IP", "params": search}
    client.search("bench", data=[queries[0]], limit=K, search_params=search_params)  # the index is built by now
    build_s = time.perf_counter() - start
    one = lambda q: [h["id"] for h in client.search("bench", data=[q], limit=K, search_params=search_params)[0]]  # noqa: E731
    many = lambda qs: [[h["id"] for h in row] for row in client.search("bench", data=list(qs), limit=K,  # noqa: E731
                                                                         search_params=search_params)]
    described = client.describe_index("bench", "vector")
    return {"engine": "Milvus Lite", "index": kind, "params": {**params, **search}, "build_s": round(build_s, 2),
            "disk_bytes": folder_bytes(folder), "index_state": described.get("state"), "one": one, "many": many,
            "close": client.close}


# -------------------------------------------------------------------------------------------------------------- LanceDB
def run_lance(kind: str | None, params: dict, search: dict, vectors, texts, queries, folder: Path, single: int) -> dict:
    import lancedb
    import pyarrow as pa

    db = lancedb.connect(str(folder))
    start = time.perf_counter()
    table = None
    for first in range(0, len(vectors), INSERT_BATCH):
        last = min(first + INSERT_BATCH, len(vectors))
        batch = pa.table({"id": pa.array(np.arange(first, last), pa.int64()), "text": pa.array(texts[first:last]),
                          "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors[first:last].reshape(-1)),
                                                                      vectors.shape[1])})
        table = db.create_table("bench", batch) if table is None else table
        if first:
            table.add(batch)
    if kind is not None:
        table.create_index(metric="dot", vector_column_name="vector", index_type=kind, **params)
    build_s = time.perf_counter() - start

    def query(q):
        built = table.search(q, vector_column_name="vector").distance_type("dot").limit(K).select(["id"])
        if "nprobes" in search:
            built = built.nprobes(search["nprobes"])
        if "ef" in search:
            built = built.ef(search["ef"])
        return built

    one = lambda q: query(q).to_arrow().column("id").to_pylist()  # noqa: E731

    def many(qs):
        result = query(list(qs)).to_arrow()  # a list of vectors: one search per vector, tagged with query_index
        out: list[list[int]] = [[] for _ in range(len(qs))]
        for row, doc in zip(result.column("query_index").to_pylist(), result.column("id").to_pylist()):
            out[row].append(doc)
        return out

    return {"engine": "LanceDB", "index": kind or "none (exact scan)", "params": {**params, **search},
            "build_s": round(build_s, 2), "disk_bytes": folder_bytes(folder), "one": one, "many": many,
            "close": lambda: None}


# --------------------------------------------------------------------------------------------------------------- Qdrant
def run_qdrant(vectors, texts, queries, folder: Path, single: int) -> dict:
    from qdrant_client import QdrantClient, models

    client = QdrantClient(path=str(folder))
    start = time.perf_counter()
    client.create_collection("bench", vectors_config=models.VectorParams(size=vectors.shape[1],
                                                                         distance=models.Distance.DOT))
    for first in range(0, len(vectors), INSERT_BATCH):
        last = min(first + INSERT_BATCH, len(vectors))
        client.upsert("bench", points=models.Batch(ids=list(range(first, last)), vectors=vectors[first:last].tolist(),
                                                   payloads=[{"text": t} for t in texts[first:last]]))
    build_s = time.perf_counter() - start
    one = lambda q: [p.id for p in client.query_points("bench", query=q.tolist(), limit=K).points]  # noqa: E731

    def many(qs):
        requests = [models.QueryRequest(query=q.tolist(), limit=K) for q in qs]
        return [[p.id for p in r.points] for r in client.query_batch_points("bench", requests=requests)]

    return {"engine": "Qdrant local mode", "index": "none (exact scan; local mode has no HNSW)", "params": {},
            "build_s": round(build_s, 2), "disk_bytes": folder_bytes(folder), "one": one, "many": many,
            "close": client.close}


# ------------------------------------------------------------------------------------------------------------- datasets
def real_set(data_dir: Path, cache_dir: Path | None, queries_n: int):
    from st_prompts.loading import load_sentence_model
    from st_prompts.search.encoding import l2_normalize
    from st_prompts.utils import packaged_minilm_path

    lines = (data_dir / "train" / "wiki_sentences.txt").read_text(encoding="utf-8").splitlines()
    distinct = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    order = np.random.default_rng(0).permutation(len(distinct))
    held = set(order[:queries_n].tolist())
    corpus = [t for i, t in enumerate(distinct) if i not in held]
    query_texts = [distinct[i] for i in order[:queries_n]]
    model = load_sentence_model(packaged_minilm_path())
    docs, doc_info = encode_cached(model, corpus, kind="document", cache_dir=cache_dir, name="vdb-wiki-docs")
    qs, query_info = encode_cached(model, query_texts, kind="query", cache_dir=cache_dir, name="vdb-wiki-queries")
    return corpus, l2_normalize(docs), l2_normalize(qs), {"documents": doc_info, "queries": query_info}


def synthetic_set(real: np.ndarray, n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((n, real.shape[1]), np.float32)
    for first in range(0, n, 50_000):
        last = min(first + 50_000, n)
        a, b, c = (rng.integers(0, len(real), last - first) for _ in range(3))
        block = real[a] + 0.6 * (real[b] - real[c])
        out[first:last] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def exact_top(vectors: np.ndarray, queries: np.ndarray) -> np.ndarray:
    scores = queries @ vectors.T
    top = np.argpartition(-scores, K, axis=1)[:, :K]
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1), axis=1)


# ----------------------------------------------------------------------------------------------------------------- main
def machine() -> dict:
    cpu = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core"):
                cpu[key.strip()] = value.strip()
            if key.strip() == "Flags":
                cpu["simd"] = " ".join(f for f in value.split() if f in ("avx2", "avx512f", "fma", "avx512_vnni"))
    except (OSError, subprocess.CalledProcessError):
        pass
    packages = {p: version(p) for p in ("faiss-cpu", "pymilvus", "milvus-lite", "lancedb", "pylance", "qdrant-client",
                                        "numpy", "pyarrow", "torch", "sentence-transformers")
                if _installed(p)}
    return {"python": platform.python_version(), "cpu": cpu, "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
            os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "packages": packages}


def _installed(name: str) -> bool:
    try:
        version(name)
        return True
    except Exception:
        return False


def run_set(label: str, vectors, texts, queries, args, scratch: Path) -> list[dict]:
    """Build every engine's index over ``vectors``, then time them all in interleaved rounds (:func:`measure`)."""
    truth = exact_top(vectors, queries)
    entries: list[dict] = []

    def built(entry: dict) -> None:
        entry.update(set=label, documents=len(vectors), load_after_build=load())
        print(json.dumps({k: v for k, v in entry.items() if not callable(v)}), flush=True)
        entries.append(entry)
        gc.collect()

    engines = set(args.engines)
    faiss_params = {}
    if "faiss" in engines:
        for kind in ("flat", "ivf", "hnsw"):
            entry = run_faiss(kind, vectors, texts, queries, scratch / f"{label}-faiss-{kind}", args.single)
            faiss_params[kind] = entry["params"]
            built(entry)
    ivf = faiss_params.get("ivf", {"nlist": int(4 * np.sqrt(len(vectors))), "nprobe": 32})
    hnsw = faiss_params.get("hnsw", {"m": 32, "ef_construction": 200, "ef_search": 128})
    if "milvus" in engines:
        for kind, build, search in (("FLAT", {}, {}),
                                    ("IVF_FLAT", {"nlist": ivf["nlist"]}, {"nprobe": ivf["nprobe"]}),
                                    ("HNSW", {"M": hnsw["m"], "efConstruction": hnsw["ef_construction"]},
                                     {"ef": hnsw["ef_search"]})):
            built(run_milvus(kind, build, search, vectors, texts, queries, scratch / f"{label}-milvus-{kind}",
                             args.single))
    if "lancedb" in engines:
        for kind, build, search in ((None, {}, {}),
                                    ("IVF_FLAT", {"num_partitions": ivf["nlist"]}, {"nprobes": ivf["nprobe"]}),
                                    ("IVF_HNSW_SQ", {"m": hnsw["m"], "ef_construction": hnsw["ef_construction"]},
                                     {"ef": hnsw["ef_search"]})):
            built(run_lance(kind, build, search, vectors, texts, queries, scratch / f"{label}-lance-{kind}",
                            args.single))
    if "qdrant" in engines and len(vectors) <= args.qdrant_max:
        built(run_qdrant(vectors, texts, queries, scratch / f"{label}-qdrant", args.single))
    measure(entries, queries, args.single, args.rounds)
    results = []
    for entry in entries:
        entry["close"]()
        result = {k: v for k, v in entry.items() if not callable(v) and k not in (
            "ids", "single_rounds", "batched_rounds", "stable", "single_and_batched_agree", "load_during")}
        result.update(recall_at_10=round(recall_at_k(entry["ids"], truth), 4), **speed_summary(entry))
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "vdb-bench-cache")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--single", type=int, default=50, help="queries timed one at a time (default: 50)")
    parser.add_argument("--sets", nargs="+", choices=("real", "synthetic"), default=["real", "synthetic"])
    parser.add_argument("--synthetic", type=int, default=50_000, help="synthetic set size (default: 50000)")
    parser.add_argument("--append", action="store_true", help="keep the results of the sets not run now from "
                        "OUT_DIR/vector_db.json (each set records its own run: command, time, load)")
    parser.add_argument("--engines", nargs="+", default=["faiss", "milvus", "lancedb", "qdrant"])
    parser.add_argument("--qdrant-max", type=int, default=20_000,
                        help="skip Qdrant local mode above this size (a pure-Python stand-in without an index: "
                        "11k vectors took minutes to insert; default 20000)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default: 5)")
    parser.add_argument("--scratch", type=Path, default=None, help="folder for the databases (default: a temp dir)")
    args = parser.parse_args()
    data_dir = args.data_dir or default_data_dir()
    path = args.out_dir / "vector_db.json"
    report = {"machine": machine(), "k": K, "batch": BATCH, "runs": {}, "results": []}
    if args.append and path.exists():
        report = {**json.loads(path.read_text(encoding="utf-8")), "machine": machine()}
    texts, docs, queries, encoding = real_set(data_dir, args.cache_dir, args.queries)
    report.setdefault("encoding", encoding)
    if encoding["documents"]["chunks_encoded"]:
        report["encoding"] = encoding  # an encoding measured now replaces one read from the cache
    sets = []
    if "real" in args.sets:
        sets.append(("wiki-real", docs, texts))
    if "synthetic" in args.sets:
        synthetic = synthetic_set(docs, args.synthetic)
        labels = [f"synthetic {i}" for i in range(args.synthetic)]
        sets.append((f"synthetic-{args.synthetic // 1000}k", synthetic, labels))
    scratch = Path(tempfile.mkdtemp(prefix="vdb-bench-", dir=args.scratch))
    try:
        for label, vectors, set_texts in sets:
            run = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "load_before": load(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "single": args.single,
                   "rounds": args.rounds}
            results = run_set(label, vectors, set_texts, queries, args, scratch / label)
            run["load_after"] = load()
            report["runs"][label] = run
            report["results"] = [r for r in report["results"] if r["set"] != label] + results
            args.out_dir.mkdir(parents=True, exist_ok=True)  # written after each set: a stopped run keeps the rest
            path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            write_markdown(report, args.out_dir / "vector_db.md")
            print(f"wrote {path} and {args.out_dir / 'vector_db.md'}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # our own temp dir
    return 0


def write_markdown(report: dict, path: Path) -> None:
    m = report["machine"]
    lines = [
        "# Vector databases next to FAISS (generated by `benchmarks/vector_db.py`)", "",
        f"Machine: {m['cpu'].get('Model name')} ({m['cpu'].get('CPU(s)')} CPUs, {m['cpu'].get('simd')}), "
        f"{m['memory_gib']} GiB, Python {m['python']}; **shared with other jobs** (each set gives its load average "
        "before and after, each row the 1-minute load over its timing rounds): numbers from a machine this busy are "
        "noisy; the ranges show how much.", "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()) + ".", "",
        "Same L2-normalised float32 vectors for every engine, inner product, k = 10; recall@10 against exact numpy "
        "search; queries/s client-side with precomputed query vectors: one query per call (the first queries) and "
        f"batches of {report['batch']} (all queries), the median of the rounds, interleaved across engines after a "
        "warm-up (min-max in brackets; every round returned the same ids unless marked); build = insert + index "
        "build (+ load, + calibration for FAISS IVF / HNSW); disk = bytes written. Every engine runs embedded, in "
        "this process. See the module docstring for the data.", "",
    ]
    encoding = report.get("encoding", {}).get("documents", {})
    if encoding:
        lines += [f"Encoding the real set (packaged MiniLM, 2 torch threads): {encoding['docs']:,} sentences in "
                  f"{encoding['seconds_this_run']} s, {encoding['docs_per_s_this_run']} sentences/s, load average "
                  f"after {encoding['load_average_after']}.", ""]
    for label in dict.fromkeys(r["set"] for r in report["results"]):
        rows = [r for r in report["results"] if r["set"] == label]
        run = report["runs"][label]
        lines += [f"## {label} ({rows[0]['documents']:,} documents, {report['encoding']['queries']['docs']} queries)",
                  "", f"Command: `{run['command']}`, started {run['started']}, {run['rounds']} rounds, "
                  f"{run['single']} single queries; load average {run['load_before']} before, {run['load_after']} "
                  "after." + (f" {run['note']}" if run.get("note") else ""), "",
                  "| engine | index | parameters | recall@10 | q/s one at a time | q/s batched | build s | "
                  "disk MB | load |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            params = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k != "calibration") or "-"
            single, batched = r["qps_single"], r["qps_batched"]
            lines.append(
                f"| {r['engine']} | {r['index']} | {params} | {r['recall_at_10']:.3f}"
                f"{'' if r['ids_same_every_round'] else ' (ids changed between rounds)'} | {single['median']:,.0f} "
                f"({single['min']:,.0f}-{single['max']:,.0f}) | {batched['median']:,.0f} ({batched['min']:,.0f}-"
                f"{batched['max']:,.0f}) | {r['build_s']:.1f} | {r['disk_bytes'] / 1e6:.1f} | "
                f"{min(r['load_during']):.1f}-{max(r['load_during']):.1f} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
