"""``st-prompts train`` end to end on a tiny backbone and tiny data; the paper presets match the papers' tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SENTENCES
from sentence_transformers import SentenceTransformer

from st_prompts.cli import main
from st_prompts.errors import ConfigurationError
from st_prompts.methods import settings as preset


@pytest.mark.parametrize("supervised", [False, True])
def test_train_command_saves_a_loadable_model_with_a_card(tiny_bert, data_dir, tmp_path, capsys, supervised):
    """A model and its prompts-only checkpoint that encode alike, each with the card a downloader reads first."""
    out = tmp_path / "model"
    argv = ["train", "dcpcse", "--backbone", tiny_bert, "--data-dir", str(data_dir), "--max-steps", "2",
            "--batch-size", "4", "--eval-steps", "1", "--output", str(out), "--prompts-only", "--no-progress"]
    assert main(argv + (["--supervised"] if supervised else [])) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.rindex("{\n"):])["steps"] == 2
    result = json.loads((out / "train_result.json").read_text())
    assert result["steps"] == 2 and result["settings"]["supervised"] is supervised
    assert result["best_step"] in (1, 2) and result["best_metric"] is not None
    full = SentenceTransformer(str(out), trust_remote_code=True)
    small = SentenceTransformer(str(out) + "-prompts", trust_remote_code=True)
    np.testing.assert_array_equal(full.encode(SENTENCES), small.encode(SENTENCES))
    card = (out / "README.md").read_text()
    # st-prompts is not on PyPI: the card installs it from source and keeps the published line as a note
    assert "pip install -e path/to/st_prompts" in card and "# once it is published: pip install -U st-prompts" in card
    assert "pip install -U sentence-transformers st-prompts" not in card
    # the saved max_seq_length (trained at 32): 64 positions, less the prefix if ungated (unsupervised: 16)
    config = json.loads(next(out.rglob("sentence_bert_config.json")).read_text())
    assert config["max_seq_length"] in ((52, 64) if supervised else (48, 64)) and config["max_seq_length"] > 32
    assert f"**Encodes:** up to {config['max_seq_length']} tokens per text" in card
    assert "trust_remote_code=True" in card and "load_sentence_model" in card
    assert "**Method:** dcpcse" in card and "Deep Continuous Prompt" in card
    assert f"**Backbone:** {Path(tiny_bert).name} (frozen)" in card
    assert "**Trained parameters:**" in card and "**STS-B dev Spearman of the selected checkpoint:**" in card
    assert "source_sentence: A man with a hard hat is dancing." in card
    assert "sentence_transformers_model_id" not in card
    prompts_card = (Path(str(out) + "-prompts") / "README.md").read_text()
    assert "Prompts-only checkpoint" in prompts_card and "trust_remote_code=True" in prompts_card


def test_train_command_reports_bad_data_dir(tiny_bert, tmp_path, capsys):
    assert main(["train", "dcpcse", "--backbone", tiny_bert, "--data-dir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "missing" in err and "Traceback" not in err


def test_paper_presets_follow_the_tables():
    s = preset("dcpcse", False, "paper")
    assert (s.backbone, s.batch_size, s.learning_rate, s.prefix_length, s.mlm_weight, s.epochs) == (
        "bert-base-uncased", 256, 3e-2, 16, 0.0, 1.0)
    s = preset("dcpcse", False, "paper", backbone="roberta-base")
    assert (s.batch_size, s.learning_rate, s.prefix_length, s.mlm_weight) == (64, 3e-2, 14, 0.1)
    s = preset("dcpcse", True, "paper", backbone="roberta-large")
    assert (s.batch_size, s.learning_rate, s.prefix_length, s.epochs) == (256, 5e-3, 10, 10.0)
    s = preset("scpcse", False, "paper")
    assert (s.batch_size, s.learning_rate, s.epochs, s.eval_steps) == (256, 1e-3, 5.0, 125)
    assert preset("simcse", True, "paper").batch_size == 512
    assert all(preset(m, False, "paper").max_seq_length == 32 and preset(m, False, "paper").temperature == 0.05
               for m in ("dcpcse", "scpcse", "simcse"))
    with pytest.raises(ConfigurationError, match="No paper hyperparameters"):
        preset("dcpcse", False, "paper", backbone="distilbert-base-uncased")
    assert preset("dcpcse", False, "cpu", learning_rate=0.5).learning_rate == 0.5


def test_cpu_scale_defaults_to_the_bundled_data(tiny_bert, tmp_path, capsys):
    """A newcomer without --data-dir trains on the small data set shipped in the package (and says so)."""
    from st_prompts.data.training_data import bundled_data_dir

    bundled = bundled_data_dir()
    assert sum(1 for _ in open(bundled / "wiki_sentences.txt")) == 3000
    assert sum(1 for _ in open(bundled / "nli_triplets.csv")) == 1501  # header + 1,500 triplets
    out = tmp_path / "model"
    argv = ["train", "dcpcse", "--supervised", "--backbone", tiny_bert, "--max-steps", "1", "--batch-size", "4",
            "--limit", "8", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "bundled with st_prompts" in capsys.readouterr().err
    result = json.loads((out / "train_result.json").read_text())
    assert result["settings"]["supervised"] is True and result["best_metric"] is not None


def test_offline_hub_download_fails_with_a_clear_message(monkeypatch):
    import huggingface_hub

    from st_prompts.data.training_data import load_training_dataset
    from st_prompts.errors import DataNotFoundError

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(DataNotFoundError, match="--data-dir"):
        load_training_dataset(False, None)


def test_every_long_phase_says_one_line_with_no_progress_and_dev_limit_bounds_selection(tiny_bert, data_dir,
                                                                                        tmp_path, capsys):
    """With --no-progress each long phase still logs a line (backbone, data and its size, training, each evaluation,
    saving); --dev-limit selects on a share of STS-B dev and reports the selected weights' score on the whole set."""
    from st_prompts.evaluation.sts import stsb_dev_evaluator

    total = len(stsb_dev_evaluator(str(data_dir / "senteval")).sentences1)
    out = tmp_path / "model"
    argv = ["train", "dcpcse", "--backbone", tiny_bert, "--data-dir", str(data_dir), "--max-steps", "2",
            "--batch-size", "4", "--eval-steps", "1", "--dev-limit", "4", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert any(line.startswith(f"Loading the backbone {tiny_bert} for dcpcse") for line in err), err
    assert any(f"train: 8 examples; selection on STS-B dev, 4 of {total:,} pairs" in line for line in err), err
    assert any(line.startswith("Training dcpcse train: 2 steps of batch 4 over 8 examples, evaluating every 1 steps")
               for line in err), err
    evaluations = [line for line in err if line.startswith("Evaluating sts-dev (4 pairs) at step")]
    assert len(evaluations) == 2, err  # steps 1 and 2
    assert f"Evaluating the selected weights on the whole STS-B dev ({total:,} pairs)." in err
    assert f"Saving the model to {out}." in err
    printed = json.loads(captured.out[captured.out.rindex("{\n"):])
    assert printed["selection_dev_pairs"] == 4 and printed["selection_dev_spearman"] is not None
    result = json.loads((out / "train_result.json").read_text())
    assert result["selection_pairs"] == 4 and result["best_metric"] == printed["best_dev_spearman"]
    # the reported number is the whole dev set's
    from st_prompts.loading import load_sentence_model

    full = stsb_dev_evaluator(str(data_dir / "senteval"))
    assert abs(full(load_sentence_model(str(out)))[full.primary_metric] - result["best_metric"]) < 1e-4

    assert main(argv[:-5] + ["--dev-limit", "1", "--output", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "dev_limit must be a number of STS-B dev pairs of at least 2" in capsys.readouterr().err
