"""DiffAug's settings and presets (no torch import; the model and stages are in :mod:`.method`)."""

from __future__ import annotations

from dataclasses import dataclass

from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import MethodConfig, PrefixSettings, option
from st_prompts.prompts.features import DENOISING_POSITIONS
from st_prompts.prompts.templates import PROMPTBERT_TEMPLATE

#: ``--stage1-switch`` values.
SWITCH_RULES = ("steps", "diagnostics")
#: ``--stage1-schedule`` values: the official one (linear decay over the stage-2 length, stage 1 stops before it
#: ends) or a schedule that decays to 0 within stage 1.
STAGE1_SCHEDULES = ("official", "stage1")
#: ``--kappa-threshold`` default (docs/methods/diffaug.md says how it was chosen).
DEFAULT_KAPPA_THRESHOLD = 0.0
#: ``--pooling`` values: the template's [MASK] state (the paper), or no template and [CLS] / mean pooling of the last
#: layer (the official code's ``apply_prompt=False``, which takes the last layer's [CLS] state).
POOLINGS = ("mask", "cls", "mean")
#: Table 5 (BERT-base): setting -> (stage-1 steps, stage-2 lr, stage-2 batch, stage-2 epochs); stage 1: lr 1e-3, batch 128.
PAPER_TABLE = {
    "semi": (2000, 1e-5, 256, 1.0),
    "semi_aux": (1500, 1e-5, 256, 1.0),
    "sup": (1250, 5e-5, 128, 3.0),
}
#: Files of a stage-1 checkpoint besides the prompts-only model.
STAGE1_MARKER = "diffaug_stage1.json"
STAGE1_CLASSIFIER = "nli_classifier.safetensors"
STAGE1_MLP = "mlp.safetensors"
#: Suffix of the stage-1 checkpoint written beside the output folder.
STAGE1_SUFFIX = "-stage1"
#: The kind its manifest records (a save of it replaces only a folder of this kind).
STAGE1_KIND = "DiffAug stage-1 checkpoint"


@dataclass
class DiffAugSettings(PrefixSettings):
    """DiffAug's options. ``learning_rate``, ``batch_size``, ``epochs`` and ``max_steps`` are those of stage 2."""

    prefix_length: int = option(8, "prefix positions per view l (the encoder holds 2l: one half per view)")
    prefix_projection: bool = option(True, "reparameterise the prefix with an MLP (Embedding -> Linear -> Tanh -> "
                                     "Linear; the official code always does)")
    prefix_hidden_size: int | None = option(None, "hidden size of that MLP (default: the backbone's hidden size H, as "
                                            "in the official code)")
    same_prefix: bool = option(False, "ablation 'same prefix': one prefix of l positions seen by both sentences")
    pooling: str = option("mask", "sentence vector: the template's [MASK] state (paper), or no template and the "
                          "last layer's [CLS] state or mean (the official code's apply_prompt=False)", POOLINGS)
    template: str = option(PROMPTBERT_TEMPLATE, "hard template with one [X] (sentence) and one [MASK] (pooled); "
                           "used only with --pooling mask")
    template_denoising: bool = option(True, "subtract the template-only [MASK] state in stage 2's contrastive loss "
                                      "(the official code)")
    denoising_positions: str = option("official", "where the subtracted template-only state is taken: official (as "
                                      "the official get_delta: tokens after the sentence l positions further, a "
                                      "prefix draw of its own) or exact (the full input's positions and draw)",
                                      DENOISING_POSITIONS)
    inference_denoising: bool = option(False, "also subtract it in STS-B dev selection and in the saved model (the "
                                       "official evaluation does not)")
    stage1_template_denoising: bool = option(False, "also denoise in stage 1 (the official code does not: the paper "
                                             "applies denoising 'for contrastive learning')")
    mlp_train: bool = option(True, "training-only MLP over the pooled output: frozen in stage 1, trained in stage 2, "
                             "never saved (the official --mlp_train)")
    stage1_steps: int | None = option(None, "stage-1 steps (the most, with --stage1-switch diagnostics); default: "
                                      "table 5 (2000 semi, 1500 semi with aux, 1250 sup)")
    stage1_learning_rate: float = option(1e-3, "stage-1 learning rate (prefix and NLI classifier)")
    stage1_batch_size: int = option(128, "stage-1 batch: NLI triplets per step (two classifier rows each)")
    stage1_schedule: str = option("official", "official: the stage-1 rate decays linearly over the stage-2 length "
                                  "and stage 1 stops before; stage1: it decays to 0 over stage 1", STAGE1_SCHEDULES)
    stage1_switch: str = option("steps", "end stage 1 after --stage1-steps, or by the delta/kappa rule (diagnostics)",
                                SWITCH_RULES)
    kappa_threshold: float = option(DEFAULT_KAPPA_THRESHOLD, "diagnostics rule: end stage 1 once delta has peaked "
                                    "and kappa < this")
    diagnostics_steps: int = option(50, "compute delta and kappa every this many stage-1 steps")
    diagnostics_samples: int = option(64, "probe pairs for delta and kappa")
    backbone_learning_rate: float | None = option(None, "stage-2 learning rate of the backbone (default: "
                                                  "--learning-rate; table 5: 1e-5 semi, 5e-5 sup)")
    aux_weight: float = option(0.0, "semi-supervised stage 2: weight of the auxiliary NLI cross-entropy (paper: 1e-3)")
    label_fraction: float = option(1.0, "share of the NLI triplets used (low-label setting: 0.01 or 0.1), drawn with "
                                   "--seed")
    skip_stage1: bool = option(False, "ablation 'no stage 1': stage 2 from a randomly initialised prefix")
    stage1_from: str | None = option(None, "start stage 2 from this stage-1 checkpoint (OUTPUT-stage1 of a run) "
                                     "instead of running stage 1")
    save_stage1: bool = option(True, "save the stage-1 result beside the output (OUTPUT-stage1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage1_steps is None:
            key = "sup" if self.supervised else ("semi_aux" if self.aux_weight > 0 else "semi")
            self.stage1_steps = PAPER_TABLE[key][0] if self.scale == "paper" else 200
        if self.aux_weight < 0:
            raise ConfigurationError(f"aux_weight must be >= 0, got {self.aux_weight}.")
        if self.aux_weight > 0 and self.supervised:
            raise ConfigurationError("The auxiliary NLI loss belongs to the semi-supervised setting (DiffAug's "
                                     "supervised stage 2 already trains on NLI triplets).")
        if not 0.0 < self.label_fraction <= 1.0:
            raise ConfigurationError(f"label_fraction must be in (0, 1], got {self.label_fraction}.")
        if self.skip_stage1 and self.stage1_from:
            raise ConfigurationError("Give either --skip-stage1 or --stage1-from, not both.")
        if self.stage1_steps < 1 and not (self.skip_stage1 or self.stage1_from):
            raise ConfigurationError(
                f"stage1_steps={self.stage1_steps}: DiffAug's stage 2 needs the prefix trained by stage 1. Pass "
                "--skip-stage1 for the paper's 'no stage 1' ablation, or --stage1-from a stage-1 checkpoint."
            )
        if self.stage1_batch_size < 1:
            raise ConfigurationError("stage1_batch_size must be >= 1 (triplets per step).")

    @property
    def uses_template(self) -> bool:
        """Whether the PromptBERT template (and its denoising) is used: only with [MASK] pooling."""
        return self.pooling == "mask"

    @property
    def num_views(self) -> int:
        """Views of the prefix: 2 (two prefixes), or 1 with ``same_prefix``."""
        return 1 if self.same_prefix else 2

    @property
    def encoder_prefix_length(self) -> int:
        """Positions of the encoder's prefix: ``2l`` (``l`` with ``same_prefix``)."""
        return self.prefix_length * self.num_views


def presets(scale: str, supervised: bool, backbone: str | None) -> dict:
    if scale == "cpu":
        # Packaged all-MiniLM-L6-v2 on the shared data: stage 1 200 steps of 32 NLI triplets at 3e-3 (selected on
        # STS-B dev; 1e-2 sits at a cliff where stage 1 collapses), stage 2 one epoch of batch 64; the prefix gate
        # where it helped (semi-supervised). Readings: docs/methods/diffaug.md.
        values = dict(backbone="minilm", batch_size=64, learning_rate=5e-5 if supervised else 1e-5, epochs=1.0,
                      eval_steps=50, stage1_batch_size=32, stage1_learning_rate=3e-3, prefix_length=8,
                      prefix_gate=not supervised)
        if backbone in (None, "minilm"):
            # A measured deviation from the paper, for this backbone only: all-MiniLM-L6-v2 has no MLM head and its
            # template [MASK] state carries no NLI signal (benchmarks/results/diffaug_probe.md), so both settings
            # collapse with the template; [CLS] without it (the official apply_prompt=False) does not.
            values["pooling"] = "cls"
        return values
    stage1, lr, batch, epochs = PAPER_TABLE["sup" if supervised else "semi"]
    # The official supervised script runs batches of 128 with --gradient_accumulation_steps 4 (table 5 reads 128).
    return dict(backbone=backbone or "bert-base-uncased", batch_size=batch, learning_rate=lr, epochs=epochs,
                eval_steps=50, stage1_batch_size=128, stage1_learning_rate=1e-3, prefix_length=8,
                max_seq_length=32, gradient_accumulation_steps=4 if supervised else 1)


def side_outputs(settings: DiffAugSettings) -> tuple[tuple[str, str], ...]:
    """``OUTPUT-stage1``: the stage-1 checkpoint a run saves beside its output (unless it skips or loads stage 1)."""
    if settings.save_stage1 and not (settings.stage1_from or settings.skip_stage1):
        return ((STAGE1_SUFFIX, STAGE1_KIND),)
    return ()


CONFIG = MethodConfig(
    name="diffaug", title="DiffAug", citation="Wang & Lu 2022", settings_class=DiffAugSettings, presets=presets,
    supervision=("semi-supervised", "supervised"), prompts_only=False, side_outputs=side_outputs,
    paper="Differentiable Data Augmentation for Contrastive Sentence Representation Learning (Wang & Lu, 2022)",
    paper_url="https://arxiv.org/abs/2210.16536",
    description="two prefix views as a differentiable augmentation: prefix tuning on NLI, then joint tuning",
    summary="two prefixes as a differentiable augmentation, prefix tuning then joint tuning (Wang & Lu 2022)",
    quick=(("stage1_steps", 1), ("stage1_batch_size", 16), ("diagnostics_steps", 1), ("diagnostics_samples", 8)),
    last_stage_alone=(("skip_stage1", True),),
)
