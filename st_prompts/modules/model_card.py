"""The model card an st_prompts model carries: sentence-transformers' own card (its installed template) with a section
saying that the model needs st_prompts and how to load it, its method, paper, frozen backbone, the share of
parameters trained and its STS-B dev reading, and a usage snippet that works without ``trust_remote_code``."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sentence_transformers.sentence_transformer.model_card import SentenceTransformerModelCardData

from st_prompts.sizes import prompt_set_size
from st_prompts.storage import write_file_atomic

#: The hub id of the packaged MiniLM (what the ``minilm`` alias stands for).
PACKAGED_MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
#: Real STS-B dev pairs shown as widget and usage examples (sentences 1 and 2 of the first scored pairs).
EXAMPLE_PAIRS = (
    ("A man with a hard hat is dancing.", "A man wearing a hard hat is dancing."),
    ("A young child is riding a horse.", "A child is riding a horse."),
    ("A man is feeding a mouse to a snake.", "The man is feeding a mouse to the snake."),
)

_SECTION = """
{%- if st_prompts %}

## Trained with st_prompts

{{ st_prompts.summary }}

- **Method:** {{ st_prompts.method }}{% if st_prompts.paper %} ({% if st_prompts.paper_url %}[{{ st_prompts.paper }}]({{ st_prompts.paper_url }}){% else %}{{ st_prompts.paper }}{% endif %}){% endif %}
- **Backbone:** {{ st_prompts.backbone }}{% if st_prompts.frozen %} (frozen){% endif %}
- **Trained parameters:** {{ st_prompts.trained }}
{%- if st_prompts.stsb_dev %}
- **STS-B dev Spearman of the selected checkpoint:** {{ st_prompts.stsb_dev }}
{%- endif %}
- **Encodes:** up to {{ st_prompts.max_seq_length }} tokens per text (the saved `max_seq_length`; longer texts are truncated)
{%- if st_prompts.prompts_only %}
- **Prompts-only checkpoint:** this folder holds the soft prompts and a reference to the backbone ({{ st_prompts.backbone }}, checked by a fingerprint of its weights); the backbone is loaded from there.
{%- endif %}
{%- endif %}
{%- if st_prompts_bank %}

{{ st_prompts_bank }}
{%- endif %}
"""

#: The install lines of the card: st-prompts is not on PyPI yet, so it is installed from its source.
INSTALL = ("pip install -U sentence-transformers\n"
           "# st_prompts is not on PyPI yet: install it from a checkout of its source\n"
           "pip install -e path/to/st_prompts\n"
           "# once it is published: pip install -U st-prompts\n")


def _template() -> Path:
    """sentence-transformers' model card template with the st_prompts section and install line added, written once
    per template version to a file of the temporary folder (``ModelCard.from_template`` reads a path)."""
    source = Path(SentenceTransformerModelCardData.__dataclass_fields__["template_path"].default)
    text = source.read_text(encoding="utf-8")
    heading = text.index("\n", text.index("\n# {{ model_name") + 1)  # after the title line
    text = text[:heading] + _SECTION + text[heading:]
    text = text.replace("pip install -U sentence-transformers\n", INSTALL, 1)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"st_prompts-model-card-{os.getuid() if hasattr(os, 'getuid') else 0}-{digest}.md"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_file_atomic(path, text)
    return path


def backbone_card_name(name_or_path: str) -> str:
    """How a card names a backbone: the packaged MiniLM's hub id, a hub id, or a local folder's name."""
    from st_prompts.utils import PACKAGED_MINILM_ALIASES, packaged_minilm_alias

    if name_or_path in PACKAGED_MINILM_ALIASES or packaged_minilm_alias(name_or_path):
        return PACKAGED_MINILM_HUB_ID
    if os.path.exists(name_or_path):
        return os.path.basename(os.path.normpath(name_or_path))
    return name_or_path


@dataclass
class PromptsModelCardData(SentenceTransformerModelCardData):
    """sentence-transformers' model card data, with what an st_prompts model's card must say.

    Args (besides sentence-transformers' own):
        method: the st_prompts method that trained the model (``"dcpcse"``, ...).
        method_title: its name as written (``"DiffAug"``); paper, paper_url: its paper (the method's ``CONFIG``).
        backbone: the backbone's name (a hub id where one is known).
        stsb_dev: the STS-B dev Spearman (x 100) of the selected checkpoint, if one was selected.
        prompts_only: the card of a prompts-only checkpoint.
    """

    method: str | None = None
    method_title: str | None = None
    paper: str | None = None
    paper_url: str | None = None
    backbone: str | None = None
    stsb_dev: float | None = None
    prompts_only: bool = False
    generate_widget_examples: bool = False
    template_path: Path = field(default_factory=_template, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.widget:
            self.widget = [{"source_sentence": a, "sentences": [b, *(p[1] for p in EXAMPLE_PAIRS if p[1] != b)]}
                           for a, b in EXAMPLE_PAIRS[:1]]
        if self.usage_examples is None:
            self.usage_examples = [EXAMPLE_PAIRS[0][0], EXAMPLE_PAIRS[0][1], EXAMPLE_PAIRS[1][0]]
        self.tags = list(dict.fromkeys([*self.tags, "st-prompts", "prompt-tuning"]))

    def trained_share(self) -> str:
        """``"73,728 of 22,786,176 (0.32 %)"`` for the model this card describes."""
        if self.model is None:
            return "unknown"
        parameters = list(self.model.parameters())
        trained = sum(p.numel() for p in parameters if p.requires_grad)
        total = sum(p.numel() for p in parameters)
        return f"{trained:,} of {total:,} ({100 * trained / max(total, 1):.2f} %)"

    def bank(self) -> Any:
        """The model's :class:`~st_prompts.PromptedTransformer` when the model is a prompt bank, else ``None``."""
        encoder = self.model[0] if self.model is not None and len(self.model) else None
        return encoder if getattr(getattr(encoder, "sets", None), "is_bank", False) else None

    def get_default_model_name(self) -> str:
        bank = self.bank()
        if bank is not None and not self.method:
            return f"Prompt bank on {self.backbone or backbone_card_name(bank.backbone_reference)}"
        if self.method:
            return f"{self.method_title or self.method.upper()} on {self.backbone or 'its backbone'}"
        return super().get_default_model_name()

    def backbone_frozen(self) -> bool:
        """Whether the model's backbone is frozen (a prompted encoder that keeps it so)."""
        return any(getattr(module, "freeze_backbone", False) for module in (self.model or []))

    @classmethod
    def replacing(cls, card: SentenceTransformerModelCardData, **changes: Any) -> PromptsModelCardData:
        """A card of this class holding everything ``card`` holds (``changes`` on top)."""
        values = {f.name: getattr(card, f.name) for f in fields(card) if f.init and f.name in cls.__dataclass_fields__}
        new = cls(**{**values, **changes})
        for f in fields(card):  # what the card learnt since it was made (trainer callbacks, evaluations, ...)
            value = getattr(card, f.name)
            if not f.init and f.name != "template_path" and f.name in cls.__dataclass_fields__ and value:
                setattr(new, f.name, value)
        return new

    def get_model_specific_metadata(self) -> dict[str, Any]:
        metadata = super().get_model_specific_metadata()
        bank = self.bank()
        if bank is not None:
            metadata["st_prompts_bank"] = bank_section(bank, self.backbone or backbone_card_name(bank.backbone_reference),
                                                       self.model_id or "path/to/this/bank")
        if self.method is None:
            return metadata
        kind = "prompts-only checkpoint" if self.prompts_only else "model"
        metadata["st_prompts"] = {
            "summary": (f"This {kind} was trained with st_prompts ({self.method}). Load it with st_prompts installed; "
                        "`st_prompts.loading.load_sentence_model` loads only st_prompts' and sentence-transformers' "
                        "own classes, while `SentenceTransformer(..., trust_remote_code=True)` trusts every class the "
                        "folder names."),
            "method": self.method,
            "paper": self.paper,
            "paper_url": self.paper_url,
            "backbone": self.backbone or "unknown",
            "frozen": self.backbone_frozen(),
            "trained": self.trained_share(),
            "stsb_dev": f"{self.stsb_dev:.2f}" if self.stsb_dev is not None else None,
            "prompts_only": self.prompts_only,
            "max_seq_length": self.model.max_seq_length if self.model is not None else "unknown",
        }
        return metadata

    def generate_usage_snippet(self) -> str:
        model_id = self.model_id or "path/to/this/model"
        examples = self.usage_examples_display or self.usage_examples or [p[0] for p in EXAMPLE_PAIRS]
        lines = [
            "```python",
            "from sentence_transformers import SentenceTransformer",
            "from st_prompts.loading import load_sentence_model",
            "",
            "# st_prompts' and sentence-transformers' own classes only (nothing else the folder names runs):",
            f'model = load_sentence_model("{model_id}")',
            "# or, trusting every class and auto_map the folder names:",
            f'# model = SentenceTransformer("{model_id}", trust_remote_code=True)',
            "sentences = [",
            *(f"    {text!r}," for text in examples),
            "]",
            "embeddings = model.encode(sentences)",
            "similarities = model.similarity(embeddings, embeddings)",
            "```",
        ]
        return "\n".join(lines)


def _cell(text: Any) -> str:
    """``text`` as one markdown table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _score(value: Any) -> str:
    return f"{100 * value:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def bank_section(encoder: Any, backbone: str, model_id: str) -> str:
    """The card section of a prompt bank: its prompt sets (size, training record and selection score beside the
    backbone's) and how to encode per call and per row."""
    names = encoder.prompt_set_names
    roles = {"default": encoder.default_task, "query": encoder.query_task, "document": encoder.document_task}
    lines = ["## A prompt bank (st_prompts)", "",
             f"A frozen {backbone} with {len(names)} named prompt set{'s' if len(names) != 1 else ''} (deep prefixes "
             "trained with st_prompts), each chosen per call or per row; rows of different tasks share one forward "
             "pass. Without a task the bank encodes with "
             + (f"the set `{roles['default']}`." if roles["default"] else "the backbone as shipped.")]
    if names:
        lines += ["", "| prompt set | prefix positions | trainable parameters | stored parameters | trained on | "
                  "selected by | selection score (step) | step 0 | backbone |",
                  "|---|---:|---:|---:|---|---|---:|---:|---:|"]
        for name in names:
            module = encoder.prompt_sets[name]
            info = encoder.prompt_set_info.get(name, {})
            size = prompt_set_size(module)  # a reparameterised set trains its MLP but stores the prefix it computes
            trained = ", ".join(part for part in (
                f"{info['rows']:,} rows" if isinstance(info.get("rows"), int) else "",
                _cell(info["loss"]) if info.get("loss") else "",
                f"{info['steps']:,} step{'s' if info['steps'] != 1 else ''}" if isinstance(info.get("steps"), int) else "") if part)
            best = _score(info.get("best_score"))
            if best and info.get("best_step") is not None:
                best += f" ({info['best_step']})"
            cells = [f"`{name}`", str(encoder.prompt_set_options()[name]["prefix_length"]),
                     f"{size.trainable_parameters:,}", f"{size.stored_parameters:,}",
                     trained or "not recorded", _cell(info.get("evaluator") or ""), best,
                     _score(info.get("start_score")), _score(info.get("backbone_score"))]
            lines.append("| " + " | ".join(cells) + " |")
        metrics = sorted({_cell(info["metric"]) for info in encoder.prompt_set_info.values()
                          if isinstance(info.get("metric"), str) and info["metric"]})
        if metrics:
            lines += ["", f"Scores: the selection evaluator's {', '.join(metrics)} × 100; the kept weights are the "
                      "best evaluation's (step 0: the set as it started; backbone: the shipped model, recorded for "
                      "gated sets, which start as the backbone)."]
        set_roles = [f"{role}: `{value}`" for role, value in roles.items() if value]
        if set_roles:
            lines += ["", "Roles: " + ", ".join(set_roles) + "."]
    first = names[0] if names else "NAME"
    per_row = ", ".join(f'"{names[i % len(names)]}"' for i in range(2)) if names else '"NAME", "NAME"'
    lines += ["", "Encode with one set per call, or one per row (mixed rows share forward passes):", "",
              "```python", "from sentence_transformers import SentenceTransformer",
              "from st_prompts.loading import load_sentence_model", "",
              f'model = load_sentence_model("{model_id}")  # runs only st_prompts\' and sentence-transformers\' classes',
              f'# model = SentenceTransformer("{model_id}", trust_remote_code=True)  # trusts everything the folder names',
              f'texts = ["{EXAMPLE_PAIRS[0][0]}", "{EXAMPLE_PAIRS[1][0]}"]',
              f'embeddings = model.encode(texts, task="{first}")  # per call',
              f"embeddings = model.encode(texts, task=[{per_row}])  # per row",
              "```"]
    return "\n".join(lines)
