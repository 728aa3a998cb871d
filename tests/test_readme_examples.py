"""The README's Python examples run as written, offline, in order (one interpreter, a fresh temporary folder): every
```python block of README.md, read from the file, except one preceded by a `<!-- readme-test: skip ... -->` line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def test_every_readme_python_block_runs_offline(tmp_path):
    run, skipped = readme_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(run) >= 2 and len(skipped) <= 1  # the training and bank examples run; only the server call is skipped
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(f"# --- README block {i + 1}\n{block}" for i, block in enumerate(run)) +
                      "\nprint('README EXAMPLES DONE')\n", encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "README EXAMPLES DONE" in result.stdout
    assert (tmp_path / "runs" / "dcpcse" / "README.md").is_file() and (tmp_path / "runs" / "my-bank").is_dir()
