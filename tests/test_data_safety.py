"""Nothing the user has is lost: output folders, interrupted saves, concurrent updates, ids, damaged files, bad input.

Attacks from a careless or hostile user: a folder with other files in it as the output, ``.`` as the output, a save
killed at every step, two processes updating one index, reading an index while it is replaced, truncated files.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import SENTENCES, edit_json, one_error_line, prompted_model, run_cli, save_plain

from st_prompts.cli import main
from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.search import SemanticIndex
from st_prompts.storage import MANIFEST_FILE, replace_folder

FIXTURES = Path(__file__).parent / "fixtures"


def train_argv(tiny_bert, data_dir, output, *extra):
    return ["train", "dcpcse", "--backbone", tiny_bert, "--data-dir", str(data_dir), "--max-steps", "1",
            "--batch-size", "4", "--eval-steps", "1", "--output", str(output), "--no-progress", *extra]


# ---------------------------------------------------------------------------------------------- train --output
def test_train_output_never_replaces_a_folder_it_did_not_write(tiny_bert, data_dir, tmp_path, capsys):
    thesis = tmp_path / "thesis"
    (thesis / "src").mkdir(parents=True)
    (thesis / "thesis.tex").write_text("years of work")
    (thesis / "src" / "main.py").write_text("print(1)")
    assert main(train_argv(tiny_bert, data_dir, thesis)) == 2
    assert "not a model saved by st-prompts" in one_error_line(capsys)
    assert main(train_argv(tiny_bert, data_dir, thesis, "--overwrite")) == 2  # --overwrite does not change that
    assert (thesis / "thesis.tex").read_text() == "years of work" and (thesis / "src" / "main.py").exists()


@pytest.mark.parametrize("output", [".", "..", "./"])
def test_train_output_refuses_the_current_folder_and_its_parents(tiny_bert, data_dir, tmp_path, capsys, monkeypatch,
                                                                 output):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert main(train_argv(tiny_bert, data_dir, output, "--overwrite")) == 2
    assert "current folder or one of its parents" in one_error_line(capsys)
    assert (work / "notes.txt").read_text() == "mine"


def test_an_st_prompts_model_is_replaced_only_with_overwrite(tiny_bert, data_dir, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(train_argv(tiny_bert, data_dir, out)) == 0
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert "model.safetensors" in manifest["files"] and "train_result.json" in manifest["files"]
    first = (out / "train_result.json").read_text()
    assert main(train_argv(tiny_bert, data_dir, out)) == 2
    assert "--overwrite" in one_error_line(capsys)
    assert main(train_argv(tiny_bert, data_dir, out, "--overwrite", "--seed", "7")) == 0
    assert (out / "train_result.json").read_text() != first
    # A file the user put into the model folder makes it theirs: even --overwrite refuses, and the file stays.
    (out / "my-notes.md").write_text("notes")
    assert main(train_argv(tiny_bert, data_dir, out, "--overwrite")) == 2
    assert "my-notes.md" in one_error_line(capsys)
    assert (out / "my-notes.md").read_text() == "notes"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model")] == []  # no lock file stays behind


def test_trainer_files_never_land_in_the_output(tiny_bert, data_dir, tmp_path, monkeypatch):
    """A Ctrl-C during training leaves an existing model as it was (the trainer's evaluation CSVs go elsewhere)."""
    import st_prompts.training.run as run_module

    out = tmp_path / "model"
    assert main(train_argv(tiny_bert, data_dir, out)) == 0
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    original = run_module.KeepBestCallback.consider

    def consider_then_interrupt(self, value, step):
        original(self, value, step)
        interrupt()

    monkeypatch.setattr(run_module.KeepBestCallback, "consider", consider_then_interrupt)
    assert main(train_argv(tiny_bert, data_dir, out, "--overwrite")) == 130
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert not any("eval" in name for name in before)


def test_saved_files_follow_the_umask(tiny_bert, data_dir, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "model"
        assert main(train_argv(tiny_bert, data_dir, out)) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((out / "soft_prompts.safetensors").stat().st_mode) == 0o644


# ---------------------------------------------------------------------------------------------- interrupted saves
def _write(text: str):
    def write(folder: Path) -> None:
        (folder / "model.txt").write_text(text)
        (folder / "sub").mkdir()
        (folder / "sub" / "part.txt").write_text(text)
    return write


def _ours(folder: Path):
    return None if (folder / "model.txt").is_file() else "not ours"


def _complete(folder: Path) -> str:
    assert (folder / "sub" / "part.txt").read_text() == (folder / "model.txt").read_text()
    return (folder / "model.txt").read_text()


@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_save_interrupted_at_each_rename_leaves_one_complete_folder(tmp_path, monkeypatch, failing_call):
    import st_prompts.storage as storage

    target = tmp_path / "out"
    replace_folder(target, _write("old"), ownership=_ours)
    calls = []
    real_replace = os.replace

    def interrupted_replace(src, dst):
        calls.append((src, dst))
        if len(calls) == failing_call:
            raise KeyboardInterrupt  # a Ctrl-C at this rename
        return real_replace(src, dst)

    monkeypatch.setattr(storage.os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        replace_folder(target, _write("new"), ownership=_ours, overwrite=True)
    monkeypatch.undo()
    assert _complete(target) == "old"  # the first rename failed, or the second failed and the old one came back
    assert [p.name for p in tmp_path.iterdir() if "st-prompts-" in p.name and "lock" not in p.name] == []


KILLED_SAVE = """
import os, shutil, sys
from pathlib import Path
import st_prompts.storage as storage

target, text, kill_at = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
calls = []
real_replace, real_rmtree = os.replace, shutil.rmtree

def replace(src, dst):
    calls.append(dst)
    if kill_at == f"replace-{len(calls)}":
        os._exit(9)  # killed: no exception handler, no finally block runs
    return real_replace(src, dst)

def rmtree(path, *args, **kwargs):
    if kill_at == "rmtree" and ".st-prompts-old-" in str(path):
        os._exit(9)
    return real_rmtree(path, *args, **kwargs)

storage.os.replace, storage.shutil.rmtree = replace, rmtree

def write(folder):
    (folder / "model.txt").write_text(text)
    (folder / "sub").mkdir()
    (folder / "sub" / "part.txt").write_text(text)

storage.replace_folder(target, write, ownership=lambda f: None if (f / "model.txt").is_file() else "not ours",
                       overwrite=True)
"""


@pytest.mark.parametrize("kill_at", ["replace-1", "replace-2", "rmtree"])
def test_a_kill_at_each_step_leaves_one_complete_folder_and_the_next_save_cleans_up(kill_at, tmp_path):
    """The process is killed (``os._exit``: nothing of it runs any more) at the rename aside, at the rename in, and
    before the old folder is deleted: one complete folder survives each time (at the target, or for the instant
    between the renames under the set-aside name); the next save removes the leftovers."""
    target = tmp_path / "out"
    replace_folder(target, _write("old"), ownership=_ours)
    result = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(target), "new", kill_at], capture_output=True)
    assert result.returncode == 9, result.stderr
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".out.st-prompts-") and p.is_dir()]
    complete = ([target] if target.exists() else []) + [p for p in hidden if (p / "model.txt").exists()]
    assert {_complete(p) for p in complete} <= {"old", "new"} and complete
    if kill_at == "replace-2":  # between the renames: the old one is complete under the set-aside name
        assert not target.exists() and any(_complete(p) == "old" for p in hidden)
    else:
        assert _complete(target) == ("new" if kill_at == "rmtree" else "old")
    replace_folder(target, _write("next"), ownership=_ours, overwrite=True)
    assert _complete(target) == "next"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # (the killed save's lock file removed too)


def test_leftovers_that_st_prompts_did_not_write_are_left_alone(tmp_path):
    target = tmp_path / "out"
    stranger = tmp_path / ".out.st-prompts-old-abc123"
    stranger.mkdir()
    (stranger / "diary.txt").write_text("private")
    replace_folder(target, _write("v1"), ownership=_ours)
    assert (stranger / "diary.txt").read_text() == "private"


def test_an_index_save_interrupted_at_each_step_keeps_a_loadable_index(tmp_path, monkeypatch):
    import st_prompts.storage as storage

    vectors = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    index = SemanticIndex.from_embeddings(vectors, [f"doc {i}" for i in range(40)])
    target = tmp_path / "idx"
    index.save(target)
    index.remove([0])
    real_replace, real_rmtree = os.replace, shutil.rmtree
    for step in ("replace-1", "replace-2", "rmtree"):
        calls = []

        def replace(src, dst, step=step, calls=calls):
            calls.append(dst)
            if step == f"replace-{len(calls)}":
                raise KeyboardInterrupt
            return real_replace(src, dst)

        def rmtree(path, *args, step=step, **kwargs):
            if step == "rmtree" and ".st-prompts-old-" in str(path):
                raise OSError("interrupted")
            return real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(storage.os, "replace", replace)
        monkeypatch.setattr(storage.shutil, "rmtree", rmtree)
        try:
            index.save(target)
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
        loaded = SemanticIndex.load(target)
        assert len(loaded) in (39, 40)  # the old or the new index, complete
        index = loaded if len(loaded) == 39 else index
    index = SemanticIndex.load(target)
    index.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # leftovers (and the lock file) removed


# ---------------------------------------------------------------------------------------------- indexes
def test_index_build_overwrite_never_deletes_other_files(tmp_path, capsys):
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("my project")
    (project / "meta.json").write_text("{}")
    corpus = FIXTURES / "search" / "corpus.txt"
    assert main(["index", "build", "minilm", str(corpus), str(project), "--overwrite", "--no-progress"]) == 2
    assert "not a semantic index saved by st-prompts" in one_error_line(capsys)
    assert (project / "README.md").read_text() == "my project" and (project / "src").is_dir()
    vectors = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    with pytest.raises(ConfigurationError, match="not a semantic index saved by st-prompts"):
        SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(10)]).save(project)
    assert (project / "README.md").exists()


def test_arguments_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import st_prompts.loading as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_sentence_model", no_loading)
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a folder")
    corpus = FIXTURES / "search" / "corpus.txt"
    assert main(["index", "build", "minilm", str(corpus), str(a_file), "--overwrite"]) == 2
    assert "not a folder" in one_error_line(capsys)
    vectors = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(10)]).save(tmp_path / "idx")
    for argv in (["-k", "0"], ["-k", "-3"]):
        assert run_cli(["index", "search", str(tmp_path / "idx"), "q", *argv]) == 2
        assert "-k" in one_error_line(capsys)
    assert main(["index", "search", str(tmp_path / "idx"), "   "]) == 2
    assert "empty" in one_error_line(capsys)


def test_blank_queries_are_refused(tmp_path):
    vectors = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    index = SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(10)])
    for queries in ("", "  \t", ["fine", ""]):
        with pytest.raises(ConfigurationError, match="empty"):
            index.search(queries)


def test_removed_ids_are_never_handed_out_again(tmp_path):
    vectors = np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)
    index = SemanticIndex.from_embeddings(vectors[:10], [f"d{i}" for i in range(10)])
    index.remove([9])  # the largest id
    assert index.add(["a new text"], embeddings=vectors[10:11]) == [10]
    index.save(tmp_path / "idx")
    with SemanticIndex.update(tmp_path / "idx") as loaded:
        loaded.remove([10])
    loaded = SemanticIndex.load(tmp_path / "idx")
    assert loaded.add(["another text"], embeddings=vectors[11:12]) == [11]


def test_a_stale_copy_cannot_overwrite_a_newer_save(tmp_path):
    vectors = np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)
    SemanticIndex.from_embeddings(vectors[:10], [f"d{i}" for i in range(10)]).save(tmp_path / "idx")
    first = SemanticIndex.load(tmp_path / "idx")
    second = SemanticIndex.load(tmp_path / "idx")
    first.add(["from the first"], embeddings=vectors[10:11])
    first.save(tmp_path / "idx")
    second.add(["from the second"], embeddings=vectors[11:12])
    with pytest.raises(ConfigurationError, match="changed by another process"):
        second.save(tmp_path / "idx")
    assert "from the first" in SemanticIndex.load(tmp_path / "idx").texts


def _exit_with(argv: list[str]) -> None:
    sys.exit(main(argv))


def test_two_concurrent_index_adds_keep_both(tiny_bert, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"document number {i} about topic {i % 3}" for i in range(12)) + "\n")
    model = save_plain(tmp_path / "model", tiny_bert)  # (each process loads the index's model)
    assert main(["index", "build", str(model), str(corpus), str(tmp_path / "idx"), "--no-progress"]) == 0
    (tmp_path / "a.txt").write_text("alpha one\nalpha two\n")
    (tmp_path / "b.txt").write_text("beta one\nbeta two\nbeta three\n")
    fork = multiprocessing.get_context("fork")  # two processes, without an interpreter start each
    processes = [fork.Process(target=_exit_with, args=(["index", "add", str(tmp_path / "idx"), str(tmp_path / name),
                                                        "--no-progress"],)) for name in ("a.txt", "b.txt")]
    for process in processes:
        process.start()
    for process in processes:
        process.join(300)
        assert process.exitcode == 0
    index = SemanticIndex.load(tmp_path / "idx")
    assert len(index) == 17 and len(set(index.ids)) == 17
    assert {"alpha one", "alpha two", "beta one", "beta two", "beta three"} <= set(index.texts)


def test_readers_never_see_a_half_replaced_index(tmp_path):
    vectors = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    texts = [f"document {i}" for i in range(300)]
    SemanticIndex.from_embeddings(vectors[:100], texts[:100]).save(tmp_path / "idx")
    stop = threading.Event()
    failures: list[BaseException] = []

    def writer():
        size = 100
        while not stop.is_set():
            size = 100 if size >= 299 else size + 1
            SemanticIndex.from_embeddings(vectors[:size], texts[:size]).save(tmp_path / "idx")

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            try:
                loaded = SemanticIndex.load(tmp_path / "idx", mmap=bool(_ % 2))
                assert loaded.index.ntotal == len(loaded.ids) and loaded.texts[len(loaded) - 1] == texts[len(loaded) - 1]
            except BaseException as exc:  # noqa: BLE001 - collected and reported below
                failures.append(exc)
    finally:
        stop.set()
        thread.join()
    assert not failures, failures[:3]


# ---------------------------------------------------------------------------------------------- damaged files
def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("name", ["probe.npy", "docs.offsets.npy", "docs.jsonl", "index.faiss", "meta.json"])
def test_a_truncated_index_file_is_a_one_line_error(name, tmp_path, capsys, minilm):
    index = SemanticIndex.build(minilm, [f"sentence number {i}" for i in range(30)], show_progress_bar=False)
    index.save(tmp_path / "idx")
    _truncate(tmp_path / "idx" / name)
    commands = [["index", "info", str(tmp_path / "idx")], ["index", "search", str(tmp_path / "idx"), "q", "--mmap"]]
    if name != "docs.offsets.npy":  # read by memory-mapped indexes only
        commands.append(["index", "search", str(tmp_path / "idx"), "q"])
    for argv in commands:
        assert main(argv) == 2, (name, argv)
        one_error_line(capsys)


@pytest.mark.parametrize("name", ["model.safetensors", "soft_prompts.safetensors"])
def test_a_truncated_weight_file_is_a_one_line_error(name, tiny_bert, tmp_path, capsys):
    prompted_model(tiny_bert, "cls", prefix_length=2).save(str(tmp_path / "m"))
    _truncate(tmp_path / "m" / name)
    argv = ["evaluate", str(tmp_path / "m"), "--tasks", "STSBenchmark", "--senteval-dir", str(FIXTURES / "senteval"),
            "--no-progress"]
    assert main(argv) == 2
    assert "damaged" in one_error_line(capsys)


# ---------------------------------------------------------------------------------------------- bad input
def test_an_nli_row_with_an_unquoted_comma_is_refused_with_its_line(tmp_path):
    from st_prompts.data.training_data import read_nli_pairs, read_nli_triplets

    path = tmp_path / "nli.csv"
    path.write_text('sent0,sent1,hard_neg\n"a, quoted premise",b,c\na man, with a hat,sits,stands\n')
    with pytest.raises(DataFormatError, match=r"line 3: expected 3 fields .* got 4"):
        read_nli_triplets(path)
    with pytest.raises(DataFormatError, match="line 3"):
        read_nli_pairs(path)
    path.write_text('sent0,sent1,hard_neg\n"a, quoted premise",b,c\n\n"multi\nline",e,f\n')
    assert read_nli_triplets(path) == [("a, quoted premise", "b", "c"), ("multi\nline", "e", "f")]


@pytest.mark.parametrize("extra,words", [(["--max-steps", "0"], "max_steps"), (["--limit", "0"], "limit"),
                                         (["--limit", "-5"], "limit"), (["--max-steps", "-2"], "max_steps")])
def test_nonsense_counts_are_refused_with_one_line(extra, words, tiny_bert, data_dir, tmp_path, capsys):
    argv = train_argv(tiny_bert, data_dir, tmp_path / "m")
    argv[argv.index("--max-steps"):argv.index("--max-steps") + 2] = []
    assert run_cli(argv + extra) == 2
    assert words in one_error_line(capsys).replace("-", "_")  # "--max-steps" at parse time, "max_steps" later
    assert not (tmp_path / "m").exists()


def test_sts_scores_outside_the_scale_are_refused(tmp_path):
    from st_prompts.data.senteval import load_sts

    folder = tmp_path / "STS" / "STSBenchmark"
    folder.mkdir(parents=True)
    (folder / "sts-dev.csv").write_text("main-captions\tMSRvid\t2012dev\t0001\t7.5\tA man.\tA woman.\n")
    with pytest.raises(DataFormatError, match="outside 0-5"):
        load_sts(tmp_path, "STSBenchmark", "dev")


def test_a_calibration_without_a_model_says_what_it_cannot_promise(tmp_path, capsys):
    vectors = np.random.default_rng(0).standard_normal((600, 16)).astype(np.float32)
    with pytest.warns(UserWarning, match="calibrated without a model"):
        index = SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(600)], index_type="ivf")
    assert "real queries" in index.info["calibration"]["caveat"]
    index.save(tmp_path / "idx")
    assert main(["index", "info", str(tmp_path / "idx")]) == 0
    assert "calibrated without a model" in capsys.readouterr().out
    with_queries = SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(600)], index_type="ivf",
                                                 calibration_queries=vectors[:50] + 0.1)
    assert "caveat" not in with_queries.info["calibration"]


# ---------------------------------------------------------------------------------------------- ownership (issue 37)
def snapshot(folder: Path) -> dict:
    """Everything below ``folder``, byte for byte: files (their bytes), folders, symbolic links (their targets)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                out[relative] = ("link", os.readlink(path))
            elif path.is_dir():
                out[relative] = ("folder",)
            else:
                out[relative] = ("file", path.read_bytes())
    return out


def small_index(tmp_path: Path, name: str = "idx", n: int = 10, **kw) -> Path:
    vectors = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)
    SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(n)], **kw).save(tmp_path / name)
    return tmp_path / name


def test_index_build_overwrite_keeps_a_users_meta_json_and_docs_jsonl(tmp_path, capsys):
    """Issue 37: a folder of the user's own meta.json and docs.jsonl (an index's file names) is not an index."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "meta.json").write_text('{"my": "settings"}')
    (folder / "docs.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(folder)
    corpus = FIXTURES / "search" / "corpus.txt"
    assert main(["index", "build", "minilm", str(corpus), str(folder), "--overwrite", "--no-progress"]) == 2
    assert "not a semantic index saved by st-prompts" in one_error_line(capsys)
    vectors = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    with pytest.raises(ConfigurationError, match=MANIFEST_FILE):
        SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(10)]).save(folder, overwrite=True)
    assert snapshot(folder) == before
    (folder / "meta.json").unlink()  # docs.jsonl alone
    before = snapshot(folder)
    assert main(["index", "build", "minilm", str(corpus), str(folder), "--overwrite", "--no-progress"]) == 2
    assert "not a semantic index saved by st-prompts" in one_error_line(capsys)
    assert snapshot(folder) == before


def test_an_index_carries_a_manifest_of_exactly_its_files(tmp_path):
    index = small_index(tmp_path)
    manifest = json.loads((index / MANIFEST_FILE).read_text())
    assert manifest["written_by"] == "st-prompts" and manifest["kind"] == "semantic index"
    assert sorted(manifest["files"]) == sorted(p.name for p in index.iterdir() if p.name != MANIFEST_FILE)
    with SemanticIndex.update(index) as loaded:
        loaded.remove([3])
    assert sorted(json.loads((index / MANIFEST_FILE).read_text())["files"]) == sorted(
        p.name for p in index.iterdir() if p.name != MANIFEST_FILE)


def test_an_index_without_the_proof_loads_updates_and_gets_it_but_build_overwrite_refuses(tmp_path, capsys):
    """Indexes saved before the proof existed: loaded, searched and updated (which adds the proof), never replaced
    by a new build."""
    legacy = small_index(tmp_path, "legacy", n=12)
    (legacy / MANIFEST_FILE).unlink()
    vectors = np.random.default_rng(0).standard_normal((12, 8)).astype(np.float32)  # small_index's
    loaded = SemanticIndex.load(legacy)
    assert loaded.search_embeddings(vectors[:1], k=1)[0][0].id == loaded.ids[0]
    assert main(["index", "info", str(legacy)]) == 0
    before = snapshot(legacy)
    corpus = FIXTURES / "search" / "corpus.txt"
    assert main(["index", "build", "minilm", str(corpus), str(legacy), "--overwrite", "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "no st_prompts_save.json" in line and "index add" in line and "delete it yourself" in line
    with pytest.raises(ConfigurationError, match="proof"):
        SemanticIndex.from_embeddings(vectors, [f"x{i}" for i in range(12)]).save(legacy)
    assert snapshot(legacy) == before
    assert main(["index", "remove", str(legacy), "0"]) == 0  # an update of the old index: allowed, adds the proof
    manifest = json.loads((legacy / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in legacy.iterdir() if p.name != MANIFEST_FILE)
    assert len(SemanticIndex.load(legacy)) == 11
    with SemanticIndex.update(legacy) as index:  # and the Python update path keeps working on it
        index.add(["one more"], embeddings=vectors[:1])
    assert len(SemanticIndex.load(legacy)) == 12


def test_index_calibrate_adds_the_proof_to_an_old_index(tmp_path):
    vectors = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
    with pytest.warns(UserWarning):
        SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(300)], index_type="ivf",
                                      nlist=8).save(tmp_path / "ivf")
    (tmp_path / "ivf" / MANIFEST_FILE).unlink()
    assert main(["index", "calibrate", str(tmp_path / "ivf"), "--target-recall", "0.9"]) == 0
    assert json.loads((tmp_path / "ivf" / MANIFEST_FILE).read_text())["kind"] == "semantic index"


def _add_symlink_to_folder(folder: Path, outside: Path) -> str:
    (outside / "data").mkdir()
    (outside / "data" / "mine.txt").write_text("mine")
    os.symlink(outside / "data", folder / "data")
    return "data"


def _add_symlink_to_file(folder: Path, outside: Path) -> str:
    (outside / "notes.txt").write_text("notes")
    os.symlink(outside / "notes.txt", folder / "notes.txt")
    return "notes.txt"


def _add_empty_folder(folder: Path, outside: Path) -> str:
    (folder / "empty").mkdir()
    return "empty/"


def _add_nested_folder(folder: Path, outside: Path) -> str:
    (folder / "nested" / "deeper").mkdir(parents=True)
    return "nested/"


def _add_file(folder: Path, outside: Path) -> str:
    (folder / "my-notes.md").write_text("notes")
    return "my-notes.md"


def _replace_a_listed_file_by_a_link(folder: Path, outside: Path) -> str:
    name = "meta.json" if (folder / "meta.json").exists() else "config.json"
    (outside / "copy.json").write_bytes((folder / name).read_bytes())
    (folder / name).unlink()
    os.symlink(outside / "copy.json", folder / name)
    return name


ADDITIONS = {"symlink-to-folder": _add_symlink_to_folder, "symlink-to-file": _add_symlink_to_file,
             "empty-folder": _add_empty_folder, "nested-folder": _add_nested_folder, "file": _add_file,
             "listed-file-as-link": _replace_a_listed_file_by_a_link}


@pytest.mark.parametrize("addition", ADDITIONS)
def test_index_build_overwrite_and_updates_refuse_anything_the_manifest_does_not_list(addition, tmp_path, capsys):
    index = small_index(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shown = ADDITIONS[addition](index, outside)
    before, elsewhere = snapshot(index), snapshot(outside)
    corpus = FIXTURES / "search" / "corpus.txt"
    assert main(["index", "build", "minilm", str(corpus), str(index), "--overwrite", "--no-progress"]) == 2
    assert shown in one_error_line(capsys)
    assert main(["index", "remove", str(index), "1"]) == 2  # an update replaces the folder too: refused alike
    assert shown in one_error_line(capsys)
    assert snapshot(index) == before and snapshot(outside) == elsewhere


@pytest.fixture(scope="module")
def trained_model(tiny_bert, tmp_path_factory):
    """A model saved by ``st-prompts train`` (once for this module; tests copy it)."""
    root = tmp_path_factory.mktemp("trained")
    (root / "data" / "train").mkdir(parents=True)
    (root / "data" / "train" / "wiki_sentences.txt").write_text("\n".join(SENTENCES) + "\n")
    shutil.copytree(FIXTURES / "senteval", root / "data" / "senteval")
    assert main(train_argv(tiny_bert, root / "data", root / "model")) == 0
    return root / "model", root / "data"


@pytest.mark.parametrize("addition", ADDITIONS)
def test_train_overwrite_refuses_anything_the_manifest_does_not_list(addition, trained_model, tiny_bert, tmp_path,
                                                                     capsys, monkeypatch):
    """Issue 37: a symlink to a folder, an empty folder, a nested folder (and the like) added to an st-prompts model
    make ``train --overwrite`` refuse before training starts; nothing is deleted."""
    from st_prompts.storage import save_model_folder
    from st_prompts.training import pipeline, train_and_save

    model, data = trained_model
    folder = tmp_path / "model"
    shutil.copytree(model, folder, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    shown = ADDITIONS[addition](folder, outside)
    before, elsewhere = snapshot(folder), snapshot(outside)

    def no_training(*args, **kwargs):
        raise AssertionError("training started before the destination was checked")

    monkeypatch.setattr(pipeline, "train", no_training)
    assert main(train_argv(tiny_bert, data, folder, "--overwrite")) == 2
    line = one_error_line(capsys)
    assert shown in line and "did not write" in line
    with pytest.raises(ConfigurationError, match="did not write"):
        train_and_save("dcpcse", backbone=tiny_bert, data_dir=str(data), output=str(folder), overwrite=True,
                       max_steps=1, batch_size=4, show_progress_bar=False)
    with pytest.raises(ConfigurationError, match="did not write"):
        save_model_folder(folder, lambda path: (path / "x.txt").write_text("x"), overwrite=True)
    assert snapshot(folder) == before and snapshot(outside) == elsewhere


def test_a_model_manifest_pointing_outside_its_folder_is_refused(trained_model, tmp_path):
    from st_prompts.storage import check_model_destination

    model, _ = trained_model
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    edit_json(folder / MANIFEST_FILE, lambda manifest: manifest["files"].append("../elsewhere/thesis.tex"))
    with pytest.raises(ConfigurationError, match="outside the folder"):
        check_model_destination(folder, overwrite=True)
    # and a model is never mistaken for an index, nor an index for a model
    index = small_index(tmp_path)
    with pytest.raises(ConfigurationError, match="not a model"):
        check_model_destination(index, overwrite=True)
    with pytest.raises(ConfigurationError, match="not a semantic index"):
        SemanticIndex.load(index).save(model, overwrite=True)


# ---------------------------------------------------------------------------------------------- paths read from files
@pytest.mark.parametrize("name", ["../outside.npy", "ABSOLUTE", "link.npy", "sub/../../outside.npy"])
def test_vectors_file_of_meta_json_stays_inside_the_index(name, tmp_path, capsys):
    index = small_index(tmp_path)
    outside = tmp_path / "outside.npy"
    np.save(outside, np.zeros((10, 8), dtype=np.float16))
    if name == "ABSOLUTE":
        name = str(outside)
    if name == "link.npy":
        os.symlink(outside, index / name)
    edit_json(index / "meta.json", lambda meta: {**meta, "vectors": {"file": name, "dtype": "float16"}})
    with pytest.raises(DataFormatError, match="vectors.file"):
        SemanticIndex.load(index)
    for argv in (["index", "info", str(index)], ["index", "search", str(index), "q", "--mmap"]):
        assert main(argv) == 2
        assert "outside" in one_error_line(capsys) or "out of its folder" in capsys.readouterr().err


def test_module_paths_of_a_prompt_set_source_stay_inside_its_folder(tmp_path):
    from st_prompts.modules.prompt_sets import read_prompt_set

    folder = tmp_path / "source"
    folder.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "../elsewhere", "type": "st_prompts.PromptedTransformer"}]))
    with pytest.raises(DataFormatError, match="out of its folder"):
        read_prompt_set(str(folder))


# ---------------------------------------------------------------------------------------------- non-finite numbers
@pytest.mark.parametrize("option", ["learning_rate", "temperature", "warmup_ratio", "prefix_init_std", "mlm_weight"])
def test_method_settings_refuse_non_finite_numbers(option):
    from st_prompts import methods

    for value in (float("inf"), float("nan"), float("-inf")):
        with pytest.raises(ConfigurationError, match=f"{option} must be a finite number"):
            methods.config("dcpcse").settings(scale="cpu", **{option: value})


def test_train_learning_rate_inf_is_refused_before_training(tiny_bert, data_dir, tmp_path, capsys, monkeypatch):
    """Issue 37: ``train --learning-rate inf`` trained and saved a model of NaN embeddings, exit 0."""
    from st_prompts.training import train_and_save

    with pytest.raises(SystemExit) as exc:
        main(train_argv(tiny_bert, data_dir, tmp_path / "m", "--learning-rate", "inf"))
    assert exc.value.code == 2 and "not a finite number" in capsys.readouterr().err
    with pytest.raises(ConfigurationError, match="learning_rate must be a finite number"):
        train_and_save("dcpcse", backbone=tiny_bert, data_dir=str(data_dir), output=str(tmp_path / "m"),
                       learning_rate=float("inf"), max_steps=1, batch_size=4, show_progress_bar=False)
    assert not (tmp_path / "m").exists()


def test_a_diverged_training_is_not_saved(trained_model, tiny_bert, tmp_path, capsys):
    """A finite learning rate that still blows the weights up: the selection score is NaN, nothing is saved, and an
    existing model stays as it was. The command line refuses such a rate when it parses it (at most 10); Python
    takes any finite one, and the run's end refuses to save."""
    from st_prompts.errors import TrainingDivergedError
    from st_prompts.training import train_and_save

    model, data = trained_model
    out = tmp_path / "m"
    assert run_cli(train_argv(tiny_bert, data, out, "--learning-rate", "1e30")) == 2
    assert "at most 10" in one_error_line(capsys)
    assert not out.exists()
    settings = dict(backbone=tiny_bert, data_dir=str(data), output=str(out), max_steps=1, batch_size=4, eval_steps=1,
                    show_progress_bar=False, learning_rate=1e30, prefix_gate=False)
    with pytest.raises(TrainingDivergedError, match="training diverged"):
        train_and_save("dcpcse", **settings)
    assert not out.exists()
    shutil.copytree(model, out)
    before = snapshot(out)
    with pytest.raises(TrainingDivergedError, match="training diverged"):
        train_and_save("dcpcse", overwrite=True, **settings)
    assert snapshot(out) == before


def test_non_finite_weights_or_score_are_never_saved(tiny_bert, tmp_path):
    import torch

    from st_prompts.errors import TrainingDivergedError
    from st_prompts.training.pipeline import save_run
    from st_prompts.training.run import TrainResult

    model = prompted_model(tiny_bert, "cls", prefix_length=2)
    result = TrainResult(steps=1, seconds=0.0, best_metric=0.5, best_step=1, log_history=[], trainable_parameters=1,
                         total_parameters=1, settings={})
    with pytest.raises(TrainingDivergedError, match="model-selection score is inf"):
        save_run(model, TrainResult(**{**result.__dict__, "best_metric": float("inf")}), str(tmp_path / "a"))
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))
    with pytest.raises(TrainingDivergedError, match="NaN or infinite"):
        save_run(model, result, str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_finite_check_is_exact_where_a_sum_overflows():
    """``finite`` reads a tensor's sum first: a NaN or an infinity anywhere is caught, and finite values whose sum
    overflows (fp32, bf16, fp16) are still finite."""
    import torch

    from st_prompts.modules.set_checks import finite

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.full((4, 3), torch.finfo(dtype).max, dtype=dtype)
        assert finite(big) and finite(-big) and finite(torch.zeros(0, dtype=dtype))
        for bad in (float("nan"), float("inf"), float("-inf")):
            damaged = big.clone()
            damaged[2, 1] = bad
            assert not finite(damaged) and not finite(torch.tensor([1.0, bad], dtype=dtype))


def test_model_selection_never_prefers_a_non_finite_score():
    from st_prompts.training.run import KeepBestCallback

    class Evaluator:
        primary_metric = "spearman"

    for values, best in (([float("nan"), 0.5, 0.4], 0.5), ([0.3, float("nan"), float("inf")], 0.3),
                         ([float("-inf"), 0.1], 0.1)):
        keep = KeepBestCallback(torch_module(), Evaluator())
        for step, value in enumerate(values):
            keep.consider(value, step)
        assert keep.best == best
    keep = KeepBestCallback(torch_module(), Evaluator())
    keep.consider(float("nan"), 1)
    assert keep.best != keep.best  # only NaN seen: recorded as such (and refused at saving)


def torch_module():
    import torch

    return torch.nn.Linear(2, 2)


def test_bank_train_refuses_non_finite_and_diverged_sets(tiny_bert, tmp_path, capsys, monkeypatch):
    import st_prompts.bank
    from st_prompts.bank import create_bank, train_prompt_set

    data = tmp_path / "pairs.csv"
    data.write_text("sentence1,sentence2,score\n" + "".join(f"a man plays {i},a woman plays {i},{i % 5}\n"
                                                           for i in range(8)))
    bank = tmp_path / "bank"
    argv = ["bank", "train", str(bank), "sts", "--data", str(data), "--max-steps", "2", "--batch-size", "4",
            "--prefix-length", "2", "--no-progress", "--backbone", tiny_bert]
    assert run_cli(argv + ["--learning-rate", "1e38"]) == 2  # refused when parsed (at most 10)
    assert "at most 10" in one_error_line(capsys)
    assert not bank.exists()
    model = create_bank(tiny_bert)
    import torch
    from sentence_transformers.losses import CoSENTLoss

    def blown_up(model, name, *args, **kwargs):  # a run whose weights overflowed, whatever the rate
        result = train_prompt_set(model, name, *args, **kwargs)
        with torch.no_grad():
            for parameter in model[0].prompt_sets[name].parameters():
                parameter.fill_(float("inf"))
        return result

    monkeypatch.setattr(st_prompts.bank, "train_prompt_set", blown_up)
    assert main(argv + ["--learning-rate", "1e-2"]) == 2
    assert "training diverged" in one_error_line(capsys)
    assert not bank.exists()
    monkeypatch.undo()

    for option in ("learning_rate", "epochs", "warmup_ratio"):
        with pytest.raises(ConfigurationError, match=f"{option} must be a finite number"):
            train_prompt_set(model, "sts", None, CoSENTLoss(model), **{option: float("nan")})


# ---------------------------------------------------------------------------------------------- no network, not cached
@pytest.fixture
def hub_backbone_checkpoint(tiny_bert, tmp_path):
    """A prompts-only checkpoint whose backbone is a hub id that no cache holds."""
    from st_prompts import save_prompts_only

    folder = tmp_path / "prompts"
    save_prompts_only(prompted_model(tiny_bert, "cls", prefix_length=2), str(folder))
    edit_json(folder / "sentence_bert_config.json",
              lambda config: {**config, "backbone_name_or_path": "st-prompts-tests/not-cached-anywhere"})
    return folder


TIMED_COMMANDS = """
import json, sys, time
import faiss, sentence_transformers, transformers  # imported first: the bound is on each command, not on imports
from st_prompts.cli import main
for argv in json.loads(sys.argv[1]):
    start = time.monotonic()
    code = main(argv)
    sys.stderr.flush()
    print(json.dumps([code, time.monotonic() - start]), flush=True)
    print("--- end of command", file=sys.stderr, flush=True)
"""


def test_an_uncached_hub_backbone_without_network_fails_in_seconds_with_one_line(hub_backbone_checkpoint, tmp_path):
    """Issue 37: without network and without HF_HUB_OFFLINE, 177 s and ~70 'Retrying...' lines before the error.
    Simulated: an empty cache, HF_HUB_OFFLINE unset, the hub at a closed port (environment read at import, so a
    process of its own)."""
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
               HF_ENDPOINT="http://127.0.0.1:9", TQDM_DISABLE="1")
    senteval = ["--tasks", "STSBenchmark", "--senteval-dir", str(FIXTURES / "senteval")]
    commands = [["index", "build", str(hub_backbone_checkpoint), str(FIXTURES / "search" / "corpus.txt"),
                 str(tmp_path / "idx")],
                ["evaluate", str(hub_backbone_checkpoint), *senteval],
                ["evaluate", "st-prompts-tests/not-cached-anywhere", *senteval]]
    result = subprocess.run([sys.executable, "-c", TIMED_COMMANDS, json.dumps(commands)], env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    outcomes = [json.loads(line) for line in result.stdout.strip().splitlines()]
    errors = result.stderr.strip().split("--- end of command")[:-1]
    assert len(outcomes) == len(errors) == len(commands), result.stderr[-3000:]
    for argv, (code, seconds), error in zip(commands, outcomes, errors):
        lines = error.strip().splitlines()
        assert code == 2 and len(lines) == 1, (argv, error[-2000:])
        assert "not-cached-anywhere" in lines[0] and "Hugging Face cache" in lines[0]
        assert "cannot be reached" in lines[0]
        assert seconds < 20, (argv, seconds)
    assert not (tmp_path / "idx").exists()


@pytest.mark.parametrize("offline", [False, True])
def test_an_uncached_hub_backbone_fails_in_one_line_through_the_command_line(offline, hub_backbone_checkpoint,
                                                                             tmp_path, capsys, monkeypatch):
    """The same in this process (the hub's settings patched), with HF_HUB_OFFLINE set (before: 10 s and a message of
    two lines) and without."""
    import time

    from huggingface_hub import constants

    from st_prompts import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub, "_probes", {})
    start = time.monotonic()
    assert main(["index", "build", str(hub_backbone_checkpoint), str(FIXTURES / "search" / "corpus.txt"),
                 str(tmp_path / "idx")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("st-prompts index: error: "), lines
    line = lines[0]
    assert ("HF_HUB_OFFLINE is set" if offline else "cannot be reached") in line and "hf download" in line
    assert time.monotonic() - start < 20


def test_an_uncached_hub_backbone_is_refused_through_the_python_api(hub_backbone_checkpoint, tmp_path, monkeypatch):
    import time

    from huggingface_hub import constants

    from st_prompts import hub
    from st_prompts.errors import DataNotFoundError
    from st_prompts.loading import load_sentence_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub, "_probes", {})
    start = time.monotonic()
    with pytest.raises(DataNotFoundError, match="cannot be reached") as exc:
        load_sentence_model(str(hub_backbone_checkpoint))
    assert "\n" not in str(exc.value) and "prompts-only checkpoint" in str(exc.value)
    with pytest.raises(DataNotFoundError, match="cannot be reached"):
        load_sentence_model("st-prompts-tests/not-cached-anywhere")
    assert time.monotonic() - start < 20
    # A cached model passes without any network access, and local paths and the packaged aliases are never checked.
    snapshot = tmp_path / "empty-cache" / "models--st-prompts-tests--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    hub.check_hub_model("st-prompts-tests/cached")
    for name in ("smollm2", "minilm", str(tmp_path), "./relative/missing", "x.gguf"):
        hub.check_hub_model(name)


# ---------------------------------------------------------------------------------------------- one line, no traceback
LATIN1 = "sentence1,sentence2,score\nthe café is open,a coffee shop,4.0\nthe dog,a cat,1.0\n".encode("latin-1")


def test_bank_train_with_a_file_that_is_not_utf8_is_one_line(tiny_bert, tmp_path, capsys):
    """Issue 37: ``bank train`` with a non-UTF-8 CSV ended in a UnicodeDecodeError traceback."""
    from st_prompts.data.task_data import read_task_file

    good = tmp_path / "good.csv"
    good.write_text("sentence1,sentence2,score\na man plays,a woman plays,4.0\nthe dog,a cat,1.0\n")
    for name, data in (("pairs.csv", LATIN1), ("pairs.tsv", LATIN1.replace(b",", b"\t")),
                       ("pairs.jsonl", b'{"a": "ok", "b": "x", "score": 1}\n{"a": "caf\xe9", "b": "x", "score": 2}\n')):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DataFormatError, match="line 2: not UTF-8"):
            read_task_file(path)
        for argv in (["--data", str(path)], ["--data", str(good), "--dev", str(path)]):
            assert main(["bank", "train", str(tmp_path / "bank"), "sts", *argv, "--backbone", tiny_bert]) == 2
            assert f"{name}, line 2: not UTF-8" in one_error_line(capsys)
    assert not (tmp_path / "bank").exists()


def test_other_readers_refuse_files_that_are_not_utf8_in_one_line(tiny_bert, data_dir, tmp_path, capsys):
    (data_dir / "train" / "wiki_sentences.txt").write_bytes(b"a fine line\ncaf\xe9 au lait\n")
    assert main(train_argv(tiny_bert, data_dir, tmp_path / "m")) == 2
    assert "wiki_sentences.txt, line 2: not UTF-8" in one_error_line(capsys)
    texts = {"corpus.txt": b"one\ncaf\xe9\n", "corpus.csv": b"text\ncaf\xe9\n",
             "corpus.jsonl": b'{"text": "fine"}\n{"text": "caf\xe9"}\n'}
    vectors = np.random.default_rng(0).standard_normal((10, 384)).astype(np.float32)
    SemanticIndex.from_embeddings(vectors, [f"d{i}" for i in range(10)]).save(tmp_path / "idx")
    for name, data in texts.items():
        (tmp_path / name).write_bytes(data)
        for argv in (["index", "build", "minilm", str(tmp_path / name), str(tmp_path / "new")],
                     ["index", "add", str(tmp_path / "idx"), str(tmp_path / name)],
                     ["ski", "generate", "--llm", "smollm2", "--input", str(tmp_path / name), "--output",
                      str(tmp_path / "ski.jsonl")]):
            if argv[0] == "ski" and name != "corpus.txt":
                continue
            assert main(argv) == 2, argv
            line = one_error_line(capsys)
            assert f"{name}, line 2: not UTF-8" in line, (argv, line)
    assert not (tmp_path / "new").exists() and not (tmp_path / "ski.jsonl").exists()


def test_an_output_below_a_file_is_one_line(tiny_bert, data_dir, tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    assert main(train_argv(tiny_bert, data_dir, tmp_path / "a-file" / "model")) == 2
    assert "is a file, not a folder" in one_error_line(capsys)
    assert main(["bank", "create", str(tmp_path / "a-file" / "sub" / "bank"), "--backbone", tiny_bert]) == 2
    assert "is a file, not a folder" in one_error_line(capsys)
    assert (tmp_path / "a-file").read_text() == "mine"


ESCAPE = "\x1b[2J\x1b[31m"


def test_control_characters_of_user_text_never_reach_the_terminal(minilm, tmp_path, capsys):
    """Issue 37: messages carried the ANSI escape codes of file names and file contents."""
    import logging

    from st_prompts.cli import configure_output
    from st_prompts.errors import printable

    missing = tmp_path / f"{ESCAPE}corpus\u202e.txt"
    assert main(["index", "build", "minilm", str(missing), str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert "\x1b" not in line and "\u202e" not in line and "\\x1b[2J\\x1b[31mcorpus\\u202e.txt" in line
    with pytest.raises(SystemExit):  # argparse's own errors too
        main(["index", "build", "minilm", "c.txt", "out", "--index-type", f"flat{ESCAPE}"])
    err = capsys.readouterr().err
    assert "\x1b" not in err and len(err.strip().splitlines()) == 1
    configure_output()
    logging.getLogger("st_prompts.test").info("read %s\nline two", f"{ESCAPE}file")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[2J" in err and "\nline two" in err
    # a document's text (file content) in the ranked list of 'index search'
    SemanticIndex.build(minilm, ["a dog runs in the park", f"{ESCAPE}evil\u202edocument"], model_name="minilm",
                        show_progress_bar=False).save(tmp_path / "idx")
    assert main(["index", "search", str(tmp_path / "idx"), f"dog{ESCAPE}", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\\x1b[2J\\x1b[31mevil\\u202edocument" in out
    assert printable("tab\tnew\nline\r") == "tab\\tnew\\nline\\r"
    assert printable("tab\tnew\nline", one_line=False) == "tab\tnew\nline"
