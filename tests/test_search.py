"""Tests of st_prompts.search (FAISS semantic search) and the ``st-prompts index`` command."""

from __future__ import annotations

import copy
import functools
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_error, cli_out, edit_json, save_plain

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError, DataNotFoundError
from st_prompts.search import SearchHit, SemanticIndex

FIXTURES = Path(__file__).parent / "fixtures" / "search"
CORPUS_TXT = FIXTURES / "corpus.txt"
CORPUS_JSONL = FIXTURES / "corpus.jsonl"
QUERIES = ["where do cats sleep?", "bread recipe", "stock prices dropped", "how do plants make oxygen"]


@pytest.fixture(scope="module")
def corpus_index(minilm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SemanticIndex.from_file(minilm, CORPUS_TXT, show_progress_bar=False)


@pytest.fixture(scope="module")
def saved_index(corpus_index, tmp_path_factory) -> Path:
    """``corpus_index`` saved, for the tests that only read it."""
    folder = tmp_path_factory.mktemp("saved") / "idx"
    corpus_index.save(folder)
    return folder


def clustered_vectors(n: int, dim: int = 64, clusters: int = 40, seed: int = 0, sample_seed: int | None = None,
                      spread: float = 0.6) -> np.ndarray:
    """Random-ish vectors with structure (Gaussian blobs), like real embeddings; pure noise is unrealistically hard.
    ``seed`` fixes the blob centres; ``sample_seed`` (default: ``seed``) draws other points around the same centres."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim))
    if sample_seed is not None:
        rng = np.random.default_rng(sample_seed)
    labels = rng.integers(clusters, size=n)
    return (centers[labels] + spread * rng.normal(size=(n, dim))).astype(np.float32)


def brute_force(doc_emb: np.ndarray, query_emb: np.ndarray, k: int):
    """The top ``k`` rows of each query by numpy over normalised vectors (independent of FAISS), and their scores."""
    scores = normalized(query_emb) @ normalized(doc_emb).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def hits_as_tuples(results):
    return [[(hit.id, hit.text, round(hit.score, 5)) for hit in hits] for hits in results]


# ---------------------------------------------------------------- exact search
def test_exact_search_matches_numpy_brute_force_on_model_embeddings(minilm, corpus_index):
    texts = corpus_index.texts
    doc_emb = minilm.encode(texts, convert_to_numpy=True)
    query_emb = minilm.encode(QUERIES, convert_to_numpy=True)
    order, scores = brute_force(doc_emb, query_emb, k=5)
    results = corpus_index.search(QUERIES, k=5)
    assert len(results) == len(QUERIES)
    for hits, row_order, row_scores in zip(results, order, scores):
        assert len(hits) == 5
        assert all(isinstance(hit, SearchHit) for hit in hits)
        np.testing.assert_allclose([hit.score for hit in hits], row_scores, atol=1e-5)
        assert [hit.text for hit in hits] == [texts[i] for i in row_order]
    assert results[0][0].text.startswith(("A cat sleeps", "Kittens"))
    assert "bread" in results[1][0].text or "dough" in results[1][0].text


def test_exact_search_matches_brute_force_on_unnormalised_vectors():
    rng = np.random.default_rng(1)
    doc_emb = rng.normal(size=(500, 32)).astype(np.float32) * rng.uniform(0.1, 10, size=(500, 1)).astype(np.float32)
    query_emb = rng.normal(size=(20, 32)).astype(np.float32) * 7
    index = SemanticIndex.from_embeddings(doc_emb, [f"doc {i}" for i in range(500)])
    results = index.search_embeddings(query_emb, k=10)
    order, scores = brute_force(doc_emb, query_emb, k=10)
    for hits, row_order, row_scores in zip(results, order, scores):
        assert [hit.id for hit in hits] == list(row_order)  # default ids: 0-based positions
        np.testing.assert_allclose([hit.score for hit in hits], row_scores, atol=1e-5)
        assert all(-1.0 - 1e-5 <= hit.score <= 1.0 + 1e-5 for hit in hits)  # cosines


def test_text_file_ids_are_line_numbers_and_single_query_string(corpus_index):
    lines = CORPUS_TXT.read_text(encoding="utf-8").splitlines()
    assert len(corpus_index) == sum(1 for line in lines if line.strip())
    for doc_id, text in zip(corpus_index.ids, corpus_index.texts):
        assert lines[doc_id - 1] == text  # 1-based line numbers; the blank line 7 keeps its number
    assert 7 not in corpus_index.ids
    results = corpus_index.search("where do cats sleep?", k=3)
    assert len(results) == 1 and len(results[0]) == 3


def test_duplicate_texts_are_kept_with_a_warning(minilm):
    with pytest.warns(UserWarning, match="repeat the text"):
        index = SemanticIndex.build(minilm, ["same text", "other text", "same text"], show_progress_bar=False)
    assert index.ids == [0, 1, 2]
    hits = index.search("same text", k=2)[0]
    assert {hit.id for hit in hits} == {0, 2}
    assert hits[0].score == pytest.approx(hits[1].score, abs=1e-5)


def listing(folder):
    """The entries of ``folder``, without the lock files that serialise writers of the indexes in it."""
    return sorted(p for p in folder.iterdir() if not p.name.endswith(".st-prompts.lock"))


# ---------------------------------------------------------------- save / load
def test_save_load_round_trip_gives_identical_results(minilm, corpus_index, tmp_path):
    before = corpus_index.search(QUERIES, k=6)
    corpus_index.save(tmp_path / "idx")
    assert sorted(os.listdir(tmp_path / "idx")) == ["docs.jsonl", "docs.offsets.npy", "index.faiss", "meta.json",
                                                 "probe.npy", "st_prompts_save.json"]
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())
    assert meta["model"]["name"] == "minilm"
    assert meta["model"]["dimension"] == meta["dimension"] == 384
    assert meta["model"]["fingerprint"].startswith("sha256:")
    assert meta["num_docs"] == len(corpus_index)
    assert meta["index_type"] == "flat" and meta["normalization"] == "l2" and meta["score"] == "cosine"
    assert meta["id_source"] == "line_number"
    loaded = SemanticIndex.load(tmp_path / "idx", model=minilm)
    assert loaded.ids == corpus_index.ids and loaded.texts == corpus_index.texts
    assert hits_as_tuples(loaded.search(QUERIES, k=6)) == hits_as_tuples(before)
    assert [tmp_path / "idx"] == listing(tmp_path)  # no temp directory left behind


def test_loaded_index_loads_its_recorded_model_lazily(corpus_index, saved_index):
    loaded = SemanticIndex.load(saved_index)
    assert loaded.model is None
    assert hits_as_tuples(loaded.search(QUERIES[:1], k=3)) == hits_as_tuples(corpus_index.search(QUERIES[:1], k=3))
    assert loaded.model is not None


def test_save_replaces_an_index_atomically_and_cleans_up_on_failure(corpus_index, tmp_path, monkeypatch):
    target = tmp_path / "idx"
    corpus_index.save(target)
    original = (target / "docs.jsonl").read_bytes()

    import st_prompts.search.store as store_module

    def exploding_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(store_module.json, "dump", exploding_dump)
    with pytest.raises(OSError, match="disk full"):
        corpus_index.save(target)
    monkeypatch.undo()
    assert (target / "docs.jsonl").read_bytes() == original  # the old index is untouched
    assert SemanticIndex.load(target).ids == corpus_index.ids
    assert listing(tmp_path) == [target]  # no half-written temp directory

    with pytest.raises(ConfigurationError, match="already holds an index"):
        corpus_index.save(target, overwrite=False)
    other = tmp_path / "not-an-index"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigurationError, match="not a semantic index saved by st-prompts"):
        corpus_index.save(other)
    assert (other / "precious.txt").read_text() == "keep me"


# ---------------------------------------------------------------- model identity
def test_model_with_different_weights_is_rejected(minilm, corpus_index, saved_index):
    other = copy.deepcopy(minilm)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    with pytest.raises(BackboneMismatchError, match="does not match"):
        SemanticIndex.load(saved_index, model=other)
    with pytest.raises(BackboneMismatchError):
        corpus_index.set_model(other)


def test_model_with_different_dimension_is_rejected(minilm_path, corpus_index, saved_index):
    from sentence_transformers import SentenceTransformer

    truncated = SentenceTransformer(minilm_path, truncate_dim=128, device="cpu")
    with pytest.raises(BackboneMismatchError, match="128-dimensional"):
        SemanticIndex.load(saved_index, model=truncated)
    with pytest.raises(BackboneMismatchError, match="dimensions"):
        corpus_index.search_embeddings(np.ones((1, 128), dtype=np.float32), k=1)


def test_model_without_final_normalize_is_compatible(minilm, corpus_index, saved_index):
    """Scores are cosines whatever the model's last layer, so dropping Normalize changes nothing."""
    from sentence_transformers import SentenceTransformer

    unnormalised = SentenceTransformer(modules=[minilm[0], minilm[1]], device="cpu")
    loaded = SemanticIndex.load(saved_index, model=unnormalised)
    assert hits_as_tuples(loaded.search(QUERIES, k=4)) == hits_as_tuples(corpus_index.search(QUERIES, k=4))


# ---------------------------------------------------------------- approximate indexes
@pytest.fixture(scope="module")
def ann_data():
    vectors = clustered_vectors(4000, dim=64)
    # Queries about the corpus's topics (same blobs) but not copies of documents (other, wider draws).
    queries = clustered_vectors(200, dim=64, sample_seed=123, spread=0.8)
    exact = SemanticIndex.from_embeddings(vectors, [str(i) for i in range(len(vectors))])
    return vectors, queries, exact.search_embeddings(queries, k=10)


@pytest.mark.parametrize("index_type", ["ivf", "hnsw"])
def test_approximate_indexes_reach_high_recall_with_defaults(index_type, ann_data):
    vectors, queries, exact = ann_data
    index = SemanticIndex.from_embeddings(vectors, [str(i) for i in range(len(vectors))], index_type=index_type)
    approx = index.search_embeddings(queries, k=10)
    recall = np.mean([len({h.id for h in a} & {h.id for h in e}) / 10 for a, e in zip(approx, exact)])
    assert recall >= 0.95, f"{index_type} recall@10 = {recall:.3f}"
    if index_type == "ivf":
        assert index.index_params["nlist"] == min(round(4 * np.sqrt(4000)), 4000 // 39)
    for hits in approx:
        assert len(hits) == 10 and all(hit.id != -1 for hit in hits)


def test_ivf_on_a_tiny_corpus_falls_back_to_one_list_and_explicit_nlist_too_large_is_an_error():
    vectors = clustered_vectors(30, dim=16)
    texts = [f"t{i}" for i in range(30)]
    index = SemanticIndex.from_embeddings(vectors, texts, index_type="ivf")
    assert index.index_params == {"nlist": 1, "nprobe": 1}
    exact = SemanticIndex.from_embeddings(vectors, texts)
    assert hits_as_tuples(index.search_embeddings(vectors[:5], k=5)) == hits_as_tuples(
        exact.search_embeddings(vectors[:5], k=5))
    for options, match in (({"index_type": "ivf", "nlist": 64}, "nlist=64 needs at least 64 documents"),
                           ({"index_type": "lsh"}, "unknown index_type"),
                           ({"index_type": "hnsw", "nlist": 4}, "unknown parameter")):
        with pytest.raises(ConfigurationError, match=match):
            SemanticIndex.from_embeddings(vectors, texts, **options)


def test_search_params_can_be_changed(ann_data):
    vectors, queries, _ = ann_data
    index = SemanticIndex.from_embeddings(vectors, [str(i) for i in range(len(vectors))], index_type="ivf", nprobe=2)
    index.set_search_params(nprobe=10_000)
    assert index.index_params["nprobe"] == index.index_params["nlist"]  # clamped, i.e. exhaustive
    with pytest.raises(ConfigurationError, match="ef_search applies"):
        index.set_search_params(ef_search=10)


# ---------------------------------------------------------------- bad input
@pytest.mark.filterwarnings("ignore::UserWarning")  # the blank lines skipped
def test_empty_or_missing_corpora_and_bad_ids_are_errors(minilm, tmp_path):
    build = functools.partial(SemanticIndex.build, minilm, show_progress_bar=False)
    for call, error, match in [
        (lambda: build([]), DataFormatError, "empty"),
        (lambda: build(["", "   ", "\t"]), DataFormatError, "empty"),
        (lambda: SemanticIndex.from_file(minilm, FIXTURES / "blank.txt"), DataFormatError, "no non-blank document"),
        (lambda: SemanticIndex.from_file(minilm, tmp_path / "missing.txt"), DataNotFoundError, None),
        (lambda: SemanticIndex.build(minilm, str(CORPUS_TXT)), ConfigurationError, "from_file"),
        (lambda: SemanticIndex.from_file(minilm, CORPUS_TXT, id_column="doc_id"), ConfigurationError,
         "id-column needs a dataset file"),
        (lambda: build(["x", "y", "z"], ids=["a", "b", "a"]), DataFormatError, "unique.*'a'"),
        (lambda: SemanticIndex.from_file(minilm, FIXTURES / "duplicate_ids.jsonl", text_column="body",
                                         id_column="doc_id"), DataFormatError, "unique"),
        (lambda: build(["x"], ids=[1.5]), DataFormatError, "ids must be str or int"),
    ]:
        with pytest.raises(error, match=match):
            call()


def test_dataset_columns(minilm):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_json(str(CORPUS_JSONL))
    index = SemanticIndex.build(minilm, dataset, text_column="body", id_column="doc_id", show_progress_bar=False)
    assert index.ids[:2] == ["pets-1", "pets-2"]
    assert index.search("bread", k=1)[0][0].id == "baking-1"
    assert (index.info["id_source"], index.info["source"]) == ("column:doc_id", "corpus")
    with pytest.raises(DataFormatError, match="no column 'text'"):
        SemanticIndex.build(minilm, dataset)
    # The same file through from_file: same ids, and the file is recorded as the source.
    from_file = SemanticIndex.from_file(minilm, CORPUS_JSONL, "body", "doc_id", show_progress_bar=False)
    assert from_file.ids == index.ids and from_file.texts == index.texts
    assert (from_file.info["id_source"], from_file.info["source"]) == ("column:doc_id", str(CORPUS_JSONL))
    by_row = SemanticIndex.from_file(minilm, CORPUS_JSONL, "body", show_progress_bar=False)
    assert by_row.ids == list(range(len(by_row))) and by_row.info["id_source"] == "position"


def test_missing_or_incomplete_index_directory(corpus_index, tmp_path):
    start = time.monotonic()
    with pytest.raises(DataNotFoundError, match="not found"):
        SemanticIndex.load(tmp_path / "nope")
    # a reader waits for a missing folder only while a save holds its lock (between a save's two renames): a
    # mistyped path is refused at once, not after the 5 s wait
    assert time.monotonic() - start < 2.0
    corpus_index.save(tmp_path / "idx")
    (tmp_path / "idx" / "index.faiss").unlink()
    with pytest.raises(DataFormatError, match="index.faiss is missing"):
        SemanticIndex.load(tmp_path / "idx")


def test_k_larger_than_corpus_is_clamped_with_a_warning_and_never_returns_minus_one(corpus_index):
    with pytest.warns(UserWarning, match="larger than the corpus"):
        hits = corpus_index.search("cats", k=1000)[0]
    assert len(hits) == len(corpus_index)
    assert sorted(hit.id for hit in hits) == sorted(corpus_index.ids)
    assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)
    with pytest.raises(ConfigurationError, match="positive integer"):
        corpus_index.search("cats", k=0)
    assert corpus_index.search([], k=3) == []


def test_warnings_point_at_the_callers_line(corpus_index, minilm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        corpus_index.search("cats", k=1000)
        corpus_index.search_embeddings(np.ones((1, 384), dtype=np.float32), k=1000)
        SemanticIndex.from_file(minilm, CORPUS_TXT, show_progress_bar=False)
    messages = [(str(w.message), w.filename) for w in caught if issubclass(w.category, UserWarning)]
    assert [m for m, _ in messages if "larger than the corpus" in m] and [m for m, _ in messages if "blank" in m]
    assert {filename for _, filename in messages} == {__file__}


def test_public_methods_have_no_private_parameters():
    import inspect

    for name, member in inspect.getmembers(SemanticIndex, callable):
        if not name.startswith("_"):
            private = [p for p in inspect.signature(member).parameters if p.startswith("_")]
            assert not private, f"SemanticIndex.{name}{inspect.signature(member)}"


def test_ivf_with_too_few_probes_drops_empty_slots_instead_of_returning_minus_one():
    vectors = clustered_vectors(2000, dim=16, clusters=50)
    index = SemanticIndex.from_embeddings(vectors, [str(i) for i in range(2000)], index_type="ivf", nlist=50, nprobe=1)
    for hits in index.search_embeddings(vectors[:50], k=500):  # one list holds ~40 vectors: FAISS pads with -1
        assert 0 < len(hits) < 500
        assert all(isinstance(hit.id, int) and hit.id >= 0 for hit in hits)


# ---------------------------------------------------------------- CLI
def cli_ok(argv: list, capsys) -> tuple[str, str]:
    """Run the command line ``argv`` in process, assert it succeeds: its stdout and stderr."""
    code, out, err = cli_out(argv, capsys)
    assert code == 0, err
    return out, err


def test_cli_build_and_search_end_to_end(tmp_path, capsys):
    out = tmp_path / "corpus.index"
    stdout, stderr = cli_ok(["index", "build", "minilm", CORPUS_TXT, out, "--no-progress"], capsys)
    assert "Indexed 15 documents" in stdout
    assert "skipped 1 blank" in stderr and "repeat the text" in stderr
    # one action, one message: the save itself does not announce itself a second time
    assert len(stdout.splitlines()) == 1 and "saved" not in stderr.lower() and "Indexed" not in stderr

    stdout, _ = cli_ok(["index", "search", out, "where do cats sleep?", "bread recipe", "-k", "3", "--json"], capsys)
    payload = json.loads(stdout)
    assert [entry["query"] for entry in payload] == ["where do cats sleep?", "bread recipe"]
    assert [hit["rank"] for hit in payload[0]["hits"]] == [1, 2, 3]
    assert payload[0]["hits"][0]["id"] in (1, 2, 16)
    assert payload[1]["hits"][0]["id"] in (5, 6)

    stdout, _ = cli_ok(["index", "search", out, "stock prices dropped", "-k", "2", "--model", "minilm"], capsys)
    assert stdout.splitlines()[0] == "Query: stock prices dropped"
    assert "stock market fell" in stdout.splitlines()[1] or "Investors" in stdout.splitlines()[1]
    assert "Documents:  15" in cli_ok(["index", "info", out], capsys)[0]
    assert "already holds an index" in cli_error(["index", "build", "minilm", CORPUS_TXT, out], capsys)


def test_cli_dataset_file_with_id_column_and_hnsw(tmp_path, capsys):
    out = tmp_path / "jsonl.index"
    cli_ok(["index", "build", "minilm", CORPUS_JSONL, out, "--column", "body", "--id-column", "doc_id",
            "--index-type", "hnsw", "--no-progress"], capsys)
    stdout, _ = cli_ok(["index", "search", out, "train departure", "-k", "1", "--json"], capsys)
    assert json.loads(stdout)[0]["hits"][0]["id"] == "travel-1"


def test_cli_errors_are_one_line_messages(tmp_path, capsys):
    line = cli_error(["index", "search", tmp_path / "missing", "q"], capsys, alone=True)
    assert line == f"st-prompts index: error: index directory not found: {tmp_path / 'missing'}"
    for source, options, fragment in ((FIXTURES / "blank.txt", [], "empty"),
                                      (FIXTURES / "duplicate_ids.jsonl", ["--column", "body", "--id-column", "doc_id"],
                                       "unique"),
                                      (CORPUS_TXT, ["--index-type", "ivf", "--nlist", "100"], "nlist=100")):
        assert fragment in cli_error(["index", "build", "minilm", source, tmp_path / "o", *options], capsys)
        assert not (tmp_path / "o").exists()


def test_cli_refuses_a_model_with_foreign_code_unless_trusted(tmp_path, capsys, tiny_bert, saved_index):
    foreign = save_plain(tmp_path / "foreign-model", tiny_bert)
    edit_json(foreign / "modules.json", lambda modules: modules[1].update(type="not_installed_pkg.Pooling"))
    out = tmp_path / "foreign.index"
    line = cli_error(["index", "build", foreign, CORPUS_TXT, out, "--no-progress"], capsys)
    assert "not_installed_pkg.Pooling" in line and "--trust-remote-code" in line and not out.exists()
    assert "--trust-remote-code" in cli_error(["index", "search", saved_index, "cats", "--model", foreign], capsys)
    # With the flag, trust is passed on: importing the (missing) package fails, in one line
    line = cli_error(["index", "build", foreign, CORPUS_TXT, out, "--trust-remote-code"], capsys)
    assert "not_installed_pkg" in line and "cannot be imported" in line


def test_cli_index_info_loads_no_model_library(tmp_path):
    """`index info` imports no torch, transformers or sentence-transformers (in a fresh interpreter)."""
    import subprocess
    import sys

    vectors = np.random.default_rng(0).normal(size=(20, 8)).astype("float32")
    SemanticIndex.from_embeddings(vectors, [f"text {i}" for i in range(20)], index_type="ivf", nlist=2,
                                  target_recall=None).save(tmp_path / "idx")
    probe = ("import sys; from st_prompts.cli import main; code = main(['index', 'info', sys.argv[1]]); "
             "print('LOADED', sorted(m for m in ('torch', 'transformers', 'sentence_transformers') "
             "if m in sys.modules)); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "idx")], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 0, result.stderr
    assert "Documents:  20" in result.stdout and "Type:       ivf" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "LOADED []"
