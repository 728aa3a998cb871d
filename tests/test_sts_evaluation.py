"""STSSuiteEvaluator, stsb_dev_evaluator and format_results_table."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
from sentence_transformers.sentence_transformer.modules import StaticEmbedding
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from st_prompts.data.senteval import STS_TASKS, STSPairs, load_sts
from st_prompts.errors import ConfigurationError, DataNotFoundError
from st_prompts.evaluation import sts as sts_module
from st_prompts.evaluation.sts import STSSuiteEvaluator, format_results_table, sts_table_rows, stsb_dev_evaluator

FIXTURE = Path(__file__).parent / "fixtures" / "senteval"

# Word vectors of the hand-checked model: a sentence of one word is embedded as that word's vector.
WORD_VECTORS = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 1.0], "d": [-1.0, 0.0], "e": [1.0, 2.0]}


def static_model(word_vectors: dict[str, list[float]]) -> SentenceTransformer:
    """A SentenceTransformer that embeds a sentence as the mean of its word vectors (no hub, no randomness)."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(word_vectors)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    dim = len(next(iter(word_vectors.values())))
    weights = np.array([[0.0] * dim, *word_vectors.values()], dtype=np.float32)
    return SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_weights=weights)], device="cpu")


def _embed(model: SentenceTransformer, pairs: list[STSPairs]) -> dict[str, np.ndarray]:
    sentences = list(dict.fromkeys(s for p in pairs for s in p.sentences1 + p.sentences2))
    return dict(zip(sentences, model.encode(sentences, convert_to_numpy=True)))


def _cosine_spearman(model: SentenceTransformer, pairs: STSPairs, embeddings: dict | None = None) -> float:
    """Spearman of cosine similarities, computed directly with numpy + scipy."""
    embeddings = embeddings or _embed(model, [pairs])
    e1 = np.stack([embeddings[s] for s in pairs.sentences1]).astype(np.float64)
    e2 = np.stack([embeddings[s] for s in pairs.sentences2]).astype(np.float64)
    cosine = (e1 * e2).sum(1) / (np.linalg.norm(e1, axis=1) * np.linalg.norm(e2, axis=1))
    return spearmanr(pairs.scores, cosine).statistic


def test_hand_checked_example(tmp_path):
    # Pairs (a,a) (a,c) (a,e) (a,b) (a,d): cosines 1, 1/sqrt(2), 1/sqrt(5), 0, -1 (ranks 5 4 3 2 1).
    second = ["a", "c", "e", "b", "d"]
    # STS-B gold 5 4 2 3 0 -> ranks 5 4 2 3 1: d^2 = 0+0+1+1+0 = 2, rho = 1 - 6*2 / (5*24) = 0.9
    stsb = "".join(f"g\tf\t2012\t{i}\t{g}\ta\t{s}\n" for i, (g, s) in enumerate(zip([5, 4, 2, 3, 0], second)))
    # SICK gold 5 3 4 1 2 -> ranks 5 3 4 1 2: d^2 = 0+1+1+1+1 = 4, rho = 1 - 6*4 / 120 = 0.8
    sick = "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n" + "".join(
        f"{i}\ta\t{s}\t{g}\tNEUTRAL\n" for i, (g, s) in enumerate(zip([5, 3, 4, 1, 2], second)))
    (tmp_path / "STS" / "STSBenchmark").mkdir(parents=True)
    (tmp_path / "STS" / "STSBenchmark" / "sts-test.csv").write_text(stsb)
    (tmp_path / "SICK").mkdir()
    (tmp_path / "SICK" / "SICK_test_annotated.txt").write_text(sick)

    model = static_model(WORD_VECTORS)
    evaluator = STSSuiteEvaluator(tmp_path, tasks=["STSBenchmark", "SICKRelatedness"], show_progress_bar=False)
    results = evaluator(model)
    assert results == pytest.approx(
        {"sts_stsbenchmark_spearman": 0.9, "sts_sickrelatedness_spearman": 0.8, "sts_avg_spearman": 0.85})
    assert evaluator.primary_metric == "sts_avg_spearman"
    for task in ("STSBenchmark", "SICKRelatedness"):
        direct = _cosine_spearman(model, load_sts(tmp_path, task))
        assert results[f"sts_{task.lower()}_spearman"] == pytest.approx(direct, abs=1e-12)


def test_suite_on_fixture_matches_direct_computation(minilm):
    evaluator = STSSuiteEvaluator(FIXTURE, batch_size=16, show_progress_bar=False)
    results = evaluator(minilm)
    keys = [f"sts_{t.lower()}_spearman" for t in STS_TASKS]
    assert list(results) == [*keys, "sts_avg_spearman"]
    assert evaluator.primary_metric == "sts_avg_spearman"
    pairs = {task: load_sts(FIXTURE, task) for task in STS_TASKS}
    embeddings = _embed(minilm, list(pairs.values()))
    for task, key in zip(STS_TASKS, keys):
        assert results[key] == pytest.approx(_cosine_spearman(minilm, pairs[task], embeddings), abs=1e-6), task
        assert -1 <= results[key] <= 1
    assert results["sts_avg_spearman"] == pytest.approx(np.mean([results[k] for k in keys]))
    assert results["sts_avg_spearman"] > 0.5  # a real sentence model is clearly better than chance


def test_each_distinct_sentence_is_encoded_once(tmp_path, monkeypatch):
    model = static_model(WORD_VECTORS)
    (tmp_path / "STS" / "STSBenchmark").mkdir(parents=True)
    (tmp_path / "STS" / "STSBenchmark" / "sts-test.csv").write_text(
        "g\tf\t2012\t1\t5\ta\ta\ng\tf\t2012\t2\t3\ta\tc\ng\tf\t2012\t3\t1\tb\td\n")
    encoded: list[str] = []
    original = model.encode
    monkeypatch.setattr(model, "encode", lambda sentences, *args, **kwargs: encoded.extend(
        [sentences] if isinstance(sentences, str) else sentences) or original(sentences, *args, **kwargs))
    evaluator = STSSuiteEvaluator(tmp_path, tasks=["STSBenchmark"], name="", show_progress_bar=False)
    results = evaluator(model)
    assert sorted(encoded) == ["a", "b", "c", "d"]
    assert set(results) == {"stsbenchmark_spearman", "avg_spearman"}  # name="" -> no prefix
    assert evaluator.primary_metric == "avg_spearman"


def test_bad_input_fails_at_construction(tmp_path):
    for folder, options, error, match in [(tmp_path / "nowhere", {}, DataNotFoundError, "nowhere"),
                                          (None, {}, ConfigurationError, None),
                                          (FIXTURE, {"source": "web"}, ConfigurationError, "source"),
                                          (FIXTURE, {"tasks": ["STS99"]}, ConfigurationError, "STS99"),
                                          (FIXTURE, {"similarity": "jaccard"}, ConfigurationError, "similarity")]:
        with pytest.raises(error, match=match):
            STSSuiteEvaluator(folder, **options)


def test_hub_source_uses_the_hub_loader(monkeypatch):
    calls = []
    monkeypatch.setattr(sts_module, "load_sts_from_hub", lambda task, split="test": calls.append((task, split)) or
                        STSPairs(["a", "a", "a"], ["a", "c", "b"], [5.0, 3.0, 1.0], ["all"] * 3))
    evaluator = STSSuiteEvaluator(tasks=["STS12", "stsb"], source="hub", show_progress_bar=False)
    assert calls == [("STS12", "test"), ("STSBenchmark", "test")]
    results = evaluator(static_model(WORD_VECTORS))
    assert results["sts_avg_spearman"] == pytest.approx(1.0)
    dev = stsb_dev_evaluator(source="hub")
    assert calls[-1] == ("STSBenchmark", "dev") and len(dev.scores) == 3


def test_stsb_dev_evaluator(minilm):
    evaluator = stsb_dev_evaluator(FIXTURE, batch_size=8)
    assert isinstance(evaluator, EmbeddingSimilarityEvaluator)
    assert len(evaluator.scores) == 5
    results = evaluator(minilm)
    assert evaluator.primary_metric == "sts-dev_spearman_cosine"
    assert results["sts-dev_spearman_cosine"] == pytest.approx(
        _cosine_spearman(minilm, load_sts(FIXTURE, "STSBenchmark", "dev")), abs=1e-6)
    with pytest.raises(DataNotFoundError):
        stsb_dev_evaluator(FIXTURE / "missing")


def test_format_results_table():
    results = {"model-a": {"sts_sts12_spearman": 0.7, "sts_stsbenchmark_spearman": 0.81234,
                           "sts_avg_spearman": 0.75617},
               "b": {"sts_sts12_spearman": 0.654321, "sts_stsbenchmark_spearman": math.nan, "sts_avg_spearman": 0.6}}
    table = format_results_table(results)
    lines = table.splitlines()
    assert lines[0].split() == ["model-a", "b"]
    assert [line.split() for line in lines[2:]] == [["STS12", "70.00", "65.43"], ["STS-B", "81.23", "-"],
                                                    ["Avg.", "75.62", "60.00"]]
    assert len({len(line) for line in lines[:2]}) == 1  # header and rule are aligned
    custom = format_results_table(results, rows=[("Avg.", "sts_avg_spearman", 1.0), ("x", "missing")], title="T")
    assert custom.splitlines()[0] == "T"
    assert [line.split() for line in custom.splitlines()[3:]] == [["Avg.", "0.76", "0.60"], ["x", "-", "-"]]
    assert [label for label, _ in sts_table_rows()] == ["STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg."]
