"""Benchmark of ``st-prompts index build --from-embeddings`` (issue 63, part 2): peak memory of an IVF-PQ build over
1,000,000 × 384 vectors read from 10 Parquet parts, and recall@10 of the index built from parts against the same
index built in memory (``SemanticIndex.from_embeddings``, what ``index build`` does after encoding).

Run by hand (not part of the test suite)::

    nice -n 5 python benchmarks/from_embeddings.py --data-dir ../shared/data --work /tmp/from-embeddings

* Vectors: the all-MiniLM-L6-v2 document embeddings of the 11,914 Wikipedia sentences of the shared data are the
  cluster centres; each of the 1M rows is a centre plus isotropic Gaussian noise (norm ~0.6, cosine ~0.85 to its
  centre), normalised; its text is its centre's sentence and its row number. Written as 10 parts with
  ``embedding_files.write_part`` and the packaged MiniLM's identity record (what ``st-prompts embed`` writes).
* Builds, each in its own process whose peak RSS is read with ``os.wait4`` (``ru_maxrss``): ``st-prompts index
  build --from-embeddings`` (IVF-PQ, default parameters and calibration), and the in-memory reference, a script that
  reads the parts into one array and calls ``SemanticIndex.from_embeddings`` with the same parameters, then
  ``save``.
* Recall@10 against exact brute force (numpy, by blocks) on 500 real queries (STS-B dev sentences, encoded with
  ``encode_query``), at each index's calibrated ``nprobe`` and at fixed ones.
* Real text: the 11,914 Wikipedia sentences encoded once (``encode_document``), indexed in memory as ``index build``
  does after encoding (``SemanticIndex.from_embeddings(..., model=model)``: calibrated with the model) vs the same
  embeddings written as parts and built with ``--from-embeddings``; IVF and IVF-PQ, recall@10 at fixed nprobe.

Writes ``benchmarks/results/from_embeddings.json`` and ``.md`` (``--out-dir``). Deletes its work folder at the end
(``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_model, default_data_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
K = 10


#: A small launcher (``python -S``, a few MB): it forks and execs the command and prints the child's peak RSS from
#: ``wait4``. Not forked from this process: ``ru_maxrss`` survives ``execve``, so a child forked from a process
#: holding torch and a model would report that process's size.
LAUNCHER = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "sys.stderr.write('LAUNCHER %d %d %.1f\\n' % (code, usage.ru_maxrss, usage.ru_utime))\n"
)


def run_measured(command: list[str], log: Path) -> dict:
    """Run ``command`` (nice 5) through :data:`LAUNCHER`: its exit status, wall seconds and peak RSS (MiB)."""
    start = time.perf_counter()
    load_before = os.getloadavg()
    with log.open("w") as out:
        subprocess.run(["nice", "-n", "5", sys.executable, "-S", "-c", LAUNCHER, *command], stdout=out,
                       stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    text = log.read_text()
    code, maxrss_kib, user = [line for line in text.splitlines() if line.startswith("LAUNCHER ")][-1].split()[1:]
    return {"command": " ".join(command), "exit_status": int(code), "wall_seconds": round(seconds, 1),
            "peak_rss_mib": round(int(maxrss_kib) / 1024, 1), "user_cpu_seconds": float(user),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "log_tail": text[-1500:]}


def sts_queries(data_dir: Path, count: int) -> list[str]:
    seen, out = set(), []
    for line in (data_dir / "senteval/STS/STSBenchmark/sts-dev.csv").read_text(encoding="utf-8").splitlines():
        cells = line.split("\t")
        for text in cells[5:7]:
            text = text.strip()
            if text and text not in seen:
                seen.add(text)
                out.append(text)
    return out[:count]


def exact_top(parts: list[Path], queries: np.ndarray) -> np.ndarray:
    """Exact top-K row numbers of each query over the parts' normalised vectors, by blocks."""
    from st_prompts.search.embedding_files import EmbeddingFiles

    files = EmbeddingFiles.open(parts)
    best_s = np.full((len(queries), K), -np.inf, np.float32)
    best_i = np.full((len(queries), K), -1, np.int64)
    row = 0
    for _, _, vectors in files.batches(65_536, texts=False):
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        scores = queries @ unit.T
        top = np.argpartition(-scores, K, axis=1)[:, :K]
        s = np.concatenate([best_s, np.take_along_axis(scores, top, 1)], 1)
        i = np.concatenate([best_i, top + row], 1)
        order = np.argsort(-s, axis=1)[:, :K]
        best_s, best_i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
        row += len(vectors)
    return best_i


def recall_at(index, queries: np.ndarray, truth_ids: np.ndarray, **params) -> float:
    scores, positions = index.search_positions(queries, K, {**index.index_params, **params} if params else None)
    ids = [[index.ids[p] for p in row if p >= 0] for row in positions]
    return float(np.mean([len(set(row) & set(t.tolist())) / K for row, t in zip(ids, truth_ids)]))


IN_MEMORY = r'''
import json, sys, time
import numpy as np
from st_prompts.search.embedding_files import EmbeddingFiles
from st_prompts.search.index import SemanticIndex
parts, out, index_type, params = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
files = EmbeddingFiles.open([parts])
vectors = np.empty((files.rows, files.dimension), np.float32)
ids, texts, row = [], [], 0
for batch_ids, batch_texts, batch in files.batches(65_536):
    vectors[row:row + len(batch)] = batch
    ids += batch_ids
    texts += batch_texts
    row += len(batch)
start = time.perf_counter()
index = SemanticIndex.from_embeddings(vectors, texts, ids, index_type, model_identity=files.identity(), **params)
index.save(out)
print("built in", round(time.perf_counter() - start, 1), "s", index.index_params)
'''


def write_synthetic_parts(folder: Path, centres: np.ndarray, sentences: list[str], rows: int, parts: int,
                          record: dict) -> None:
    from st_prompts.search.embedding_files import part_name, write_part

    folder.mkdir(parents=True, exist_ok=True)
    per = rows // parts
    sigma = 0.6 / np.sqrt(centres.shape[1])
    for number in range(parts):
        path = folder / part_name(number)
        if path.exists():
            continue
        rng = np.random.default_rng(1000 + number)
        which = rng.integers(0, len(centres), per)
        vectors = centres[which] + sigma * rng.standard_normal((per, centres.shape[1])).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        first = number * per
        write_part(path, list(range(first, first + per)), [f"{sentences[c]} [{first + i}]" for i, c in
                                                            enumerate(which)],
                   vectors, {**record, "part": number, "first_row": first})
        print("wrote", path, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--work", type=Path, default=Path("/tmp/st-prompts-from-embeddings"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--parts", type=int, default=10)
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--skip-in-memory", action="store_true", help="skip the 1M in-memory reference build")
    parser.add_argument("--skip-real-text", action="store_true", help="skip the Wikipedia text check")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)

    from st_prompts.loading import load_sentence_model
    from st_prompts.search.embedding_files import identity_record, part_name, write_part
    from st_prompts.search.identity import ModelIdentity
    from st_prompts.search.index import SemanticIndex

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    model = load_sentence_model("minilm")
    record = {"model": identity_record(ModelIdentity.of(model, name="minilm"))}
    sentences = [line.strip() for line in (args.data_dir / "train/wiki_sentences.txt").read_text(
        encoding="utf-8").splitlines() if line.strip()]
    sentences = list(dict.fromkeys(sentences))
    cache = work / "wiki.npy"
    if cache.exists():
        wiki = np.load(cache)
    else:
        start = time.perf_counter()
        wiki = model.encode_document(sentences, batch_size=64, convert_to_numpy=True)
        print(f"encoded {len(sentences)} sentences in {time.perf_counter() - start:.0f} s", flush=True)
        np.save(cache, wiki)
    queries_text = sts_queries(args.data_dir, args.queries)
    queries = model.encode_query(queries_text, batch_size=64, convert_to_numpy=True)
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    report: dict = {"machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform()},
                    "versions": _versions(), "queries": {"kind": "STS-B dev sentences", "count": len(queries)}}
    cli = shutil.which("st-prompts") or "st-prompts"

    # ---------------------------------------------------------------- 1M synthetic vectors
    emb = work / "emb"
    start = time.perf_counter()
    write_synthetic_parts(emb, wiki.astype(np.float32) / np.linalg.norm(wiki, axis=1, keepdims=True), sentences,
                          args.rows, args.parts, record)
    parts_bytes = sum(p.stat().st_size for p in emb.iterdir())
    report["vectors"] = {"rows": args.rows, "dimension": int(wiki.shape[1]), "parts": args.parts,
                         "raw_float32_mb": round(args.rows * wiki.shape[1] * 4 / 1e6, 1),
                         "parts_on_disk_mb": round(parts_bytes / 1e6, 1),
                         "generation": "MiniLM Wikipedia vectors as centres + Gaussian noise of norm 0.6, normalised"}
    truth = exact_top([emb], queries)
    builds = {}
    out = work / "parts-ivfpq.index"
    builds["from_parts"] = run_measured([cli, "index", "build", "--from-embeddings", str(emb), str(out),
                                         "--index-type", "ivfpq", "--overwrite", "--no-progress"],
                                        work / "parts-ivfpq.log")
    print("from parts", json.dumps({k: v for k, v in builds["from_parts"].items() if k != "log_tail"}), flush=True)
    parts_index = SemanticIndex.load(out, mmap=True)
    params = {key: parts_index.index_params[key] for key in ("nlist", "pq_m", "opq", "rerank")}
    builds["from_parts"]["index_params"] = parts_index.index_params
    builds["from_parts"]["calibration"] = {k: parts_index.info["calibration"][k] for k in
                                           ("value", "measured_recall", "reached", "queries", "seconds")}
    folder_mb = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    builds["from_parts"]["index_folder_mb"] = round(folder_mb, 1)
    recall = {"from_parts_at_calibrated": round(recall_at(parts_index, queries, truth), 4)}
    if not args.skip_in_memory:
        reference_out = work / "memory-ivfpq.index"
        builds["in_memory"] = run_measured([sys.executable, "-c", IN_MEMORY, str(emb), str(reference_out), "ivfpq",
                                            json.dumps({**params, "target_recall": None,
                                                        "nprobe": parts_index.index_params["nprobe"]})],
                                           work / "memory-ivfpq.log")
        print("in memory", json.dumps({k: v for k, v in builds["in_memory"].items() if k != "log_tail"}), flush=True)
        memory_index = SemanticIndex.load(reference_out, mmap=True)
        recall["in_memory_at_same_nprobe"] = round(recall_at(memory_index, queries, truth), 4)
        recall["fixed_nprobe"] = {}
        for nprobe in (16, 64):
            a = recall_at(memory_index, queries, truth, nprobe=nprobe)
            b = recall_at(parts_index, queries, truth, nprobe=nprobe)
            recall["fixed_nprobe"][nprobe] = {"in_memory": round(a, 4), "from_parts": round(b, 4),
                                              "difference": round(b - a, 4)}
        same = np.array_equal(np.load(out / "vectors.npy", mmap_mode="r")[:1000],
                              np.load(reference_out / "vectors.npy", mmap_mode="r")[:1000])
        recall["same_first_1000_rerank_vectors"] = bool(same)
    report["builds"] = builds
    report["recall_at_10"] = recall

    def save_partial() -> None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "from_embeddings.json").write_text(json.dumps(report, indent=2) + "\n")

    report["goal"] = {"peak_rss_mib_at_most": round(args.rows * wiki.shape[1] * 4 / 3 / 2**20, 1),
                      "met": builds["from_parts"]["peak_rss_mib"] <= args.rows * wiki.shape[1] * 4 / 3 / 2**20}
    def real_text_check() -> None:
        # ---------------------------------------------------------------- real text (11.9k Wikipedia sentences)
        real = {}
        if args.skip_real_text:
            return
        wiki_parts = work / "wiki-parts"
        if not wiki_parts.exists():
            wiki_parts.mkdir()
            for number, first in enumerate(range(0, len(sentences), 4_000)):
                write_part(wiki_parts / part_name(number), list(range(first, min(len(sentences), first + 4_000))),
                           sentences[first:first + 4_000], wiki[first:first + 4_000], {**record, "part": number})
        truth_wiki = exact_top([wiki_parts], queries)
        for index_type, fixed in (("ivf", (8, 16, 32)), ("ivfpq", (8, 16, 32))):
            # what `index build` does once it has encoded the sentences (build = encode_document + this)
            text_index = SemanticIndex.from_embeddings(wiki, sentences, index_type=index_type, model=model)
            out = work / f"wiki-{index_type}.index"
            run = run_measured([cli, "index", "build", "--from-embeddings", str(wiki_parts), str(out), "--index-type",
                                index_type, "--overwrite", "--no-progress"], work / f"wiki-{index_type}.log")
            parts_index = SemanticIndex.load(out)
            row = {"from_text": {"params": text_index.index_params,
                                 "calibration_queries": text_index.info["calibration"]["queries"]["kind"],
                                 "recall_at_calibrated": round(recall_at(text_index, queries, truth_wiki), 4)},
                   "from_parts": {"params": parts_index.index_params,
                                  "calibration_queries": parts_index.info["calibration"]["queries"]["kind"],
                                  "recall_at_calibrated": round(recall_at(parts_index, queries, truth_wiki), 4),
                                  "peak_rss_mib": run["peak_rss_mib"], "wall_seconds": run["wall_seconds"]},
                   "fixed_nprobe": {}}
            for nprobe in fixed:
                a, b = recall_at(text_index, queries, truth_wiki, nprobe=nprobe), recall_at(parts_index, queries,
                                                                                            truth_wiki, nprobe=nprobe)
                row["fixed_nprobe"][nprobe] = {"from_text": round(a, 4), "from_parts": round(b, 4),
                                               "difference": round(b - a, 4)}
            real[index_type] = row
            print(index_type, json.dumps(row), flush=True)
        report["real_text"] = {"docs": len(sentences), "parts": len(list(wiki_parts.iterdir())), "types": real}


    save_partial()
    real_text_check()
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "from_embeddings.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, args.out_dir / "from_embeddings.md")
    if not args.keep:
        shutil.rmtree(work)
    print(json.dumps(report["goal"]), json.dumps(recall))
    return 0


def _versions() -> dict:
    from importlib.metadata import version

    out = {}
    for name in ("faiss-cpu", "numpy", "pyarrow", "torch", "sentence-transformers"):
        try:
            out[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            out[name] = None
    return out


def write_markdown(report: dict, path: Path) -> None:
    v, b, r = report["vectors"], report["builds"], report["recall_at_10"]
    lines = [
        "# Indexes from embedding files: memory and recall (issue 63, part 2)",
        "",
        f"Machine: {report['machine']['cpu']}, {report['machine']['cpus']} CPUs (shared with other jobs: the load "
        "averages are beside each build). Versions: " + ", ".join(f"{k} {x}" for k, x in report["versions"].items())
        + ". Command: `nice -n 5 python benchmarks/from_embeddings.py --data-dir ../shared/data`.",
        "",
        f"## {v['rows']:,} × {v['dimension']} vectors in {v['parts']} parts ({v['raw_float32_mb']:,} MB of float32; "
        f"{v['parts_on_disk_mb']:,} MB of Parquet with texts)",
        "",
        v["generation"] + ".",
        "",
        "| build | peak RSS (MiB) | wall (s) | load (1 min) before → after | exit |",
        "|---|---:|---:|---|---:|",
    ]
    for name, run in b.items():
        lines.append(f"| {name.replace('_', ' ')}: `{_short(run['command'])}` | {run['peak_rss_mib']:,} | "
                     f"{run['wall_seconds']} | {run['load_before'][0]} → {run['load_after'][0]} | "
                     f"{run['exit_status']} |")
    goal = report["goal"]
    lines += ["", f"Goal: peak RSS ≤ 1/3 of the raw vectors = {goal['peak_rss_mib_at_most']} MiB: "
              f"**{'met' if goal['met'] else 'NOT met'}**. Index folder: {b['from_parts'].get('index_folder_mb')} MB. "
              f"Parameters: {b['from_parts'].get('index_params')}; calibration (vectors only, no model loaded): "
              f"{b['from_parts'].get('calibration')}.", "",
              f"Recall@10 on {report['queries']['count']} {report['queries']['kind']} vs exact brute force: from parts "
              f"{r.get('from_parts_at_calibrated')} at its calibrated nprobe"
              + (f", in memory {r.get('in_memory_at_same_nprobe')} at the same nprobe." if "in_memory_at_same_nprobe"
                 in r else ".")]
    if "fixed_nprobe" in r:
        lines += ["", "| nprobe | in memory | from parts | difference |", "|---:|---:|---:|---:|"]
        lines += [f"| {n} | {x['in_memory']} | {x['from_parts']} | {x['difference']} |"
                  for n, x in r["fixed_nprobe"].items()]
        lines += ["", f"Same re-ranking vectors (first 1,000 rows): {r.get('same_first_1000_rerank_vectors')}."]
    real = report.get("real_text")
    if real is None:
        path.write_text("\n".join(lines) + "\n")
        return
    lines += ["", f"## Real text: {real['docs']:,} Wikipedia sentences (MiniLM), in memory as `index build` "
              "(encoded once) vs "
              f"the same embeddings in {real['parts']} parts + `--from-embeddings`", "",
              "| type | nprobe | from text | from parts | difference |", "|---|---:|---:|---:|---:|"]
    for index_type, row in real["types"].items():
        for nprobe, x in row["fixed_nprobe"].items():
            lines.append(f"| {index_type} | {nprobe} | {x['from_text']} | {x['from_parts']} | {x['difference']} |")
    lines += ["", "Each at its own calibration (the text build calibrates with the model on perturbed texts, the "
              "parts build on perturbed vectors, without loading the model):", ""]
    for index_type, row in real["types"].items():
        lines.append(f"* {index_type}: from text {row['from_text']['params']} → recall@10 "
                     f"{row['from_text']['recall_at_calibrated']}; from parts {row['from_parts']['params']} → "
                     f"{row['from_parts']['recall_at_calibrated']} (build peak RSS {row['from_parts']['peak_rss_mib']} "
                     f"MiB, {row['from_parts']['wall_seconds']} s)")
    lines += ["", f"Load average at the end: {report['load_average_end']}.", ""]
    path.write_text("\n".join(lines))


def _short(command: str) -> str:
    if "-c" in command.split(" ")[:3]:
        return "python -c <SemanticIndex.from_embeddings + save>"
    return command.replace(str(Path.home()), "~")[-160:]


if __name__ == "__main__":
    sys.exit(main())
