"""``st-prompts evaluate`` end to end on the fixture SentEval tree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import one_error_line, save_plain

from st_prompts.cli import main
from st_prompts.commands.evaluate import METRIC_GROUPS
from st_prompts.data.senteval import STS_TASKS, load_sts
from st_prompts.storage import write_json_atomic

FIXTURE = Path(__file__).parent / "fixtures" / "senteval"
TABLE_LABELS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg."]


@pytest.fixture(scope="module")
def static_model_dir(tmp_path_factory) -> str:
    """A second, tiny model saved to disk: mean of seeded random word vectors over the fixture vocabulary."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = set()
    for task in STS_TASKS:
        pairs = load_sts(FIXTURE, task)
        words.update(w for s in pairs.sentences1 + pairs.sentences2 for w in s.split())
    words = sorted(words)
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    weights = np.random.default_rng(0).standard_normal((len(words) + 1, 16)).astype(np.float32)
    path = tmp_path_factory.mktemp("models") / "static"
    SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_weights=weights)], device="cpu").save(str(path))
    return str(path)


def _table_rows(stdout: str) -> dict[str, list[str]]:
    cells = [line.split() for line in stdout.splitlines()]
    return {row[0]: row[1:] for row in cells if row and row[0] in TABLE_LABELS}


def test_evaluate_two_models_end_to_end(tmp_path, capsys, static_model_dir):
    out = tmp_path / "results" / "sts.json"  # parent does not exist yet
    rc = main(["evaluate", "minilm", static_model_dir, "--senteval-dir", str(FIXTURE), "--json", str(out),
               "--batch-size", "16", "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    header = next(line for line in stdout.splitlines() if "minilm" in line)
    # one column per model, in order, with its pooling (MiniLM and the static model both average token vectors)
    assert [c.strip() for c in header.split("  ") if c.strip()] == ["minilm (mean)", f"{static_model_dir} (mean)"]
    rows = _table_rows(stdout)
    assert list(rows) == TABLE_LABELS

    data = json.loads(out.read_text())
    assert list(data["results"]) == ["minilm", static_model_dir]
    assert data["pooling"] == {"minilm": "mean", static_model_dir: "mean"}
    assert data["metrics"]["sts"]["tasks"] == list(STS_TASKS)
    assert data["metrics"]["sts"]["pairs"] == {"STS12": 15, "STS13": 9, "STS14": 18, "STS15": 15, "STS16": 13,
                                               "STSBenchmark": 8, "SICKRelatedness": 8}
    assert "Spearman" in data["metrics"]["sts"]["protocol"]
    for column, model in enumerate(data["results"]):
        metrics = data["results"][model]
        keys = [f"sts_{t.lower()}_spearman" for t in STS_TASKS]
        assert list(metrics) == [*keys, "sts_avg_spearman"]
        assert metrics["sts_avg_spearman"] == pytest.approx(np.mean([metrics[k] for k in keys]))
        # the printed table is the JSON x 100 with 2 decimals
        for label, key in zip(TABLE_LABELS, [*keys, "sts_avg_spearman"]):
            assert rows[label][column] == f"{100 * metrics[key]:.2f}"
    assert data["results"]["minilm"]["sts_avg_spearman"] > 0.5
    assert sorted(p.name for p in out.parent.iterdir()) == ["sts.json"]  # no temporary file left behind


def test_evaluate_task_subset(tmp_path, capsys, static_model_dir):
    out = tmp_path / "r.json"
    assert main(["evaluate", static_model_dir, "--senteval-dir", str(FIXTURE), "--tasks", "stsb", "SICK-R",
                 "--json", str(out), "--no-progress"]) == 0
    assert list(_table_rows(capsys.readouterr().out)) == ["STS-B", "SICK-R", "Avg."]
    data = json.loads(out.read_text())
    assert data["metrics"]["sts"]["tasks"] == ["STSBenchmark", "SICKRelatedness"]
    assert set(data["results"][static_model_dir]) == {"sts_stsbenchmark_spearman", "sts_sickrelatedness_spearman",
                                                      "sts_avg_spearman"}


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    line = one_error_line(captured.err, alone=True)
    assert line.startswith("st-prompts evaluate: error: "), line
    return line


def test_usage_errors_are_one_line_exit_2(tmp_path, capsys):
    tree = Path(shutil.copytree(FIXTURE, tmp_path / "senteval"))
    (tree / "STS/STS14-en-test/STS.gs.images.txt").write_text("1.0\nfive\n2.0\n")  # malformed
    for argv, words in ((["minilm", "--senteval-dir", str(tmp_path / "no-senteval")], str(tmp_path / "no-senteval")),
                        (["minilm", "--senteval-dir", str(tree)], "STS.gs.images.txt:2"),
                        (["minilm"], "--senteval-dir"),
                        ([str(tmp_path / "no-model"), "--senteval-dir", str(FIXTURE)], "no-model")):
        assert main(["evaluate", *argv]) == 2
        assert words in _error_line(capsys)
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", "minilm", "--senteval-dir", str(FIXTURE), "--tasks", "STS99"])
    assert exc.value.code == 2


def test_metric_groups_registry():
    assert "sts" in METRIC_GROUPS
    group = METRIC_GROUPS["sts"]
    assert callable(group.build) and callable(group.rows) and callable(group.info)


def test_write_json_atomic_replaces(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("old")
    write_json_atomic(path, {"a": float("nan"), "b": 1.5})
    assert json.loads(path.read_text()) == {"a": None, "b": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


@pytest.fixture(scope="module")
def cls_model_dir(tmp_path_factory, tiny_bert) -> str:
    """A tiny random BERT with [CLS] pooling, saved to disk."""
    return str(save_plain(tmp_path_factory.mktemp("models") / "cls", tiny_bert, "cls"))


def test_pairs_metrics_show_task_split_pooling_and_consistent_units(tmp_path, capsys, cls_model_dir):
    out = tmp_path / "pairs.json"
    assert main(["evaluate", "minilm", cls_model_dir, "--senteval-dir", str(FIXTURE), "--metrics", "retrieval",
                 "alignment", "--pairs-task", "stsb", "--pairs-split", "dev", "--json", str(out),
                 "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    # Captions name the task and split that were read, not the option names.
    assert "--pairs" not in stdout
    assert lines[0] == "Retrieval (D2CSE protocol) on STS-B (STSBenchmark) dev: recall@k and MRR@10 x 100"
    assert lines[1] == "Alignment / uniformity on STS-B (STSBenchmark) dev: raw values, lower is better"
    # Column headers carry each model's pooling.
    assert [c.strip() for c in lines[2].split("  ") if c.strip()] == ["minilm (mean)", f"{cls_model_dir} ([CLS])"]

    data = json.loads(out.read_text())
    assert data["pooling"] == {"minilm": "mean", cls_model_dir: "[CLS]"}
    retrieval = data["metrics"]["retrieval"]
    assert (retrieval["task"], retrieval["split"]) == ("STSBenchmark", "dev")
    assert "fraction" in retrieval["values"] and "x 100" in retrieval["table"]
    assert "x 100" not in retrieval["protocol"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[4:]}
    for column, model in enumerate(data["results"]):
        metrics = data["results"][model]
        for label, key in [("Recall@1", "retrieval_recall@1"), ("Recall@3", "retrieval_recall@3"),
                           ("Recall@5", "retrieval_recall@5"), ("MRR@10", "retrieval_mrr@10")]:
            assert 0.0 <= metrics[key] <= 1.0  # stored as fractions, as "values" says
            assert rows[label][column] == f"{100 * metrics[key]:.2f}"  # the table shows them x 100
        assert rows["Alignment"][column] == f"{metrics['alignment_alignment']:.2f}"  # raw
    assert data["results"]["minilm"]["retrieval_recall@1"] == 1.0  # 2 score-5 pairs in the dev fixture
