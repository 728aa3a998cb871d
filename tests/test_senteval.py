"""The SentEval STS reader, on the small SentEval-layout tree in tests/fixtures/senteval (see its README)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import one_line_message

from st_prompts.data import senteval
from st_prompts.data.senteval import STS_TASKS, STSPairs, check_senteval_dir, load_sts, load_sts_from_hub
from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError

FIXTURE = Path(__file__).parent / "fixtures" / "senteval"

# Counted by hand in the fixture files: 3 scored lines per subset file, except STS16 answer-answer and headlines
# (2 each); the blank gold lines of STS15/STS16 are not pairs.
EXPECTED_COUNTS = {
    "STS12": 15,  # 5 subsets x 3
    "STS13": 9,  # 3 subsets x 3 (FNWN, headlines, OnWN: no SMT)
    "STS14": 18,  # 6 subsets x 3
    "STS15": 15,  # 5 files x 4 lines, one blank gold line each
    "STS16": 13,  # 2 + 2 + 3 + 3 + 3 (one blank gold line in each file)
    "STSBenchmark": 8,  # sts-test.csv rows
    "SICKRelatedness": 8,  # SICK_test_annotated.txt rows after the header
}


@pytest.fixture
def tree(tmp_path) -> Path:
    """A writable copy of the fixture tree, to break."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "senteval"))


@pytest.mark.parametrize("task", STS_TASKS)
def test_pair_counts(task):
    pairs = load_sts(FIXTURE, task)
    assert len(pairs) == EXPECTED_COUNTS[task]
    assert len(pairs.sentences1) == len(pairs.sentences2) == len(pairs.scores) == len(pairs.subsets)
    assert all(s1 and s2 for s1, s2 in zip(pairs.sentences1, pairs.sentences2))


def test_subsets_follow_senteval_lists_and_blank_gold_lines_keep_the_alignment():
    assert load_sts(FIXTURE, "STS13").subset_names == ["FNWN", "headlines", "OnWN"]
    sts16 = load_sts(FIXTURE, "STS16")
    assert sts16.subset_names == ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"]
    assert [len(sts16.subset(s)) for s in sts16.subset_names] == [2, 2, 3, 3, 3]
    assert load_sts(FIXTURE, "STS12").subset_names == ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN",
                                                        "surprise.SMTnews"]
    assert set(load_sts(FIXTURE, "STSBenchmark").subsets) == {"all"}
    sts12 = load_sts(FIXTURE, "STS12")
    assert sts12.sentences1[0].startswith("the problem likely will mean corrective changes")
    assert sts12.sentences2[0].startswith("he said the problem needs to be corrected")
    assert sts12.scores[0] == 4.4
    # belief: gold line 1 is blank, so the first belief pair is input line 2 with gold 2.70
    belief = load_sts(FIXTURE, "STS15").subset("belief")
    assert belief.sentences1[0] == "hollywood will be required occasionally to cast english actors as good guys ."
    assert belief.scores == [2.7, 4.0, 1.6]


def test_stsb_splits_quotes_and_whitespace_read_like_senteval(tree):
    assert [len(load_sts(FIXTURE, "STSBenchmark", s)) for s in ("train", "dev", "test")] == [4, 5, 8]
    dev = load_sts(FIXTURE, "STSBenchmark", "validation")  # alias of dev
    # the last dev row has one unbalanced '"': csv quoting would swallow the tab and the next column
    assert dev.sentences1[-1].startswith('" the grass family is one of')
    assert dev.sentences2[-1].startswith("as noted on the wiki page")
    assert dev.scores[-1] == 1.4
    assert load_sts(FIXTURE, "STSBenchmark").scores[:3] == [2.5, 3.6, 5.0]
    (tree / "STS/STSBenchmark/sts-test.csv").write_text("g\tf\t2012\t0001\t3.0\t  a   man  is\tsinging .  \n")
    pairs = load_sts(tree, "STSBenchmark")
    assert (pairs.sentences1, pairs.sentences2, pairs.scores) == (["a man is"], ["singing ."], [3.0])


def test_sick_crlf_header_and_splits():
    test = load_sts(FIXTURE, "SICKRelatedness")
    assert test.scores == [3.3, 3.7, 3.0, 4.9, 3.665, 3.3, 2.7, 2.9]
    assert test.sentences1[0] == "There is no boy playing outdoors and there is no man smiling"
    assert not any("\r" in s for s in test.sentences1 + test.sentences2)
    assert len(load_sts(FIXTURE, "SICKRelatedness", "dev")) == 4  # SICK_trial.txt
    assert len(load_sts(FIXTURE, "SICKRelatedness", "train")) == 4


def test_task_and_split_names():
    assert [len(load_sts(FIXTURE, task)) for task in ("stsb", "SICK-R", "sts13")] == [8, 8, 9]
    for task, split, match in (("STS17", "test", "unknown STS task"), ("STS12", "dev", "only has a test split"),
                               ("STSBenchmark", "validate", "unknown split")):
        with pytest.raises(ConfigurationError, match=match):
            load_sts(FIXTURE, task, split)


def test_stspairs_subset_and_len():
    pairs = STSPairs(["a", "b", "c"], ["x", "y", "z"], [1.0, 2.0, 3.0], ["s1", "s2", "s1"])
    assert len(pairs) == 3
    sub = pairs.subset("s1")
    assert (sub.sentences1, sub.sentences2, sub.scores, sub.subsets) == (["a", "c"], ["x", "z"], [1.0, 3.0], ["s1"] * 2)
    with pytest.raises(ConfigurationError, match="s3"):
        pairs.subset("s3")
    with pytest.raises(ValueError):
        STSPairs(["a"], [], [1.0], ["all"])


def test_check_senteval_dir_needs_only_the_requested_tasks(tmp_path):
    assert check_senteval_dir(FIXTURE) == FIXTURE
    assert check_senteval_dir(FIXTURE, tasks=["STSBenchmark"], split="dev") == FIXTURE
    shutil.copytree(FIXTURE / "STS" / "STSBenchmark", tmp_path / "STS" / "STSBenchmark")
    assert check_senteval_dir(tmp_path, tasks=["STSBenchmark"]) == tmp_path
    with pytest.raises(DataNotFoundError, match="SICK/"):
        check_senteval_dir(tmp_path, tasks=["STSBenchmark", "SICKRelatedness"])


# ----------------------------------------------------------------------------------------------------- bad input


def test_missing_dir_and_one_level_too_high(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataNotFoundError) as exc:
        check_senteval_dir(missing)
    message = one_line_message(exc)
    assert str(missing) in message and "does not exist" in message and "STS.input" in message  # names the layout
    with pytest.raises(DataNotFoundError, match="nowhere"):
        load_sts(missing, "STS12")
    with pytest.raises(ConfigurationError):
        check_senteval_dir(None)
    shutil.copytree(FIXTURE, tmp_path / "downstream")  # one level too high: a hint
    with pytest.raises(DataNotFoundError, match="did you mean .*downstream"):
        check_senteval_dir(tmp_path)


def test_missing_files_are_all_named_in_one_error(tree):
    (tree / "STS/STS13-en-test/STS.gs.OnWN.txt").unlink()
    (tree / "STS/STSBenchmark/sts-test.csv").unlink()
    with pytest.raises(DataNotFoundError) as exc:
        check_senteval_dir(tree)
    message = one_line_message(exc)
    assert "STS/STS13-en-test/STS.gs.OnWN.txt" in message
    assert "STS/STSBenchmark/sts-test.csv" in message
    with pytest.raises(DataNotFoundError, match="STS.gs.OnWN.txt"):
        load_sts(tree, "STS13")
    assert len(load_sts(tree, "STS12")) == 15  # the other tasks still load


@pytest.mark.parametrize(
    "relpath, content, task, expected",
    [
        ("STS/STS13-en-test/STS.input.FNWN.txt", "only one sentence here\nb\tc\nd\te\n", "STS13", r"STS.input.FNWN.txt:1: expected 2"),
        ("STS/STS13-en-test/STS.gs.FNWN.txt", "1.0\nhigh\n3.0\n", "STS13", r"STS.gs.FNWN.txt:2: score 'high'"),
        ("STS/STS13-en-test/STS.gs.FNWN.txt", "1.0\n2.0\n", "STS13", r"STS.input.FNWN.txt has 3 lines but .*STS.gs.FNWN.txt has 2"),
        ("STS/STSBenchmark/sts-test.csv", "g\tf\t2012\t1\t2.0\tonly one sentence\n", "STSBenchmark", r"sts-test.csv:1: expected at least 7"),
        ("STS/STSBenchmark/sts-test.csv", "g\tf\t2012\t1\tn/a\ta\tb\n", "STSBenchmark", r"sts-test.csv:1: score 'n/a'"),
        ("SICK/SICK_test_annotated.txt", "pair_ID\ts1\ts2\tscore\n1\ta\tb\t3\n", "SICKRelatedness", r"SICK_test_annotated.txt:1: header"),
        ("SICK/SICK_test_annotated.txt", "pair_ID\tsentence_A\tsentence_B\trelatedness_score\n1\ta\tb\t3\n2\ta\tb\n", "SICKRelatedness", r"SICK_test_annotated.txt:3: expected 4"),
        ("SICK/SICK_test_annotated.txt", b"pair_ID\tsentence_A\tsentence_B\trelatedness_score\n1\ta\xff\tb\t3\n", "SICKRelatedness", r"SICK_test_annotated.txt: not valid UTF-8"),
    ],
)
def test_malformed_files(tree, relpath, content, task, expected):
    path = tree / relpath
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for call in (lambda: load_sts(tree, task), lambda: check_senteval_dir(tree)):
        with pytest.raises(DataFormatError, match=expected) as exc:
            call()
        assert str(path) in one_line_message(exc)


# ----------------------------------------------------------------------------------------------------------- hub


def fake_hub(monkeypatch, rows=None, error=None) -> list:
    """``datasets.load_dataset`` answering ``rows`` (or raising ``error``); returns the list of its calls."""
    import datasets

    calls = []

    def load_dataset(repo, split):
        calls.append((repo, split))
        if error:
            raise error
        return datasets.Dataset.from_dict(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_load_sts_from_hub_converts(monkeypatch):
    calls = fake_hub(monkeypatch, {"sentence1": ["a", "b"], "sentence2": ["c", "d"], "score": [0.5, 1]})
    pairs = load_sts_from_hub("STSBenchmark", "dev")
    assert calls == [("sentence-transformers/stsb", "validation")]
    assert (pairs.sentences1, pairs.sentences2, pairs.scores, pairs.subsets) == (["a", "b"], ["c", "d"], [0.5, 1.0], ["all", "all"])
    load_sts_from_hub("sts13")
    assert calls[-1] == (senteval.HUB_DATASETS["STS13"], "test")
    with pytest.raises(ConfigurationError):
        load_sts_from_hub("SICKRelatedness", "train")


def test_load_sts_from_hub_errors_are_one_line(monkeypatch):
    fake_hub(monkeypatch, error=ConnectionError("no network\nmore details"))
    with pytest.raises(DataNotFoundError, match="mteb/sts12-sts .*no network") as exc:
        load_sts_from_hub("STS12")
    one_line_message(exc)
    fake_hub(monkeypatch, {"text": ["a"]})
    with pytest.raises(DataFormatError, match="sentence1"):
        load_sts_from_hub("STS12")
