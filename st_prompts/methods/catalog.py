"""The methods tables of ``README.md`` and ``docs/index.md``, written from the registry (no torch).

Each file holds its table between :data:`BEGIN` and :data:`END`, a row per method from its ``CONFIG``, linking
``docs/methods/<name>.md``. ``python -m st_prompts.methods.catalog`` rewrites both (``--check``: exit 1 if stale).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from st_prompts import methods

__all__ = ["BEGIN", "END", "TABLES", "methods_table", "stale", "write"]

BEGIN = "<!-- methods: begin (written by python -m st_prompts.methods.catalog) -->"
END = "<!-- methods: end -->"
#: The files holding a table, relative to the repository, and the path from each to ``docs/methods/``.
TABLES = {"README.md": "docs/methods/", "docs/index.md": "methods/"}


def methods_table(link: str) -> str:
    """The Markdown table of every registered method, its page linked as ``link + <name>.md``."""
    rows = ["| method | paper | in one line |", "|---|---|---|"]
    for name in methods.names():
        config = methods.config(name)
        rows.append(f"| [{config.title}]({link}{name}.md) | {config.citation} | {config.description} |")
    return "\n".join(rows)


def _replaced(text: str, table: str, where: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{where} has no {BEGIN!r} ... {END!r} block for the methods table.")
    return text[:start + len(BEGIN)] + "\n" + table + "\n" + text[end:]


def stale(root: Path) -> list[str]:
    """The files under ``root`` whose methods table is not the registry's."""
    found = []
    for name, link in TABLES.items():
        text = (root / name).read_text(encoding="utf-8")
        if _replaced(text, methods_table(link), name) != text:
            found.append(name)
    return found


def write(root: Path) -> list[str]:
    """Rewrite the stale tables under ``root``; returns the files written."""
    written = stale(root)
    for name in written:
        path = root / name
        path.write_text(_replaced(path.read_text(encoding="utf-8"), methods_table(TABLES[name]), name),
                        encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m st_prompts.methods.catalog", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: here)")
    parser.add_argument("--check", action="store_true", help="only say which tables are stale (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        found = stale(args.root)
        print("stale: " + ", ".join(found) if found else "the methods tables are current")
        return 1 if found else 0
    written = write(args.root)
    print("wrote " + ", ".join(written) if written else "the methods tables are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
