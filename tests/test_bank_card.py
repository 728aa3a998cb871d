"""A saved prompt bank's model card lists its prompt sets (what each was trained on, its selection score) and shows
per-call and per-row encoding; the records survive a reload, and banks saved without them still load."""

from __future__ import annotations

import json

import numpy as np
from datasets import Dataset
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
from sentence_transformers.sentence_transformer.losses import CoSENTLoss, MultipleNegativesRankingLoss

from st_prompts import bank
from st_prompts.loading import load_sentence_model

PAIRS = [("A man plays a guitar.", "A man plays music.", 4.2), ("A dog runs.", "A cat sleeps.", 0.5),
         ("A woman cooks.", "A woman prepares food.", 4.6), ("Kids play.", "The stock market fell.", 0.0)]


def test_a_saved_bank_card_lists_its_sets_and_per_row_encoding_and_survives_hostile_records(minilm_path, tmp_path):
    model = bank.create_bank(minilm_path)
    sts = Dataset.from_dict({"sentence1": [p[0] for p in PAIRS], "sentence2": [p[1] for p in PAIRS],
                             "score": [p[2] / 5 for p in PAIRS]})
    nli = Dataset.from_dict({"anchor": [p[0] for p in PAIRS[:3]], "positive": [p[1] for p in PAIRS[:3]],
                             "negative": [p[1] for p in PAIRS[1:]]})
    dev = EmbeddingSimilarityEvaluator([p[0] for p in PAIRS], [p[1] for p in PAIRS], [p[2] for p in PAIRS],
                                       name="tiny-dev")
    result = bank.train_prompt_set(model, "sts", sts, CoSENTLoss(model), evaluator=dev, max_steps=2, batch_size=4,
                                   eval_steps=1, prefix_gate=True, show_progress_bar=False)
    bank.train_prompt_set(model, "nli", nli, MultipleNegativesRankingLoss(model), max_steps=1, batch_size=3,
                          prefix_length=4, show_progress_bar=False)
    folder = tmp_path / "bank"
    model.save(str(folder))

    card = (folder / "README.md").read_text()
    assert "## A prompt bank (st_prompts)" in card and "# Prompt bank on sentence-transformers/all-MiniLM-L6-v2" in card
    assert "| `sts` | 16 |" in card and "| `nli` | 4 |" in card
    assert "4 rows, CoSENTLoss, 2 steps" in card and "3 rows, MultipleNegativesRankingLoss, 1 step" in card
    assert "EmbeddingSimilarityEvaluator 'tiny-dev' (4 pairs)" in card
    assert f"{100 * result.best_metric:.2f} ({result.best_step})" in card
    assert 'task="sts")' in card and 'task=["sts", "nli"])' in card
    assert "pip install -e path/to/st_prompts" in card and "pip install -U sentence-transformers st-prompts" not in card
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    record = config["prompt_set_info"]["sts"]
    assert record["rows"] == 4 and record["best_step"] == result.best_step
    assert record["metric"].endswith("spearman_cosine")
    assert record["backbone_score"] == record["start_score"]  # a gated set starts as the backbone
    assert not {"backbone_score", "best_score"} & set(config["prompt_set_info"]["nli"])

    loaded = load_sentence_model(str(folder))
    assert loaded[0].prompt_set_info == config["prompt_set_info"]
    texts = ["A man plays a guitar.", "A dog runs."]
    mixed = loaded.encode(texts, task=["sts", "nli"])
    assert np.allclose(mixed[0], loaded.encode(texts[:1], task="sts")[0], atol=1e-5)
    assert np.allclose(mixed[1], loaded.encode(texts[1:], task="nli")[0], atol=1e-5)

    # a bank saved before the records: it loads, and its card names the sets without them
    del config["prompt_set_info"]
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))
    old = load_sentence_model(str(folder))
    assert old[0].prompt_set_info == {}
    old.save(str(tmp_path / "old"))
    old_card = (tmp_path / "old" / "README.md").read_text()
    assert "| `sts` | 16 |" in old_card and "not recorded" in old_card and "CoSENTLoss" not in old_card

    # hostile records (read from the folder, written into the card): malformed values dropped, texts one table cell
    config["prompt_set_info"] = {"sts": {"metric": 5, "evaluator": {"a": 1}, "rows": True, "steps": 1e308,
                                         "best_score": "x", "loss": "Evil | cell\n# heading"},
                                 "nli": {"metric": "a_metric", "start_score": float("nan")}, "ghost": {"rows": 3}}
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))
    loaded = load_sentence_model(str(folder))
    assert loaded[0].prompt_set_info == {"sts": {"loss": "Evil | cell # heading"}, "nli": {"metric": "a_metric"}}
    loaded.save(str(tmp_path / "again"))
    card = (tmp_path / "again" / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| `sts` |"))
    assert "Evil \\| cell # heading" in row and row.count(" | ") == 8 and "\n# heading" not in card
