"""The trust check under fire: the property of ``tests/test_loader_allowlist.py`` with many examples.

``test_hostile_folders_never_run_code`` builds hostile model folders (a malicious pickle and an importable
``evil.py``; dangerous keys and values at any level of any JSON file, hub kernels among them; the model nested as a
Router route; shard indexes and links pointing out of the folder) and asserts that nothing of them runs, that each is
loaded cleanly or refused in one line (through Python and the CLI), and that a folder with a path out or a hub kernel
is always refused. CI runs a few dozen examples; this script runs the same property with ``--examples N`` in a fresh
process, with a stand-in ``kernels`` package on ``PYTHONPATH`` (the one of ``tests/test_hub_bounds.py``: it records
every call, so that transformers takes kernels as installed and any request for a planted kernel is seen).

Run by hand (about a second per example on a two-core CPU)::

    python benchmarks/trust_fuzz.py --examples 1000

It writes ``benchmarks/results/trust_fuzz.json`` and ``.md``: the examples run, the time, and the findings (the
falsifying example, if any; none is the expected result).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_environment  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TEST = "tests/test_loader_allowlist.py::test_hostile_folders_never_run_code"


def _stand_in(root: Path) -> Path:
    """The stand-in kernels package of tests/test_hub_bounds.py, written under ``root``."""
    spec = importlib.util.spec_from_file_location("_hub_bounds", REPO / "tests" / "test_hub_bounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.stand_in_kernels(root)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="hypothesis examples (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--no-kernels", action="store_true", help="without the stand-in kernels package")
    parser.add_argument("--out", type=Path, default=RESULTS / "trust_fuzz", help="report path, without suffix")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error("--examples must be at least 1")

    with tempfile.TemporaryDirectory(prefix="trust-fuzz-") as scratch:
        env = {**os.environ, "ST_PROMPTS_FUZZ_EXAMPLES": str(args.examples), "HF_HUB_OFFLINE": "1"}
        log = Path(scratch) / "kernels.log"
        if not args.no_kernels:
            site = _stand_in(Path(scratch))
            env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
                       KERNELS_LOG=str(log))
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST,
                   f"--hypothesis-seed={args.seed}", "--hypothesis-show-statistics"]
        start = time.monotonic()
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
        requests = [line for line in (log.read_text().splitlines() if log.exists() else [])
                    if any(word in line for word in ("get_kernel", "kernelize", "LayerRepository", "evil"))]

    output = result.stdout + result.stderr
    # The generate phase's line: the examples drawn (shrinking and explaining a failure rerun variants of it).
    counts = re.findall(r"generate phase.*\n.*\n\s*- (\d+) passing, (\d+) failing, and (\d+) invalid", output)
    passing = [int(p) for p, _, _ in counts]
    failing = [int(f) for _, f, _ in counts]
    stopped = re.findall(r"Stopped because (.*)", output)
    findings = []
    if result.returncode != 0:
        block = output[output.find("Falsifying example"):] if "Falsifying example" in output else output[-4000:]
        findings.append(block[:4000])
    findings += [f"kernel request: {line}" for line in requests]
    report = {
        "examples_requested": args.examples, "examples_invalid": sum(int(i) for _, _, i in counts),
        "examples_passing": sum(passing), "examples_failing": sum(failing),
        "seconds": round(seconds, 1), "seconds_per_example": round(seconds / max(1, sum(passing) + sum(failing)), 2),
        "stopped_because": stopped, "stand_in_kernels": not args.no_kernels, "pytest_exit": result.returncode,
        "findings": findings,
        "command": f"python benchmarks/trust_fuzz.py --examples {args.examples} --seed {args.seed}"
                   + (" --no-kernels" if args.no_kernels else ""),
        "environment": run_environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    env_info = report["environment"]
    lines = [
        "# Trust fuzzing: hostile model folders", "",
        f"`{report['command']}` on {env_info['device']} ({env_info['cpus']} CPUs, load average "
        f"{', '.join(f'{x:.1f}' for x in env_info['load_average'])} at the end: the machine was shared).", "",
        "| examples run | failing | time (s) | s / example | stand-in kernels | findings |",
        "|---:|---:|---:|---:|---|---:|",
        f"| {report['examples_passing'] + report['examples_failing']} | {report['examples_failing']} | "
        f"{report['seconds']} | {report['seconds_per_example']} | {'yes' if report['stand_in_kernels'] else 'no'} | "
        f"{len(findings)} |", "",
    ]
    lines += ["Findings:", ""] + [f"```\n{f}\n```" for f in findings] if findings else ["No finding."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "environment"}, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(0 if not main()["findings"] else 1)
