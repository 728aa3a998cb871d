"""The multitask study's scheduler (benchmarks/multitask_study.py): the decoder task's configurations, and a study
continued on another device reads phase 1 from its run files and runs only the later phases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def study(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("multitask_study", None)
    import multitask_study

    monkeypatch.setattr(multitask_study, "RESULTS", tmp_path)
    return multitask_study


class _Pool:
    """Records what would run; nothing runs."""

    def __init__(self):
        self.jobs = []

    def apply_async(self, function, args):
        self.jobs.append(args[0][:4])
        return self

    def ready(self):
        return False


def _write(study, task, config, lr, selected, seed=42):
    path = study.run_path(task, config, lr, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"task": task, "config": config, "name": study.config_name(config),
                                "learning_rate": lr, "seed": seed, "selected": selected,
                                "metrics": {"stsb_dev": selected, "sick_trial": 70.0}}))


def test_the_decoder_task_runs_every_configuration_its_first_four_first(study):
    configs = study.task_configs()
    assert list(configs)[:4] == ["base", "gate", "lora-epochs1", "full-epochs1"]
    for name in ("length-4", "length-64", "reparam", "warmup", "epochs-3", "lora-epochs3", "full-epochs3"):
        assert study.job_config("smollm2", name) == configs[name]
    pool = _Pool()
    study.queue_first_rungs(study.Study(pool, "data", ["sts", "smollm2"], frozen=["sts"]), ["sts", "smollm2"])
    assert {job[0] for job in pool.jobs} == {"smollm2"}  # a frozen task queues nothing
    assert [study.config_name(job[1]) for job in pool.jobs][::3] == list(configs)  # three rungs each, in order
    assert study.SELECTION["smollm2"] == "stsb_dev" and study.UNSEEN["smollm2"] == "sick_trial"


def test_a_frozen_phase1_reads_the_run_files_and_submits_nothing(study):
    gate = study.task_configs()["gate"]
    for lr, score in ((0.03, 87.0), (0.1, 88.2), (0.3, 85.0)):
        _write(study, "sts", gate, lr, score)
    pool = _Pool()
    frozen = study.Study(pool, "data", ["sts"], frozen=["sts"])
    grid = frozen.grid("sts", gate, phase1=True)
    with pytest.raises(StopIteration) as done:
        next(grid)
    assert done.value.value["learning_rate"] == 0.1 and pool.jobs == []
    # a configuration without run files gives no record, and still nothing runs
    with pytest.raises(StopIteration) as done:
        next(frozen.grid("sts", study.task_configs()["full-epochs3"], phase1=True))
    assert done.value.value is None and pool.jobs == []


def test_an_unfrozen_grid_submits_its_first_rungs(study):
    pool = _Pool()
    live = study.Study(pool, "data", ["smollm2"])
    next(live.grid("smollm2", study.task_configs()["lora-epochs1"], phase1=True))
    assert [job[2] for job in pool.jobs] == [1e-3, 3e-3, 1e-2]


def test_the_three_seed_table_marks_a_seed_run_on_another_device(study, monkeypatch):
    base = study.task_configs()["base"]
    for lr, score, seed, device in ((0.03, 86.0, 42, "NVIDIA H200"), (0.1, 86.5, 42, "NVIDIA H200"),
                                    (0.3, 20.0, 42, "NVIDIA H200"), (0.1, 86.1, 43, "NVIDIA H200"),
                                    (0.1, 86.3, 44, "x86_64")):
        _write(study, "sts", base, lr, score, seed)
        path = study.run_path("sts", base, lr, seed)
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "device": device}))
    text = study.report(["sts"])
    row = next(line for line in text.splitlines() if line.startswith("| sts | prompts |"))
    assert "| 42, 43, 44† |" in row and "86.30 ± 0.20" in row
    assert "† run on the CPU (x86_64), the other seeds on NVIDIA H200." in text


def test_a_jobs_entry_may_name_its_configuration(study):
    together = study.job_config("dcpcse", "gate+length-4+reparam+warmup")
    assert together == {**study.BASE, "gate": True, "length": 4, "projection": True, "warmup": 0.1}
    assert study.job_config("sts", "lora-epochs1") == study.task_configs()["lora-epochs1"]
    assert study.job_config("sts", together) is together
    with pytest.raises(SystemExit, match="no configuration 'gate\\+lenght-4'"):
        study.job_config("sts", "gate+lenght-4")
    with pytest.raises(SystemExit, match="does not name one configuration"):
        study.job_config("sts", "length-4+gate")
