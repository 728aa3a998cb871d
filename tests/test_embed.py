"""``st-prompts embed`` (st_prompts.embedding): a corpus into Parquet parts, locally and on Ray Data actors (one Ray
session of 2 CPUs for the module). References: the model's own ``encode_document`` / ``encode(task=...)``."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import cli_error, cli_out, random_bank, save_plain

from st_prompts.embedding import RayOptions, embed_file
from st_prompts.errors import ConfigurationError, StPromptsError
from st_prompts.search.embedding_files import EmbeddingFiles, part_record

WORDS = "the a man woman plays guitar piano dog cat runs sits on mat park happy sad big small red blue".split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(count)]


@pytest.fixture(scope="module")
def plain(tiny_bert, tmp_path_factory) -> str:
    """A plain sentence-transformers model folder (tiny random BERT, mean pooling)."""
    return str(save_plain(tmp_path_factory.mktemp("plain") / "model", tiny_bert))


@pytest.fixture(scope="module")
def bank(tiny_bert, tmp_path_factory) -> str:
    """A bank folder with two random prompt sets, ``sts`` and ``nli``."""
    path = tmp_path_factory.mktemp("bank") / "bank"
    random_bank(tiny_bert, sts=3, nli=5).save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def loaded():
    """Models loaded once per folder, through the safe loader (the references)."""
    from st_prompts.loading import load_sentence_model

    return functools.cache(lambda path: load_sentence_model(path, device="cpu"))


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def read_folder(path) -> tuple[list, list, np.ndarray]:
    ids, texts, vectors = [], [], []
    for batch_ids, batch_texts, batch_vectors in EmbeddingFiles.open([path]).batches():
        ids += batch_ids
        texts += batch_texts or []
        vectors.append(batch_vectors)
    return ids, texts, np.concatenate(vectors)


def records(path) -> dict[str, dict]:
    return {p.name: part_record(p) for p in sorted(Path(path).glob("part-*.parquet"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """A text file of 30 lines, one of them blank (line 5)."""
    lines = sentences(30)
    lines[4] = "   "
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, lines


# ---------------------------------------------------------------------------------------------- the two engines
def test_local_parts_hold_encode_documents_vectors_ids_and_texts(plain, loaded, corpus, tmp_path):
    path, lines = corpus
    result = embed_file(plain, path, tmp_path / "out", part_rows=8, batch_size=4)
    kept = [(number, line.strip()) for number, line in enumerate(lines, start=1) if line.strip()]
    ids, texts, vectors = read_folder(tmp_path / "out")
    assert ids == [n for n, _ in kept] and texts == [t for _, t in kept]  # 1-based line numbers, the blank skipped
    reference = loaded(plain).encode_document([t for _, t in kept], batch_size=3)
    np.testing.assert_allclose(vectors, reference, atol=1e-6, rtol=0)
    assert not np.allclose(np.linalg.norm(vectors, axis=1), 1.0)  # as encode gives them: not normalised
    assert (result.parts_written, result.parts_skipped, result.rows, result.blank) == (4, 0, 29, 1)
    run = json.loads((tmp_path / "out" / "embed.json").read_text())
    from st_prompts.search.identity import ModelIdentity

    assert run["model"]["fingerprint"] == ModelIdentity.of(loaded(plain)).fingerprint
    assert run["status"] == "complete" and run["settings"]["part_rows"] == 8
    assert [r["first_row"] for r in records(tmp_path / "out").values()] == [0, 8, 16, 24]


def test_ray_engine_gives_the_local_vectors_and_records_its_node(plain, loaded, corpus, tmp_path, ray_session,
                                                                 monkeypatch):
    path, lines = corpus
    plans = []
    iterate = ray_session.data.Dataset.iter_batches
    monkeypatch.setattr(ray_session.data.Dataset, "iter_batches",
                        lambda self, *a, **k: plans.append(repr(self)) or iterate(self, *a, **k))
    result = embed_file(plain, path, tmp_path / "ray", part_rows=8, batch_size=4, engine="ray",
                        ray=RayOptions(actors=1, num_cpus=1))  # one actor: each starts torch (seconds)
    # the actors' stage is the last: a stage of Ray tasks after it (select_columns was one) needs a CPU that actors
    # holding every CPU free only when they end, so no part reached the driver before the last was encoded
    assert len(plans) == 1 and plans[0].startswith("MapBatches(_DatasetEncoder)"), plans
    embed_file(plain, path, tmp_path / "local", part_rows=8, batch_size=4)
    ray_ids, ray_texts, ray_vectors = read_folder(tmp_path / "ray")
    ids, texts, vectors = read_folder(tmp_path / "local")
    assert (ray_ids, ray_texts) == (ids, texts)
    np.testing.assert_allclose(ray_vectors, vectors, atol=1e-6, rtol=0)
    np.testing.assert_allclose(ray_vectors, loaded(plain).encode_document(texts), atol=1e-6, rtol=0)
    by = [r["encoded_by"] for r in records(tmp_path / "ray").values()]
    node = ray_session.get_runtime_context().get_node_id()
    assert all(b["engine"] == "ray" and b["node_id"] == node for b in by), by
    assert len({b["pid"] for b in by}) == 1 and os.getpid() not in {b["pid"] for b in by}  # the actor, not here
    run = json.loads((tmp_path / "ray" / "embed.json").read_text())  # the model's identity, as the actor sent it
    assert {b["fingerprint"] for b in by} == {run["model"]["fingerprint"]}
    assert result.parts_written == 4 and result.nodes == {node: 4}
    # resumed with the other engine: nothing to do (the engine is not a setting of the vectors)
    assert embed_file(plain, path, tmp_path / "ray", part_rows=8).parts_skipped == 4
    # the engine encodes through embed_dataset (the columns it keeps are how parts come back): one actor pool per
    # test is what CI affords, so its own public check here is the refusal of what is not a Dataset
    from st_prompts.embedding import embed_dataset

    with pytest.raises(ConfigurationError, match="ray.data.Dataset"):
        embed_dataset(texts, plain)


# ---------------------------------------------------------------------------------------------- inputs and tasks
def test_json_lines_and_parquet_with_their_columns(plain, loaded, tmp_path):
    texts = sentences(10, seed=1)
    rows = [{"doc": f"d{i}", "body": t} for i, t in enumerate(texts)]
    rows[3]["body"] = ""  # blank: skipped, its row kept
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    embed_file(plain, jsonl, tmp_path / "j", text_column="body", id_column="doc", part_rows=4)
    ids, got, vectors = read_folder(tmp_path / "j")
    keep = [r for r in rows if r["body"]]
    assert ids == [r["doc"] for r in keep] and got == [r["body"] for r in keep]
    np.testing.assert_allclose(vectors, loaded(plain).encode_document(got), atol=1e-6, rtol=0)
    parquet = tmp_path / "docs.parquet"  # small row groups: parts cut across them
    pq.write_table(pa.table({"t": texts}), parquet, row_group_size=3)
    embed_file(plain, parquet, tmp_path / "p", text_column="t", part_rows=4, keep_texts=False)
    ids, got, vectors = read_folder(tmp_path / "p")
    assert ids == list(range(10)) and got == []  # 0-based rows; --no-texts
    np.testing.assert_allclose(vectors, loaded(plain).encode_document(texts), atol=1e-6, rtol=0)


def test_a_task_column_encodes_each_row_with_its_set(bank, loaded, tmp_path):
    texts = sentences(9, seed=2)
    tasks = ["sts", "nli", None, "nli", "sts", "", "sts", "nli", "sts"]
    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"text": texts, "task": tasks}), parquet)
    embed_file(bank, parquet, tmp_path / "rows", task_column="task", part_rows=4)
    _, _, vectors = read_folder(tmp_path / "rows")
    model = loaded(bank)
    for i, (text, task) in enumerate(zip(texts, tasks)):
        expected = model.encode([text], task=task)[0] if task else model.encode_document([text])[0]
        np.testing.assert_allclose(vectors[i], expected, atol=1e-5, rtol=0)
    assert not np.allclose(vectors[0], model.encode_document([texts[0]])[0], atol=1e-3)  # the sets move the rows
    embed_file(bank, parquet, tmp_path / "sts", task="sts", part_rows=4)
    _, _, vectors = read_folder(tmp_path / "sts")
    np.testing.assert_allclose(vectors, model.encode(texts, task="sts"), atol=1e-6, rtol=0)
    assert json.loads((tmp_path / "sts" / "embed.json").read_text())["model"]["task"] == "sts"


def test_a_ray_run_loads_no_model_here_and_takes_the_actors_identity(plain, tiny_bert, loaded, corpus, tmp_path,
                                                                    monkeypatch):
    """The driver of ``--engine ray`` loads no model: the identity each actor sends decides the run file, and another
    model is refused in one line before any part is written (a stand-in for ``encode_parts_on_ray``)."""
    from st_prompts.embedding import ray_engine
    from st_prompts.embedding.encoder import ModelSpec
    from st_prompts.embedding.inputs import read_part
    from st_prompts.search.embedding_files import identity_record
    from st_prompts.search.identity import ModelIdentity

    path, _ = corpus
    other = str(save_plain(tmp_path / "other", tiny_bert, pooling="cls"))  # same backbone, other vectors

    def pool(*actors):
        def encode(spec, source, todo, *, task, name, accept, **_):
            for actor in actors:
                accept(identity_record(ModelIdentity.of(loaded(actor), name=name, task=task)))
            for number, first_row, locator, digest, _ in todo:
                texts = read_part(source, number, first_row, locator).texts
                yield number, first_row, locator, digest, loaded(actors[0]).encode_document(texts), {"node_id": "n"}
        return encode

    def no_load(self, device=None):
        raise AssertionError("the driver loaded a model")

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(ModelSpec, "load", no_load)
        patch.setattr(ray_engine, "encode_parts_on_ray", pool(plain))
        assert embed_file(plain, path, out, part_rows=8, engine="ray").parts_written == 4
        run = json.loads((out / "embed.json").read_text())
        assert run["model"]["fingerprint"] == ModelIdentity.of(loaded(plain)).fingerprint
        (out / "part-00002.parquet").unlink()
        snapshot = {p.name: p.read_bytes() for p in out.iterdir()}
        patch.setattr(ray_engine, "encode_parts_on_ray", pool(other))
        with pytest.raises(StPromptsError, match="was embedded by another model") as refused:
            embed_file(other, path, out, part_rows=8, engine="ray")
        assert "\n" not in str(refused.value)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == snapshot  # nothing written
        patch.setattr(ray_engine, "encode_parts_on_ray", pool(plain, other))
        with pytest.raises(StPromptsError, match="the Ray actors loaded different models"):
            embed_file(plain, path, tmp_path / "two", part_rows=8, engine="ray")
        assert not list((tmp_path / "two").glob("part-*"))
        patch.setattr(ray_engine, "encode_parts_on_ray", pool(plain))
        damaged = {**run, "model": "not a record"}  # a hand-edited run file over parts: one line, nothing written
        (out / "embed.json").write_text(json.dumps(damaged))
        with pytest.raises(StPromptsError, match="records no readable model"):
            embed_file(plain, path, out, part_rows=8, engine="ray")
        assert sorted(p.name for p in out.glob("part-*")) == sorted(n for n in snapshot if n.startswith("part-"))
        (out / "embed.json").write_bytes(snapshot["embed.json"])
        result = embed_file(plain, path, out, part_rows=8, engine="ray")  # resumed: the missing part only
        assert (result.parts_written, result.parts_skipped) == (1, 3)
    # nothing left to encode: no actor to ask, so this process checks the model (and refuses another one)
    for engine in ("ray", "local"):
        with pytest.raises(StPromptsError, match="was embedded by another model"):
            embed_file(other, path, out, part_rows=8, engine=engine)
    assert embed_file(plain, path, out, part_rows=8, engine="ray").parts_skipped == 4


# ---------------------------------------------------------------------------------------------- resume, refusals
def test_a_rerun_rewrites_only_the_missing_or_changed_parts(plain, corpus, tmp_path):
    path, lines = corpus
    source = tmp_path / "c.txt"
    source.write_text(path.read_text())
    out = tmp_path / "out"
    embed_file(plain, source, out, part_rows=8)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    first = read_folder(out)
    (out / "part-00001.parquet").unlink()
    (out / ".part-00002.parquet.st-prompts-tmp-0123456789ab").write_bytes(b"half a part")  # a killed write's leftover
    time.sleep(0.01)
    result = embed_file(plain, source, out, part_rows=8)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert (result.parts_written, result.parts_skipped) == (1, 3)
    assert {n for n in after if after[n] != before[n]} == {"part-00001.parquet"}
    assert sorted(os.listdir(out)) == ["embed.json", *sorted(before)]  # the leftover went, nothing else did
    second = read_folder(out)
    assert first[:2] == second[:2] and np.array_equal(first[2], second[2])
    changed = lines[:]
    changed[20] = "a new sentence in part two"
    source.write_text("\n".join(changed) + "\n")
    result = embed_file(plain, source, out, part_rows=8)
    assert (result.parts_written, result.parts_skipped) == (1, 3)
    assert read_folder(out)[1][19] == "a new sentence in part two"  # row 21 is the 20th kept document


def test_other_settings_a_foreign_folder_and_a_second_writer_are_refused(plain, corpus, tmp_path, capsys):
    path, _ = corpus
    out = tmp_path / "out"
    embed_file(plain, path, out, part_rows=8)
    snapshot = {p.name: p.read_bytes() for p in out.iterdir()}
    line = cli_error(["embed", plain, path, out, "--part-rows", "10"], capsys)
    assert "other settings (part_rows: 8, now 10)" in line
    line = cli_error(["embed", plain, path, out, "--part-rows", "8", "--no-texts"], capsys)
    assert "texts" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == snapshot  # refused before anything was written
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert "did not write (notes.txt)" in cli_error(["embed", plain, path, foreign], capsys)
    assert os.listdir(foreign) == ["notes.txt"]
    holder = subprocess.Popen(  # another process writes into out: refused at once, not left waiting
        [sys.executable, "-c", "import sys, time; from st_prompts.storage import folder_lock\n"
         f"with folder_lock({str(out)!r}):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert "being written by another process" in cli_error(["embed", plain, path, out, "--part-rows", "8"],
                                                                capsys)
    finally:
        holder.kill()
        holder.wait()


def test_the_command_line_runs_and_its_errors_are_one_line(plain, bank, corpus, tmp_path, capsys, monkeypatch):
    path, _ = corpus
    code, out, _ = cli_out(["embed", plain, path, tmp_path / "cli", "--part-rows", "16", "--batch-size", "8"], capsys)
    assert code == 0 and "2 part(s) written, 0 skipped (already done), 29 documents" in out
    assert "input file not found" in cli_error(["embed", plain, tmp_path / "none.txt", tmp_path / "o"], capsys)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "a dog"}\n{"body": "no text"}\n')
    assert "line 2: no field 'text'" in cli_error(["embed", plain, jsonl, tmp_path / "o"], capsys)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), parquet)
    assert "no column 'body'" in cli_error(["embed", plain, parquet, tmp_path / "o", "--text-column", "body"], capsys)
    assert "Unknown task 'legal'" in cli_error(["embed", bank, path, tmp_path / "o", "--task", "legal"], capsys)
    assert "no prompt sets" in cli_error(["embed", plain, path, tmp_path / "o", "--task", "sts"], capsys)
    pq.write_table(pa.table({"text": ["a", "b"], "task": ["sts", "legal"]}), parquet)
    assert "Unknown task 'legal'" in cli_error(["embed", bank, parquet, tmp_path / "o", "--task-column", "task"],
                                               capsys)
    assert "options of --engine ray" in cli_error(["embed", plain, path, tmp_path / "o", "--actors", "2"], capsys)
    (tmp_path / "x.csv").write_text("text\na\n")
    assert "convert it to .parquet" in cli_error(["embed", plain, tmp_path / "x.csv", tmp_path / "o"], capsys)
    import ray
    from test_replicas import free_port

    port = free_port()  # nothing listens there: refused at once (Ray itself retries for minutes)
    with monkeypatch.context() as patch:  # as in a fresh process, whatever Ray session this module's tests hold
        patch.setattr(ray, "is_initialized", lambda: False)
        line = cli_error(["embed", plain, path, tmp_path / "o2", "--engine", "ray", "--ray-address",
                          f"127.0.0.1:{port}"], capsys)
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in line and not (tmp_path / "o2").exists()
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    line = cli_error(["embed", plain, path, tmp_path / "o", "--engine", "ray"], capsys)
    assert 'pip install "st-prompts[scale]"' in line
    # a run refused on its input's first part leaves its run file only, which the next run (other settings) replaces
    assert sorted(os.listdir(tmp_path / "o")) == ["embed.json"]
