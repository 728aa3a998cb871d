"""``st-prompts embed``: encode a corpus into a folder of Parquet parts (ids, texts, float32 vectors), on this machine
or on a Ray cluster; a rerun with the same settings resumes (finished parts are skipped).

    st-prompts embed minilm corpus.txt corpus.emb                       # one document a line, this machine
    st-prompts embed minilm docs.jsonl docs.emb --text-column body --id-column doc_id --part-rows 20
    st-prompts embed minilm big.txt big.emb --engine ray --actors 2 --num-cpus 1   # a local Ray, 2 actors
    st-prompts embed minilm big.txt big.emb --engine ray --ray-address 10.0.0.1:6379 --num-gpus 1

INPUT: a text file (ids: 1-based line numbers; blank lines skipped), JSON lines or Parquet (ids: 0-based rows, or
--id-column). OUTPUT: a folder of part-NNNNN.parquet (--part-rows input rows each) and embed.json (the run's
settings and the model's identity), which st-prompts index build --from-embeddings reads. The vectors are what the
model's encode_document gives (not normalised), or encode(task=...) with --task, or each row's own prompt set with
--task-column. With --engine ray the input must be at the same path on every node; the parts are written by this
process only. See docs/scale.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from st_prompts.commands._numbers import positive_float, positive_int
from st_prompts.commands.options import (add_dtype_argument, add_no_progress_argument, add_trust_remote_code_argument,
                                         cli_text, show_progress)
from st_prompts.errors import ConfigurationError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``embed``."""
    parser = subparsers.add_parser(
        "embed", help="encode a corpus into Parquet parts, locally or on a Ray cluster (resumable)",
        description=cli_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", help="model or bank folder, hub id, or 'minilm' (the packaged "
                        "all-MiniLM-L6-v2)")
    parser.add_argument("input", metavar="INPUT", type=Path, help="text file (one document a line), .jsonl or .parquet")
    parser.add_argument("output", metavar="OUTPUT", type=Path, help="folder of parts to write (new, or one this "
                        "command wrote with the same settings: resumed)")
    parser.add_argument("--text-column", default="text", help="text column of a .jsonl/.parquet input (default: text)")
    parser.add_argument("--id-column", help="id column of a .jsonl/.parquet input (default: row numbers)")
    parser.add_argument("--task-column", help="column naming each row's prompt set of a bank (rows "
                        "without one take --task, else the document side)")
    parser.add_argument("--task", help="a prompt set of a bank (st-prompts bank) for every row "
                        "(default: the model's document side)")
    add_dtype_argument(parser)
    parser.add_argument("--quantize", choices=("none", "int8"), default="none",
                        help="int8: encode with the backbone's linear layers in int8 on the CPU (docs/serving.md)")
    parser.add_argument("--batch-size", type=positive_int(1 << 20), default=64, help="encoding batch size "
                        "(default: 64)")
    parser.add_argument("--part-rows", type=positive_int(1 << 30), default=100_000,
                        help="input rows per part (default: 100000); a resumed run must keep it")
    parser.add_argument("--no-texts", action="store_true", help="write ids and vectors only (no text column)")
    parser.add_argument("--device", help="device of --engine local (default: sentence-transformers' choice)")
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="local: this process; ray: Ray Data actors (pip install \"st-prompts[scale]\")")
    parser.add_argument("--ray-address", metavar="HOST:PORT",
                        help="an existing Ray cluster (default: start a local Ray on this machine)")
    parser.add_argument("--actors", type=positive_int(1 << 16), help="Ray actors, each with its own copy of the model "
                        "(default: as many as the cluster's CPUs, or GPUs with --num-gpus, hold)")
    parser.add_argument("--num-cpus", type=positive_float(1024.0),
                        help="CPUs per Ray actor (default: 1; also its torch threads)")
    parser.add_argument("--num-gpus", type=positive_float(64.0),
                        help="GPUs per Ray actor (default: none; the model then runs on a GPU)")
    add_trust_remote_code_argument(parser)
    add_no_progress_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``st-prompts embed``."""
    from st_prompts.embedding import ModelSpec, RayOptions, embed_file

    ray_options = (args.ray_address, args.actors, args.num_cpus, args.num_gpus)
    if args.engine == "local" and any(value is not None for value in ray_options):
        raise ConfigurationError("--ray-address, --actors, --num-cpus and --num-gpus are options of --engine ray")
    if args.engine == "ray" and args.device is not None:
        raise ConfigurationError("--device is an option of --engine local; give Ray actors GPUs with --num-gpus")
    spec = ModelSpec(args.model, args.trust_remote_code, dtype=args.dtype, quantize=args.quantize,
                     device=args.device)
    result = embed_file(spec, args.input, args.output, text_column=args.text_column, id_column=args.id_column,
                        task_column=args.task_column, task=args.task, part_rows=args.part_rows,
                        batch_size=args.batch_size, keep_texts=not args.no_texts, engine=args.engine,
                        ray=RayOptions(args.ray_address, args.actors, args.num_cpus or 1.0, args.num_gpus or 0.0),
                        progress=show_progress(args))
    print(result.summary())
    return 0
