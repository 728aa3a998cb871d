"""Tests of alignment / uniformity (Wang & Isola) against direct numpy / scipy computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import LookupModel, write_stsb
from scipy.spatial.distance import pdist

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.evaluation.alignment import AlignmentUniformityEvaluator, alignment_loss, uniformity_loss


def unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("chunk_size", [1, 2, 7, 22, 23, 1024])
def test_uniformity_matches_pdist_for_every_chunking(chunk_size):
    x = np.random.default_rng(0).normal(size=(23, 8))
    expected = np.log(np.mean(np.exp(-2 * pdist(unit(x), "sqeuclidean"))))
    assert uniformity_loss(x, chunk_size=chunk_size) == pytest.approx(expected, rel=1e-10, abs=1e-12)
    # SimCSE's formula
    t = torch.nn.functional.normalize(torch.tensor(x), dim=1)
    simcse = torch.pdist(t, p=2).pow(2).mul(-2).exp().mean().log().item()
    assert uniformity_loss(x, chunk_size=chunk_size) == pytest.approx(simcse, rel=1e-9)


def test_uniformity_extremes():
    # all embeddings equal: every distance 0 -> log 1 = 0 (the worst value)
    assert uniformity_loss(np.ones((5, 3))) == pytest.approx(0.0, abs=1e-12)
    # two antipodal points: distance^2 = 4 -> -8
    assert uniformity_loss(np.array([[1.0, 0.0], [-1.0, 0.0]])) == pytest.approx(-8.0)
    # temperature
    assert uniformity_loss(np.array([[1.0, 0.0], [0.0, 1.0]]), t=3.0) == pytest.approx(-6.0)


def test_alignment_matches_numpy():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(11, 5)), rng.normal(size=(11, 5))
    expected = np.mean(np.sum((unit(x) - unit(y)) ** 2, axis=1))
    assert alignment_loss(x, y) == pytest.approx(expected, rel=1e-10)
    assert alignment_loss(x, y, alpha=1) == pytest.approx(np.mean(np.linalg.norm(unit(x) - unit(y), axis=1)))
    assert alignment_loss(x, x) == pytest.approx(0.0, abs=1e-12)


def make_split():
    rng = np.random.default_rng(2)
    names = [f"s{i}" for i in range(12)]
    table = {n: rng.normal(size=6) for n in names}
    pairs = [("s0", "s1", 5.0), ("s2", "s3", 4.0), ("s4", "s5", 3.99),  # the threshold 4 is inclusive
             ("s0", "s6", 4.6),  # s0 again: counted once for uniformity
             ("s7", "s7", 4.2),  # identical positive: distance 0, kept
             ("s8", "s9", 0.5), ("s10", "s11", 2.0), ("s9", "s2", 1.0)]
    s1, s2, sc = (list(c) for c in zip(*pairs))
    return table, s1, s2, sc


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_evaluator_matches_direct_computation(chunk_size):
    table, s1, s2, sc = make_split()
    ev = AlignmentUniformityEvaluator(s1, s2, sc, name="toy", chunk_size=chunk_size)
    results = ev(LookupModel(table))

    emb = {k: unit(v.astype(np.float32)) for k, v in table.items()}
    positives = [(a, b) for a, b, s in zip(s1, s2, sc) if s >= 4]
    assert len(positives) == 4 and ev.num_positive_pairs == 4
    expected_align = np.mean([np.sum((emb[a] - emb[b]) ** 2) for a, b in positives])
    distinct = sorted(set(s1) | set(s2))
    assert len(distinct) == 12 and ev.num_sentences == 12
    d2 = pdist(np.stack([emb[s] for s in distinct]), "sqeuclidean")
    expected_unif = np.log(np.mean(np.exp(-2 * d2)))

    assert set(results) == {"toy_alignment", "toy_uniformity"}
    assert results["toy_alignment"] == pytest.approx(expected_align, rel=1e-6)
    assert results["toy_uniformity"] == pytest.approx(expected_unif, rel=1e-6)


def test_lower_is_better_and_primary_metric():
    table, s1, s2, sc = make_split()
    ev = AlignmentUniformityEvaluator(s1, s2, sc, name="toy")
    assert ev.greater_is_better is False
    ev(LookupModel(table))
    assert ev.primary_metric == "toy_alignment"
    ev2 = AlignmentUniformityEvaluator(s1, s2, sc, main_metric="uniformity")
    res = ev2(LookupModel(table))
    assert ev2.primary_metric == "uniformity" and "uniformity" in res and ev2.greater_is_better is False
    with pytest.raises(ConfigurationError):
        AlignmentUniformityEvaluator(s1, s2, sc, main_metric="spearman")


def test_loss_and_evaluator_input_errors():
    with pytest.raises(DataFormatError):
        uniformity_loss(np.ones((1, 3)))
    with pytest.raises(DataFormatError):
        alignment_loss(np.ones((2, 3)), np.ones((3, 3)))
    with pytest.raises(ConfigurationError):
        uniformity_loss(np.ones((3, 3)), chunk_size=0)
    with pytest.raises(DataFormatError, match="no positive pair"):
        AlignmentUniformityEvaluator(["a", "b"], ["c", "d"], [1.0, 3.9])
    with pytest.raises(DataFormatError, match="at least 2 distinct"):
        AlignmentUniformityEvaluator(["a"], ["a"], [5.0])
    with pytest.raises(DataFormatError):
        AlignmentUniformityEvaluator(["a"], ["b", "c"], [5.0])


def test_from_senteval(tmp_path):
    write_stsb(tmp_path, [(5.0, "a b", "c d"), (4.0, "e", "f"), (1.0, "a b", "g")])
    ev = AlignmentUniformityEvaluator.from_senteval(tmp_path, "STSBenchmark", "test")
    assert ev.name == "STSBenchmark-test"
    assert (ev.num_positive_pairs, ev.num_sentences) == (2, 5)
