"""What a calibration without a model promises on real queries (run by hand; writes JSON + markdown).

``SemanticIndex.from_embeddings(vectors, texts, index_type="ivf")`` has no model: its default calibration queries are
perturbed document vectors and blends of two documents. This script measures, on real text, the recall@10 (against
exact search) that real queries of another genre get at the calibrated ``nprobe``, beside ``SemanticIndex.build``
(which calibrates with its model on perturbed texts, blends and foreign sentences), and how hard every kind of query
made from the document vectors alone is compared with real queries.

Corpus: the shared Wikipedia sentences; queries: the first 500 distinct first sentences of STS-B dev; model: the packaged
all-MiniLM-L6-v2. ::

    python benchmarks/search_vectors_only.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from st_prompts.storage import write_file_atomic, write_json_atomic  # noqa: E402

NPROBES = (32, 48, 64, 96, 128, 160)


def recall_at_10(index, queries: np.ndarray, exact: np.ndarray) -> float:
    _, positions = index.search(np.ascontiguousarray(queries, dtype=np.float32), 10)
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(positions, exact)]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()

    import faiss
    import torch
    from sentence_transformers import SentenceTransformer

    from st_prompts.search import SemanticIndex
    from st_prompts.search.encoding import l2_normalize
    from st_prompts.utils import packaged_minilm_path

    start = time.perf_counter()
    docs = [line.strip() for line in (args.data_dir / "train" / "wiki_sentences.txt").open(encoding="utf-8")
            if line.strip()]
    rows = [line.rstrip("\n").split("\t") for line in
            (args.data_dir / "senteval" / "STS" / "STSBenchmark" / "sts-dev.csv").open(encoding="utf-8")]
    queries = list(dict.fromkeys(r[5] for r in rows if len(r) > 6))[:500]
    model = SentenceTransformer(packaged_minilm_path(), device="cpu")
    doc_vectors = model.encode(docs, batch_size=128, normalize_embeddings=True, show_progress_bar=False)
    query_vectors = model.encode(queries, batch_size=128, normalize_embeddings=True, show_progress_bar=False)
    exact = np.argsort(-(query_vectors @ doc_vectors.T), axis=1)[:, :10]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vectors_only = SemanticIndex.from_embeddings(doc_vectors, docs, index_type="ivf")
        with_model = SemanticIndex.build(model, docs, index_type="ivf", show_progress_bar=False)
    report: dict = {
        "environment": f"{platform.machine()} CPU, torch {torch.__version__}, faiss {faiss.__version__}",
        "corpus": f"{len(docs):,} Wikipedia sentences (shared data)",
        "queries": f"{len(queries)} STS-B dev sentences",
        "calibrated": {},
    }
    for name, index in (("from_embeddings (no model)", vectors_only), ("build (with the model)", with_model)):
        record = index.info["calibration"]
        report["calibrated"][name] = {
            "nlist": index.index_params["nlist"], "nprobe": index.index_params["nprobe"],
            "calibration_queries": record["queries"]["kind"],
            "recall_by_query_kind": record["recall_by_query_kind"],
            "real_query_recall@10": round(recall_at_10(index.index, query_vectors, exact), 4),
        }

    # How hard each kind of query made from the document vectors alone is, against the real queries.
    rng = np.random.default_rng(0)
    n, dim = doc_vectors.shape
    picks = lambda: doc_vectors[rng.choice(n, 500)]  # noqa: E731
    noise = lambda x, s: l2_normalize(x + s * rng.standard_normal(x.shape).astype(np.float32) / np.sqrt(dim))  # noqa: E731
    mean = doc_vectors.mean(0)
    chol = np.linalg.cholesky(np.cov(doc_vectors.T) + 1e-6 * np.eye(dim)).astype(np.float32)
    kinds = {
        "real queries (STS-B dev)": query_vectors,
        "perturbed document vectors (default, cosine ~0.8)": noise(picks(), 0.75),
        "perturbed document vectors, twice the noise": noise(picks(), 1.5),
        "blends of two documents (default)": l2_normalize(picks() + picks()),
        "blends of four documents": l2_normalize(picks() + picks() + picks() + picks()),
        "Gaussian with the corpus mean and covariance": l2_normalize(
            mean[None] + rng.standard_normal((500, dim)).astype(np.float32) @ chol.T),
    }
    ivf = vectors_only.index
    curves = {}
    for name, vectors in kinds.items():
        truth = np.argsort(-(vectors @ doc_vectors.T), axis=1)[:, :10]
        curve = {}
        for nprobe in NPROBES:
            faiss.extract_index_ivf(ivf).nprobe = nprobe
            curve[nprobe] = round(recall_at_10(ivf, vectors, truth), 4)
        top1 = float(np.median(np.max(vectors @ doc_vectors.T, axis=1)))
        curves[name] = {"median_top1_cosine": round(top1, 3), "recall@10_by_nprobe": curve}
    report["query_kinds"] = curves
    report["seconds"] = round(time.perf_counter() - start, 1)

    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "search_vectors_only.json", report)
    lines = [
        "# Calibration without a model, on real queries",
        "",
        f"{report['environment']}; {report['corpus']}; {report['queries']}; all-MiniLM-L6-v2; IVF, "
        f"recall@10 against exact search. Command: `python benchmarks/search_vectors_only.py --data-dir "
        f"../shared/data` ({report['seconds']:.0f} s).",
        "",
        "| index | nlist | calibrated nprobe | calibration queries | real-query recall@10 |",
        "|---|---:|---:|---|---:|",
    ]
    for name, row in report["calibrated"].items():
        lines.append(f"| {name} | {row['nlist']} | {row['nprobe']} | {row['calibration_queries'].replace('_', ' ')} "
                     f"| {row['real_query_recall@10']:.3f} |")
    lines += ["", "Recall@10 of each kind of query at each nprobe (the no-model index):", "",
              "| queries | median top-1 cosine | " + " | ".join(f"nprobe {p}" for p in NPROBES) + " |",
              "|---|---:|" + "---:|" * len(NPROBES)]
    for name, row in curves.items():
        lines.append(f"| {name} | {row['median_top1_cosine']:.3f} | "
                     + " | ".join(f"{row['recall@10_by_nprobe'][p]:.3f}" for p in NPROBES) + " |")
    lines += ["", "No kind of query made from the document vectors alone is as hard as real queries of another genre: "
              "a calibration without a model cannot promise their recall. It says so (a warning, `index info`, "
              "`calibration.caveat` in meta.json); give real query embeddings (`calibration_queries=`) or build with "
              "the model.", ""]
    write_file_atomic(args.out / "search_vectors_only.md", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
