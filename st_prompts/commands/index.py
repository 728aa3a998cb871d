"""``st-prompts index``: build a FAISS semantic-search index over a corpus, query it, describe it.

Examples::

    st-prompts index build minilm corpus.txt corpus.index                 # one document per line, exact search
    st-prompts index build minilm docs.jsonl docs.index --column body --id-column doc_id --index-type hnsw
    st-prompts index search corpus.index "how do cats sleep?" "bread recipe" -k 5
    st-prompts index search corpus.index "how do cats sleep?" --json
    st-prompts index info corpus.index

See :mod:`st_prompts.search` for the conventions (cosine scores, ids, duplicates, ``k`` clamping). Models are loaded
with :func:`st_prompts.loading.load_sentence_model`: their code is trusted only when it all comes from
sentence-transformers or st_prompts, unless ``--trust-remote-code`` is given.

Only the standard library and :mod:`st_prompts.errors` are imported at module level, so that ``--help`` is fast;
the runners import the heavy parts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from st_prompts.commands.options import add_no_progress_argument, add_trust_remote_code_argument
from st_prompts.errors import ConfigurationError, DataNotFoundError

_TEXT_WIDTH = 200

# faiss logs at INFO which CPU-specific build it loads; that is noise for a command-line user.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``index`` and its sub-commands ``build``, ``search`` and ``info``."""
    parser = subparsers.add_parser(
        "index",
        help="build and query a FAISS semantic-search index",
        description="Build a FAISS semantic-search index over a corpus encoded with a sentence-transformers model, "
        "and query it. Scores are cosine similarities.",
    )
    commands = parser.add_subparsers(dest="index_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: _missing_subcommand(parser))

    build = commands.add_parser(
        "build",
        help="encode a corpus and save an index",
        description="Encode CORPUS with MODEL and save the index to the directory OUT. CORPUS is a text file with "
        "one document per line (ids = 1-based line numbers; blank lines skipped) or a .jsonl/.json/.csv/.parquet "
        "dataset (--column, --id-column; ids = 0-based rows by default). Duplicate texts are kept with a warning; "
        "duplicate ids are an error.",
    )
    build.add_argument("model", metavar="MODEL", help="model name or path ('minilm' = the packaged all-MiniLM-L6-v2)")
    build.add_argument("corpus", metavar="CORPUS", type=Path, help="text file or dataset file to index")
    build.add_argument("out", metavar="OUT", type=Path, help="index directory to write")
    build.add_argument("--index-type", choices=("flat", "ivf", "hnsw"), default="flat",
                       help="flat = exact (default); ivf / hnsw = approximate, for large corpora")
    build.add_argument("--batch-size", type=int, default=64, help="encoding batch size (default: 64)")
    build.add_argument("--column", default="text", help="text column of a dataset file (default: text)")
    build.add_argument("--id-column", default=None, help="id column of a dataset file (default: row numbers)")
    build.add_argument("--nlist", type=int, default=None, help="IVF: number of lists (default: 4*sqrt(n))")
    build.add_argument("--nprobe", type=int, default=None, help="IVF: lists visited per query")
    build.add_argument("--m", type=int, default=None, help="HNSW: neighbours per node")
    build.add_argument("--ef-construction", type=int, default=None, help="HNSW: build-time candidate list size")
    build.add_argument("--ef-search", type=int, default=None, help="HNSW: search-time candidate list size")
    build.add_argument("--device", default=None, help="device to encode on (default: sentence-transformers' choice)")
    add_trust_remote_code_argument(build)
    build.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds an index")
    add_no_progress_argument(build)
    build.set_defaults(func=run_build)

    search = commands.add_parser(
        "search",
        help="query an index",
        description="Print the K documents closest to each QUERY (cosine similarity), best first.",
    )
    search.add_argument("index", metavar="OUT", type=Path, help="index directory written by 'index build'")
    search.add_argument("queries", metavar="QUERY", nargs="+", help="query text(s)")
    search.add_argument("-k", type=int, default=5, help="hits per query (default: 5; clamped to the corpus size)")
    search.add_argument("--model", default=None,
                        help="model to encode the queries with (default: the one recorded in the index); it must "
                        "match the index's model")
    search.add_argument("--nprobe", type=int, default=None, help="IVF: lists visited per query (this search only)")
    search.add_argument("--ef-search", type=int, default=None, help="HNSW: candidate list size (this search only)")
    search.add_argument("--device", default=None, help="device to encode on")
    add_trust_remote_code_argument(search)
    search.add_argument("--json", action="store_true", help="print JSON instead of a ranked list")
    search.set_defaults(func=run_search)

    info = commands.add_parser("info", help="describe an index", description="Print an index's metadata.")
    info.add_argument("index", metavar="OUT", type=Path, help="index directory")
    info.add_argument("--json", action="store_true", help="print meta.json as is")
    info.set_defaults(func=run_info)


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


@contextmanager
def _warnings_as_messages() -> Iterator[None]:
    """Print library warnings (blank lines skipped, k clamped, ...) as one-line messages instead of Python's format."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            yield
        finally:
            seen = set()
            for warning in caught:
                message = str(warning.message)
                if issubclass(warning.category, UserWarning) and message not in seen:
                    seen.add(message)
                    print(f"st-prompts index: warning: {message}", file=sys.stderr)


def _recorded_model_name(name: str) -> str:
    """The name to store in the index: aliases and hub ids as given, local paths made absolute."""
    from st_prompts.utils import PACKAGED_MINILM_ALIASES

    if name in PACKAGED_MINILM_ALIASES and not os.path.exists(name):
        return "minilm"
    if os.path.exists(name):
        return os.path.abspath(name)
    return name


def run_build(args: argparse.Namespace) -> int:
    """Run ``st-prompts index build``."""
    from st_prompts.loading import load_sentence_model
    from st_prompts.search import SemanticIndex

    if args.out.exists() and not args.overwrite and (not args.out.is_dir() or any(args.out.iterdir())):
        raise ConfigurationError(f"{args.out} already exists (use --overwrite to replace an existing index)")
    if not args.corpus.exists():
        raise DataNotFoundError(f"corpus file not found: {args.corpus}")
    params = {
        "nlist": args.nlist,
        "nprobe": args.nprobe,
        "m": args.m,
        "ef_construction": args.ef_construction,
        "ef_search": args.ef_search,
    }
    params = {key: value for key, value in params.items() if value is not None}
    with _warnings_as_messages():
        model = load_sentence_model(args.model, args.trust_remote_code, device=args.device)
        index = SemanticIndex.from_file(
            model,
            args.corpus,
            text_column=args.column,
            id_column=args.id_column,
            index_type=args.index_type,
            batch_size=args.batch_size,
            show_progress_bar=not args.no_progress,
            model_name=_recorded_model_name(args.model),
            **params,
        )
        index.save(args.out, overwrite=True)
    details = ", ".join(f"{key}={value}" for key, value in index.index_params.items())
    print(
        f"Indexed {len(index)} documents from {args.corpus} with {args.model} ({index.dimension} dims, "
        f"{index.index_type}{' ' + details if details else ''}) -> {args.out}"
    )
    return 0


def run_search(args: argparse.Namespace) -> int:
    """Run ``st-prompts index search``."""
    from st_prompts.search import SemanticIndex

    with _warnings_as_messages():
        index = SemanticIndex.load(args.index)
        if args.nprobe is not None or args.ef_search is not None:
            index.set_search_params(nprobe=args.nprobe, ef_search=args.ef_search)
        if args.model is not None:
            index.set_model(args.model, device=args.device, trust_remote_code=args.trust_remote_code)
        elif index.model_identity is not None:
            index.use_recorded_model(device=args.device, trust_remote_code=args.trust_remote_code)
        results = index.search(args.queries, k=args.k)
    if args.json:
        payload = [
            {
                "query": query,
                "hits": [
                    {"rank": rank, "id": hit.id, "score": round(hit.score, 6), "text": hit.text}
                    for rank, hit in enumerate(hits, start=1)
                ],
            }
            for query, hits in zip(args.queries, results)
        ]
        print(json.dumps(payload, ensure_ascii=False, indent=2))
        return 0
    for number, (query, hits) in enumerate(zip(args.queries, results)):
        if number:
            print()
        print(f"Query: {query}")
        if not hits:
            print("  (no hits)")
        id_width = max(len(str(hit.id)) for hit in hits) if hits else 0
        for rank, hit in enumerate(hits, start=1):
            text = hit.text if len(hit.text) <= _TEXT_WIDTH else hit.text[: _TEXT_WIDTH - 1] + "…"
            print(f"  {rank:>2}. {hit.score:.4f}  [{str(hit.id):>{id_width}}]  {text}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    """Run ``st-prompts index info``."""
    from st_prompts.search import SemanticIndex

    index = SemanticIndex.load(args.index)  # validates the directory
    meta = json.loads((args.index / "meta.json").read_text(encoding="utf-8"))
    if args.json:
        print(json.dumps(meta, ensure_ascii=False, indent=2))
        return 0
    model = index.model_identity
    print(f"Index:      {args.index}")
    print(f"Documents:  {len(index)}")
    print(f"Type:       {index.index_type} ({meta.get('faiss_factory')}) {index.index_params or ''}".rstrip())
    print(f"Dimension:  {index.dimension}; scores are cosine similarities (L2-normalised, inner product)")
    if model is not None:
        print(f"Model:      {model.name} ({model.fingerprint[:19]}…)")
    else:
        print("Model:      none (built from bare embeddings)")
    return 0
