"""An index exported into a vector database (Milvus Lite, and its gRPC server) searches like its FAISS folder, in the
library, from the command line and behind ``st-prompts serve`` (MiniLM: its scores lie far enough apart that every
engine orders the hits alike). References: the FAISS index's search and a brute-force numpy search."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import FIXTURES, cli_error, cli_out, one_line_message, run_cli, save_plain
from test_replicas import free_port
from test_search import brute_force as top_rows
from test_serving import Server

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError, DataNotFoundError
from st_prompts.loading import load_sentence_model
from st_prompts.search import SemanticIndex
from st_prompts.search.vector_db import VectorCollection, export_index, is_address, parse_address, release

DOCS = (FIXTURES / "search" / "real_corpus.txt").read_text(encoding="utf-8").splitlines()[:100]
QUERIES = (FIXTURES / "search" / "real_queries.txt").read_text(encoding="utf-8").splitlines()[:8]


@pytest.fixture(scope="module")
def world(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("vector-db")
    model = load_sentence_model(minilm_path, device="cpu")
    docs, queries = model.encode_document(DOCS), model.encode_query(QUERIES)  # once: every index is built from these
    flat = SemanticIndex.from_embeddings(docs, DOCS, model=model)
    flat.save(root / "flat.index")
    served_db = f"milvus:{root / 'served.db'}#docs"
    # a Milvus server reached over http://: Milvus Lite's own gRPC server in a process of its own (the protocol of a
    # standalone Milvus; offline, no other server can run here)
    milvus = subprocess.Popen([sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(root / "milvus-data"),
                               "--host", "127.0.0.1", "--port", str(free_port())], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    listening = milvus.stdout.readline()
    assert "listening on" in listening, listening
    remote = "http://" + listening.split("listening on ")[1].split()[0] + "#docs"
    out, err = io.StringIO(), io.StringIO()  # capsys is per test: the module's exports print here
    for target in (served_db, remote):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_cli(["index", "export", root / "flat.index", "--to", target, "--no-progress"])
        assert code == 0, err.getvalue()
    # --pass-overhead-tokens: the start-up measurement of the pass overhead is not what this module tests
    server = Server("vdb", [str(minilm_path), "--threads", "1", "--pass-overhead-tokens", "64",
                            "--index", f"folder={root / 'flat.index'}", "--index", f"db={served_db}",
                            "--index", f"remote={remote}"])
    try:
        # the library's own export, searched by most tests
        exported = parse_address(f"{root / 'lib.db'}#flat")
        record = export_index(SemanticIndex.load(root / "flat.index", mmap=True), exported, rows=40)
        yield {"root": root, "model": model, "flat": flat, "server": server, "docs": docs, "queries": queries,
               "exported": exported, "record": record, "remote": remote}
    finally:
        server.stop()
        milvus.terminate()
        milvus.wait(30)


def brute_force(world, docs_ids, k: int) -> list[list]:
    """The ``k`` best ids of each query by numpy over the model's embeddings."""
    return [[docs_ids[i] for i in row] for row in top_rows(world["docs"], world["queries"], k)[0]]


@contextlib.contextmanager
def opened(address, client: bool = False):
    """:meth:`VectorCollection.open` of ``address`` (``client``: a ``MilvusClient`` of its file or server), closed and
    released after."""
    from pymilvus import MilvusClient

    handle = MilvusClient(address.uri) if client else VectorCollection.open(address)
    try:
        yield handle
    finally:
        handle.close()
        release(address)


def foreign_collection(client, name: str) -> None:
    """A collection st-prompts did not write: an id and a 2-dimensional vector."""
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False)
    schema.add_field("pk", DataType.INT64, is_primary=True)
    schema.add_field("v", DataType.FLOAT_VECTOR, dim=2)
    params = client.prepare_index_params()
    params.add_index(field_name="v", index_type="FLAT", metric_type="L2")
    client.create_collection(name, schema=schema, index_params=params)


def test_an_exported_flat_index_searches_exactly_like_the_faiss_folder(world):
    flat, record = world["flat"], world["record"]
    assert record["complete"] and record["documents"] == len(DOCS) and record["search"]["index_type"] == "FLAT"
    with opened(world["exported"]) as collection:
        assert len(collection) == len(DOCS) and collection.dimension == flat.dimension
        assert collection.model_identity.fingerprint == flat.model_identity.fingerprint
        queries = world["queries"]
        got, want = collection.search_embeddings(queries, 10), flat.search_embeddings(queries, 10)
        for mine, theirs, truth in zip(got, want, brute_force(world, list(range(len(DOCS))), 10)):
            assert [h.id for h in mine] == [h.id for h in theirs] == truth
            assert [h.text for h in mine] == [h.text for h in theirs]
            assert np.allclose([h.score for h in mine], [h.score for h in theirs], atol=1e-5)
        assert len(collection.search_embeddings(queries[:1], 10_000)[0]) == len(DOCS)  # k clamped to the size


def test_an_hnsw_index_with_string_ids_keeps_its_parameters_and_ids(world):
    ids = [f"doc-{i}" for i in range(len(DOCS))]
    hnsw = SemanticIndex.from_embeddings(world["docs"], DOCS, ids, index_type="hnsw", model=world["model"],
                                         target_recall=None, ef_search=200)
    address = parse_address(f"milvus:{world['root'] / 'lib.db'}#hnsw")
    record = export_index(hnsw, address)
    assert record["search"] == {"index_type": "HNSW", "metric_type": "IP", "params": {"ef": 200},
                                "build": {"M": hnsw.index_params["m"], "efConstruction":
                                          hnsw.index_params["ef_construction"]}}
    with opened(address) as collection:
        got = collection.search_embeddings(world["queries"], 10)
    truth = brute_force(world, ids, 10)
    assert np.mean([len({h.id for h in row} & set(t)) / 10 for row, t in zip(got, truth)]) >= 0.95
    assert all(DOCS[int(h.id[4:])] == h.text for row in got for h in row)


def test_an_existing_collection_is_replaced_only_with_overwrite_and_a_foreign_one_never(world, capsys):
    root = world["root"]
    target = f"{root / 'cli.db'}#again"
    assert cli_out(["index", "export", root / "flat.index", "--to", target, "--no-progress"], capsys)[0] == 0
    message = cli_error(["index", "export", root / "flat.index", "--to", target], capsys, status=2)
    assert "already exists" in message and "--overwrite" in message
    code, out, _ = cli_out(["index", "export", root / "flat.index", "--to", target, "--overwrite", "--no-progress"],
                           capsys)
    assert code == 0 and f"Exported {len(DOCS)} documents" in out and "--index NAME=milvus:" in out
    theirs = parse_address(f"{root / 'cli.db'}#theirs")
    with opened(theirs, client=True) as client:  # a collection st-prompts did not write is never dropped
        foreign_collection(client, "theirs")
        client.insert("theirs", [{"pk": 1, "v": [0.0, 1.0]}])
    message = cli_error(["index", "export", root / "flat.index", "--to", f"{root / 'cli.db'}#theirs", "--overwrite"],
                        capsys)
    assert "not written by st-prompts" in message
    with pytest.raises(DataFormatError) as error:
        VectorCollection.open(theirs)
    assert "records no model" in one_line_message(error)
    with opened(theirs, client=True) as client:
        assert client.has_collection("theirs") and client.has_collection("again")


@pytest.mark.parametrize("uri, expected", [
    ("ftp://host/x", "not a vector database address"),
    ("docs.index", "not a vector database address"),
    ("milvus:", "names no file"),
    ("x.db#1bad", "collection name"),
    ("x.db#a__st_prompts", "collection name"),
    ("http://", "not a server address"),
    ("milvus:/no/such/folder/x.db#c", "no folder"),
])
def test_a_bad_address_is_one_line(world, capsys, uri, expected):
    assert expected in cli_error(["index", "export", world["root"] / "flat.index", "--to", uri], capsys)


def test_a_lite_file_is_never_written_into_a_folder_st_prompts_saved(world, capsys):
    folder = world["root"] / "flat.index"
    before = sorted(p.name for p in folder.iterdir())
    message = cli_error(["index", "export", folder, "--to", f"milvus:{folder / 'x.db'}#docs"], capsys)
    assert "lies inside" in message and "semantic index" in message
    assert sorted(p.name for p in folder.iterdir()) == before


def test_addresses_are_told_from_index_folders(tmp_path):
    assert is_address("milvus:docs.db") and is_address("http://h:19530#c") and is_address("x.db#c")
    assert not is_address(str(tmp_path)) and not is_address("docs.index")
    (tmp_path / "odd.db").mkdir()  # a Milvus Lite file is a folder; an index folder that ends in .db stays one
    assert is_address(str(tmp_path / "odd.db"))
    (tmp_path / "odd.db" / "meta.json").write_text("{}")
    assert not is_address(str(tmp_path / "odd.db"))
    address = parse_address("milvus://h:19530#c")
    assert (address.uri, address.embedded, str(address)) == ("http://h:19530", False, "http://h:19530#c")
    assert parse_address("docs.db", default_collection="d").uri == str(Path("docs.db").resolve())


def test_a_milvus_lite_file_is_not_shared_by_forked_workers(world, capsys):
    message = cli_error(["serve", "minilm", "--workers", "2", "--index", f"docs={world['exported']}"], capsys)
    assert "one process at a time" in message and "http://HOST:PORT#COLLECTION" in message


def test_a_model_that_encodes_otherwise_is_refused_and_a_missing_collection_is_named(world, tiny_bert):
    from st_prompts.serving.indexes import IndexRegistry
    from st_prompts.serving.model import ServedModel

    root = world["root"]
    other = ServedModel.load(str(save_plain(root / "other", tiny_bert, pooling="cls")), device="cpu")
    with pytest.raises(BackboneMismatchError) as error:
        IndexRegistry(other).load("docs", str(world["exported"]))
    one_line_message(error)
    with pytest.raises(DataNotFoundError) as missing:
        IndexRegistry(other).load("docs", f"milvus:{root / 'lib.db'}#nothing")
    assert "no collection 'nothing'" in one_line_message(missing)


def _insert_failing_after(monkeypatch, batches: int) -> None:
    """Make the connection drop after ``batches`` inserts of documents into a version (records are inserted too)."""
    from pymilvus import MilvusClient
    from pymilvus.exceptions import MilvusException

    inserts = []
    real_insert = MilvusClient.insert

    def failing_insert(self, name, rows, **kwargs):
        if "__st_v" in name and not name.endswith("__st_prompts"):
            inserts.append(len(rows))
            if len(inserts) > batches:
                raise MilvusException(message="connection reset\nby peer")
        return real_insert(self, name, rows, **kwargs)

    monkeypatch.setattr(MilvusClient, "insert", failing_insert)


def _versions_in(address) -> list[str]:
    with opened(address, client=True) as client:
        return sorted(c for c in client.list_collections() if c.startswith(address.collection + "__st_v")
                      and not c.endswith("__st_prompts"))


def test_an_export_that_broke_off_leaves_the_collection_as_it_was(world, monkeypatch, capsys):
    address = parse_address(f"{world['root'] / 'broken.db'}#half")
    _insert_failing_after(monkeypatch, 1)
    with pytest.raises(ConfigurationError) as error:
        export_index(world["flat"], address, rows=30)
    assert "exporting to 'half'" in one_line_message(error) and "connection reset" in str(error.value)
    monkeypatch.undo()
    with pytest.raises(DataFormatError) as unfinished:  # a first export: nothing to read, and said so
        VectorCollection.open(address)
    assert "did not finish" in one_line_message(unfinished)
    release(address)
    # nothing was finished, so nothing is overwritten: no --overwrite needed; the broken version is dropped
    assert cli_out(["index", "export", world["root"] / "flat.index", "--to", str(address), "--no-progress"],
                   capsys)[0] == 0
    query = world["queries"][:1]
    expected = [h.id for h in world["flat"].search_embeddings(query, 3)[0]]
    with opened(address) as first:
        assert len(first) == len(DOCS) and [h.id for h in first.search_embeddings(query, 3)[0]] == expected
    assert len(_versions_in(address)) == 1
    # an --overwrite that breaks off: the collection still reads the whole first export
    smaller = SemanticIndex.from_embeddings(world["docs"][:50], DOCS[:50], model=world["model"])
    _insert_failing_after(monkeypatch, 1)
    with pytest.raises(ConfigurationError):
        export_index(smaller, address, rows=20, overwrite=True)
    monkeypatch.undo()
    with opened(address) as kept:
        assert len(kept) == len(DOCS) and [h.id for h in kept.search_embeddings(query, 3)[0]] == expected
    # a whole --overwrite moves the name; the version before stays for readers that opened it, older ones go
    export_index(smaller, address, rows=20, overwrite=True)
    export_index(smaller, address, rows=20, overwrite=True)
    with opened(address) as now:
        assert len(now) == 50 and now.collection == _versions_in(address)[-1]
    assert len(_versions_in(address)) == 2  # the current one and the one before; the broken one and the first gone


def test_collections_that_look_like_versions_but_are_not_st_prompts_are_never_dropped(world):
    address = parse_address(f"{world['root'] / 'lookalike.db'}#docs")
    theirs = {"docs__st_v20200101000000_deadbeef", "docs__st_v20200101000001_deadbeef",
              "docs__st_v20200101000001_deadbeef__st_prompts"}  # the last: a "record" of another shape
    with opened(address, client=True) as client:
        for name in theirs:
            foreign_collection(client, name)
    for _ in range(3):  # every export drops the versions before the one before it: never these
        export_index(world["flat"], address, rows=50, overwrite=True)
    with opened(address, client=True) as client:
        assert theirs <= set(client.list_collections())
    assert len(_versions_in(address)) == 2 + 2  # theirs, and the current version with the one before


def test_on_a_server_an_unfinished_export_is_kept_for_the_writer_that_may_still_be_filling_it(world, monkeypatch):
    address = parse_address(world["remote"].replace("#docs", "#slow"))
    export_index(world["flat"], address, rows=50)
    _insert_failing_after(monkeypatch, 0)
    with pytest.raises(ConfigurationError):
        export_index(world["flat"], address, rows=50, overwrite=True)
    monkeypatch.undo()
    export_index(world["flat"], address, rows=50, overwrite=True)  # on a server another export may be filling it
    with opened(address) as collection:
        assert len(collection) == len(DOCS)
    assert len(_versions_in(address)) == 3  # the one before (for its readers), the unfinished one, the current


def test_a_forked_process_searches_a_server_collection_through_its_own_connection(world):
    """What ``serve --workers N`` does with a collection on a server: the workers are forked after it was opened, and
    a gRPC channel does not survive a fork; each process opens its own."""
    import json
    import os
    import signal
    import time

    collection = VectorCollection.open(parse_address(world["remote"]))
    query = world["queries"][:3]
    expected = [[h.id for h in row] for row in collection.search_embeddings(query, 4)]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            hits = collection.search_embeddings(query, 4)
            os.write(write, json.dumps([[h.id for h in row] for row in hits]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    answer = os.read(read, 100_000).decode()
    os.close(read)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0 and json.loads(answer) == expected, answer
    assert [[h.id for h in row] for row in collection.search_embeddings(query, 4)] == expected  # the parent's too
    collection.close()


def test_export_of_an_index_without_its_reranking_vectors_is_refused(world):
    flat = SemanticIndex.load(world["root"] / "flat.index")
    flat.index_type = "ivfpq"  # an IVF-PQ index built with rerank 0 keeps no vectors to copy exactly
    with pytest.raises(ConfigurationError) as error:
        export_index(flat, parse_address(f"{world['root'] / 'lib.db'}#pq"))
    assert "keeps no vectors" in one_line_message(error)
    with pytest.raises(DataNotFoundError):  # refused before anything was written
        VectorCollection.open(parse_address(f"{world['root'] / 'lib.db'}#pq"))


def test_the_server_answers_search_from_the_collection_as_from_the_folder(world):
    base = world["server"].wait_ready()
    body = {"query": QUERIES, "k": 7}
    folder = requests.post(f"{base}/search", json={**body, "index": "folder"}, timeout=60)
    assert folder.status_code == 200, folder.text
    folder = folder.json()
    truth = brute_force(world, list(range(len(DOCS))), 7)
    for name in ("db", "remote"):  # the Lite file, and the Milvus server over http://
        db = requests.post(f"{base}/search", json={**body, "index": name}, timeout=60)
        assert db.status_code == 200, db.text
        db = db.json()
        assert db["index"] == name and set(db) == set(folder) and len(db["data"]) == len(QUERIES)
        for mine, theirs, want in zip(db["data"], folder["data"], truth):
            assert [h["id"] for h in mine["hits"]] == [h["id"] for h in theirs["hits"]] == want
            assert [(h["rank"], h["text"]) for h in mine["hits"]] == [(h["rank"], h["text"]) for h in theirs["hits"]]
            assert np.allclose([h["score"] for h in mine["hits"]], [h["score"] for h in theirs["hits"]], atol=1e-5)
    health = requests.get(f"{base}/health", timeout=30).json()
    assert set(health["indexes"]) == {"folder", "db", "remote"}
