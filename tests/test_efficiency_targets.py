"""The efficiency benchmark's target checks (benchmarks/efficiency.py): the step-time and encode-throughput targets are
read from the paired measurements (one process, interleaved) when there are some, and say which numbers they used."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def efficiency():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("efficiency", REPO / "benchmarks" / "efficiency.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def row(step, memory, encode, setting="unsupervised"):
    return {"setting": setting, "step_seconds": {"median": step}, "memory": {"peak_mib": memory},
            "throughput": {"ratio": encode, "all": {"model": [1.0, 1.0, 1.0]}}}


def test_targets_use_the_paired_step_times_and_encode_ratios(efficiency):
    results = {"simcse-unsup": row(2.0, 1000, 1.0), "lora-unsup": row(1.6, 700, 0.98),
               "peft-prefix-unsup": row(1.4, 650, 0.95), "dcpcse-unsup": row(1.5, 640, 0.93)}

    def paired(dcpcse_steps, encode_ratios):
        rows = {name: {"seconds": [1.0, 1.0, 1.0]} for name in ("simcse-unsup", "lora-unsup", "peft-prefix-unsup")}
        rows["dcpcse-unsup"] = {"seconds": dcpcse_steps,
                                "encode": {"vs_backbone": encode_ratios,
                                           "median_vs_backbone": sorted(encode_ratios)[len(encode_ratios) // 2],
                                           "quartiles_vs_backbone": [min(encode_ratios), max(encode_ratios)]}}
        return {"unsup": {"rows": rows}}

    # separate processes say DCPCSE is slower than PEFT prefix tuning and encodes at 0.93: the paired runs decide
    checks = dict(efficiency.ratios(results, paired([0.99, 0.98, 1.01], [0.97, 0.96, 0.94])))
    step = next(k for k in checks if "step time" in k)
    encode = next(k for k in checks if "encode" in k)
    assert checks[step] and "0.990 × PEFT prefix" in step
    assert checks[encode] and "median of 3 batches: 0.960" in encode and "in its own process: 0.930" in encode
    checks = dict(efficiency.ratios(results, paired([1.02, 1.01, 0.99], [0.94, 0.93, 0.96])))
    assert not any(ok for text, ok in checks.items() if "step time" in text or "encode" in text)
    # memory: 640 MiB against 700 / 650, and 0.64 × SimCSE
    assert all(ok for text, ok in checks.items() if "memory" in text)
    # without a paired run, the separate-process numbers are used
    checks = dict(efficiency.ratios(results, None))
    assert not next(ok for text, ok in checks.items() if "encode" in text)
    assert not next(ok for text, ok in checks.items() if "step time" in text)  # 1.5 s against PEFT prefix's 1.4 s
