"""What ``st-prompts index search`` and ``index info`` print: every text from a user or a file is made printable and
cut to :data:`TEXT_WIDTH` characters, so a 1 MB document or id never floods a terminal. Standard library and
:mod:`st_prompts.errors` only."""

from __future__ import annotations

import argparse
import json
from typing import Any

from st_prompts.errors import printable

#: The most characters of one input (query, document, id, name) a line quotes.
TEXT_WIDTH = 200


def clip(value: Any, width: int | None = TEXT_WIDTH) -> str:
    """``str(value)`` made printable (one line) and cut to ``width`` characters (``None``: whole)."""
    return printable(json_clip(str(value), width))


def json_clip(value: Any, width: int | None) -> Any:
    """A string cut to ``width`` characters for JSON output (other values as they are; ``None``: whole)."""
    if isinstance(value, str) and width is not None and len(value) > width:
        return value[: width - 1] + "…"
    return value


def print_results(args: argparse.Namespace, results: list) -> None:
    """The hits of each query: a ranked list, or JSON with ``--json``. Queries, ids and texts are cut to
    :data:`TEXT_WIDTH` characters unless ``--full-text`` (then a cut text's JSON record says ``"text_chars"``)."""
    width = None if args.full_text else TEXT_WIDTH
    if args.json:
        payload = [
            {
                "query": json_clip(query, width),
                "hits": [
                    {"rank": rank, "id": json_clip(hit.id, width), "score": round(hit.score, 6),
                     "text": json_clip(hit.text, width),
                     **({"text_chars": len(hit.text)} if width is not None and len(hit.text) > width else {})}
                    for rank, hit in enumerate(hits, start=1)
                ],
            }
            for query, hits in zip(args.queries, results)
        ]  # fmt: skip
        print(json.dumps(payload, ensure_ascii=False, indent=2))
        return
    for number, (query, hits) in enumerate(zip(args.queries, results)):
        if number:
            print()
        print(f"Query: {clip(query)}")
        if not hits:
            print("  (no hits)")
        shown_ids = [clip(hit.id, 40) for hit in hits]
        id_width = max(map(len, shown_ids)) if hits else 0
        for rank, (hit, shown_id) in enumerate(zip(hits, shown_ids), start=1):
            print(f"  {rank:>2}. {hit.score:.4f}  [{shown_id:>{id_width}}]  {clip(hit.text, width)}")


def calibration_line(record: dict) -> str:
    """One line describing a calibration record (meta.json's ``calibration``, checked when the index was read)."""
    queries = record.get("queries") or {}
    rerank = f", rerank={record['rerank']}" if "rerank" in record else ""
    status = "reached" if record.get("reached") else "NOT reached"
    kind = clip(str(queries.get("kind", "?")).replace("_", " "), 80)
    return (
        f"Calibrated: {record['parameter']}={record['value']}{rerank} -> recall@{record['k']} "
        f"{record['measured_recall']:.4f} (target {record['target_recall']}, {status}) on {queries.get('count')} "
        f"{kind} queries, {record.get('num_docs')} documents"
    )


def print_info(path: Any, index: Any, meta: dict[str, Any]) -> None:
    """``index info``'s description of the index at ``path`` (``index``: the stored index; ``meta``: its checked
    ``meta.json``)."""
    model = index.model_identity
    print(f"Index:      {clip(path)}")
    print(f"Documents:  {len(index.ids)}")
    print(f"Type:       {index.index_type} ({clip(meta.get('faiss_factory'), 60)}) {index.index_params or ''}".rstrip())
    print(f"Dimension:  {index.faiss_index.d}; scores are cosine similarities (L2-normalised, inner product)")
    if model is not None:
        print(f"Model:      {clip(model.name)} ({clip(model.fingerprint[:19], None)}…)"
              + (f", documents encoded in {model.quantize} (--quantize {model.quantize})" if model.quantize else ""))
    else:
        print("Model:      none (built from bare embeddings)")
    sizes = meta.get("bytes_per_vector") or {}
    if sizes:
        line = f"{sizes.get('faiss_codes_and_ids')} B/vector of FAISS codes + ids in RAM"
        if "rerank_vectors_on_disk" in sizes:
            line += f"; {sizes['rerank_vectors_on_disk']} B/vector of re-ranking vectors on disk (memory-mapped)"
        print(f"Memory:     {line}")
    record = meta.get("calibration")
    if record:
        print(calibration_line(record).replace("Calibrated: ", "Calibration: ", 1))
        current = index.index_params.get(record["parameter"])
        if current != record["value"] or ("rerank" in record and index.index_params.get("rerank") != record["rerank"]):
            print(f"            (the index now uses {record['parameter']}={current}: set by hand after calibrating)")
        if record.get("caveat"):
            print(f"            ({clip(record['caveat'], 600)})")
        if record.get("num_docs") != len(index.ids):
            print(f"            (measured on {record.get('num_docs')} documents; the index now holds {len(index.ids)}: "
                  "re-run 'st-prompts index calibrate')")  # fmt: skip
    elif index.index_type != "flat":
        print("Calibration: none (search parameters set by hand or defaults)")
    drift = meta.get("drift")
    if drift:
        print(f"Drift:      last added documents: mean squared distance to the IVF centroids "
              f"{drift['ratio_to_training']}x that of the training documents")  # fmt: skip
    if meta.get("files"):
        print(f"Files:      {len(meta['files'])} with their size and SHA-256 recorded ('--verify' checks every one)")
