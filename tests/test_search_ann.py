"""Approximate search (st_prompts.search): recall calibration, IVF-PQ with exact re-ranking, add / remove, memory-mapped
loading, drift warnings, chunked resumable encoding, and their CLI commands. Real text: 800 distinct sentences as the
corpus and 120 STS-B dev sentences, not in the corpus, as queries (``tests/fixtures/search/real_*.txt``)."""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_error, st_model
from test_search import brute_force, cli_ok, clustered_vectors, hits_as_tuples, normalized

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.search import SemanticIndex
from st_prompts.search.chunked import encode_in_chunks

FIXTURES = Path(__file__).parent / "fixtures" / "search"
REAL_CORPUS = FIXTURES / "real_corpus.txt"
REAL_QUERIES = FIXTURES / "real_queries.txt"


def read_lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


clustered = functools.partial(clustered_vectors, clusters=30)


def exact_top(docs: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Reference top-k rows by numpy brute force (independent of FAISS)."""
    return brute_force(docs, queries, k)[0]


def recall_at_10(index: SemanticIndex, queries: np.ndarray, truth: np.ndarray, ids: list) -> float:
    results = index.search_embeddings(queries, k=10)
    return float(np.mean([len({h.id for h in hits} & {ids[i] for i in row}) / 10 for hits, row in zip(results, truth)]))


@pytest.fixture(scope="module")
def real_text(minilm):
    """The real-text corpus and queries with their MiniLM embeddings (encoded once per module)."""
    corpus, queries = read_lines(REAL_CORPUS), read_lines(REAL_QUERIES)
    assert len(set(corpus)) == len(corpus) == 800 and not set(queries) & set(corpus)
    doc_emb = minilm.encode_document(corpus, batch_size=64, convert_to_numpy=True)
    query_emb = minilm.encode_query(queries, batch_size=64, convert_to_numpy=True)
    return corpus, queries, doc_emb, query_emb


# ---------------------------------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("index_type", ["ivf", "hnsw"])
def test_calibration_on_real_text_reaches_its_target_measured_independently(index_type, real_text, minilm):
    corpus, queries, doc_emb, query_emb = real_text
    sample, held_out = queries[:60], query_emb[60:]
    index = SemanticIndex.from_embeddings(doc_emb, corpus, index_type=index_type, model=minilm, target_recall=0.95,
                                          calibration_queries=sample)  # fmt: skip
    record = index.info["calibration"]
    parameter = "nprobe" if index_type == "ivf" else "ef_search"
    assert record["parameter"] == parameter and index.index_params[parameter] == record["value"]
    assert record["reached"] and record["measured_recall"] >= 0.95 and record["lower_bound"] >= 0.95
    assert record["queries"] == {"kind": "given_texts", "count": 60}
    # Independent check: numpy brute force on the calibration sample gives at least the target.
    ids = list(range(len(corpus)))
    assert recall_at_10(index, query_emb[:60], exact_top(doc_emb, query_emb[:60], 10), ids) >= 0.95
    # The value is the smallest that meets the criterion: one below was tried and fell short (or it is the minimum).
    tried = dict((value, recall) for value, recall in record["tried"])
    lowest = 1 if index_type == "ivf" else 10
    assert record["value"] == lowest or record["value"] - 1 in tried
    if index_type == "ivf":
        assert record["value"] < index.index_params["nlist"]  # not simply exhaustive
    # It generalises to the other real queries (not seen by the calibration) with some slack.
    assert recall_at_10(index, held_out, exact_top(doc_emb, held_out, 10), ids) >= 0.9


def test_default_build_calibrates_on_perturbed_documents_and_records_it(real_text, minilm, tmp_path, capsys):
    corpus, _, doc_emb, query_emb = real_text
    index = SemanticIndex.from_embeddings(doc_emb, corpus, index_type="ivf", model=minilm)
    record = index.info["calibration"]
    assert record["target_recall"] == 0.95 and record["reached"]
    kinds = {"perturbed_documents", "document_blends", "foreign_sentences"}
    assert record["queries"]["kind"] == "+".join(sorted(kinds, key=["perturbed_documents", "document_blends",
                                                                      "foreign_sentences"].index))
    assert set(record["recall_by_query_kind"]) == kinds
    assert min(record["recall_by_query_kind"].values()) >= 0.95
    # never below the former fixed default (nprobe 64, or every list of a small index)
    assert record["value"] >= min(64, index.index_params["nlist"])
    # The real queries, which the calibration never saw, meet the target too.
    ids = list(range(len(corpus)))
    assert recall_at_10(index, query_emb, exact_top(doc_emb, query_emb, 10), ids) >= 0.95
    # Saved in meta.json and shown by `index info`.
    index.save(tmp_path / "idx")
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())
    assert meta["calibration"]["value"] == index.index_params["nprobe"] == meta["index_params"]["nprobe"]
    assert (f"Calibration: nprobe={record['value']} -> recall@10 {record['measured_recall']:.4f} "
            "(target 0.95, reached)") in cli_ok(["index", "info", tmp_path / "idx"], capsys)[0]


def test_explicit_search_parameter_disables_the_default_calibration_and_conflicts_with_a_target():
    vectors = clustered(2000)
    texts = [f"t{i}" for i in range(2000)]
    index = SemanticIndex.from_embeddings(vectors, texts, index_type="ivf", nprobe=3)
    assert index.index_params["nprobe"] == 3 and "calibration" not in index.info
    for options, match in (({"index_type": "ivf", "nprobe": 3, "target_recall": 0.9},
                            "either target_recall or nprobe"),
                           ({"target_recall": 0.9}, "exact"),
                           ({"index_type": "hnsw", "target_recall": 1.5}, r"\(0, 1\]")):
        with pytest.raises(ConfigurationError, match=match):
            SemanticIndex.from_embeddings(vectors, texts, **options)
    flat = SemanticIndex.from_embeddings(vectors, texts)
    with pytest.raises(ConfigurationError, match="nothing to calibrate"):
        flat.calibrate(0.9)


def test_calibration_with_user_embeddings_for_out_of_distribution_queries():
    """Queries from other blobs than the corpus: the default sample underestimates them, a user sample does not."""
    vectors = clustered(4000)
    texts = [str(i) for i in range(4000)]
    foreign = clustered(400, seed=99)  # other cluster centres: another distribution
    sample, held_out = foreign[:200], foreign[200:]
    index = SemanticIndex.from_embeddings(vectors, texts, index_type="ivf", calibration_queries=sample,
                                          target_recall=0.95)  # fmt: skip
    assert index.info["calibration"]["queries"] == {"kind": "given_embeddings", "count": 200}
    ids = list(range(4000))
    assert recall_at_10(index, sample, exact_top(vectors, sample, 10), ids) >= 0.95
    assert recall_at_10(index, held_out, exact_top(vectors, held_out, 10), ids) >= 0.93


def test_unreachable_target_warns_and_records_it():
    vectors = clustered(3000)
    index = SemanticIndex.from_embeddings(vectors, [str(i) for i in range(3000)], index_type="ivfpq", pq_m=4,
                                          rerank=0, target_recall=None)  # fmt: skip
    with pytest.warns(UserWarning, match="did not reach"):
        record = index.calibrate(1.0, clustered(50, seed=7))
    assert not record["reached"] and record["value"] == index.index_params["nlist"]


# ------------------------------------------------------------------------------------------- IVF-PQ and re-ranking
def test_ivfpq_with_reranking_returns_the_exact_top1_for_documents_queried_with_their_own_text(real_text, minilm):
    corpus, queries, doc_emb, query_emb = real_text
    ids = [f"doc-{i}" for i in range(len(corpus))]
    index = SemanticIndex.from_embeddings(doc_emb, corpus, ids, index_type="ivfpq", model=minilm,
                                          calibration_queries=query_emb[:60])  # fmt: skip
    assert index.index_params["pq_m"] == 48 and index.index_params["rerank"] == 200
    assert index.vectors.dtype == np.float16 and index.vectors.shape == (800, 384)
    chosen = list(range(0, 800, 4))  # 200 documents
    results = index.search([corpus[i] for i in chosen], k=5)
    for row, hits in zip(chosen, results):
        assert hits[0].id == ids[row] and hits[0].text == corpus[row]
        assert hits[0].score == pytest.approx(1.0, abs=2e-3)  # float16 vectors: exact up to rounding
    # Re-ranked scores are exact cosines, in order, equal to brute force for the real queries' top hits.
    reference = normalized(query_emb[60:]) @ normalized(doc_emb).T
    for q, hits in enumerate(index.search_embeddings(query_emb[60:], k=10)):
        rows = [int(hit.id.split("-")[1]) for hit in hits]
        np.testing.assert_allclose([hit.score for hit in hits], reference[q, rows], atol=2e-3)
        assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)
    # The compressed index costs <= 64 bytes per vector in RAM (codes + ids).
    from st_prompts.search.faiss_index import code_bytes_per_vector

    assert code_bytes_per_vector(index.index, "ivfpq") == 48 + 8


def test_reranking_recovers_what_pq_alone_loses():
    vectors = clustered(3000, dim=64, spread=0.9)
    queries = clustered(100, dim=64, sample_seed=5, spread=1.0)
    texts = [str(i) for i in range(3000)]
    truth = exact_top(vectors, queries, 10)
    plain = SemanticIndex.from_embeddings(vectors, texts, index_type="ivfpq", pq_m=8, rerank=0, nprobe=64)
    reranked = SemanticIndex.from_embeddings(vectors, texts, index_type="ivfpq", pq_m=8, rerank=200, nprobe=64)
    assert plain.vectors is not None  # kept even without re-ranking: calibration and later re-ranking need them
    ids = list(range(3000))
    low, high = recall_at_10(plain, queries, truth, ids), recall_at_10(reranked, queries, truth, ids)
    assert high >= 0.97 and high > low + 0.1, (low, high)


def test_ivfpq_parameter_errors():
    vectors = clustered(300, dim=64)
    texts = [str(i) for i in range(300)]
    for rows, options, match in ((300, {"pq_m": 10}, "pq_m=10 must divide"),
                                 (100, {"pq_m": 8}, "at least 256 documents"),
                                 (300, {"pq_m": 8, "rerank": -1}, "rerank must be")):
        with pytest.raises(ConfigurationError, match=match):
            SemanticIndex.from_embeddings(vectors[:rows], texts[:rows], index_type="ivfpq", **options)


# --------------------------------------------------------------------------------------------------- add / remove
@pytest.mark.parametrize("index_type", ["flat", "ivf", "hnsw", "ivfpq"])
def test_add_and_remove_keep_ids_texts_and_vectors_together_through_save_and_load(index_type, tmp_path):
    base = clustered(1200)
    ids = [f"d{i}" for i in range(1200)]
    texts = [f"text of {i}" for i in ids]
    params = {"pq_m": 16} if index_type == "ivfpq" else {}
    index = SemanticIndex.from_embeddings(base, texts, ids, index_type=index_type, **params)
    extra = clustered(150, sample_seed=3)
    new_ids = [f"n{i}" for i in range(150)]
    assert index.add([f"text of {i}" for i in new_ids], new_ids, embeddings=extra) == new_ids
    removed = ids[::5] + new_ids[::3]
    assert index.remove(removed) == len(removed)

    expected = {i: v for i, v in zip(ids + new_ids, np.concatenate([base, extra])) if i not in set(removed)}
    assert len(index) == len(expected) == index.index.ntotal
    assert index.ids == [i for i in ids + new_ids if i in expected]  # order kept
    assert index.texts == [f"text of {i}" for i in index.ids]
    stored = np.asarray(index.exact_vectors(), dtype=np.float32)
    np.testing.assert_allclose(stored, normalized(np.array([expected[i] for i in index.ids])), atol=2e-3)
    # Every remaining document, queried with its own vector, comes back first under its own id and text.
    own = np.array([expected[i] for i in index.ids])
    hits = index.search_embeddings(own, k=1)
    found = np.mean([h[0].id == i and h[0].text == f"text of {i}" for h, i in zip(hits, index.ids)])
    assert found >= (1.0 if index_type != "hnsw" else 0.99)
    # Removed documents are never returned.
    everything = index.search_embeddings(clustered(20, sample_seed=11), k=50)
    assert not {h.id for row in everything for h in row} & set(removed)

    index.save(tmp_path / "idx")
    loaded = SemanticIndex.load(tmp_path / "idx")
    assert loaded.ids == index.ids and loaded.texts == index.texts
    queries = clustered(30, sample_seed=21)
    assert [[(h.id, h.text) for h in row] for row in loaded.search_embeddings(queries, k=10)] == [
        [(h.id, h.text) for h in row] for row in index.search_embeddings(queries, k=10)]
    # A loaded index can be updated again, and default integer ids continue after the largest one.
    more = loaded.add(["one more"], ["x1"], embeddings=clustered(1, sample_seed=4))
    assert more == ["x1"] and loaded.texts[-1] == "one more"


def test_update_errors_and_integer_ids():
    index = SemanticIndex.from_embeddings(clustered(500), [f"t{i}" for i in range(500)], index_type="ivf")
    assert index.add(["a", "b"], embeddings=clustered(2, sample_seed=1)) == [500, 501]
    for call, match in ((lambda: index.add(["c"], [3], embeddings=clustered(1)), "already in the index"),
                        (lambda: index.remove([10_000]), "not in the index"),
                        (lambda: index.remove(index.ids), "empty"),
                        (lambda: index.add(["  "], embeddings=clustered(1)), "non-blank"),
                        (lambda: index.add(["d"], embeddings=clustered(2)), "2 embeddings for 1")):
        with pytest.raises(DataFormatError, match=match):
            call()
    named = SemanticIndex.from_embeddings(clustered(50), ["x"] * 50, [f"s{i}" for i in range(50)])
    with pytest.raises(ConfigurationError, match="non-integer ids"):
        named.add(["y"], embeddings=clustered(1))


def test_adding_documents_far_from_the_trained_centroids_warns():
    vectors = clustered(3000)
    index = SemanticIndex.from_embeddings(vectors, [str(i) for i in range(3000)], index_type="ivf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in-distribution: no warning
        index.add([f"near {i}" for i in range(100)], embeddings=clustered(100, sample_seed=8))
    assert index.info["drift"]["ratio_to_training"] < 1.5
    with pytest.warns(UserWarning, match="far from the IVF centroids"):
        index.add([f"far {i}" for i in range(100)], embeddings=clustered(100, seed=42))
    assert index.info["drift"]["ratio_to_training"] > 1.5


# ----------------------------------------------------------------------------------------------------------- mmap
@pytest.mark.parametrize("index_type", ["flat", "ivf", "hnsw", "ivfpq"])
def test_memory_mapped_loading_gives_the_same_results_and_is_read_only(index_type, tmp_path):
    vectors = clustered(1500)
    ids = [f"d{i}" for i in range(1500)]
    params = {"pq_m": 16} if index_type == "ivfpq" else {}
    index = SemanticIndex.from_embeddings(vectors, [f"text {i}" for i in ids], ids, index_type=index_type, **params)
    index.save(tmp_path / "idx")
    mapped = SemanticIndex.load(tmp_path / "idx", mmap=True)
    assert not isinstance(mapped.ids, list) and len(mapped) == 1500
    assert mapped.ids[7] == "d7" and mapped.texts[7] == "text d7"
    if index_type == "ivfpq":
        assert isinstance(mapped.vectors, np.memmap)
    queries = clustered(40, sample_seed=2)
    loaded = SemanticIndex.load(tmp_path / "idx")  # and a plain load keeps the type, the parameters, no model
    assert (loaded.index_type, loaded.index_params, loaded.model_identity) == (index_type, index.index_params, None)
    for other in (mapped, loaded):
        assert hits_as_tuples(other.search_embeddings(queries, k=10)) == hits_as_tuples(
            index.search_embeddings(queries, k=10))
    for call, match in ((lambda: loaded.search("a text query needs a model"), "no model"),
                        (lambda: mapped.add(["x"], ["new"], embeddings=clustered(1)), "read-only"),
                        (lambda: mapped.remove(["d1"]), "read-only")):
        with pytest.raises(ConfigurationError, match=match):
            call()


def test_version_1_index_without_offsets_still_loads(tmp_path):
    index = SemanticIndex.from_embeddings(clustered(100), [f"t{i}" for i in range(100)])
    index.save(tmp_path / "idx")
    (tmp_path / "idx" / "docs.offsets.npy").unlink()
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())
    meta["format_version"] = 1
    del meta["files"]  # version 1 recorded no sizes or checksums
    (tmp_path / "idx" / "meta.json").write_text(json.dumps(meta))
    for mmap in (False, True):
        assert SemanticIndex.load(tmp_path / "idx", mmap=mmap).texts[5] == "t5"


# ------------------------------------------------------------------------------------------ chunked encoding
@pytest.fixture(scope="module")
def tiny_model(tiny_bert):
    return st_model(tiny_bert)


class Interrupt(Exception):
    pass


def test_interrupted_encoding_resumes_from_the_cached_chunks(tiny_model, tmp_path, monkeypatch):
    texts = [f"the man plays guitar number {i} in the park" if i % 2 else f"a dog sits on the mat {i}"
             for i in range(230)]  # fmt: skip
    reference = encode_in_chunks(tiny_model, texts, chunk_size=50, progress=False).embeddings
    calls = []
    original = tiny_model.encode_document
    corpus = set(texts) | {"a completely new sentence"}

    def counting(inputs, **kwargs):
        if inputs[0] in corpus:  # a corpus chunk (not the probe sentences of the model fingerprint)
            if crash and len(calls) == 3:
                raise Interrupt("simulated crash while encoding the 4th chunk")
            calls.append(len(inputs))
        return original(inputs, **kwargs)

    crash = True
    monkeypatch.setattr(tiny_model, "encode_document", counting)
    with pytest.raises(Interrupt):
        encode_in_chunks(tiny_model, texts, chunk_size=50, cache_dir=tmp_path / "cache", progress=False)
    assert len(list((tmp_path / "cache").glob("chunk-*.npy"))) == 3

    calls.clear()
    crash = False
    result = encode_in_chunks(tiny_model, texts, chunk_size=50, cache_dir=tmp_path / "cache", progress=False)
    assert (result.chunks_total, result.chunks_encoded, result.chunks_reused) == (5, 2, 3)
    assert calls == [50, 30]  # only the 4th and 5th chunks were encoded
    np.testing.assert_allclose(result.embeddings, reference, atol=1e-5)

    # A changed text re-encodes only its chunk; a finished cache encodes nothing.
    calls.clear()
    changed = texts[:120] + ["a completely new sentence"] + texts[121:]
    result = encode_in_chunks(tiny_model, changed, chunk_size=50, cache_dir=tmp_path / "cache", progress=False)
    assert (result.chunks_encoded, result.chunks_reused) == (1, 4) and calls == [50]
    # Another chunk size or another model must not reuse the chunks.
    with pytest.raises(ConfigurationError, match="chunk_size"):
        encode_in_chunks(tiny_model, texts, chunk_size=40, cache_dir=tmp_path / "cache", progress=False)


def test_build_with_an_encoding_cache_and_the_multi_process_pool(tiny_model, tmp_path):
    texts = [f"the {w} sits on the mat {i}" for i, w in enumerate(["cat", "dog", "man", "woman"] * 30)]
    single = SemanticIndex.build(tiny_model, texts, show_progress_bar=False)
    pooled = SemanticIndex.build(tiny_model, texts, show_progress_bar=False, processes=2, chunk_size=40,
                                 encode_cache_dir=tmp_path / "cache")  # fmt: skip
    assert len(list((tmp_path / "cache").glob("chunk-*.npy"))) == 3
    np.testing.assert_allclose(pooled.exact_vectors(), single.exact_vectors(), atol=1e-5)


# ------------------------------------------------------------------------------------------------------------ CLI
def test_cli_add_remove_calibrate_and_info(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(read_lines(REAL_CORPUS)[:150]) + "\n", encoding="utf-8")
    queries = tmp_path / "queries.txt"
    queries.write_text("\n".join(read_lines(REAL_QUERIES)[:40]) + "\n", encoding="utf-8")
    out = tmp_path / "idx"
    stdout, _ = cli_ok(["index", "build", "minilm", corpus, out, "--index-type", "hnsw", "--calibration-queries",
                        queries, "--no-progress"], capsys)
    assert "Calibrated: ef_search=" in stdout and "given texts queries" in stdout

    more = tmp_path / "more.txt"
    more.write_text("A violinist tunes her instrument backstage.\n\nThe ferry leaves the harbour at dawn.\n")
    stdout, _ = cli_ok(["index", "add", out, more, "--no-progress"], capsys)
    assert "Added 2 documents" in stdout and "ids 151..152" in stdout
    stdout, _ = cli_ok(["index", "search", out, "boat departs in the early morning", "-k", "1", "--json"], capsys)
    hit = json.loads(stdout)[0]["hits"][0]
    assert (hit["id"], hit["text"]) == (152, "The ferry leaves the harbour at dawn.")
    assert "Removed 2 documents" in cli_ok(["index", "remove", out, "152", "1"], capsys)[0]
    loaded = SemanticIndex.load(out)
    assert 152 not in loaded.ids and 1 not in loaded.ids and 151 in loaded.ids and len(loaded) == 150

    assert "Calibration: ef_search=" in cli_ok(["index", "info", out], capsys)[0]
    stdout, _ = cli_ok(["index", "calibrate", out, "--target-recall", "0.99", "--queries", queries], capsys)
    assert "target 0.99" in stdout
    stdout, _ = cli_ok(["index", "search", out, "a ferry", "-k", "2", "--mmap", "--json"], capsys)
    assert len(json.loads(stdout)[0]["hits"]) == 2

    assert "not in the index" in cli_error(["index", "remove", out, "99999"], capsys)
    line = cli_error(["index", "build", "minilm", corpus, tmp_path / "x", "--index-type", "ivfpq", "--pq-m", "7",
                      "--no-progress"], capsys)
    assert "pq_m=7 must divide" in line
