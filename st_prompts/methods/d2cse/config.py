"""D2CSE's settings and presets (no torch import; the model and stages are in :mod:`.method`)."""

from __future__ import annotations

from dataclasses import dataclass

from st_prompts.errors import ConfigurationError
from st_prompts.losses.constants import BACKBONE_GENERATOR
from st_prompts.methods.base import MethodConfig, PrefixSettings, option

#: D2CSE table 7, unsupervised: backbone -> (batch size, learning rate, prompt length, [CLS] prompt); 2 epochs
UNSUPERVISED_TABLE = {
    "bert-base-uncased": (144, 0.021, 16, False),
    "bert-large-uncased": (144, 0.034, 16, False),
    "roberta-base": (128, 0.044, 16, True),
}
#: D2CSE table 7, supervised: backbone -> (batch size, learning rate, prompt length, [CLS] prompt); 10 epochs
SUPERVISED_TABLE = {
    "bert-base-uncased": (256, 0.055, 12, True),
    "roberta-base": (256, 0.024, 12, True),
}
#: Table 7 for every setting: masking ratio 0.3, λ 0.005. Epochs: 2 unsupervised, 10 supervised.
PAPER_MASKING_RATIO = 0.3
PAPER_CRTD_WEIGHT = 0.005
#: The generator per backbone: "a distilled version of BERT" (D2CSE §3); for RoBERTa its distilled twin, which shares
#: RoBERTa's vocabulary (DiffCSE's RoBERTa runs use distilroberta-base the same way).
PAPER_GENERATORS = {
    "bert-base-uncased": "distilbert-base-uncased",
    "bert-large-uncased": "distilbert-base-uncased",
    "roberta-base": "distilroberta-base",
}


@dataclass
class D2CSESettings(PrefixSettings):
    """D2CSE's options (see :class:`~st_prompts.methods.base.PrefixSettings` for the shared ones)."""

    cls_prompt: bool = option(False, "trainable [CLS] prompt replacing the static [CLS] input embedding (table 7)")
    crtd_weight: float = option(PAPER_CRTD_WEIGHT, "lambda: weight of the conditional replaced-token detection loss")
    masking_ratio: float = option(PAPER_MASKING_RATIO, "share of tokens masked before the generator fills them")
    generator: str = option(BACKBONE_GENERATOR, "masked LM that corrupts the sentences: a Hugging Face name or path "
                            "sharing the backbone's vocabulary (paper: distilbert-base-uncased), or backbone-mlm (offline "
                            "fallback: the frozen backbone with an MLM head trained briefly on the training sentences)")
    generator_steps: int | None = option(None, "backbone-mlm: training steps of the generator's MLM head (default: 2 "
                                         "epochs over the training sentences, at most 300)")
    generator_learning_rate: float = option(3e-3, "backbone-mlm: learning rate of the generator's MLM head")
    corruption_cache: str | None = option(None, "directory of the corruption cache (default: $ST_PROMPTS_CACHE/"
                                          "corruptions or ~/.cache/st_prompts/corruptions)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.masking_ratio < 1.0:
            raise ConfigurationError(f"masking_ratio must be in (0, 1), got {self.masking_ratio!r}.")
        if self.crtd_weight < 0:
            raise ConfigurationError(f"crtd_weight must be >= 0, got {self.crtd_weight!r}.")
        if self.generator_steps is not None and self.generator_steps < 0:
            raise ConfigurationError(f"generator_steps must be >= 0, got {self.generator_steps!r}.")


def presets(scale: str, supervised: bool, backbone: str | None) -> dict:
    if scale == "cpu":
        # DCPCSE's CPU budget (batch 64, one epoch, prefix 16 / 12), so that the two methods compare at equal data,
        # steps and batch; learning rates selected on STS-B dev; [CLS] prompt as table 7's BERT-base column; the
        # offline generator; no prefix gate (it did not help this preset). Readings: docs/methods/d2cse.md.
        return dict(backbone="minilm", batch_size=64, learning_rate=1e-1,
                    prefix_length=12 if supervised else 16,
                    cls_prompt=supervised, epochs=1.0, eval_steps=50, generator=BACKBONE_GENERATOR)
    backbone = backbone or "bert-base-uncased"
    table = SUPERVISED_TABLE if supervised else UNSUPERVISED_TABLE
    if backbone not in table:
        raise ConfigurationError(
            f"No paper hyperparameters for {backbone!r} ({'supervised' if supervised else 'unsupervised'}); D2CSE's "
            f"table 7 covers {', '.join(table)}. Use scale='cpu' (its CPU preset; --scale cpu on the command line), or "
            "give batch_size, learning_rate, prefix_length, cls_prompt and generator (--batch-size, --learning-rate, "
            "--prefix-length, --cls-prompt, --generator) with it, or one of those backbones."
        )
    batch, lr, prefix, cls_prompt = table[backbone]
    return dict(backbone=backbone, batch_size=batch, learning_rate=lr, prefix_length=prefix, cls_prompt=cls_prompt,
                masking_ratio=PAPER_MASKING_RATIO, crtd_weight=PAPER_CRTD_WEIGHT, epochs=10.0 if supervised else 2.0,
                eval_steps=125, generator=PAPER_GENERATORS[backbone])


CONFIG = MethodConfig(
    name="d2cse", title="D2CSE", citation="Lee 2022", settings_class=D2CSESettings, presets=presets,
    paper="D2CSE: Difference-aware Deep continuous prompts for Contrastive Sentence Embeddings (Lee, 2022)",
    paper_url="https://arxiv.org/abs/2304.08991",
    description=("deep prompts, an optional [CLS] prompt and conditional replaced-token detection by the same "
                 "frozen encoder"),
    summary="deep prompts + [CLS] prompt + conditional replaced-token detection by the same frozen encoder (Lee 2022)",
    quick=(("generator_steps", 2),),
    last_stage_alone=(("generator_steps", 5),),  # the generator trains before the stage; its quality is not timed
)
