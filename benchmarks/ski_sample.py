"""What the packaged SmolLM2 SKI looks like: a few statistics and a seeded sample of each shipped SKI file.

Run by hand::

    python benchmarks/ski_sample.py            # writes benchmarks/results/ski_sample.md

SKICSE's Figure 1 shows LLaMA2-7B answering the prompt with knowledge about the sentence's entities, its meaning and
its grammar. The statistics here say how far a 135M-parameter model gets: how much of the sentence's content words
the answer mentions (a crude proxy for staying on topic), how often it shares none of them, and how often it answers
like a chat assistant ("I'm sorry", "how can I help") instead of about the sentence.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_prompts.methods.skicse.config import default_ski_file  # noqa: E402

STOPWORDS = set("the a an of in on at to and or is are was were be by for with as that this it its from his her their "
                "they he she has have had not but".split())
ASSISTANT = re.compile(r"(i'm sorry|i am sorry|i'm ready|how can i (help|assist)|what can i (help|assist)|as an ai|"
                       r"i apologi|i can't|i cannot)", re.IGNORECASE)


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOPWORDS and len(w) > 2}


def describe(path: str, sample: int, seed: int) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    header, rows = rows[0], rows[1:]
    answered = [r for r in rows if r.get("ski")]
    recall = []
    for r in answered:
        words = content_words(r["sentence"])
        if words:
            recall.append(len(words & content_words(r["ski"])) / len(words))
    lines = [
        f"## `{Path(path).name}`",
        "",
        f"Model `{header.get('model')}`; {len(rows):,} sentences, {len(rows) - len(answered):,} without SKI (recorded "
        f"missing); answers of median {statistics.median(len(r['ski'].split()) for r in answered):.0f} words.",
        "",
        f"- share of the sentence's content words that the answer repeats (mean): {statistics.fmean(recall):.2f}",
        f"- answers sharing no content word with their sentence: {sum(v == 0 for v in recall) / len(recall):.1%}",
        f"- answers in chat-assistant style (apologies, offers of help): "
        f"{sum(bool(ASSISTANT.search(r['ski'])) for r in answered) / len(answered):.1%}",
        "",
        f"Sample (seed {seed}):",
        "",
    ]
    for r in random.Random(seed).sample(rows, sample):
        lines += [f"- **{r['sentence'].strip()}**", f"  → {r['ski'] or '(missing)'}"]
    return lines + [""]


def main() -> int:
    lines = ["# The packaged SmolLM2 SKI (`python benchmarks/ski_sample.py`)", ""]
    for supervised in (False, True):
        lines += describe(default_ski_file(supervised), sample=5, seed=1)
    out = Path(__file__).resolve().parent / "results" / "ski_sample.md"
    out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
