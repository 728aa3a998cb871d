"""Nothing the user has is lost: output folders, interrupted or killed saves, concurrent updates, ids, damaged files,
bad input, from a careless or hostile user."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SENTENCES, edit_json, one_error_line, prompted_model, run_cli, save_plain

from st_prompts.cli import main
from st_prompts.errors import ConfigurationError, DataFormatError, TrainingDivergedError
from st_prompts.search import SemanticIndex
from st_prompts.storage import MANIFEST_FILE, replace_folder

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = FIXTURES / "search" / "corpus.txt"
SENTEVAL = ["--tasks", "STSBenchmark", "--senteval-dir", str(FIXTURES / "senteval")]


def train_argv(tiny_bert, data_dir, output, *extra):
    return ["train", "dcpcse", "--backbone", tiny_bert, "--data-dir", str(data_dir), "--max-steps", "1",
            "--batch-size", "4", "--eval-steps", "1", "--output", str(output), "--no-progress", *extra]


@pytest.fixture(scope="module")
def trained_model(tiny_bert, tmp_path_factory):
    """A model saved by ``st-prompts train`` (once for this module; tests copy it)."""
    root = tmp_path_factory.mktemp("trained")
    (root / "data" / "train").mkdir(parents=True)
    (root / "data" / "train" / "wiki_sentences.txt").write_text("\n".join(SENTENCES) + "\n")
    shutil.copytree(FIXTURES / "senteval", root / "data" / "senteval")
    assert main(train_argv(tiny_bert, root / "data", root / "model")) == 0
    return root / "model", root / "data"


def vectors(n: int, dim: int = 8) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)


def index_of(n: int, dim: int = 8, **kw) -> SemanticIndex:
    """An index of ``n`` random vectors (:func:`vectors`) and the texts ``d0``, ``d1``, ..."""
    return SemanticIndex.from_embeddings(vectors(n, dim), [f"d{i}" for i in range(n)], **kw)


def small_index(tmp_path: Path, name: str = "idx", n: int = 10, **kw) -> Path:
    index_of(n, **kw).save(tmp_path / name)
    return tmp_path / name


def build_over(folder: Path) -> int:
    """``index build minilm CORPUS folder --overwrite``'s exit status."""
    return main(["index", "build", "minilm", str(CORPUS), str(folder), "--overwrite", "--no-progress"])


def snapshot(folder: Path) -> dict:
    """Everything below ``folder``, byte for byte: files (their bytes), folders, symbolic links (their targets)."""
    def state(path: Path) -> tuple:
        if path.is_symlink():
            return ("link", os.readlink(path))
        return ("folder",) if path.is_dir() else ("file", path.read_bytes())

    return {path.relative_to(folder).as_posix(): state(path) for path in folder.rglob("*")}


# ---------------------------------------------------------------------------------------------- train --output
@pytest.mark.parametrize("output,words", [("thesis", "not a model saved by st-prompts"),
                                          *[(o, "current folder or one of its parents") for o in (".", "..", "./")],
                                          ("a-file/model", "is a file, not a folder")])
def test_train_output_never_replaces_what_the_user_has(output, words, tiny_bert, data_dir, tmp_path, capsys,
                                                       monkeypatch):
    """A folder it did not write (--overwrite does not change that), the current folder or a parent, a path below a
    file."""
    (tmp_path / "thesis" / "src").mkdir(parents=True)
    (tmp_path / "thesis" / "thesis.tex").write_text("years of work")
    (tmp_path / "thesis" / "src" / "main.py").write_text("print(1)")
    (tmp_path / "a-file").write_text("mine")
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    for overwrite in ([], ["--overwrite"]):
        assert main(train_argv(tiny_bert, data_dir, output, *overwrite)) == 2
        assert words in one_error_line(capsys)
    assert snapshot(tmp_path) == before


def test_an_st_prompts_model_is_replaced_only_with_overwrite_and_follows_the_umask(tiny_bert, data_dir, tmp_path,
                                                                                   capsys):
    out = tmp_path / "model"
    old = os.umask(0o022)
    try:
        assert main(train_argv(tiny_bert, data_dir, out)) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for name in ("model.safetensors", "soft_prompts.safetensors"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644
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


def test_trainer_files_never_land_in_the_output(trained_model, tiny_bert, tmp_path, capsys, monkeypatch):
    """A Ctrl-C during training is one line and leaves an existing model as it was (the trainer's evaluation CSVs go
    elsewhere)."""
    import st_prompts.training.run as run_module

    model, data = trained_model
    out = Path(shutil.copytree(model, tmp_path / "model"))
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    original = run_module.KeepBestCallback.consider

    def consider_then_interrupt(self, value, step):
        original(self, value, step)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module.KeepBestCallback, "consider", consider_then_interrupt)
    assert main(train_argv(tiny_bert, data, out, "--overwrite")) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "st-prompts train: interrupted"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert not any("eval" in name for name in before)


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


def _failing_at(step: str, fail):
    """Stand-ins for ``os.replace`` and ``shutil.rmtree`` that call ``fail(name)`` at ``step`` (``replace-N``: the
    N-th rename; ``rmtree``: deleting the set-aside old folder)."""
    calls, real_replace, real_rmtree = [], os.replace, shutil.rmtree

    def replace(src, dst):
        calls.append(dst)
        if step == f"replace-{len(calls)}":
            fail("replace")
        return real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        if step == "rmtree" and ".st-prompts-old-" in str(path):
            fail("rmtree")
        return real_rmtree(path, *args, **kwargs)

    return replace, rmtree


def _killed_save(target: Path, kill_at: str) -> None:
    """In a forked child: save "new" over ``target``, killed at ``kill_at`` (``os._exit``: no handler, no finally
    block runs)."""
    os.replace, shutil.rmtree = _failing_at(kill_at, lambda name: os._exit(9))  # (this child's only)
    replace_folder(target, _write("new"), ownership=_ours, overwrite=True)


@pytest.mark.parametrize("kill_at", ["replace-1", "replace-2", "rmtree"])
def test_a_kill_at_each_step_leaves_one_complete_folder_and_the_next_save_cleans_up(kill_at, tmp_path):
    """Killed at the rename aside, at the rename in, and before the old folder is deleted: one complete folder
    survives (at the target, or between the renames under the set-aside name); the next save removes the leftovers."""
    target = tmp_path / "out"
    replace_folder(target, _write("old"), ownership=_ours)
    child = multiprocessing.get_context("fork").Process(target=_killed_save, args=(target, kill_at))
    child.start()
    child.join(120)
    assert child.exitcode == 9
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".out.st-prompts-") and p.is_dir()]
    complete = ([target] if target.exists() else []) + [p for p in hidden if (p / "model.txt").exists()]
    assert {_complete(p) for p in complete} <= {"old", "new"} and complete
    if kill_at == "replace-2":  # between the renames: the old one is complete under the set-aside name
        assert not target.exists() and any(_complete(p) == "old" for p in hidden)
    else:
        assert _complete(target) == ("new" if kill_at == "rmtree" else "old")
    stranger = tmp_path / ".out.st-prompts-old-abc123"  # a leftover st-prompts did not write: left alone
    stranger.mkdir()
    (stranger / "diary.txt").write_text("private")
    replace_folder(target, _write("next"), ownership=_ours, overwrite=True)
    assert _complete(target) == "next" and (stranger / "diary.txt").read_text() == "private"
    assert sorted(p.name for p in tmp_path.iterdir()) == [stranger.name, "out"]  # (the killed save's lock file too)


def test_an_index_save_interrupted_at_each_step_keeps_a_complete_index(tmp_path, monkeypatch):
    """A Ctrl-C at either rename leaves the old index (restored), an error deleting the old one the new index."""
    import st_prompts.storage as storage

    index = SemanticIndex.from_embeddings(vectors(40), [f"doc {i}" for i in range(40)])
    target = tmp_path / "idx"
    index.save(target)
    index.remove([0])

    def interrupt(name):
        raise KeyboardInterrupt if name == "replace" else OSError("interrupted")

    for step in ("replace-1", "replace-2", "rmtree"):
        replace, rmtree = _failing_at(step, interrupt)
        monkeypatch.setattr(storage.os, "replace", replace)
        monkeypatch.setattr(storage.shutil, "rmtree", rmtree)
        try:
            index.save(target)
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
        loaded = SemanticIndex.load(target)
        assert len(loaded) == (39 if step == "rmtree" else 40)
        if step != "rmtree":
            assert [p.name for p in tmp_path.iterdir() if "st-prompts-" in p.name and "lock" not in p.name] == []
    index = SemanticIndex.load(target)
    index.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # leftovers (and the lock file) removed


# ---------------------------------------------------------------------------------------------- indexes
@pytest.mark.parametrize("contents", [{"README.md": "my project", "meta.json": "{}", "src/": ""},
                                      {"meta.json": '{"my": "settings"}', "docs.jsonl": '{"mine": 1}\n'},
                                      {"docs.jsonl": '{"mine": 1}\n'}])
def test_index_build_overwrite_never_replaces_a_folder_of_other_files(contents, tmp_path, capsys):
    """Not even one of the user's own meta.json and docs.jsonl (an index's file names)."""
    folder = tmp_path / "d"
    folder.mkdir()
    for name, text in contents.items():
        (folder / name).mkdir() if name.endswith("/") else (folder / name).write_text(text)
    before = snapshot(folder)
    assert build_over(folder) == 2
    assert "not a semantic index saved by st-prompts" in one_error_line(capsys)
    for overwrite in (False, True):
        with pytest.raises(ConfigurationError, match=f"not a semantic index saved by st-prompts .*{MANIFEST_FILE}"):
            index_of(10).save(folder, overwrite=overwrite)
    assert snapshot(folder) == before


def test_arguments_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import st_prompts.loading as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_sentence_model", no_loading)
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a folder")
    assert build_over(a_file) == 2
    assert "not a folder" in one_error_line(capsys)
    idx = small_index(tmp_path)  # (-k 0 and -k -5 are refused at parse time: test_cli_hostile.py)
    assert main(["index", "search", str(idx), "   "]) == 2
    assert "empty" in one_error_line(capsys)
    for queries in ("", "  \t", ["fine", ""]):
        with pytest.raises(ConfigurationError, match="empty"):
            SemanticIndex.load(idx).search(queries)


def test_removed_ids_are_never_handed_out_again_and_stale_copies_never_saved(tmp_path):
    index = index_of(10)
    index.remove([9])  # the largest id
    assert index.add(["a new text"], embeddings=vectors(11)[10:]) == [10]
    index.save(tmp_path / "idx")
    with SemanticIndex.update(tmp_path / "idx") as loaded:
        loaded.remove([10])
    loaded = SemanticIndex.load(tmp_path / "idx")
    assert loaded.add(["another text"], embeddings=vectors(12)[11:]) == [11]
    # and a stale copy cannot overwrite a newer save
    idx = small_index(tmp_path, "idx2")
    first, second = SemanticIndex.load(idx), SemanticIndex.load(idx)
    first.add(["from the first"], embeddings=vectors(12)[10:11])
    first.save(idx)
    second.add(["from the second"], embeddings=vectors(12)[11:])
    with pytest.raises(ConfigurationError, match="changed by another process"):
        second.save(idx)
    assert "from the first" in SemanticIndex.load(idx).texts


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
    data = vectors(300, 16)
    texts = [f"document {i}" for i in range(300)]
    SemanticIndex.from_embeddings(data[:100], texts[:100]).save(tmp_path / "idx")
    stop = threading.Event()
    failures: list[BaseException] = []

    def writer():
        size = 100
        while not stop.is_set():
            size = 100 if size >= 299 else size + 1
            SemanticIndex.from_embeddings(data[:size], texts[:size]).save(tmp_path / "idx")

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            try:
                loaded = SemanticIndex.load(tmp_path / "idx", mmap=bool(_ % 2))
                last = len(loaded) - 1
                assert loaded.index.ntotal == len(loaded.ids) and loaded.texts[last] == texts[last]
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
    assert main(["evaluate", str(tmp_path / "m"), *SENTEVAL, "--no-progress"]) == 2
    assert "damaged" in one_error_line(capsys)


# ---------------------------------------------------------------------------------------------- bad input
def test_an_nli_row_with_an_unquoted_comma_and_an_sts_score_out_of_scale_are_refused(tmp_path):
    from st_prompts.data.senteval import load_sts
    from st_prompts.data.training_data import read_nli_pairs, read_nli_triplets

    path = tmp_path / "nli.csv"
    path.write_text('sent0,sent1,hard_neg\n"a, quoted premise",b,c\na man, with a hat,sits,stands\n')
    with pytest.raises(DataFormatError, match=r"line 3: expected 3 fields .* got 4"):
        read_nli_triplets(path)
    with pytest.raises(DataFormatError, match="line 3"):
        read_nli_pairs(path)
    path.write_text('sent0,sent1,hard_neg\n"a, quoted premise",b,c\n\n"multi\nline",e,f\n')
    assert read_nli_triplets(path) == [("a, quoted premise", "b", "c"), ("multi\nline", "e", "f")]
    # and an STS score outside the scale
    folder = tmp_path / "STS" / "STSBenchmark"
    folder.mkdir(parents=True)
    (folder / "sts-dev.csv").write_text("main-captions\tMSRvid\t2012dev\t0001\t7.5\tA man.\tA woman.\n")
    with pytest.raises(DataFormatError, match="outside 0-5"):
        load_sts(tmp_path, "STSBenchmark", "dev")


@pytest.mark.parametrize("extra,words", [(["--max-steps", "0"], "max_steps"), (["--limit", "0"], "limit"),
                                         (["--limit", "-5"], "limit"), (["--max-steps", "-2"], "max_steps")])
def test_nonsense_counts_are_refused_with_one_line(extra, words, tiny_bert, data_dir, tmp_path, capsys):
    argv = train_argv(tiny_bert, data_dir, tmp_path / "m")
    argv[argv.index("--max-steps"):argv.index("--max-steps") + 2] = []
    assert run_cli(argv + extra) == 2
    assert words in one_error_line(capsys).replace("-", "_")  # "--max-steps" at parse time, "max_steps" later
    assert not (tmp_path / "m").exists()


def test_a_calibration_without_a_model_says_what_it_cannot_promise(tmp_path, capsys):
    with pytest.warns(UserWarning, match="calibrated without a model"):
        index = index_of(600, 16, index_type="ivf")
    assert "real queries" in index.info["calibration"]["caveat"]
    index.save(tmp_path / "idx")
    assert main(["index", "info", str(tmp_path / "idx")]) == 0
    assert "calibrated without a model" in capsys.readouterr().out
    with_queries = index_of(600, 16, index_type="ivf", calibration_queries=vectors(50, 16) + 0.1)
    assert "caveat" not in with_queries.info["calibration"]


# ---------------------------------------------------------------------------------------------- ownership
def test_an_index_without_the_proof_loads_updates_and_gets_it_but_build_overwrite_refuses(tmp_path, capsys):
    """An index's manifest lists exactly its files. Indexes saved before this proof existed: loaded, searched and
    updated (which adds the proof), never replaced by a new build."""
    legacy = small_index(tmp_path, "legacy", n=12)
    manifest = json.loads((legacy / MANIFEST_FILE).read_text())
    assert manifest["written_by"] == "st-prompts" and manifest["kind"] == "semantic index"
    assert sorted(manifest["files"]) == sorted(p.name for p in legacy.iterdir() if p.name != MANIFEST_FILE)
    (legacy / MANIFEST_FILE).unlink()
    loaded = SemanticIndex.load(legacy)
    assert loaded.search_embeddings(vectors(1), k=1)[0][0].id == loaded.ids[0]
    assert main(["index", "info", str(legacy)]) == 0
    before = snapshot(legacy)
    assert build_over(legacy) == 2
    line = one_error_line(capsys)
    assert "no st_prompts_save.json" in line and "index add" in line and "delete it yourself" in line
    with pytest.raises(ConfigurationError, match="proof"):
        SemanticIndex.from_embeddings(vectors(12), [f"x{i}" for i in range(12)]).save(legacy)
    assert snapshot(legacy) == before
    assert main(["index", "remove", str(legacy), "0"]) == 0  # an update of the old index: allowed, adds the proof
    manifest = json.loads((legacy / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in legacy.iterdir() if p.name != MANIFEST_FILE)
    assert len(SemanticIndex.load(legacy)) == 11
    with SemanticIndex.update(legacy) as index:  # and the Python update path keeps working on it
        index.add(["one more"], embeddings=vectors(1))
    assert len(SemanticIndex.load(legacy)) == 12
    assert sorted(json.loads((legacy / MANIFEST_FILE).read_text())["files"]) == sorted(
        p.name for p in legacy.iterdir() if p.name != MANIFEST_FILE)
    with pytest.warns(UserWarning):  # and so does index calibrate
        ivf = small_index(tmp_path, "ivf", n=300, index_type="ivf", nlist=8)
    (ivf / MANIFEST_FILE).unlink()
    assert main(["index", "calibrate", str(ivf), "--target-recall", "0.9"]) == 0
    assert json.loads((ivf / MANIFEST_FILE).read_text())["kind"] == "semantic index"


def add_foreign(kind: str, folder: Path, outside: Path) -> str:
    """Add to ``folder`` something its manifest does not list (see ADDITIONS); return how the refusal names it."""
    if kind == "symlink-to-folder":
        (outside / "data").mkdir()
        (outside / "data" / "mine.txt").write_text("mine")
        os.symlink(outside / "data", folder / "data")
        return "data"
    if kind == "symlink-to-file":
        (outside / "notes.txt").write_text("notes")
        os.symlink(outside / "notes.txt", folder / "notes.txt")
        return "notes.txt"
    if kind == "empty-folder":
        (folder / "empty").mkdir()
        return "empty/"
    if kind == "nested-folder":
        (folder / "nested" / "deeper").mkdir(parents=True)
        return "nested/"
    if kind == "file":
        (folder / "my-notes.md").write_text("notes")
        return "my-notes.md"
    name = "meta.json" if (folder / "meta.json").exists() else "config.json"  # a listed file replaced by a link
    (outside / "copy.json").write_bytes((folder / name).read_bytes())
    (folder / name).unlink()
    os.symlink(outside / "copy.json", folder / name)
    return name


ADDITIONS = ["symlink-to-folder", "symlink-to-file", "empty-folder", "nested-folder", "file", "listed-file-as-link"]


@pytest.mark.parametrize("addition", ADDITIONS)
def test_overwrites_and_updates_refuse_anything_the_manifest_does_not_list(addition, trained_model, tiny_bert, tmp_path,
                                                                          capsys, monkeypatch):
    """An index (build --overwrite, an update) and a model (train --overwrite, before training starts; saves): nothing
    is deleted."""
    from st_prompts.storage import save_model_folder
    from st_prompts.training import pipeline, train_and_save

    model, data = trained_model
    index, folder = small_index(tmp_path), Path(shutil.copytree(model, tmp_path / "model", symlinks=True))
    shown = {}
    for name, target in (("index", index), ("model", folder)):
        (tmp_path / f"outside-{name}").mkdir()
        shown[name] = add_foreign(addition, target, tmp_path / f"outside-{name}")
    before = snapshot(tmp_path)
    assert build_over(index) == 2
    assert shown["index"] in one_error_line(capsys)
    assert main(["index", "remove", str(index), "1"]) == 2  # an update replaces the folder too: refused alike
    assert shown["index"] in one_error_line(capsys)
    monkeypatch.setattr(pipeline, "train", lambda *a, **k: pytest.fail("training started before the check"))
    assert main(train_argv(tiny_bert, data, folder, "--overwrite")) == 2
    line = one_error_line(capsys)
    assert shown["model"] in line and "did not write" in line
    with pytest.raises(ConfigurationError, match="did not write"):
        train_and_save("dcpcse", backbone=tiny_bert, data_dir=str(data), output=str(folder), overwrite=True,
                       max_steps=1, batch_size=4, show_progress_bar=False)
    with pytest.raises(ConfigurationError, match="did not write"):
        save_model_folder(folder, lambda path: (path / "x.txt").write_text("x"), overwrite=True)
    assert snapshot(tmp_path) == before


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


def test_a_diverged_training_is_not_saved(trained_model, tiny_bert, tmp_path, capsys):
    """An infinite rate is refused before training; one that blows the weights up by the command line's parser (at
    most 10), in Python by the run's end, which saves nothing (its score is NaN): an existing model stays as it was."""
    from st_prompts.training import train_and_save
    from st_prompts.training.pipeline import save_run
    from st_prompts.training.run import TrainResult

    model, data = trained_model
    out = tmp_path / "m"
    assert run_cli(train_argv(tiny_bert, data, out, "--learning-rate", "1e30")) == 2
    assert "at most 10" in one_error_line(capsys)
    assert not out.exists()
    settings = dict(backbone=tiny_bert, data_dir=str(data), output=str(out), max_steps=1, batch_size=4, eval_steps=1,
                    show_progress_bar=False, learning_rate=1e30, prefix_gate=False)
    with pytest.raises(ConfigurationError, match="learning_rate must be a finite number"):  # (the CLI's: the walk)
        train_and_save("dcpcse", **{**settings, "learning_rate": float("inf")})
    with pytest.raises(TrainingDivergedError, match="training diverged"):
        train_and_save("dcpcse", **settings)
    assert not out.exists()
    shutil.copytree(model, out)
    before = snapshot(out)
    with pytest.raises(TrainingDivergedError, match="training diverged"):
        train_and_save("dcpcse", overwrite=True, **settings)
    assert snapshot(out) == before
    # nor is a run whose weights or selection score are not finite
    prompted = prompted_model(tiny_bert, "cls", prefix_length=2)
    result = TrainResult(steps=1, seconds=0.0, best_metric=0.5, best_step=1, log_history=[], trainable_parameters=1,
                         total_parameters=1, settings={})
    with pytest.raises(TrainingDivergedError, match="model-selection score is inf"):
        save_run(prompted, TrainResult(**{**result.__dict__, "best_metric": float("inf")}), str(tmp_path / "a"))
    with torch.no_grad():
        next(p for p in prompted.parameters() if p.requires_grad).fill_(float("nan"))
    with pytest.raises(TrainingDivergedError, match="NaN or infinite"):
        save_run(prompted, result, str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_finite_check_is_exact_and_model_selection_never_prefers_a_non_finite_score():
    """A NaN or an infinity anywhere is caught; finite values whose sum overflows are still finite."""
    from st_prompts.modules.set_checks import finite
    from st_prompts.training.run import KeepBestCallback

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.full((4, 3), torch.finfo(dtype).max, dtype=dtype)
        assert finite(big) and finite(-big) and finite(torch.zeros(0, dtype=dtype))
        for bad in (float("nan"), float("inf"), float("-inf")):
            damaged = big.clone()
            damaged[2, 1] = bad
            assert not finite(damaged) and not finite(torch.tensor([1.0, bad], dtype=dtype))

    class Evaluator:
        primary_metric = "spearman"

    for values, best in (([float("nan"), 0.5, 0.4], 0.5), ([0.3, float("nan"), float("inf")], 0.3),
                         ([float("-inf"), 0.1], 0.1), ([float("nan")], float("nan"))):
        keep = KeepBestCallback(torch.nn.Linear(2, 2), Evaluator())
        for step, value in enumerate(values):
            keep.consider(value, step)
        np.testing.assert_equal(keep.best, best)  # only NaN seen: NaN kept (and refused at saving)


def test_bank_train_refuses_non_finite_and_diverged_sets(tiny_bert, tmp_path, capsys, monkeypatch):
    import st_prompts.bank
    from sentence_transformers.losses import CoSENTLoss

    from st_prompts.bank import create_bank, train_prompt_set

    data = tmp_path / "pairs.csv"
    data.write_text("sentence1,sentence2,score\n" + "".join(f"a man plays {i},a woman plays {i},{i % 5}\n"
                                                           for i in range(8)))
    bank = tmp_path / "bank"
    argv = ["bank", "train", str(bank), "sts", "--data", str(data), "--max-steps", "2", "--batch-size", "4",
            "--prefix-length", "2", "--no-progress", "--backbone", tiny_bert]
    model = create_bank(tiny_bert)

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
NOT_CACHED = "st-prompts-tests/not-cached-anywhere"


@pytest.fixture
def hub_backbone_checkpoint(tiny_bert, tmp_path):
    """A prompts-only checkpoint whose backbone is a hub id that no cache holds."""
    from st_prompts import save_prompts_only

    folder = tmp_path / "prompts"
    save_prompts_only(prompted_model(tiny_bert, "cls", prefix_length=2), str(folder))
    edit_json(folder / "sentence_bert_config.json", lambda config: {**config, "backbone_name_or_path": NOT_CACHED})
    return folder


def unreachable_hub(monkeypatch, tmp_path, offline: bool = False):
    """This process's hub settings: an empty cache, the hub at a closed port; returns ``st_prompts.hub``."""
    from huggingface_hub import constants

    from st_prompts import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub, "_probes", {})
    return hub


@pytest.mark.parametrize("offline", [False, True])
def test_an_uncached_hub_backbone_fails_in_one_line_in_seconds(offline, hub_backbone_checkpoint, tmp_path, capsys,
                                                               monkeypatch):
    """In this process (the hub's settings patched), with HF_HUB_OFFLINE set and without."""
    from st_prompts.errors import DataNotFoundError
    from st_prompts.loading import load_sentence_model

    hub = unreachable_hub(monkeypatch, tmp_path, offline)
    reason = "HF_HUB_OFFLINE is set" if offline else "cannot be reached"
    start = time.monotonic()
    assert main(["index", "build", str(hub_backbone_checkpoint), str(CORPUS), str(tmp_path / "idx")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("st-prompts index: error: "), lines
    assert reason in lines[0] and "hf download" in lines[0]
    monkeypatch.setattr(hub, "_probes", {})
    with pytest.raises(DataNotFoundError, match=reason) as exc:
        load_sentence_model(str(hub_backbone_checkpoint))
    assert "\n" not in str(exc.value) and "prompts-only checkpoint" in str(exc.value)
    with pytest.raises(DataNotFoundError, match=reason):
        load_sentence_model(NOT_CACHED)
    assert time.monotonic() - start < 20
    # A cached model passes without any network access, and local paths and the packaged aliases are never checked.
    cached = tmp_path / "empty-cache" / "models--st-prompts-tests--cached" / "snapshots" / "abc"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    for name in ("st-prompts-tests/cached", "smollm2", "minilm", str(tmp_path), "./relative/missing", "x.gguf"):
        hub.check_hub_model(name)


# ---------------------------------------------------------------------------------------------- one line, no traceback
LATIN1 = "sentence1,sentence2,score\nthe café is open,a coffee shop,4.0\nthe dog,a cat,1.0\n".encode("latin-1")


def test_readers_refuse_files_that_are_not_utf8_in_one_line(tiny_bert, data_dir, tmp_path, capsys):
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
    (data_dir / "train" / "wiki_sentences.txt").write_bytes(b"a fine line\ncaf\xe9 au lait\n")
    assert main(train_argv(tiny_bert, data_dir, tmp_path / "m")) == 2
    assert "wiki_sentences.txt, line 2: not UTF-8" in one_error_line(capsys)
    texts = {"corpus.txt": b"one\ncaf\xe9\n", "corpus.csv": b"text\ncaf\xe9\n",
             "corpus.jsonl": b'{"text": "fine"}\n{"text": "caf\xe9"}\n'}
    idx = small_index(tmp_path, n=10, dim=384)
    for name, data in texts.items():
        (tmp_path / name).write_bytes(data)
        commands = [["index", "build", "minilm", str(tmp_path / name), str(tmp_path / "new")],
                    ["index", "add", str(idx), str(tmp_path / name)]]
        if name == "corpus.txt":
            commands.append(["ski", "generate", "--llm", "smollm2", "--input", str(tmp_path / name), "--output",
                             str(tmp_path / "ski.jsonl")])
        for argv in commands:
            assert main(argv) == 2, argv
            line = one_error_line(capsys)
            assert f"{name}, line 2: not UTF-8" in line, (argv, line)
    assert not (tmp_path / "new").exists() and not (tmp_path / "ski.jsonl").exists()


def test_a_bank_below_a_file_is_one_line(tiny_bert, tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    assert main(["bank", "create", str(tmp_path / "a-file" / "sub" / "bank"), "--backbone", tiny_bert]) == 2
    assert "is a file, not a folder" in one_error_line(capsys)
    assert (tmp_path / "a-file").read_text() == "mine"


ESCAPE = "\x1b[2J\x1b[31m"


def test_control_characters_of_user_text_never_reach_the_terminal(minilm, tmp_path, capsys):
    """Neither the ANSI escape codes of file names nor those of file contents."""
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
