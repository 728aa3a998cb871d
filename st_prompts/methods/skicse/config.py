"""SKICSE's settings and presets (no torch import; the model and stages are in :mod:`.method`)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from st_prompts.errors import ConfigurationError
from st_prompts.losses.constants import SUPERVISED_READINGS as READINGS
from st_prompts.methods.base import MLP_HEAD_MODES, MethodConfig, PrefixSettings, option

#: ``encoder`` values: the paper's full fine-tuning, or this package's frozen backbone with a deep prefix.
ENCODERS = ("full", "prompted")
#: What to do with training rows whose sentence has no row in the SKI file.
UNCACHED = ("drop", "fallback")
#: Label column of the SKICSE datasets: 1 where the row has SKI, 0 where it falls back to the SimCSE term.
PRESENCE_LABEL = "label"


def default_ski_file(supervised: bool) -> str:
    """The SmolLM2 SKI file shipped with st_prompts for the shared / bundled data."""
    name = "nli_premises_smollm2.jsonl" if supervised else "wiki_sentences_smollm2.jsonl"
    return str(resources.files("st_prompts") / "resources" / "ski" / name)


@dataclass
class SKICSESettings(PrefixSettings):
    """SKICSE's options (see :class:`~st_prompts.methods.base.PrefixSettings` for the shared ones; the prefix is used
    by ``encoder="prompted"`` only)."""

    encoder: str = option("full", "full: fine-tune the whole backbone (the paper); prompted: frozen backbone + "
                          "deep prefix (DCPCSE)", ENCODERS)
    ski_file: str | None = option(None, "SKI cache from 'st-prompts ski generate' (default: the packaged SmolLM2 SKI "
                                  "of the first ~2,000 shared Wikipedia sentences / NLI premises)")
    ski_weight: float = option(0.15, "unsupervised lambda: weight of InfoNCE(x; x_ski) (Eq. 3)")
    ski_weight_1: float = option(0.1, "supervised lambda1: weight of L1, the SKI-anchored term (Eq. 5, 7)")
    ski_weight_2: float = option(0.3, "supervised lambda2: weight of L2, SKI as positive of x (Eq. 6, 7)")
    reading: str = option("text", "supervised L1/L2: text (SKI anchor's positive is the entailment; L2 has x_ski in "
                          "its denominator) or printed (Eq. 5/6 as printed)", READINGS)
    ski_max_seq_length: int | None = option(None, "maximum tokens of a SKI text (default: --max-seq-length)")
    uncached: str = option("drop", "training rows whose sentence is not in the SKI file: drop, or fallback "
                           "(SimCSE term only)", UNCACHED)
    learning_rate: float | None = option(None, "peak learning rate (default: the preset of --encoder)")
    prefix_length: int | None = option(None, "deep prompt positions per layer (--encoder prompted; default: preset)")
    mlp_head: str = option("train_only", "SimCSE MLP over [CLS]: train_only, saved (kept at inference) or none",
                           MLP_HEAD_MODES)
    head_learning_rate: float | None = option(None, "learning rate of the MLP head (default: --learning-rate)")
    full_learning_rate: float = option(3e-5, "preset learning rate of --encoder full", cli=False)
    prompted_learning_rate: float = option(3e-2, "preset learning rate of --encoder prompted", cli=False)
    prompted_prefix_length: int = option(16, "preset prefix length of --encoder prompted", cli=False)

    def __post_init__(self) -> None:
        if self.learning_rate is None:
            prompted = self.encoder == "prompted"
            self.learning_rate = self.prompted_learning_rate if prompted else self.full_learning_rate
        if self.prefix_length is None:
            self.prefix_length = self.prompted_prefix_length
        super().__post_init__()
        if not 0 <= self.ski_weight <= 1:
            raise ConfigurationError(f"ski_weight (lambda) must be in [0, 1], got {self.ski_weight}.")
        if self.ski_weight_1 < 0 or self.ski_weight_2 < 0 or self.ski_weight_1 + self.ski_weight_2 > 1:
            raise ConfigurationError("Need ski_weight_1, ski_weight_2 >= 0 and ski_weight_1 + ski_weight_2 <= 1.")
        if self.ski_max_seq_length is not None and self.ski_max_seq_length < 2:
            raise ConfigurationError(f"ski_max_seq_length must be >= 2, got {self.ski_max_seq_length}.")


def presets(scale: str, supervised: bool, backbone: str | None) -> dict:
    if scale == "cpu":
        # the prompted encoder's rates were selected on STS-B dev (docs/methods/skicse.md)
        return dict(backbone="minilm", batch_size=64, full_learning_rate=5e-5 if supervised else 3e-5,
                    prompted_learning_rate=1e-1 if supervised else 3e-2,
                    prompted_prefix_length=12 if supervised else 16, epochs=1.0, eval_steps=50, max_seq_length=32,
                    ski_max_seq_length=64, mlp_head="train_only")
    return dict(backbone=backbone or "bert-base-uncased", batch_size=512, full_learning_rate=1e-4,
                prompted_learning_rate=5e-3 if supervised else 3e-2, prompted_prefix_length=12 if supervised else 16,
                epochs=3.0 if supervised else 1.0, eval_steps=125, max_seq_length=128, ski_max_seq_length=128,
                mlp_head="saved" if supervised else "train_only")


CONFIG = MethodConfig(
    name="skicse", title="SKICSE", citation="SKICSE", settings_class=SKICSESettings, presets=presets,
    paper="SKICSE: Sentence Knowable Information Prompted by LLMs Improves Contrastive Sentence Embeddings",
    description='LLM-generated "sentence knowable information" as an extra positive, full or prompted encoder',
    summary="LLM-generated sentence knowable information as an extra positive, full or prompted encoder (SKICSE)",
)
