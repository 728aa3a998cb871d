"""The shared base of the pair-based evaluators (st_prompts.evaluation.pairs)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import HashModel

from st_prompts.errors import DataFormatError
from st_prompts.evaluation import AlignmentUniformityEvaluator, PairsEvaluator, STSRetrievalEvaluator

SENTEVAL = Path(__file__).parent / "fixtures" / "senteval"
EVALUATORS = [AlignmentUniformityEvaluator, STSRetrievalEvaluator]


@pytest.mark.parametrize("cls", EVALUATORS)
def test_subclasses_share_the_base_and_from_senteval_records_task_split_and_name(cls):
    assert issubclass(cls, PairsEvaluator)
    for method in ("from_senteval", "__call__", "_append_csv"):
        assert method not in vars(cls), f"{cls.__name__} redefines {method}"
    evaluator = cls.from_senteval(SENTEVAL, "STSBenchmark", "dev", batch_size=4)
    assert (evaluator.task, evaluator.split, evaluator.name) == ("STSBenchmark", "dev", "STSBenchmark-dev")
    assert evaluator.batch_size == 4 and evaluator.show_progress_bar is False and evaluator.write_csv is True
    direct = cls(["q1", "q2"], ["a1", "a2"], [5.0, 5.0], name="x")
    assert (direct.task, direct.split) == (None, None)
    with pytest.raises(DataFormatError, match="same length, got 2, 1 and 2"):
        cls(["q1", "q2"], ["a1"], [5.0, 5.0])


@pytest.mark.parametrize("cls", EVALUATORS)
def test_call_prefixes_names_and_appends_csv_rows(cls, tmp_path):
    evaluator = cls(["q1", "q2", "q1"], ["a1", "a2", "d1"], [5.0, 5.0, 4.2], name="toy")
    model = HashModel()
    first = evaluator(model, output_path=str(tmp_path), epoch=0, steps=1)
    second = evaluator(model, output_path=str(tmp_path), epoch=1, steps=2)
    assert first == second and all(key.startswith("toy_") for key in first)
    unprefixed = evaluator.compute(model)
    assert {f"toy_{key}": value for key, value in unprefixed.items()} == pytest.approx(first)
    rows = list(csv.reader(open(tmp_path / evaluator.csv_file, encoding="utf-8")))
    assert evaluator.csv_file == f"{cls.csv_prefix}_toy_results.csv"
    assert rows[0] == ["epoch", "steps", *unprefixed]
    assert [row[:2] for row in rows[1:]] == [["0", "1"], ["1", "2"]]
    assert [float(v) for v in rows[1][2:]] == pytest.approx(list(unprefixed.values()))
    quiet = cls(["q1", "q2", "q1"], ["a1", "a2", "d1"], [5.0, 5.0, 4.2], write_csv=False)
    quiet(model, output_path=str(tmp_path / "none"))
    assert not (tmp_path / "none").exists()
