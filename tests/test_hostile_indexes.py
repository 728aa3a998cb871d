"""Hostile and damaged search indexes (``meta.json`` values, records, IVF labels, damaged files, random corruption), a
model longer than its position table and a failing chat template through the ``st-prompts index`` commands: each ends in
one ``error:`` line (exit 2), never a traceback; a 1 MB document is never printed whole. Each case edits a copy of one
small IVF index over real text (MiniLM)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import faiss
import numpy as np
import pytest
from conftest import cli_error, edit_json, run_cli
from test_search import cli_ok

from st_prompts.errors import DataFormatError
from st_prompts.search import SemanticIndex

REAL_CORPUS = Path(__file__).parent / "fixtures" / "search" / "real_corpus.txt"
#: A 1 MB document (the only one about cats: the query "cat" finds it first).
HUGE = " ".join(["cat"] * 262_144)
ONE_LINE_ERROR = re.compile(r"st-prompts index( [a-z]+)?: error: \S")


@pytest.fixture(scope="module", autouse=True)
def _no_loading_bars():
    """The CLI turns transformers' progress bars off before importing it; in this process it is imported already."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if enabled:
        hf_logging.enable_progress_bar()


@pytest.fixture(scope="module")
def base_index(tmp_path_factory, minilm) -> Path:
    """An IVF index (5 lists, nprobe 2) of 200 real sentences and one 1 MB document, saved by this st-prompts."""
    folder = tmp_path_factory.mktemp("hostile")
    lines = [line for line in REAL_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()][:200]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(lines + [HUGE]) + "\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = SemanticIndex.from_file(minilm, corpus, index_type="ivf", nprobe=2, model_name="minilm",
                                        show_progress_bar=False)  # fmt: skip
    index.save(folder / "idx")
    return folder / "idx"


def rehash(folder: Path) -> None:
    """Record the present sizes and SHA-256 of the files in ``meta.json``: a crafted index, not a damaged one."""
    meta = json.loads((folder / "meta.json").read_text())
    for name, entry in meta["files"].items():
        data = (folder / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "meta.json").write_text(json.dumps(meta))


def edit_meta(change):
    def edit(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        change(meta)
        (folder / "meta.json").write_text(json.dumps(meta))  # allow_nan: NaN, Infinity as JSON has them
    return edit


def set_key(path: str, value):
    def change(meta: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            meta = meta[key]
        meta[last] = value
    return edit_meta(change)


def write(name: str, data: bytes):
    return lambda folder: (folder / name).write_bytes(data)


def label_out_of_range(label: int):
    def edit(folder: Path) -> None:
        index = faiss.read_index(str(folder / "index.faiss"))
        ivf = faiss.extract_index_ivf(index)
        faiss.rev_swig_ptr(ivf.invlists.get_ids(0), ivf.invlists.list_size(0))[1] = label
        faiss.write_index(index, str(folder / "index.faiss"))
        rehash(folder)
    return edit


def damaged_docs(rehashed: bool):
    def edit(folder: Path) -> None:
        data = (folder / "docs.jsonl").read_bytes()
        lines = data.split(b"\n")
        lines[-2] = b"\xff" * len(lines[-2])  # the 1 MB document's record, same size: not UTF-8, not JSON
        (folder / "docs.jsonl").write_bytes(b"\n".join(lines))
        if rehashed:
            rehash(folder)
    return edit


def damaged_offsets(folder: Path) -> None:
    offsets = np.load(folder / "docs.offsets.npy")
    offsets[3], offsets[4] = offsets[4], offsets[3]
    np.save(folder / "docs.offsets.npy", offsets)
    rehash(folder)


def nan_probe(folder: Path) -> None:
    probe = np.load(folder / "probe.npy")
    probe[0, 0] = np.nan
    np.save(folder / "probe.npy", probe)
    rehash(folder)


CALIBRATION = {"target_recall": 0.95, "k": 10, "parameter": "nprobe", "value": 2, "measured_recall": 0.97,
               "reached": True, "queries": {"kind": "given_texts", "count": 40}, "num_docs": 201}
FILE_CASES = {  # name: (edit, what the message must name)
    "nprobe NaN": (set_key("index_params.nprobe", float("nan")), "index_params.nprobe"),
    "nprobe -5": (set_key("index_params.nprobe", -5), "index_params.nprobe"),
    "nprobe 1e30": (set_key("index_params.nprobe", 1e30), "index_params.nprobe"),
    "nprobe above nlist": (set_key("index_params.nprobe", 6), "index_params.nprobe"),
    "nprobe a string": (set_key("index_params.nprobe", "2"), "index_params.nprobe"),
    "nlist not the lists'": (set_key("index_params.nlist", 7), "index_params.nlist"),
    "no nlist": (edit_meta(lambda m: m["index_params"].pop("nlist")), "lacks nlist"),
    "no index_type": (edit_meta(lambda m: m.pop("index_type")), "no index_type"),
    "unknown index_type": (set_key("index_type", "annoy"), "index_type"),
    "index_type not the file's": (edit_meta(lambda m: m.update(index_type="hnsw", index_params={
        "m": 32, "ef_construction": 80, "ef_search": 128})), "index.faiss"),
    "calibration a list": (set_key("calibration", [1, 2]), "calibration"),
    "calibration value bogus": (set_key("calibration", {**CALIBRATION, "value": "x"}), "calibration.value"),
    "calibration recall NaN": (set_key("calibration", {**CALIBRATION, "measured_recall": float("nan")}),
                               "calibration.measured_recall"),
    "calibration without a k": (set_key("calibration", {key: v for key, v in CALIBRATION.items() if key != "k"}),
                                "calibration.k"),
    "calibration of ef_search": (set_key("calibration", {**CALIBRATION, "parameter": "ef_search"}),
                                 "calibration.parameter"),
    "num_docs a string": (set_key("num_docs", "201"), "num_docs"),
    "num_docs not the index's": (set_key("num_docs", 5), "meta.json says 5"),
    "format_version Infinity": (set_key("format_version", float("inf")), "format_version"),
    "next_id NaN": (set_key("next_id", float("nan")), "next_id"),
    "drift without ratio": (set_key("drift", {"last_add_mean_sq_distance": 1.0}), "drift.ratio_to_training"),
    "ivf_training NaN": (set_key("ivf_training.mean_sq_distance", float("nan")), "ivf_training.mean_sq_distance"),
    "model dimension": (set_key("model.dimension", 7), "model.dimension"),
    "model name a number": (set_key("model.name", 12), "model.name"),
    "meta.json nested 100,000 deep": (write("meta.json", b"[" * 100_000 + b"]" * 100_000), "meta.json"),
    "meta.json not UTF-8": (write("meta.json", b"\xff\xfe{}"), "meta.json"),
    "meta.json of 17 MiB": (write("meta.json", b"{" + b" " * (17 << 20) + b"}"), "meta.json is"),
    "nprobe true": (set_key("index_params.nprobe", True), "index_params.nprobe"),
    "IVF label 10**6": (label_out_of_range(10**6), "label 1000000"),
    "IVF label -7": (label_out_of_range(-7), "label -7"),
    "damaged index.faiss (same size)": (lambda f: (f / "index.faiss").write_bytes(
        b"\0" * (f / "index.faiss").stat().st_size), "index.faiss"),
    "truncated index.faiss": (lambda f: (f / "index.faiss").write_bytes((f / "index.faiss").read_bytes()[:999]),
                              "index.faiss"),
    "damaged docs.jsonl": (damaged_docs(rehashed=False), "docs.jsonl"),
    "crafted docs.jsonl": (damaged_docs(rehashed=True), "docs.jsonl"),
    "damaged docs.offsets.npy": (damaged_offsets, "docs.offsets.npy"),
    "probe.npy NaN": (nan_probe, "probe.npy"),
}
FILE_CASES["files size -1"] = (set_key("files", {"index.faiss": {"bytes": -1, "sha256": "0" * 64}}),
                               "files.index.faiss.bytes")
#: Cases some commands never notice, rightly: 'info' reads no document, a full load never reads the offsets (it
#: writes them anew), and only the memory-mapped search reads records one at a time.
ONLY = {"crafted docs.jsonl": ("remove", "search", "search --mmap"),
        "damaged docs.offsets.npy": ("info", "search --mmap")}
MMAP_CASES = ("damaged docs.jsonl", "crafted docs.jsonl", "damaged docs.offsets.npy", "IVF label 10**6",
              "truncated index.faiss")
COMMANDS = {
    "info": lambda idx: ["index", "info", str(idx)],
    "remove": lambda idx: ["index", "remove", str(idx), "3"],
    "search": lambda idx: ["index", "search", str(idx), "cat", "-k", "2"],
    "search --mmap": lambda idx: ["index", "search", str(idx), "cat", "-k", "2", "--mmap"],
}
#: (Hostile numbers on the command line of the index commands: test_cli_hostile's walk of every numeric option.)
CASES = [pytest.param(name, command, id=f"{name} / {command}") for name in FILE_CASES for command in COMMANDS
         if command in ONLY.get(name, COMMANDS) and (command != "search --mmap" or name in MMAP_CASES)]


def error_line(argv: list, capsys) -> str:
    """The one line (and nothing else) of a command refused with exit status 2, in the index commands' form."""
    line = cli_error(argv, capsys, alone=True)
    assert ONE_LINE_ERROR.match(line), line
    return line


@pytest.mark.parametrize("name,command", CASES)
def test_a_hostile_index_is_one_line_and_exit_2(name, command, base_index, tmp_path, capsys):
    folder = tmp_path / "idx"
    shutil.copytree(base_index, folder)
    edit, named = FILE_CASES[name]
    edit(folder)
    line = error_line(COMMANDS[command](folder), capsys)
    assert named in line and len(line) < 700 and str(folder) in line  # the message names the index's file


def test_a_randomly_corrupted_ivf_index_is_detected_though_faiss_reads_it(base_index, tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    folder = tmp_path / "idx"
    shutil.copytree(base_index, folder)
    data = bytearray((folder / "index.faiss").read_bytes())
    original = faiss.read_index(str(folder / "index.faiss"))
    ivf = faiss.extract_index_ivf(original)  # (a view into `original`, which must stay alive)
    codes = faiss.rev_swig_ptr(ivf.invlists.get_codes(0), ivf.invlists.list_size(0) * ivf.code_size)
    start = bytes(data).find(codes[:256].tobytes())  # where the vectors of list 0 lie in the file
    assert start > 0
    rng = np.random.default_rng(0)
    for position in rng.integers(start, start + len(codes), size=32):
        data[position] ^= int(rng.integers(1, 256))
    (folder / "index.faiss").write_bytes(bytes(data))
    damaged = faiss.read_index(str(folder / "index.faiss"))  # FAISS has no checksum: it reads and searches it
    assert damaged.search(np.ones((1, damaged.d), dtype=np.float32), 3)[1].min() >= 0
    for mmap in (False, True):
        with pytest.raises(DataFormatError, match=r"index\.faiss is damaged: its SHA-256 differs"):
            SemanticIndex.load(folder, mmap=mmap)
    assert "SHA-256" in error_line(["index", "search", str(folder), "cat"], capsys)
    # A memory-mapped load hashes files up to MMAP_HASH_LIMIT only; 'index info --verify' hashes every file.
    monkeypatch.setattr("st_prompts.search.store.MMAP_HASH_LIMIT", 1000)
    assert len(SemanticIndex.load(folder, mmap=True)) == 201
    assert run_cli(["index", "info", str(folder)]) == 0
    capsys.readouterr()
    assert "files.index.faiss.sha256" in error_line(["index", "info", str(folder), "--verify"], capsys)


def test_a_1mb_document_is_never_printed_whole(base_index, capsys):
    def search(*argv) -> str:
        return cli_ok(["index", "search", base_index, *argv], capsys)[0]

    for extra in ([], ["--json"], ["--mmap"]):
        out = search("cat cat cat", "-k", "3", *extra)
        assert "cat cat cat" in out and len(out) < 3000, len(out)
    hit = json.loads(search("cat cat cat", "-k", "1", "--json"))[0]["hits"][0]
    assert hit["text_chars"] == len(HUGE) and len(hit["text"]) == 200
    assert json.loads(search("cat cat cat", "-k", "1", "--json", "--full-text"))[0]["hits"][0]["text"] == HUGE
    assert len(search("dog " * 250_000, "-k", "1")) < 1000  # a 1 MB query or id is quoted short too
    assert len(error_line(["index", "search", str(base_index), "q", "--task", "x" * 1_000_000], capsys)) < 500


def test_index_build_refuses_a_length_beyond_the_position_table_and_a_failing_chat_template(
        minilm_path, tiny_backbones, tmp_path, capsys):  # fmt: skip
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a man plays the guitar\nthe dog runs in the park\n" + "word " * 3000 + "\n")
    long = tmp_path / "long-minilm"
    shutil.copytree(minilm_path, long)
    edit_json(long / "sentence_bert_config.json", lambda config: config.update(max_seq_length=100_000))
    line = error_line(["index", "build", str(long), str(corpus), str(tmp_path / "a"), "--no-progress"], capsys)
    assert "max_seq_length 100000" in line and "position table holds 512" in line
    assert not (tmp_path / "a").exists()

    decoder = tmp_path / "decoder"
    shutil.copytree(tiny_backbones("llama"), decoder)
    edit_json(decoder / "tokenizer_config.json",
              lambda settings: settings.update(chat_template="{{ raise_exception('" + "x" * 5000 + "') }}"))
    line = error_line(["index", "build", str(decoder), str(corpus), str(tmp_path / "b"), "--no-progress"], capsys)
    assert "chat template" in line and len(line) < 700


def test_the_real_entry_point_prints_no_traceback(base_index, tmp_path):
    """``st-prompts`` as installed (a new process, no pytest capture) over a few hostile indexes."""
    script = Path(sys.executable).parent / "st-prompts"
    for name, command in (("nprobe NaN", "info"), ("IVF label 10**6", "search")):
        folder = tmp_path / name.replace(" ", "_").replace("*", "")
        shutil.copytree(base_index, folder)
        FILE_CASES[name][0](folder)
        result = subprocess.run([str(script), *COMMANDS[command](folder)], capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith("st-prompts index: error: "), result.stderr[-2000:]


def test_a_search_that_meets_a_label_outside_the_corpus_is_refused():
    """The last guard, for an index changed in memory after it was checked: a hit must be a row of the corpus."""
    vectors = np.random.default_rng(0).standard_normal((120, 8)).astype(np.float32)
    index = SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(120)], index_type="ivf", nlist=2, nprobe=2,
                                          target_recall=None)  # fmt: skip
    ivf = faiss.extract_index_ivf(index.index)
    faiss.rev_swig_ptr(ivf.invlists.get_ids(0), ivf.invlists.list_size(0))[:] = 10**6
    with pytest.raises(DataFormatError, match="returned the row 1000000 for an index of 120 documents"):
        index.search_embeddings(vectors[:5], k=120)


@pytest.mark.parametrize("change", ["no files", "a file left out"])
def test_a_format_3_meta_json_that_does_not_record_every_file_is_refused(change, base_index, tmp_path, capsys):
    """From format 3 on st-prompts records the size and SHA-256 of every file it writes: a ``meta.json`` that leaves
    one out was not written by it, and every command refuses it, ``index info --verify`` included."""
    folder = tmp_path / "idx"
    shutil.copytree(base_index, folder)
    edit_meta(lambda meta: meta.pop("files") if change == "no files" else meta["files"].pop("docs.jsonl"))(folder)
    for argv in (["index", "info", str(folder), "--verify"], ["index", "info", str(folder)],
                 ["index", "search", str(folder), "a query", "--model", "minilm"]):
        line = error_line(argv, capsys)
        assert ("records no files" if change == "no files" else "records no size or SHA-256 for docs.jsonl") in line


def test_index_info_verify_says_what_it_verified_and_when_nothing_was(base_index, tmp_path, capsys):
    folder = tmp_path / "idx"
    shutil.copytree(base_index, folder)
    capsys.readouterr()
    verify = ["index", "info", folder, "--verify"]
    assert "Verified:   size and SHA-256 of 4 files (docs.jsonl" in cli_ok(verify, capsys)[0]
    edit_meta(lambda meta: meta.pop("files"))(folder)  # an index of format 2 (before the records)
    set_key("format_version", 2)(folder)
    out = cli_ok(verify, capsys)[0]
    assert "Verified:   nothing: this index (format 2) was written before st-prompts recorded" in out
