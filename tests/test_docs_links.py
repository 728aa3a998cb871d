"""Every relative link of README.md, CONTRIBUTING.md, CHANGELOG.md, docs/ and benchmarks/results/ names a file that
exists, and a ``#fragment`` into a Markdown file one of its headings (GitHub's anchor rules) or HTML ids/names."""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", flags=re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", flags=re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*(?:[ \t]#+[ \t]*)?$", flags=re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<[a-zA-Z][^>]*\s(?:id|name)=[\"']([^\"']+)[\"']")


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
             *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks" / "results").rglob("*.md"))]
    return [p for p in found if p.is_file()]


def without_code(text: str) -> str:
    """``text`` with fenced blocks and inline code blanked (their lines kept, so line numbers still count)."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text as rendered (code, emphasis, links and HTML tags reduced to their
    text), lower-cased, every character but letters, digits, ``_``, ``-`` and spaces removed, spaces made ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.replace("`", "")
    text = re.sub(r"(\*{1,3}|_{1,3})(\S(?:.*?\S)?)\1", r"\2", text)  # emphasis
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- " or unicodedata.category(c).startswith("M"))
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor of a Markdown file: its headings' (a repeated one gets ``-1``, ``-2``, ...) and HTML ids/names."""
    raw = path.read_text(encoding="utf-8")
    text = _FENCE.sub("", raw)
    out, seen = set(), {}
    for match in _HEADING.finditer(text):
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        out.add(anchor if count == 0 else f"{anchor}-{count}")
    out.update(_HTML_ANCHOR.findall(raw))
    return frozenset(out)


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every link of ``path`` outside code."""
    text = without_code(path.read_text(encoding="utf-8"))
    found = [(m.start(1), m.group(1)) for m in _INLINE_LINK.finditer(text)]
    found += [(m.start(1), m.group(1)) for m in _REFERENCE.finditer(text)]
    return [(text.count("\n", 0, start) + 1, target.strip("<>")) for start, target in sorted(found)]


def broken(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of ``path`` (a page under ``root``), one line each."""
    problems = []
    for line, target in links(path):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{line}: ({target})"
        if file_part.startswith("/"):
            problems.append(f"{where}: an absolute path (GitHub reads it from the repository's root: write it "
                            "relative)")
        elif not resolved.exists():
            problems.append(f"{where}: no {resolved.relative_to(root) if resolved.is_relative_to(root) else resolved}")
        elif fragment and resolved.suffix == ".md" and unquote(fragment).lower() not in anchors(resolved):
            problems.append(f"{where}: {resolved.relative_to(root)} has no heading #{fragment}")
    return problems


def test_github_anchors_of_headings():
    assert github_anchor("Workers: one machine's cores, one copy of the weights (`--workers N`)") == \
        "workers-one-machines-cores-one-copy-of-the-weights---workers-n"
    assert github_anchor("The prefix gate on the CPU (issue 51)") == "the-prefix-gate-on-the-cpu-issue-51"
    assert github_anchor("`st-prompts demo`") == "st-prompts-demo"
    assert github_anchor("Which one should I use? The *readings* in [detail](x.md)") == \
        "which-one-should-i-use-the-readings-in-detail"
    assert github_anchor("Ünïcode 2× and_under") == "ünïcode-2-and_under"


def test_the_checker_finds_dead_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title\n## Twice\n## Twice\n```bash\n# not a heading\n```\n",
                                            encoding="utf-8")
    page = tmp_path / "docs" / "b.md"
    page.write_text("[ok](a.md#a-title) [ok](a.md#twice-1) [self](#here) [web](https://x.y/z) `[code](no.md)`\n"
                    "# Here\n[dead](docs/a.md) ![img](pic.png) [anchor](a.md#not-a-heading)\n"
                    "[ref]: ../missing.md\n", encoding="utf-8")
    assert broken(page, tmp_path) == [
        "docs/b.md:3: (docs/a.md): no docs/docs/a.md", "docs/b.md:3: (pic.png): no docs/pic.png",
        "docs/b.md:3: (a.md#not-a-heading): docs/a.md has no heading #not-a-heading",
        "docs/b.md:4: (../missing.md): no missing.md"]


def test_every_relative_link_of_the_documentation_resolves():
    found = pages()
    assert len(found) > 20 and sum(len(links(p)) for p in found) > 100  # the pages and their links were read
    problems = [problem for page in found for problem in broken(page)]
    assert not problems, "\n".join(problems)
