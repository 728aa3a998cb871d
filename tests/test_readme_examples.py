"""The README's Python examples run as written, offline, in order (one script, a fresh temporary folder): every
```python block of README.md, read from the file, except one preceded by a `<!-- readme-test: skip ... -->` line."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = "<!-- readme-test: skip"


def readme_blocks(text: str) -> tuple[list[str], list[str]]:
    """(blocks to run, blocks marked as not runnable) of a Markdown text."""
    run, skipped = [], []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        (skipped if before.startswith(SKIP) else run).append(match.group(1))
    return run, skipped


def test_the_block_reader_finds_blocks_and_honours_the_marker():
    text = "x\n```python\na = 1\n```\n<!-- readme-test: skip (server) -->\n```python\nb()\n```\n```bash\nls\n```\n"
    assert readme_blocks(text) == (["a = 1\n"], ["b()\n"])


def test_every_readme_python_block_runs_offline(tmp_path, monkeypatch, capsys):
    """One script in this process (no interpreter start), the hub off, and for speed STS-B dev selection on 200 of
    its 1,500 pairs."""
    from huggingface_hub import constants

    from st_prompts.training import pipeline

    full_dev = pipeline.stsb_dev_evaluator
    monkeypatch.setattr(pipeline, "stsb_dev_evaluator", lambda *a, **k: pipeline.dev_subset(full_dev(*a, **k), 200))

    run, skipped = readme_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(run) >= 2 and len(skipped) <= 1  # the training and bank examples run; only the server call is skipped
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(f"# --- README block {i + 1}\n{block}" for i, block in enumerate(run)) +
                      "\nprint('README EXAMPLES DONE')\n", encoding="utf-8")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    assert "README EXAMPLES DONE" in capsys.readouterr().out
    assert (tmp_path / "runs" / "dcpcse" / "README.md").is_file() and (tmp_path / "runs" / "my-bank").is_dir()
