"""Tests of the STS retrieval evaluator (recall@K / MRR@10, D2CSE protocol)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import LookupModel, write_stsb

from st_prompts.errors import DataFormatError
from st_prompts.evaluation.retrieval import STSRetrievalEvaluator, build_retrieval_queries


def clustered_table() -> dict[str, np.ndarray]:
    """q1, q2, q3 are orthogonal unit vectors; every other sentence has cosine ``alpha`` with its own query only:
    the answers rank 1st for q1, 3rd for q2 (after d1, d2) and 6th for q3 (after d3..d7), the query excluded."""
    home = {"a1": ("q1", 0.9), "d1": ("q2", 0.95), "d2": ("q2", 0.9), "a2": ("q2", 0.8),  # sentence -> (query, cosine)
            "d3": ("q3", 0.99), "d4": ("q3", 0.98), "d5": ("q3", 0.97), "d6": ("q3", 0.96), "d7": ("q3", 0.95),
            "a3": ("q3", 0.5), "x1": (None, 0.0), "x2": (None, 0.0)}
    queries = ["q1", "q2", "q3"]
    dim = len(queries) + len(home)
    table = {q: np.eye(dim)[i] for i, q in enumerate(queries)}
    for j, (sentence, (query, alpha)) in enumerate(home.items()):
        v = np.zeros(dim)
        if query is not None:
            v[queries.index(query)] = alpha
        v[len(queries) + j] = math.sqrt(1 - alpha**2)  # own direction: cosine 0 with every other cluster
        table[sentence] = v
    return table


PAIRS = [("q1", "a1", 5.0), ("q2", "a2", 5.0), ("q3", "a3", 5.0), ("x1", "x1", 5.0),  # x1: identical, dropped
         ("d1", "d2", 1.0), ("d3", "d4", 2.0), ("d5", "d6", 3.0), ("d7", "x2", 0.0),
         ("q1", "d3", 4.8)]  # a query sentence again, below 5: not a query


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


@pytest.mark.parametrize("options, ranks", [
    ({}, [1, 3, 6]),
    ({"exclude_query": False}, [2, 4, 7]),  # the query's own text kept in the pool ranks first (cosine 1)
    ({"bidirectional": True}, [1, 3, 6, 1, 1, 1]),  # reverse queries (a_i -> q_i) all rank 1
])
def test_known_ranks_give_exact_recall_and_mrr(options, ranks):
    ev = STSRetrievalEvaluator(*split(PAIRS), name="toy", **options)
    assert (ev.num_queries, ev.pool_size, ev.num_identical_dropped) == (len(ranks), 15, 1)
    results = ev(LookupModel(clustered_table()))
    ranks = np.array(ranks)
    expected = {f"toy_recall@{k}": np.mean(ranks <= k) for k in (1, 3, 5, 10)}
    assert results == pytest.approx({**expected, "toy_mrr@10": np.mean(1 / ranks)})
    assert ev.primary_metric == "toy_recall@1" and ev.greater_is_better


def test_pool_smaller_than_cutoff():
    # 4 candidates (< 10): the masked query still ranks below every real candidate.
    table = {"q": np.array([1.0, 0, 0, 0]), "b": np.array([0.9, math.sqrt(0.19), 0, 0]),
             "a": np.array([0.6, 0, 0.8, 0]), "c": np.array([0.1, 0, 0, math.sqrt(0.99)])}
    results = STSRetrievalEvaluator(["q", "b"], ["a", "c"], [5.0, 1.0])(LookupModel(table))
    assert results["recall@1"] == 0.0
    assert results["recall@3"] == 1.0
    assert results["mrr@10"] == pytest.approx(0.5)


def test_no_query_or_a_length_mismatch_raises():
    with pytest.raises(DataFormatError, match="no retrieval query"):
        STSRetrievalEvaluator(["a", "b"], ["c", "b"], [4.5, 5.0], name="tiny")
    with pytest.raises(DataFormatError):
        STSRetrievalEvaluator(["a", "b"], ["c"], [5.0, 5.0])


def test_real_model_matches_independent_ranking(minilm):
    """With the packaged MiniLM, the evaluator agrees with ranks computed directly from the embeddings."""
    pairs = [("A man is playing a guitar.", "A man plays the guitar.", 5.0),
             ("A woman is slicing an onion.", "A woman cuts an onion.", 5.0),
             ("The cat sits on the mat.", "A cat is sitting on a mat.", 5.0),
             ("Kids are playing football.", "Children play soccer.", 5.0),
             ("A man is playing the piano.", "A woman is eating pasta.", 0.0),
             ("A man is playing a flute.", "A dog runs in the park.", 0.2),
             ("A woman is peeling a potato.", "The stock market fell today.", 0.0),
             ("A cat sleeps on the sofa.", "Two dogs are running.", 0.4)]
    s1, s2, scores = split(pairs)
    results = STSRetrievalEvaluator(s1, s2, scores)(minilm)
    pool = list(dict.fromkeys(s for pair in zip(s1, s2) for s in pair))
    emb = minilm.encode(pool, normalize_embeddings=True)
    ranks = []
    for q, a in zip(s1[:4], s2[:4]):
        sims = {text: float(emb[pool.index(q)] @ emb[i]) for i, text in enumerate(pool) if text != q}
        ranks.append(1 + sum(v > sims[a] for v in sims.values()))
    ranks = np.array(ranks)
    for k in (1, 3, 5, 10):
        assert results[f"recall@{k}"] == pytest.approx(np.mean(ranks <= k))
    assert results["mrr@10"] == pytest.approx(np.mean(np.where(ranks <= 10, 1 / ranks, 0)))


def test_from_senteval(tmp_path):
    write_stsb(tmp_path, [(5.0, "q1", "a1"), (5.0, "q2", "a2"), (5.0, "x1", "x1"), (1.0, "d1", "d2"),
                          (3.4, "q1", "d3")])
    ev = STSRetrievalEvaluator.from_senteval(tmp_path, "STSBenchmark", "dev")
    assert ev.name == "STSBenchmark-dev"
    assert (ev.num_queries, ev.pool_size, ev.num_identical_dropped) == (2, 8, 1)
