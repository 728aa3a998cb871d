"""``bank train`` on the files of the ``--data-dir`` layout (SentEval's headerless STS-B and SICK files), and its
evaluation schedule: before the first step and after the last, not after each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from st_prompts.cli import main
from st_prompts.data.senteval import load_sts
from st_prompts.data.task_data import read_task_file
from st_prompts.errors import DataFormatError
from st_prompts.loading import load_sentence_model

SENTEVAL = Path(__file__).resolve().parent / "fixtures" / "senteval"
STSB = SENTEVAL / "STS" / "STSBenchmark"
SICK = SENTEVAL / "SICK"


def test_senteval_sts_b_files_are_scored_pairs_rescaled_to_one():
    for split, name in (("train", "sts-train.csv"), ("dev", "sts-dev.csv"), ("test", "sts-test.csv")):
        data = read_task_file(STSB / name)
        pairs = load_sts(SENTEVAL, "STSBenchmark", split)  # the evaluation's reader: the same pairs, the same order
        assert data.kind == "scored-pairs" and data.dataset.column_names == ["sentence1", "sentence2", "score"]
        assert data.dataset["sentence1"] == pairs.sentences1 and data.dataset["sentence2"] == pairs.sentences2
        assert data.dataset["score"] == pytest.approx([s / 5 for s in pairs.scores])
    assert read_task_file(STSB / "sts-dev.csv").dataset["sentence1"][4].startswith('" the grass')  # unbalanced quote
    assert len(read_task_file(STSB / "sts-test.csv", limit=3).dataset) == 3


def test_sick_files_are_scored_pairs_and_other_text_files_sentences(tmp_path):
    for split, name in (("train", "SICK_train.txt"), ("dev", "SICK_trial.txt"), ("test", "SICK_test_annotated.txt")):
        data = read_task_file(SICK / name)
        pairs = load_sts(SENTEVAL, "SICKRelatedness", split)
        assert data.kind == "scored-pairs" and data.dataset["sentence1"] == pairs.sentences1
        assert data.dataset["score"] == pytest.approx([(s - 1) / 4 for s in pairs.scores])  # SICK's 1-5
    (tmp_path / "wiki.txt").write_text("A first sentence.\n\n  A second one.  \n", encoding="utf-8")
    sentences = read_task_file(tmp_path / "wiki.txt")
    assert sentences.kind == "sentences" and sentences.dataset["anchor"] == ["A first sentence.", "A second one."]


def test_a_broken_senteval_line_is_one_line_naming_it(tmp_path):
    lines = (STSB / "sts-train.csv").read_text(encoding="utf-8").splitlines()
    (tmp_path / "sts-train.csv").write_text("\n".join([lines[0], lines[1].rsplit("\t", 1)[0], *lines[2:]]) + "\n",
                                            encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"sts-train.csv:2: expected at least 7 tab-separated columns"):
        read_task_file(tmp_path / "sts-train.csv")
    bad = lines[0].split("\t")
    bad[4] = "7.5"
    (tmp_path / "score.csv").write_text("\t".join(bad) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"score.csv:1: score '7.5' is outside 0-5"):
        read_task_file(tmp_path / "score.csv")
    # a CSV with a header is still a CSV, whatever its width
    (tmp_path / "wide.csv").write_text("a,b,score\nx,y,1\n", encoding="utf-8")
    assert read_task_file(tmp_path / "wide.csv").kind == "scored-pairs"


@pytest.fixture
def evaluations(monkeypatch):
    """The size of every dev evaluation ``bank train`` runs, in order (st_prompts' evaluators call this one)."""
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    sizes = []
    call = EmbeddingSimilarityEvaluator.__call__

    def counted(self, model, *args, **kwargs):
        sizes.append(len(self.sentences1))
        return call(self, model, *args, **kwargs)

    monkeypatch.setattr(EmbeddingSimilarityEvaluator, "__call__", counted)
    return sizes


def _csv(path: Path, source: Path) -> str:
    """``source`` (a SentEval STS file) written as a CSV with a header."""
    import csv

    pairs = read_task_file(source).dataset
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sentence1", "sentence2", "score"])
        writer.writerows(zip(pairs["sentence1"], pairs["sentence2"], pairs["score"]))
    return str(path)


COMMON = ["--batch-size", "2", "--max-steps", "8", "--no-progress"]


def test_bank_train_reads_the_files_of_the_data_dir_layout(tiny_bert, tmp_path, capsys):
    data_dir = tmp_path / "data"
    shutil.copytree(SENTEVAL, data_dir / "senteval")
    bank = str(tmp_path / "bank")
    assert main(["bank", "train", bank, "sts", "--data", str(data_dir / "senteval" / "STS" / "STSBenchmark" /
                                                              "sts-train.csv"), "--data-dir", str(data_dir),
                 "--backbone", tiny_bert, *COMMON]) == 0
    assert main(["bank", "train", bank, "sick", "--data", str(SICK / "SICK_train.txt"), "--dev",
                 str(SICK / "SICK_trial.txt"), *COMMON]) == 0
    assert '"rows": 4' in capsys.readouterr().out  # SICK_train.txt's four pairs
    assert sorted(load_sentence_model(bank)[0].prompt_sets) == ["sick", "sts"]


@pytest.mark.parametrize("extra,sizes", [([], [5, 5]), (["--dev-limit", "3", "--eval-steps", "4"], [3, 3, 3, 5])])
def test_bank_train_evaluates_before_the_first_step_and_after_the_last_not_after_each(extra, sizes, tiny_bert, tmp_path,
                                                                                       evaluations, capsys):
    """Steps 0 and 8 on the five dev pairs; with --dev-limit 3 --eval-steps 4, steps 0, 4 and 8 on three pairs, then
    the kept weights once on all five."""
    data = _csv(tmp_path / "train.csv", STSB / "sts-train.csv")
    dev = _csv(tmp_path / "dev.csv", STSB / "sts-dev.csv")
    assert main(["bank", "train", str(tmp_path / "bank"), "sts", "--data", data, "--dev", dev, *extra, "--backbone",
                 tiny_bert, *COMMON]) == 0
    assert evaluations == sizes
    trained = json.loads(capsys.readouterr().out)["trained"]
    assert not extra or (trained["selection_dev_pairs"] == 3 and set(trained) >= {"best_dev", "selection_dev"})


def test_dev_limit_without_a_dev_set_is_one_line(tiny_bert, tmp_path, capsys):
    assert main(["bank", "train", str(tmp_path / "bank"), "sts", "--data", str(STSB / "sts-train.csv"),
                 "--backbone", tiny_bert, "--dev-limit", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "st-prompts bank: error: --dev-limit limits the dev set: give one with --dev, --data-dir or " \
                  "--senteval-dir."
    assert not (tmp_path / "bank").exists()
