"""``st-prompts index``: build a FAISS semantic-search index over a corpus, query it, update it, describe it.

Examples::

    st-prompts index build minilm corpus.txt corpus.index                 # one document per line, exact search
    st-prompts index build minilm docs.jsonl docs.index --column body --id-column doc_id --index-type hnsw
    st-prompts index build minilm big.txt big.index --index-type ivfpq --processes 2 --encode-cache big.cache
    st-prompts index build minilm corpus.txt ivf.index --index-type ivf --target-recall 0.97 \
        --calibration-queries my_questions.txt
    st-prompts index search corpus.index "how do cats sleep?" "bread recipe" -k 5
    st-prompts index search big.index "how do cats sleep?" --json --mmap
    st-prompts index add corpus.index more.txt                             # encode and append, saved atomically
    st-prompts index remove corpus.index 12 57
    st-prompts index calibrate ivf.index --target-recall 0.98
    st-prompts index info corpus.index                                     # shows the calibration
    st-prompts index export corpus.index --to milvus:./docs.db#corpus      # into a Milvus Lite file (or http://...)

Conventions: :mod:`st_prompts.search`. Only the standard library and :mod:`st_prompts.errors` are imported here, so
that ``--help`` is fast; the runners import the heavy parts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from st_prompts.commands._numbers import finite_float as _bounded_float
from st_prompts.commands._numbers import non_negative_int, positive_int
from st_prompts.commands.index_output import calibration_line, clip, print_info, print_results
from st_prompts.commands.options import (add_dtype_argument, add_no_progress_argument, add_trust_remote_code_argument,
                                         missing_subcommand, show_progress)
from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataNotFoundError
from st_prompts.utils import recorded_model_name

# Bounds of the numeric options (FAISS takes 32-bit counts; HNSW allocates ef heap entries and 2*m links per node).
_MAX_EF = 1 << 20
_COUNT = positive_int()
_EF = positive_int(_MAX_EF)
_BATCH = positive_int(1 << 20)

# faiss logs at INFO which CPU-specific build it loads; that is noise for a command-line user.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)
_recall = _bounded_float(0.0, 1.0, min_inclusive=False)  # a recall@10 target: in (0, 1], at parse time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``index`` and its sub-commands (``build``, ``search``, ``add``, ``remove``, ``calibrate``, ``info``,
    ``export``)."""
    parser = subparsers.add_parser(
        "index", help="build and query a FAISS semantic-search index",
        description="Build a FAISS semantic-search index over a corpus encoded with a sentence-transformers model, "
        "and query it. Scores are cosine similarities.",
    )
    commands = parser.add_subparsers(dest="index_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: missing_subcommand(parser))
    for add in (_add_build, _add_search, _add_add, _add_remove, _add_calibrate, _add_info, _add_export):
        add(commands)


def _add_build(commands: argparse._SubParsersAction) -> None:
    build = commands.add_parser(
        "build", help="encode a corpus and save an index",
        description="Encode CORPUS with MODEL and save the index to the directory OUT. CORPUS is a text file with "
        "one document per line (ids = 1-based line numbers; blank lines skipped) or a .jsonl/.json/.csv/.parquet "
        "dataset (--column, --id-column; ids = 0-based rows by default). Duplicate texts are kept with a warning; "
        "duplicate ids are an error. With --from-embeddings PATH... OUT, index embedding files (the Parquet parts "
        "of 'st-prompts embed') instead: nothing is encoded, the vectors are read a batch at a time (memory: about "
        "the index itself), the model, ids and texts come from the files.",
    )
    build.add_argument("model", metavar="MODEL", nargs="?",
                       help="model name or path ('minilm' = the packaged all-MiniLM-L6-v2)")
    build.add_argument("corpus", metavar="CORPUS", nargs="?", type=Path, help="text file or dataset file to index")
    build.add_argument("out", metavar="OUT", nargs="?", type=Path, help="index directory to write")
    build.add_argument("--from-embeddings", nargs="+", metavar="PATH",
                       help="embedding files, folders of them or glob patterns (quoted) to index instead of MODEL "
                       "CORPUS; OUT is the last argument (st-prompts index build --from-embeddings emb/ emb.index)")
    build.add_argument("--index-type", choices=("flat", "ivf", "hnsw", "ivfpq"), default="flat",
                       help="flat = exact (default); ivf / hnsw = approximate, for large corpora; ivfpq = compressed "
                       "(product quantization, re-ranked exactly), for corpora too large for float vectors in RAM")
    build.add_argument("--batch-size", type=_BATCH, default=64, help="encoding batch size (default: 64)")
    build.add_argument("--column", default="text", help="text column of a dataset file (default: text)")
    build.add_argument("--id-column", help="id column of a dataset file (default: row numbers)")
    build.add_argument("--nlist", type=_COUNT, help="IVF: number of lists (default: 4*sqrt(n))")
    build.add_argument("--nprobe", type=_COUNT, help="IVF: lists visited per query")
    build.add_argument("--m", type=positive_int(256), help="HNSW: neighbours per node")
    build.add_argument("--ef-construction", type=_EF, help="HNSW: build-time candidate list size")
    build.add_argument("--ef-search", type=_EF, help="HNSW: search-time candidate list size")
    build.add_argument("--pq-m", type=positive_int(1 << 16), help="IVF-PQ: bytes per vector code (default: 48)")
    build.add_argument("--opq", action="store_true", default=None, help="IVF-PQ: learn an OPQ rotation first")
    build.add_argument("--rerank", type=non_negative_int(),
                       help="IVF-PQ: candidates re-scored exactly with the stored vectors (default: 200; 0 = off)")
    build.add_argument("--target-recall", type=_recall,
                       help="approximate indexes: calibrate nprobe / ef_search to the smallest value reaching this "
                       "recall@10 against exact search (default: 0.95, unless --nprobe / --ef-search is given)")
    build.add_argument("--no-calibration", action="store_true",
                       help="approximate indexes: do not calibrate; use --nprobe / --ef-search or their defaults")
    build.add_argument("--calibration-queries", type=Path, metavar="FILE", help="text file of queries (one per line) "
                       "to calibrate on (default: perturbed held-out documents)")
    build.add_argument("--encode-cache", type=Path, metavar="DIR",
                       help="keep encoded chunks here so that an interrupted build resumes instead of re-encoding")
    build.add_argument("--chunk-size", type=_BATCH, help="documents per cached chunk (default: 10000)")
    build.add_argument("--processes", type=positive_int(1024),
                       help="encode with sentence-transformers' multi-process pool of N CPU workers")
    build.add_argument("--device", help="device to encode on (default: sentence-transformers' choice)")
    build.add_argument("--quantize", choices=("none", "int8"), default="none", help="int8: encode with the backbone's "
                       "linear layers in int8 on the CPU (docs/serving.md); default none")
    add_dtype_argument(build)
    build.add_argument("--task", help="a prompt set of a bank (st-prompts bank) that encodes the "
                       "documents and, when searching, the queries (default: the model's document and query sets)")
    add_trust_remote_code_argument(build)
    build.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds an index")
    add_no_progress_argument(build)
    build.set_defaults(func=run_build)


def _add_search(commands: argparse._SubParsersAction) -> None:
    search = commands.add_parser(
        "search", help="query an index",
        description="Print the K documents closest to each QUERY (cosine similarity), best first.",
    )
    search.add_argument("index", metavar="OUT", type=Path, help="index directory written by 'index build'")
    search.add_argument("queries", metavar="QUERY", nargs="+", help="query text(s)")
    search.add_argument("-k", type=_COUNT, default=5, help="hits per query (default: 5; clamped to the corpus size)")
    search.add_argument("--model", help="model to encode the queries with (default: the one recorded in the index); it "
                        "must match the index's model")
    search.add_argument("--nprobe", type=_COUNT, help="IVF: lists visited per query (this search only)")
    search.add_argument("--ef-search", type=_EF, help="HNSW: candidate list size (this search only)")
    search.add_argument("--rerank", type=non_negative_int(), help="IVF-PQ: candidates re-ranked (this search only)")
    search.add_argument("--mmap", action="store_true",
                        help="memory-map the index instead of reading it into RAM (for indexes larger than RAM)")
    search.add_argument("--device", help="device to encode on")
    search.add_argument("--task", help="the prompt set that encoded the index (checked; default: the "
                        "one the index records)")
    add_trust_remote_code_argument(search)
    search.add_argument("--json", action="store_true", help="print JSON instead of a ranked list")
    search.add_argument("--full-text", action="store_true", help="print the documents (and ids, queries) whole; by "
                        "default each is cut to 200 characters")
    search.set_defaults(func=run_search)


def _add_add(commands: argparse._SubParsersAction) -> None:
    add = commands.add_parser(
        "add", help="add documents to an index",
        description="Encode the documents of FILE with the index's model and add them to the index at OUT, without "
        "rebuilding it; the index is saved again atomically. FILE is read like 'index build' reads CORPUS. Ids: "
        "--id-column of a dataset file, else the integers following the index's largest id (a text file's blank "
        "lines are skipped and take no id). An IVF / IVF-PQ index warns when the new documents lie far from its "
        "trained centroids.",
    )
    add.add_argument("index", metavar="OUT", type=Path, help="index directory written by 'index build'")
    add.add_argument("file", metavar="FILE", type=Path, help="text file or dataset file with the new documents")
    add.add_argument("--column", default="text", help="text column of a dataset file (default: text)")
    add.add_argument("--id-column", help="id column of a dataset file")
    add.add_argument("--batch-size", type=_BATCH, default=64, help="encoding batch size (default: 64)")
    add.add_argument("--model", help="model to encode with (default: the index's); it must match")
    add.add_argument("--device", help="device to encode on")
    add_trust_remote_code_argument(add)
    add_no_progress_argument(add)
    add.set_defaults(func=run_add)


def _add_remove(commands: argparse._SubParsersAction) -> None:
    remove = commands.add_parser(
        "remove", help="remove documents from an index",
        description="Remove the documents with the given ids from the index at OUT; it is saved again atomically.",
    )  # fmt: skip
    remove.add_argument("index", metavar="OUT", type=Path, help="index directory")
    remove.add_argument("ids", metavar="ID", nargs="+", help="ids of the documents to remove")
    remove.set_defaults(func=run_remove)


def _add_calibrate(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser(
        "calibrate", help="re-calibrate an approximate index",
        description="Set nprobe / ef_search of the approximate index at OUT to the smallest value whose recall@10 "
        "against exact search reaches --target-recall, on perturbed held-out documents or --queries; saved atomically.",
    )  # fmt: skip
    calibrate.add_argument("index", metavar="OUT", type=Path, help="index directory")
    calibrate.add_argument("--target-recall", type=_recall, default=0.95, help="recall@10 to reach (default: 0.95)")
    calibrate.add_argument("--queries", type=Path, metavar="FILE",
                           help="text file of queries, one per line (default: perturbed held-out documents)")
    calibrate.add_argument("--model", help="model to encode with (default: the index's)")
    calibrate.add_argument("--device", help="device to encode on")
    add_trust_remote_code_argument(calibrate)
    calibrate.set_defaults(func=run_calibrate)


def _add_info(commands: argparse._SubParsersAction) -> None:
    info = commands.add_parser("info", help="describe an index", description="Print an index's metadata.")
    info.add_argument("index", metavar="OUT", type=Path, help="index directory")
    info.add_argument("--json", action="store_true", help="print meta.json as is")
    info.add_argument("--verify", action="store_true", help="check the SHA-256 of every file of the index against "
                      "the one recorded when it was written (reads every file; by default files over 256 MiB are "
                      "checked by size and structure only)")
    info.set_defaults(func=run_info)


def _add_export(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help="copy an index into a vector database collection (Milvus)",
        description="Copy the index at INDEX (ids, texts, vectors and its model's identity) into a Milvus collection, "
        "batch by batch, with an index of the same kind (flat -> FLAT, ivf -> IVF_FLAT, hnsw -> HNSW, ivfpq -> "
        "IVF_SQ8, with its parameters). URI: milvus:PATH.db[#COLLECTION] or PATH.db[#COLLECTION] (an embedded Milvus "
        "Lite file), http(s)://HOST:PORT[#COLLECTION] (a Milvus server or cluster; a token from $MILVUS_TOKEN). The "
        "collection defaults to the index folder's name. Serve it with: st-prompts serve MODEL --index NAME=URI. "
        'Needs pip install "st-prompts[scale]".',
    )  # fmt: skip
    export.add_argument("index", metavar="INDEX", type=Path, help="index directory written by 'index build'")
    export.add_argument("--to", required=True, metavar="URI", help="the collection to write (see above)")
    export.add_argument("--overwrite", action="store_true", help="replace a collection st-prompts wrote before "
                        "(one it did not write is never replaced)")
    export.add_argument("--batch-rows", type=_BATCH, default=2_000, help="documents per insert (default: 2000)")
    add_no_progress_argument(export)
    export.set_defaults(func=run_export)


@contextmanager
def _warnings_as_messages() -> Iterator[None]:
    """Print library warnings (blank lines skipped, k clamped, ...) as one-line messages instead of Python's format."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            yield
        finally:
            for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, UserWarning)):
                print(f"st-prompts index: warning: {clip(message, 600)}", file=sys.stderr)


def _params_text(params: dict[str, Any]) -> str:
    """`` key=value, ...`` of index parameters (empty without any), for a summary line."""
    details = ", ".join(f"{key}={value}" for key, value in params.items())
    return " " + details if details else ""


def run_build(args: argparse.Namespace) -> int:
    """Run ``st-prompts index build``."""
    if args.from_embeddings is not None:
        return _run_build_from_embeddings(args)
    if args.out is None:
        raise ConfigurationError("index build needs MODEL CORPUS OUT (or --from-embeddings PATH... OUT)")
    from st_prompts.loading import load_sentence_model
    from st_prompts.modules.chat_templates import guard_chat_templates
    from st_prompts.search import SemanticIndex
    from st_prompts.search.encoding import check_encode_length
    from st_prompts.search.store import check_index_destination

    check_index_destination(args.out, args.overwrite)  # before any model is loaded or document encoded
    if not args.corpus.exists():
        raise DataNotFoundError(f"corpus file not found: {args.corpus}")
    params, target, calibration_queries = _build_options(args)
    encoding = {"encode_cache_dir": args.encode_cache, "processes": args.processes}
    if args.chunk_size is not None:
        encoding["chunk_size"] = args.chunk_size
    with _warnings_as_messages():
        model = guard_chat_templates(load_sentence_model(args.model, args.trust_remote_code, device=args.device,
                                                         quantize=args.quantize, dtype=args.dtype))
        check_encode_length(model, clip(args.model, 100))  # before any document is encoded
        index = SemanticIndex.from_file(
            model, args.corpus, text_column=args.column, id_column=args.id_column, index_type=args.index_type,
            batch_size=args.batch_size, show_progress_bar=show_progress(args),
            model_name=recorded_model_name(args.model), target_recall=target,
            calibration_queries=calibration_queries, task=args.task, **encoding, **params)
        index.save(args.out, overwrite=args.overwrite)
    print(f"Indexed {len(index)} documents from {args.corpus} with {args.model} ({index.dimension} dims, "
          f"{index.index_type}{_params_text(index.index_params)}) -> {args.out}")
    if "calibration" in index.info:
        print(calibration_line(index.info["calibration"]))
    return 0


#: Options of ``index build`` that encode a corpus, with their defaults: they do not apply to --from-embeddings.
_ENCODING_OPTIONS = {"batch_size": 64, "column": "text", "id_column": None, "encode_cache": None, "chunk_size": None,
                     "processes": None, "quantize": "none", "dtype": "float32", "task": None}


def _run_build_from_embeddings(args: argparse.Namespace) -> int:
    """``st-prompts index build --from-embeddings PATH... OUT``: no model is loaded (unless text calibration queries
    need it), no torch imported."""
    from st_prompts.search.index import SemanticIndex
    from st_prompts.search.streaming_build import build_index_from_embedding_files

    given = [value for value in (args.model, args.corpus, args.out) if value is not None]
    sources = list(args.from_embeddings)
    if len(given) > 1:
        raise ConfigurationError("--from-embeddings takes the model and the documents from the embedding files: give "
                                 "only OUT besides them")
    if not given and len(sources) < 2:
        raise ConfigurationError("--from-embeddings needs the index directory to write as its last argument: "
                                 "st-prompts index build --from-embeddings PATH... OUT")
    out = Path(given[0]) if given else Path(sources.pop())
    misplaced = [f"--{name.replace('_', '-')}" for name, default in _ENCODING_OPTIONS.items()
                 if getattr(args, name) != default]
    if misplaced:
        raise ConfigurationError(f"{', '.join(misplaced)} encode(s) a corpus: not with --from-embeddings, whose "
                                 "vectors are already encoded")
    params, target, queries = _build_options(args)
    with _warnings_as_messages():
        built = build_index_from_embedding_files(
            SemanticIndex, sources, out, args.index_type, overwrite=args.overwrite, target_recall=target,
            calibration_queries=queries, show_progress_bar=show_progress(args), **params)
    model = f"model {built.model}" if built.model is not None else "no model: search it with vectors"
    print(f"Indexed {built.rows} documents from {built.parts} embedding file(s) ({model}; {built.dimension} dims, "
          f"{built.index_type}{_params_text(built.index_params)}) -> {out} in {built.seconds:.1f} s")
    if built.calibration is not None:
        print(calibration_line(built.calibration))
    return 0


def _build_options(args: argparse.Namespace) -> tuple[dict[str, Any], float | str | None, list[str] | None]:
    """``index build``'s index parameters, calibration target and queries (from text or from embeddings)."""
    params = {key: getattr(args, key) for key in ("nlist", "nprobe", "m", "ef_construction", "ef_search", "pq_m", "opq",
                                                  "rerank") if getattr(args, key) is not None}
    if args.no_calibration and (args.target_recall is not None or args.calibration_queries is not None):
        raise ConfigurationError("--no-calibration cannot be combined with --target-recall / --calibration-queries")
    target = None if args.no_calibration else (args.target_recall if args.target_recall is not None else "auto")
    if args.calibration_queries is not None and target == "auto" and args.index_type != "flat":
        target = 0.95
    queries = _read_queries(args.calibration_queries) if args.calibration_queries is not None else None
    return params, target, queries


def _read_queries(path: Path) -> list[str]:
    """Non-blank lines of a query file."""
    if not path.is_file():
        raise DataNotFoundError(f"query file not found: {path}")
    try:
        queries = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"{path} is not a UTF-8 text file: {exc}") from exc
    if not queries:
        raise ConfigurationError(f"{path} holds no query")
    return queries


def run_search(args: argparse.Namespace) -> int:
    """Run ``st-prompts index search``."""
    from st_prompts.search import SemanticIndex
    from st_prompts.search.corpus import check_queries

    check_queries(args.queries)
    with _warnings_as_messages():
        index = SemanticIndex.load(args.index, mmap=args.mmap)
        recorded = index.model_identity.task if index.model_identity is not None else None
        if args.task is not None and args.task != recorded:
            raise BackboneMismatchError(f"{args.index} was encoded with the prompt set {clip(repr(recorded), 80)}, "
                                        f"not {clip(repr(args.task), 80)}")
        if args.nprobe is not None or args.ef_search is not None or args.rerank is not None:
            index.set_search_params(nprobe=args.nprobe, ef_search=args.ef_search, rerank=args.rerank)
        _load_model_for(index, args)
        results = index.search(args.queries, k=args.k)
    print_results(args, results)
    return 0


def _load_model_for(index, args: argparse.Namespace) -> None:
    if args.model is not None:
        index.set_model(args.model, device=args.device, trust_remote_code=args.trust_remote_code)
    elif index.model_identity is not None:
        index.use_recorded_model(device=args.device, trust_remote_code=args.trust_remote_code)


def run_add(args: argparse.Namespace) -> int:
    """Run ``st-prompts index add``."""
    from st_prompts.search import SemanticIndex
    from st_prompts.search.corpus import read_corpus_file

    if not args.file.exists():
        raise DataNotFoundError(f"file not found: {args.file}")
    with _warnings_as_messages():
        corpus = read_corpus_file(args.file, text_column=args.column, id_column=args.id_column)
        with SemanticIndex.update(args.index) as index:  # concurrent updates take turns, each on the latest save
            _load_model_for(index, args)
            ids = corpus.ids if args.id_column is not None else None
            added = index.add(corpus.texts, ids, batch_size=args.batch_size, show_progress_bar=show_progress(args))
    span = f"ids {added[0]}..{added[-1]}" if added and all(isinstance(i, int) for i in added) else "their ids"
    print(f"Added {len(added)} documents from {args.file} to {args.index} ({span}); it now holds {len(index)}")
    if "calibration" in index.info:
        print("The calibration was measured before this update; re-run 'st-prompts index calibrate' to refresh it")
    return 0


def _parse_ids(index, values: list[str]) -> list:
    """Command-line ids as the index stores them: the string if the index has it, else the integer."""
    known = set(index.ids)  # an id it has neither way stays as given: remove() reports it
    return [int(v) if v not in known and len(v) <= 20 and v.lstrip("-").isdigit() and int(v) in known else v
            for v in values]


def run_remove(args: argparse.Namespace) -> int:
    """Run ``st-prompts index remove``."""
    from st_prompts.search import SemanticIndex

    with _warnings_as_messages(), SemanticIndex.update(args.index) as index:
        removed = index.remove(_parse_ids(index, args.ids))
    print(f"Removed {removed} documents from {args.index}; it now holds {len(index)}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    """Run ``st-prompts index calibrate``."""
    from st_prompts.search import SemanticIndex

    queries = _read_queries(args.queries) if args.queries is not None else None
    with _warnings_as_messages(), SemanticIndex.update(args.index) as index:
        if index.model_identity is not None:
            _load_model_for(index, args)
        index.calibrate(args.target_recall, queries)
    print(calibration_line(index.info["calibration"]))
    return 0


def run_info(args: argparse.Namespace) -> int:
    """Run ``st-prompts index info``. It needs no model: it reads the index with the store alone (FAISS and numpy,
    never torch or sentence-transformers), validating the directory without reading it all into RAM."""
    from st_prompts.search.checks import check_meta
    from st_prompts.search.faiss_index import INDEX_TYPES, PARAMETERS
    from st_prompts.search.store import load_index_dir, read_meta

    index = load_index_dir(args.index, mmap=True, verify=True if args.verify else None)
    meta = read_meta(args.index)  # checked again: a save may have replaced the index since it was read
    check_meta(args.index / "meta.json", meta, INDEX_TYPES, PARAMETERS)
    files = meta.get("files") or {}
    verified = (f"Verified:   size and SHA-256 of {len(files)} files ({', '.join(sorted(files))})" if files else
                f"Verified:   nothing: this index (format {meta.get('format_version', 0)}) was written before "
                "st-prompts recorded sizes and hashes; rebuild it to get them")
    if args.json:
        print(json.dumps(meta, ensure_ascii=False, indent=2))
        if args.verify and not files:
            print(verified.replace("Verified:   ", "index info --verify: "), file=sys.stderr)
        return 0
    print_info(args.index, index, meta)
    if args.verify:
        print(verified)
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Run ``st-prompts index export``."""
    from st_prompts.search import SemanticIndex
    from st_prompts.search.vector_db import collection_name_for, export_index, parse_address

    address = parse_address(args.to, default_collection=collection_name_for(args.index))  # before the index is read
    with _warnings_as_messages():
        index = SemanticIndex.load(args.index, mmap=True)  # vectors read batch by batch; no model needed
        record = export_index(index, address, overwrite=args.overwrite, rows=args.batch_rows,
                              progress=show_progress(args), source=str(args.index.resolve()))
    search = record["search"]
    print(f"Exported {record['documents']} documents of {args.index} to {address} ({search['index_type']}"
          f"{_params_text({**search['build'], **search['params']})}, inner product); serve it with: st-prompts serve "
          f"MODEL --index NAME={address}")
    return 0

