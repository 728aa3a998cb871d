"""Each cell of the README's results table is the STS-B dev / SICK-R trial mean of ``benchmarks/results/run_all/
summary.json``, and a row with fewer than three seeds says how many it has."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the README row's first words -> the benchmark rows of its two columns
ROWS = {"SimCSE": ("simcse-unsup", "simcse-sup"), "LoRA": ("lora-unsup", "lora-sup"),
        "PEFT prefix tuning": ("peft-prefix-unsup", "peft-prefix-sup"), "DCPCSE": ("dcpcse-unsup", "dcpcse-sup"),
        "D2CSE": ("d2cse-unsup", "d2cse-sup"), "SKICSE": ("skicse-prompted-unsup", "skicse-prompted-sup"),
        "DiffAug": ("diffaug-semi", "diffaug-sup")}
CELL = re.compile(r"^\s*(\d+\.\d\d) / (\d+\.\d\d)(?: \((\d) seeds?\))?\s*$")


def readme_table() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("method", "---") and not cells[0].startswith("---"):
            rows[cells[0]] = cells[1:]
    return rows


def test_every_readme_result_is_the_run_files_mean_and_says_its_seeds():
    summary = json.loads((ROOT / "benchmarks" / "results" / "run_all" / "summary.json").read_text())["rows"]
    table = readme_table()
    assert len(table) == len(ROWS), list(table)
    for label, cells in table.items():
        key = next(k for k in ROWS if label.startswith(k))
        for cell, row in zip(cells, ROWS[key]):
            match = CELL.match(cell)
            assert match, (label, cell)
            stsb, sick, seeds = match.groups()
            result = summary[row]
            assert stsb == f"{100 * result['stsb_dev']['mean']:.2f}", (row, cell)
            assert sick == f"{100 * result['sick_trial']['mean']:.2f}", (row, cell)
            assert (int(seeds) if seeds else 3) == len(result["seeds"]), (row, cell, result["seeds"])
            assert not result.get("evaluated_at_training_length"), row  # no protocol-1 number in the README
