"""The command modules import only light modules at top level, so that ``st-prompts --help`` is fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "sentence_transformers", "transformers", "faiss", "datasets", "matplotlib", "numpy")
COMMANDS = ("evaluate", "plot", "index")

# ``st_prompts/__init__.py`` may import heavy parts of the package: a bare package object stands in for it. The heavy
# modules are listed after each command module's import: what that module pulled in first.
PROBE = """
import argparse, json, sys, types
package = types.ModuleType("st_prompts")
package.__path__ = [{package_dir!r}]
sys.modules["st_prompts"] = package
heavy = {{}}
for name in {commands!r}:
    module = __import__(f"st_prompts.commands.{{name}}", fromlist=["add_parser"])
    module.add_parser(argparse.ArgumentParser().add_subparsers())
    heavy[name] = sorted(m for m in {heavy!r} if m in sys.modules)
print(json.dumps(heavy))
"""


def test_command_modules_do_not_import_heavy_libraries():
    package_dir = str(Path(__file__).resolve().parents[1] / "st_prompts")
    code = PROBE.format(package_dir=package_dir, commands=COMMANDS, heavy=HEAVY)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {name: [] for name in COMMANDS}


def test_torch_threads_sleep_while_they_wait_unless_the_user_chose(monkeypatch):
    """``configure_output`` (run before any command imports torch) sets ``OMP_WAIT_POLICY=PASSIVE``, which libgomp
    reads when torch loads it; a policy the user set is kept (benchmarks/results/omp_wait.md)."""
    import os

    from st_prompts import cli

    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY",
                 "TOKENIZERS_PARALLELISM"):  # what configure_output also sets: restored after the test
        monkeypatch.setenv(name, os.environ[name]) if name in os.environ else monkeypatch.delenv(name, raising=False)
    try:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        cli.configure_output(progress=False)
        assert cli.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        cli.configure_output(progress=False)
        assert cli.os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    finally:
        cli.reset_output()
