"""MultiPositiveInfoNCELoss: hand-written SKICSE formulas (both supervised readings), λ = 0 is
MultipleNegativesRankingLoss, missing SKI falls back to the SimCSE term, columns by name, per-column max lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import st_model
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_prompts.errors import ConfigurationError
from st_prompts.losses import (SUPERVISED_READINGS, InfoNCETerm, MultiPositiveInfoNCELoss, skicse_supervised_terms,
                               skicse_unsupervised_terms)

ANCHORS = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music"]
POSITIVES = ["a man plays music", "the dog runs", "a cat on a mat", "happy music is playing"]
NEGATIVES = ["the woman sits", "a red car", "big green tree", "sad water"]
SKI = ["the guitar is a music instrument and the man plays it in the park .",
       "a dog is an animal ; this one runs in a green park with a tree .",
       "the cat is small and it sits on a red mat in the house .",
       "music can be happy or sad ; this music is happy and big ."]
TAU = 0.05
UNSUP = ("anchor", "positive", "ski")
SUP = ("anchor", "positive", "negative", "ski")


@pytest.fixture(scope="module")
def model(tiny_bert):
    return st_model(tiny_bert, "cls", max_seq_length=32).eval()


def feats(model, texts):
    return dict(model.preprocess(texts))


def embed(model, texts):
    with torch.no_grad():
        return F.normalize(model.encode(texts, convert_to_tensor=True), dim=-1)


def infonce(anchor, positive, candidates):
    """-log exp(s(a_i, p_i)/τ) / Σ_c Σ_j exp(s(a_i, c_j)/τ), per row, written out."""
    rows = []
    for i in range(anchor.shape[0]):
        numerator = torch.exp(anchor[i] @ positive[i] / TAU)
        denominator = sum(torch.exp(anchor[i] @ c[j] / TAU) for c in candidates for j in range(c.shape[0]))
        rows.append(-torch.log(numerator / denominator))
    return torch.stack(rows)


def run(loss, model, columns, labels=None):
    with torch.no_grad():
        return loss([feats(model, c) for c in columns], labels)


def test_unsupervised_equals_equations_1_to_3(model):
    loss = MultiPositiveInfoNCELoss(model, UNSUP, skicse_unsupervised_terms(0.15))
    parts = run(loss, model, [ANCHORS, ANCHORS, SKI])
    h, k = embed(model, ANCHORS), embed(model, SKI)
    simcse = infonce(h, h, [h]).mean()  # eval mode: x' = x (no dropout)
    ski = infonce(h, k, [k]).mean()
    assert set(parts) == {"simcse", "ski"}
    torch.testing.assert_close(parts["simcse"], 0.85 * simcse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parts["ski"], 0.15 * ski, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("reading", SUPERVISED_READINGS)
def test_supervised_equals_equations_4_to_7_in_both_readings(model, reading):
    loss = MultiPositiveInfoNCELoss(model, SUP, skicse_supervised_terms(0.1, 0.3, reading))
    parts = run(loss, model, [ANCHORS, POSITIVES, NEGATIVES, SKI])
    h, hp, hn, hs = (embed(model, c) for c in (ANCHORS, POSITIVES, NEGATIVES, SKI))
    eq4 = infonce(h, hp, [hp, hn]).mean()
    if reading == "printed":
        eq5 = infonce(hs, hn, [hp, hn]).mean()  # the contradiction is the SKI anchor's positive, as printed
        eq6 = infonce(h, hs, [hp, hn]).mean()  # h_ski not in its own denominator, as printed
    else:
        eq5 = infonce(hs, hp, [hp, hn]).mean()
        eq6 = infonce(h, hs, [hs, hn]).mean()
    torch.testing.assert_close(parts["simcse"], 0.6 * eq4, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parts["ski_anchor"], 0.1 * eq5, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parts["ski_positive"], 0.3 * eq6, atol=1e-4, rtol=1e-4)


def test_the_two_readings_differ(model):
    from st_prompts.methods.skicse.config import READINGS

    assert set(READINGS) == set(SUPERVISED_READINGS)
    columns = [ANCHORS, POSITIVES, NEGATIVES, SKI]
    text = run(MultiPositiveInfoNCELoss(model, SUP, skicse_supervised_terms(reading="text")), model, columns)
    printed = run(MultiPositiveInfoNCELoss(model, SUP, skicse_supervised_terms(reading="printed")), model, columns)
    assert not torch.isclose(text["ski_anchor"], printed["ski_anchor"])
    assert not torch.isclose(text["ski_positive"], printed["ski_positive"])
    torch.testing.assert_close(text["simcse"], printed["simcse"])


@pytest.mark.parametrize("names, terms, columns", [
    (UNSUP, skicse_unsupervised_terms(0.0), [ANCHORS, POSITIVES, SKI]),
    (SUP, skicse_supervised_terms(0.0, 0.0), [ANCHORS, POSITIVES, NEGATIVES, SKI])], ids=["unsupervised", "supervised"])
def test_lambda_zero_is_multiple_negatives_ranking_loss(model, names, terms, columns):
    ours = run(MultiPositiveInfoNCELoss(model, names, terms), model, columns)
    reference = run(MultipleNegativesRankingLoss(model, scale=1 / TAU), model, columns[:-1])
    torch.testing.assert_close(sum(ours.values()), reference, atol=1e-5, rtol=1e-5)
    # ... and the SKI column, a 3rd/4th column there, is not a negative here: MNRL with it differs
    with_extra = run(MultipleNegativesRankingLoss(model, scale=1 / TAU), model, columns)
    assert not torch.isclose(with_extra, reference)


def test_missing_ski_rows_fall_back_to_the_simcse_term(model):
    """Row 1 has no SKI: its loss is the SimCSE term alone (weight 1), and its empty SKI text is in no denominator
    (supervised: equation 4 alone)."""
    loss = MultiPositiveInfoNCELoss(model, UNSUP, skicse_unsupervised_terms(0.15), presence_column="ski")
    ski = list(SKI)
    ski[1] = ""
    present = torch.tensor([1, 0, 1, 1])
    parts = run(loss, model, [ANCHORS, ANCHORS, ski], present)
    h, k = embed(model, ANCHORS), embed(model, ski)
    simcse = infonce(h, h, [h])
    keep = [0, 2, 3]
    ski_rows = infonce(h[keep], k[keep], [k[keep]])
    weights = torch.tensor([0.85, 1.0, 0.85, 0.85])
    torch.testing.assert_close(parts["simcse"], (weights * simcse).sum() / 4, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parts["ski"], 0.15 * ski_rows.sum() / 4, atol=1e-4, rtol=1e-4)
    # every row present: the same as without flags
    all_present = run(loss, model, [ANCHORS, ANCHORS, SKI], torch.ones(4, dtype=torch.long))
    no_flags = run(MultiPositiveInfoNCELoss(model, UNSUP, skicse_unsupervised_terms(0.15)), model,
                   [ANCHORS, ANCHORS, SKI])
    for name in no_flags:
        torch.testing.assert_close(all_present[name], no_flags[name])
    # supervised: rows without SKI keep only equation 4
    loss = MultiPositiveInfoNCELoss(model, SUP, skicse_supervised_terms(0.1, 0.3), presence_column="ski")
    ski = ["", "", "", ""]
    parts = run(loss, model, [ANCHORS, POSITIVES, NEGATIVES, ski], torch.zeros(4, dtype=torch.long))
    h, hp, hn = (embed(model, c) for c in (ANCHORS, POSITIVES, NEGATIVES))
    torch.testing.assert_close(parts["simcse"], infonce(h, hp, [hp, hn]).mean(), atol=1e-4, rtol=1e-4)
    assert parts["ski_anchor"] == 0 and parts["ski_positive"] == 0


def test_missing_rows_are_counted_in_training(model):
    loss = MultiPositiveInfoNCELoss(model, UNSUP, skicse_unsupervised_terms(), presence_column="ski")
    model.train()
    try:
        out = loss([feats(model, c) for c in (ANCHORS, ANCHORS, SKI)], torch.tensor([1, 0, 0, 1]))
        sum(out.values()).backward()
    finally:
        model.eval()
    assert (loss.rows, loss.missing_rows) == (4, 2)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_columns_are_matched_by_name_never_by_position(model):
    loss = MultiPositiveInfoNCELoss(model, UNSUP, skicse_unsupervised_terms())
    with pytest.raises(ConfigurationError, match="expects the columns"):
        run(loss, model, [ANCHORS, ANCHORS, SKI, NEGATIVES])  # a 4th column is an error, not a negative
    with pytest.raises(ConfigurationError, match="not among"):
        MultiPositiveInfoNCELoss(model, ("anchor", "positive"), skicse_unsupervised_terms())
    with pytest.raises(ConfigurationError, match="used by no term"):
        MultiPositiveInfoNCELoss(model, ("anchor", "positive", "ski", "negative"), skicse_unsupervised_terms())
    with pytest.raises(ConfigurationError, match="negative weight"):
        InfoNCETerm("x", "anchor", "positive", ("positive",), -1.0)
    # the same data in another column order gives the same loss once the names say so
    swapped = MultiPositiveInfoNCELoss(model, ("ski", "anchor", "positive"), skicse_unsupervised_terms())
    torch.testing.assert_close(sum(run(swapped, model, [SKI, ANCHORS, ANCHORS]).values()),
                               sum(run(loss, model, [ANCHORS, ANCHORS, SKI]).values()))


def test_column_max_length_collator_gives_ski_its_own_limit_and_checks_the_order_once(model, caplog):
    import logging

    from st_prompts.data.collators import ColumnMaxLengthCollator

    long_text = " ".join(["the man plays guitar in the park"] * 10)
    rows = [{"anchor": long_text, "positive": long_text, "ski": long_text, "label": 1}] * 2
    collator = ColumnMaxLengthCollator(preprocess_fn=model.preprocess, column_max_lengths={"ski": 48})
    batch = collator(rows)
    assert batch["anchor_input_ids"].shape[1] == 32 and batch["ski_input_ids"].shape[1] == 48
    assert [k for k in batch if k.endswith("_input_ids")] == ["anchor_input_ids", "positive_input_ids",
                                                              "ski_input_ids"]
    assert batch["label"].tolist() == [1, 1]
    # the column order is checked once for the whole row
    collator = ColumnMaxLengthCollator(preprocess_fn=model.preprocess, column_max_lengths={"ski": 48})
    with caplog.at_level(logging.WARNING, logger="sentence_transformers"):
        for _ in range(3):
            collator([{"anchor": "a dog runs", "positive": "a dog runs", "ski": "dogs run fast"}] * 2)
    assert not [r for r in caplog.records if "is at index" in r.getMessage()]
    # a row whose own order is unusual is still reported, once
    with caplog.at_level(logging.WARNING, logger="sentence_transformers"):
        for _ in range(3):
            collator([{"positive": "a dog runs", "anchor": "a dog runs", "ski": "dogs run fast"}] * 2)
    assert len({r.getMessage() for r in caplog.records if "is at index" in r.getMessage()}) >= 1
    assert len([r for r in caplog.records if "is at index" in r.getMessage()]) <= 2  # one call: one per column
