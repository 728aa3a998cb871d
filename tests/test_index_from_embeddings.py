"""``SemanticIndex.from_embedding_files`` (``index build --from-embeddings``): an index built from Parquet parts a batch
at a time is the one ``from_embeddings`` builds in memory; hostile files are refused in one line; no torch imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_error
from test_search import cli_ok
from test_search_ann import exact_top, recall_at_10

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError
from st_prompts.search import SemanticIndex
from st_prompts.search.embedding_files import identity_record, part_name, write_part
from st_prompts.search.identity import ModelIdentity
from st_prompts.search.store import load_index_dir

ROOT = Path(__file__).resolve().parents[1]
N, DIM, PART = 2000, 32, 700


def _vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Clustered, unnormalised vectors (as a model's output: norms vary)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((40, dim))
    scale = rng.uniform(0.5, 3.0, size=(n, 1))
    return ((centres[rng.integers(0, 40, n)] + 0.6 * rng.standard_normal((n, dim))) * scale).astype(np.float32)


def _write_parts(folder: Path, ids, texts, vectors, record=None, part_rows: int = PART) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for number, start in enumerate(range(0, len(ids), part_rows)):
        end = start + part_rows
        write_part(folder / part_name(number), ids[start:end], None if texts is None else texts[start:end],
                   vectors[start:end], {"part": number, "first_row": start, **(record or {})})
    return folder


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """3 parts of 2,000 × 32 vectors (no model record), their ids, texts and vectors."""
    root = tmp_path_factory.mktemp("from_embeddings")
    vectors = _vectors(N, DIM)
    ids = list(range(100, 100 + N))
    texts = [f"document number {i}" for i in range(N)]
    return _write_parts(root / "emb", ids, texts, vectors), ids, texts, vectors


def _queries(vectors: np.ndarray, count: int = 60) -> np.ndarray:
    rng = np.random.default_rng(5)
    return vectors[rng.choice(len(vectors), count, replace=False)] + rng.standard_normal((count, DIM)).astype(
        np.float32)


def test_flat_index_from_parts_is_the_in_memory_index(parts, tmp_path):
    folder, ids, texts, vectors = parts
    built = SemanticIndex.from_embedding_files(folder, tmp_path / "flat.index")
    reference = SemanticIndex.from_embeddings(vectors, texts, ids)
    queries = _queries(vectors)
    got, expected = built.search_embeddings(queries, 10), reference.search_embeddings(queries, 10)
    assert [[h.id for h in row] for row in got] == [[h.id for h in row] for row in expected]
    assert np.allclose([[h.score for h in row] for row in got], [[h.score for h in row] for row in expected], atol=1e-6)
    truth = exact_top(vectors, queries, 10)
    assert [[h.id for h in row] for row in got] == [[ids[t] for t in row] for row in truth]
    assert got[0][0].text == texts[ids.index(got[0][0].id)]
    stored = load_index_dir(tmp_path / "flat.index", verify=True)  # every file's size and SHA-256
    assert stored.ids == ids and stored.texts == texts and stored.model_identity is None
    meta = json.loads((tmp_path / "flat.index" / "meta.json").read_text())
    assert meta["num_docs"] == N and meta["embedding_files"] == {"parts": 3, "rows": N} and meta["duplicate_texts"] == 0


def test_ivf_and_its_calibration_match_the_in_memory_build(parts, tmp_path):
    folder, ids, texts, vectors = parts
    built = SemanticIndex.from_embedding_files(str(folder / "part-*.parquet"), tmp_path / "ivf.index", "ivf")
    reference = SemanticIndex.from_embeddings(vectors, texts, ids, "ivf")  # vectors-only calibration, same seed
    assert built.index_params == reference.index_params
    assert built.info["calibration"]["value"] == reference.info["calibration"]["value"]
    queries = _queries(vectors)
    truth = exact_top(vectors, queries, 10)
    for nprobe in (1, 3):
        built.set_search_params(nprobe=nprobe)
        reference.set_search_params(nprobe=nprobe)
        assert abs(recall_at_10(built, queries, truth, ids) - recall_at_10(reference, queries, truth, ids)) <= 0.01
    assert recall_at_10(built, queries, truth, ids) < 1.0  # nprobe 3 of 51 lists is approximate: the check can fail
    mapped = SemanticIndex.load(tmp_path / "ivf.index", mmap=True)
    assert [h.id for h in mapped.search_embeddings(queries[:1], 5)[0]] == [
        h.id for h in SemanticIndex.load(tmp_path / "ivf.index").search_embeddings(queries[:1], 5)[0]]


def test_ivfpq_streams_the_same_vectors_file(tmp_path):
    vectors = _vectors(600, DIM, seed=1)
    ids = [f"d{i}" for i in range(600)]
    texts = [f"text {i}" for i in range(600)]
    folder = _write_parts(tmp_path / "emb", ids, texts, vectors, part_rows=250)
    built = SemanticIndex.from_embedding_files(folder, tmp_path / "pq.index", "ivfpq", pq_m=4, nprobe=4)
    reference = SemanticIndex.from_embeddings(vectors, texts, ids, "ivfpq", pq_m=4, nprobe=4)
    reference.save(tmp_path / "reference.index")
    assert np.array_equal(np.load(tmp_path / "pq.index" / "vectors.npy"),
                          np.load(tmp_path / "reference.index" / "vectors.npy"))
    queries = _queries(vectors, 30)
    truth = exact_top(vectors, queries, 10)
    assert abs(recall_at_10(built, queries, truth, ids) - recall_at_10(reference, queries, truth, ids)) <= 0.01
    assert built.index_params == reference.index_params and built.index_params["nprobe"] == 4


def test_cli_text_search_with_the_parts_model(minilm, tmp_path, capsys):
    texts = [line.strip() for line in (ROOT / "tests/fixtures/search/real_corpus.txt").read_text().splitlines()
             if line.strip()][:120]
    vectors = minilm.encode(texts, batch_size=64)
    record = {"model": identity_record(ModelIdentity.of(minilm))}
    folder = _write_parts(tmp_path / "emb", list(range(len(texts))), texts, vectors, record, part_rows=40)
    out = tmp_path / "text.index"
    printed, _ = cli_ok(["index", "build", "--from-embeddings", folder / "part-0000[0-1].parquet",
                         folder / "part-00002.parquet", out, "--no-progress"], capsys)
    assert "Indexed 120 documents from 3 embedding file(s) (model minilm" in printed
    printed, _ = cli_ok(["index", "search", out, "how do cats sleep?", "a bread recipe", "-k", "3", "--json"], capsys)
    found = [[hit["id"] for hit in query["hits"]] for query in json.loads(printed)]
    reference = SemanticIndex.from_embeddings(vectors, texts, model=minilm)
    assert found == [[h.id for h in row] for row in reference.search(["how do cats sleep?", "a bread recipe"], k=3)]


def test_build_imports_no_torch(parts, tmp_path):
    folder = parts[0]
    script = ("import sys; from st_prompts.cli import main; "
              f"code = main(['index', 'build', '--from-embeddings', {str(folder)!r}, {str(tmp_path / 'x.index')!r}, "
              "'--index-type', 'hnsw', '--no-progress']); "
              "print(code, sorted(m for m in ('torch', 'sentence_transformers', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[-2] == "0 []", result.stderr[-2000:]


def test_hostile_parts_are_one_line_errors(parts, tmp_path, capsys):
    folder, ids, texts, vectors = parts
    out = tmp_path / "out.index"
    twice = _write_parts(tmp_path / "twice", ids[:300], texts[:300], vectors[:300], part_rows=300)
    write_part(twice / part_name(1), ids[250:260], texts[250:260], vectors[250:260], {"part": 1})
    strings = _write_parts(tmp_path / "strings", ["a", "b", "c"], ["x", "y", "z"], vectors[:3])
    write_part(strings / part_name(1), ["c"], ["w"], vectors[:1], {"part": 1})
    wide = _write_parts(tmp_path / "wide", [1, 2], ["a", "b"], np.ones((2, DIM + 1), np.float32))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    data = (folder / "part-00001.parquet").read_bytes()
    (damaged / "part-00000.parquet").write_bytes(data[:100] + bytes(2000) + data[2100:])  # pages zeroed
    for source, match in ((twice, "the id 350 appears twice"), (strings, "'c' appears twice"),
                          ([folder / "part-00000.parquet", wide / "part-00000.parquet"], "dimensional"),
                          (_write_parts(tmp_path / "bare", ids[:10], None, vectors[:10]), "hold no texts"),
                          (_write_parts(tmp_path / "blank", [1, 2], ["a", "  "], vectors[:2]),
                           "id 2: the text is blank"),
                          (damaged, "part-00000.parquet")):
        with pytest.raises(DataFormatError, match=match):
            SemanticIndex.from_embedding_files(source, out)
    with pytest.raises(DataNotFoundError, match="no embedding file matches"):
        SemanticIndex.from_embedding_files(str(tmp_path / "nowhere-*.parquet"), out)
    assert not out.exists()  # nothing half-written
    for argv, fragment in (([twice, out], "appears twice"), ([folder, out, "--column", "body"], "--column"),
                           ([folder], "last argument"), ([folder, out, "--index-type", "ivfpq", "--pq-m", "5"],
                                                         "pq_m=5 must divide")):
        assert fragment in cli_error(["index", "build", "--from-embeddings", *argv], capsys)
    assert "only OUT" in cli_error(["index", "build", "minilm", out, "--from-embeddings", folder], capsys)


def test_model_and_bare_parts_are_not_mixed(minilm, parts, tmp_path):
    folder, ids, texts, vectors = parts
    record = {"model": identity_record(ModelIdentity.of(minilm))}
    named = _write_parts(tmp_path / "named", [1], ["a"], np.ones((1, 384), np.float32), record)
    unnamed = _write_parts(tmp_path / "unnamed", [2], ["b"], np.ones((1, 384), np.float32))
    with pytest.raises(DataFormatError, match="records no model"):
        SemanticIndex.from_embedding_files([named, unnamed], tmp_path / "out.index")


def test_no_foreign_file_is_replaced(parts, tmp_path):
    folder = parts[0]
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ConfigurationError):
            SemanticIndex.from_embedding_files(folder, target, overwrite=overwrite)
    assert (target / "notes.txt").read_text() == "mine" and sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    index_dir = tmp_path / "index"
    SemanticIndex.from_embedding_files(folder / "part-00000.parquet", index_dir)
    with pytest.raises(ConfigurationError, match="overwrite"):
        SemanticIndex.from_embedding_files(folder, index_dir)
    assert len(SemanticIndex.from_embedding_files(folder, index_dir, overwrite=True)) == N
