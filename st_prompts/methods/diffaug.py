"""DiffAug (Wang & Lu, 2022): two prefixes as a differentiable data augmentation, trained in two stages.

What the official code (TianduoWang/DiffAug) does is the default here; each other choice is an option.

* **Two prefixes, one encoder.** One reparameterised prefix of ``2l`` positions (``Embedding(2l, H) → Linear(H, H)
  → Tanh → Linear(H, 2·L·H)``, initialised N(0, ``initializer_range``) like every weight the official
  ``init_weights()`` creates): the anchor attends to the first half (``θ1``), the positive and the hard negative to
  the second (``θ2``), every row attends to all ``2l`` at inference. The views are made by the per-row prefix
  attention mask, so positions never shift. ``--same-prefix`` (the paper's "same" ablation) uses one prefix of ``l``
  positions for both sentences.
* **PromptBERT template.** The hard template ``This sentence of "[X]" means [MASK].`` and [MASK] pooling. Template
  denoising (the template-only [MASK] state, same positions, subtracted) is used inside the stage-2 contrastive loss
  only, as in the official code ("for contrastive learning"): not in stage 1, not on the auxiliary NLI rows, not in
  STS-B dev selection and not at inference (``--inference-denoising`` keeps it there). ``--pooling cls`` (or
  ``mean``) drops the template and pools the last layer (the official ``apply_prompt=False``), for backbones whose
  [MASK] state carries little (all-MiniLM-L6-v2 has no MLM head: ``benchmarks/diffaug_probe.py``).
* **The training-only MLP** (official ``--mlp_train``): ``Linear(H, H) + Tanh`` over the pooled output, applied to
  the classifier's features in stage 1 (frozen at its random initialisation: not in stage 1's optimiser) and to the
  contrastive and NLI features in stage 2 (trained); never applied at evaluation, never saved.
* **Stage 1: prefix tuning on NLI.** The backbone is frozen; the prefix and a ``Linear(3H, 2)`` classifier over
  ``(u, v, |u − v|)`` train on NLI *triplets*: each premise is encoded once with view 0, its entailment and
  contradiction with view 1, so a batch of 128 triplets gives 256 classifier rows (entailment 1, contradiction 0).
  The learning rate decays linearly over the *stage-2* length, as the official scheduler does, and stage 1 stops
  after ``--stage1-steps`` (so it ends well above 0; ``--stage1-schedule stage1`` decays to 0 within stage 1).
  δ and κ are logged (:mod:`st_prompts.training.diagnostics`); with ``--stage1-switch diagnostics`` stage 1 ends
  once δ has peaked and κ < ``--kappa-threshold`` (the paper's rule; the official code has no δ/κ).
* **Stage 2: joint contrastive tuning.** Backbone, prefix, MLP (and classifier) train together, the backbone at
  ``--backbone-learning-rate``. Semi-supervised: unlabelled sentences, the two views of a sentence are the positive
  pair, plus (``--aux-weight``, paper 1e-3) the NLI cross-entropy over triplets with the stage-1 classifier.
  Supervised: NLI triplets (premise view 0, entailment and contradiction view 1); the official script accumulates 4
  batches of 128 (``--gradient-accumulation-steps 4`` at ``--scale paper``; the paper's table 5 reads 128: pass
  ``--gradient-accumulation-steps 1``). STS-B dev selects the best step and restores every weight that trains, the
  backbone included.

Since the backbone changes, a DiffAug model is always saved in full (``prompts_only=False``). The stage-1 result is
saved beside the output as a prompts-only checkpoint with its classifier and MLP (``OUTPUT-stage1``: its backbone is
still the original); ``--stage1-from DIR`` starts stage 2 from such a checkpoint (refused for another backbone),
``--skip-stage1`` runs stage 2 from a random prefix (the paper's "no stage 1" ablation).

Presets: table 5 of the paper and the official scripts at ``scale="paper"`` (BERT-base, l = 8); the packaged MiniLM
on the shared data at ``scale="cpu"``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataNotFoundError
from st_prompts.methods._contrastive import assemble, seed_everything
from st_prompts.methods.base import Method, PrefixSettings, Stage, option

logger = logging.getLogger(__name__)

#: The PromptBERT template (equal to ``st_prompts.prompts.shallow.PROMPTBERT_TEMPLATE``; repeated so that listing the
#: methods imports no torch; a test checks they agree).
PROMPTBERT_TEMPLATE = 'This sentence of "[X]" means [MASK].'
#: ``--stage1-switch`` values.
SWITCH_RULES = ("steps", "diagnostics")
#: ``--stage1-schedule`` values: the official one (linear decay over the stage-2 length, stage 1 stops before it
#: ends) or a schedule that decays to 0 within stage 1.
STAGE1_SCHEDULES = ("official", "stage1")
#: ``--kappa-threshold`` default (see the README's DiffAug section for how it was chosen).
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
    template_denoising: bool = option(True, "subtract the template-only [MASK] state (same positions) in stage 2's "
                                      "contrastive loss (the official code)")
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
        if self.prefix_length < 1:
            raise ConfigurationError(f"prefix_length must be >= 1, got {self.prefix_length}.")
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
        # Packaged all-MiniLM-L6-v2 on the shared data (11.9k sentences, 5.9k triplets): stage 1 200 steps of 32 NLI
        # triplets (64 classifier rows) at 1e-3, stage 2 one epoch of batch 64, STS-B dev every 50 steps.
        values = dict(backbone="minilm", batch_size=64, learning_rate=5e-5 if supervised else 1e-5, epochs=1.0,
                      eval_steps=50, stage1_batch_size=32, stage1_learning_rate=1e-3, prefix_length=8)
        if backbone in (None, "minilm"):
            # A measured deviation from the paper, for this backbone only: all-MiniLM-L6-v2 has no MLM head, and its
            # template [MASK] state carries no NLI signal under dropout (a linear probe on stage-1 features is at
            # chance, 51.3 %, against 71.5 % for [CLS]; benchmarks/diffaug_probe.py). With the template both
            # settings collapsed (run_all diffaug-*-template); [CLS] without the template (the official code's
            # apply_prompt=False) does not. --pooling mask restores the paper's pooling.
            values["pooling"] = "cls"
        return values
    stage1, lr, batch, epochs = PAPER_TABLE["sup" if supervised else "semi"]
    # The official supervised script runs batches of 128 with --gradient_accumulation_steps 4 (table 5 reads 128).
    return dict(backbone=backbone or "bert-base-uncased", batch_size=batch, learning_rate=lr, epochs=epochs,
                eval_steps=125, stage1_batch_size=128, stage1_learning_rate=1e-3, prefix_length=8,
                max_seq_length=32, gradient_accumulation_steps=4 if supervised else 1)


# ---------------------------------------------------------------------------------------------------------- model
def build_model(settings: DiffAugSettings):
    """Frozen backbone + reparameterised prefix of ``2l`` positions + hard PromptBERT template with [MASK] pooling
    (or, with ``pooling`` ``"cls"`` / ``"mean"``, no template). The saved encoder denoises only with
    ``inference_denoising``."""
    from st_prompts.modules import PromptedTransformer
    from st_prompts.utils import resolve_model_name

    seed_everything(settings.seed)
    encoder = PromptedTransformer(
        resolve_model_name(settings.backbone),
        **{**settings.prefix_options(), "prefix_length": settings.encoder_prefix_length},
        template=settings.template if settings.uses_template else None,
        template_mode="hard",
        template_denoising=settings.inference_denoising and settings.uses_template,
        freeze_backbone=True,
    )
    # max_seq_length counts the sentence's tokens; the template and special tokens come on top.
    encoder.max_seq_length = settings.max_seq_length + encoder.template_num_tokens + 2
    model = assemble(settings, encoder, pooling_mode=settings.pooling)
    if settings.mlp_train:
        from st_prompts.losses.contrastive import simcse_mlp

        _state(model)["mlp"] = simcse_mlp(model)  # built now, so that the seed fixes its random start
    return model


# ------------------------------------------------------------------------------------------- per-model run state
#: model -> {"nli_loss": the NLI loss shared by stage 1 and the auxiliary loss, "mlp": the training-only MLP,
#: "stage1_done": bool, "stage1_steps": int}
_RUN_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(model) -> dict:
    return _RUN_STATE.setdefault(model, {})


def _mlp(model, settings: DiffAugSettings):
    """The training-only MLP shared by every loss of the run (``None`` without ``mlp_train``)."""
    if not settings.mlp_train:
        return None
    state = _state(model)
    if "mlp" not in state:  # a model built elsewhere than build_model
        from st_prompts.losses.contrastive import simcse_mlp

        state["mlp"] = simcse_mlp(model)
    return state["mlp"]


def nli_loss(model, settings: DiffAugSettings):
    """The NLI triplet loss (one per model: stage 2's auxiliary loss reuses stage 1's classifier and MLP)."""
    state = _state(model)
    if "nli_loss" not in state:
        from st_prompts.losses import NLITripletSoftmaxLoss

        views = None if settings.same_prefix else (0, 1, 1)
        state["nli_loss"] = NLITripletSoftmaxLoss(model, prefix_views=views, num_views=2, mlp=_mlp(model, settings),
                                                  template_denoising=False)
    return state["nli_loss"]


# ---------------------------------------------------------------------------------------------------------- data
NLI_COLUMNS = ("premise", "entailment", "contradiction")


def _nli_triplets(settings: DiffAugSettings, data_dir, limit):
    from st_prompts.data.training_data import nli_path, read_nli_triplets, sample_fraction

    triplets = read_nli_triplets(nli_path(data_dir), limit, settings.seed)
    return sample_fraction(triplets, settings.label_fraction, settings.seed)


def stage1_data(settings: DiffAugSettings, data_dir, limit):
    """(premise, entailment, contradiction) triplets: a share ``label_fraction`` of the NLI file."""
    from datasets import Dataset

    triplets = _nli_triplets(settings, data_dir, limit)
    return Dataset.from_dict({name: [t[i] for t in triplets] for i, name in enumerate(NLI_COLUMNS)})


def stage2_columns(settings: DiffAugSettings) -> tuple[str, ...]:
    if settings.supervised:
        return ("anchor", "positive", "negative")
    if settings.aux_weight > 0:
        return ("anchor", "positive", *NLI_COLUMNS)
    return ("anchor", "positive")


def stage2_data(settings: DiffAugSettings, data_dir, limit):
    """Supervised: NLI triplets (a share ``label_fraction``). Semi-supervised: unlabelled sentences paired with
    themselves, plus (with ``aux_weight``) one NLI triplet per row, cycled over the (sampled) triplets."""
    import random

    from datasets import Dataset

    from st_prompts.data.training_data import read_sentences, sentences_path, supervised_dataset

    if settings.supervised:
        return supervised_dataset(_nli_triplets(settings, data_dir, limit))
    sentences = read_sentences(sentences_path(data_dir), limit, settings.seed)
    columns = {"anchor": sentences, "positive": list(sentences)}
    if settings.aux_weight > 0:
        triplets = _nli_triplets(settings, data_dir, None)
        random.Random(settings.seed).shuffle(triplets)
        cycled = [triplets[i % len(triplets)] for i in range(len(sentences))]
        columns.update({name: [t[i] for t in cycled] for i, name in enumerate(NLI_COLUMNS)})
    return Dataset.from_dict(columns)


def stage2_steps(settings: DiffAugSettings, datasets: dict) -> int:
    """The optimizer steps stage 2 will train (as the trainer counts them): the length of the official stage-1
    learning-rate schedule."""
    if settings.max_steps > 0:
        return settings.max_steps
    data = datasets.get("stage2")
    if data is None:
        return 0
    batches = math.ceil(len(data) / settings.batch_size)
    return math.ceil(settings.epochs * max(batches // settings.gradient_accumulation_steps, 1))


# -------------------------------------------------------------------------------------------------------- stage 1
def stage1_prepare(model, settings: DiffAugSettings) -> None:
    """Freeze the backbone and the training-only MLP (random in stage 1, as the official stage-1 optimiser holds only
    the prefix and the classifier); template denoising only with ``stage1_template_denoising``."""
    model[0].freeze_backbone = True
    mlp = _mlp(model, settings)
    if mlp is not None:
        mlp.requires_grad_(False)
    nli_loss(model, settings).template_denoising = bool(settings.uses_template and settings.stage1_template_denoising)


def stage1_callbacks(loss, settings: DiffAugSettings) -> list:
    from transformers import TrainerCallback

    from st_prompts.training.callbacks import LossStepCallback
    from st_prompts.training.diagnostics import PrefixDiagnosticsCallback

    model = loss.model

    class _Done(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            _state(model)["stage1_done"] = True
            _state(model)["stage1_steps"] = state.global_step

    views = (None, None) if settings.same_prefix else (0, 1)
    diagnostics = PrefixDiagnosticsCallback(
        model, every=settings.diagnostics_steps, samples=settings.diagnostics_samples,
        pair_columns=("premise", "entailment") if settings.supervised else ("premise", "premise"),
        num_views=2, views=views, stop_rule=settings.stage1_switch == "diagnostics",
        kappa_threshold=settings.kappa_threshold,
    )
    return [LossStepCallback(loss), diagnostics, _Done()]


# -------------------------------------------------------------------------------------------------------- stage 2
def stage2_prepare(model, settings: DiffAugSettings) -> None:
    """Start stage 2: from the stage-1 checkpoint ``stage1_from``, from the stage 1 just run (saved beside the
    output), or (``skip_stage1``) from the random prefix; then unfreeze the backbone and the MLP."""
    state = _state(model)
    if settings.stage1_from:
        load_stage1(model, settings, settings.stage1_from)
    elif state.get("stage1_done"):
        if settings.save_stage1:
            save_stage1(model, settings, settings.output_dir.rstrip("/") + STAGE1_SUFFIX)
    elif not settings.skip_stage1:
        raise ConfigurationError(
            "DiffAug's stage 2 needs a trained stage 1: run both stages, pass --stage1-from a stage-1 checkpoint, or "
            "--skip-stage1 for the paper's 'no stage 1' ablation."
        )
    model[0].freeze_backbone = False
    mlp = _mlp(model, settings)
    if mlp is not None:
        mlp.requires_grad_(True)
    if "nli_loss" in state:
        state["nli_loss"].template_denoising = False  # the auxiliary NLI rows are never denoised
    model[0].template_denoising = settings.uses_template and settings.inference_denoising  # selection, saved model


def stage2_loss(model, settings: DiffAugSettings):
    """InfoNCE with the two views (anchor: view 0; positive and negative: view 1), template denoising and the MLP,
    plus the auxiliary NLI loss over triplets (not denoised)."""
    from st_prompts.losses import AuxiliaryLoss, PromptContrastiveLoss

    columns = 3 if settings.supervised else 2
    views = None if settings.same_prefix else (0,) + (1,) * (columns - 1)
    contrastive = PromptContrastiveLoss(model, scale=1.0 / settings.temperature, prefix_views=views, num_views=2,
                                        mlp=_mlp(model, settings) or False,
                                        template_denoising=settings.uses_template and settings.template_denoising)
    if settings.aux_weight > 0 and not settings.supervised:
        return AuxiliaryLoss(model, contrastive, nli_loss(model, settings), main_columns=2, weight=settings.aux_weight)
    return contrastive


def stage2_learning_rates(model, settings: DiffAugSettings) -> dict[str, float]:
    """The backbone's own learning rate (regex over the loss's parameter names: ``model.0.model.*``)."""
    if settings.backbone_learning_rate is None:
        return {}
    return {r"^model\.0\.model\.": settings.backbone_learning_rate}


# -------------------------------------------------------------------------------------------- stage-1 checkpoints
def _identity(settings: DiffAugSettings) -> dict:
    return {"prefix_length": settings.prefix_length, "same_prefix": settings.same_prefix,
            "prefix_projection": settings.prefix_projection, "prefix_hidden_size": settings.prefix_hidden_size,
            "template": settings.template, "mlp_train": settings.mlp_train}


def save_stage1(model, settings: DiffAugSettings, path: str) -> str:
    """Save the stage-1 result: a prompts-only checkpoint (the backbone is still the original), the NLI classifier
    and ``diffaug_stage1.json`` (the prefix options, the backbone's reference and fingerprint).

    Written atomically; an earlier stage-1 checkpoint of st-prompts at ``path`` is replaced (the training pipeline
    checks ``path`` with the run's ``--overwrite`` before training), any other folder is refused."""
    from safetensors.torch import save_file

    from st_prompts.modules import backbone_fingerprint, save_prompts_only
    from st_prompts.storage import save_model_folder

    encoder = model[0]
    classifier = _state(model).get("nli_loss")
    mlp = _mlp(model, settings)
    marker = {"method": "diffaug", "stage": 1, "steps": _state(model).get("stage1_steps"),
              "backbone": encoder.backbone_reference, "backbone_fingerprint": backbone_fingerprint(encoder.auto_model),
              **_identity(settings)}

    def write(folder: Path) -> None:
        save_prompts_only(model, str(folder))
        for module, name in ((getattr(classifier, "classifier", None), STAGE1_CLASSIFIER), (mlp, STAGE1_MLP)):
            if module is not None:
                save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
                          str(folder / name))
        (folder / STAGE1_MARKER).write_text(json.dumps(marker, indent=2))

    save_model_folder(path, write, overwrite=True, kind="DiffAug stage-1 checkpoint")
    logger.info(f"Saved the stage-1 checkpoint to {path}.")
    return path


def load_stage1(model, settings: DiffAugSettings, path: str) -> None:
    """Put a stage-1 checkpoint's prefix (and NLI classifier) into ``model``.

    Raises:
        DataNotFoundError: if ``path`` is not a DiffAug stage-1 checkpoint.
        BackboneMismatchError: if it was trained on another backbone (its fingerprint differs from this model's).
        ConfigurationError: if its prefix options differ from ``settings``.
    """
    from safetensors.torch import load_file

    from st_prompts.modules import PROMPTS_FILE, backbone_fingerprint

    marker_path = Path(path, STAGE1_MARKER)
    if not marker_path.is_file():
        raise DataNotFoundError(f"{path!r} is not a DiffAug stage-1 checkpoint (no {STAGE1_MARKER}); a run writes one "
                                f"to OUTPUT{STAGE1_SUFFIX}.")
    marker = json.loads(marker_path.read_text())
    encoder = model[0]
    actual = backbone_fingerprint(encoder.auto_model)
    if marker.get("backbone_fingerprint") != actual:
        raise BackboneMismatchError(
            f"The stage-1 checkpoint {path!r} was trained on the backbone {marker.get('backbone')!r} (fingerprint "
            f"{marker.get('backbone_fingerprint')}), but this run's backbone {encoder.backbone_reference!r} has "
            f"fingerprint {actual}: stage 2 must start from a stage 1 of the same backbone (or pass --skip-stage1)."
        )
    expected = _identity(settings)
    differing = {k: (marker.get(k), v) for k, v in expected.items() if marker.get(k) != v}
    if differing:
        raise ConfigurationError(f"The stage-1 checkpoint {path!r} differs from this run in "
                                 + ", ".join(f"{k} (checkpoint {a!r}, run {b!r})" for k, (a, b) in differing.items()))
    state = load_file(os.path.join(path, PROMPTS_FILE))
    own = encoder.prompt_state_dict()
    if {k: tuple(v.shape) for k, v in state.items()} != {k: tuple(v.shape) for k, v in own.items()}:
        raise ConfigurationError(f"The prompts in {path!r} do not fit this model's prefix.")
    encoder.load_state_dict(state, strict=False)
    classifier_path = os.path.join(path, STAGE1_CLASSIFIER)
    if os.path.isfile(classifier_path):
        nli_loss(model, settings).classifier.load_state_dict(load_file(classifier_path))
    mlp, mlp_path = _mlp(model, settings), os.path.join(path, STAGE1_MLP)
    if mlp is not None and os.path.isfile(mlp_path):  # the frozen random MLP the classifier was trained behind
        mlp.load_state_dict(load_file(mlp_path))
    _state(model)["stage1_done"] = True
    logger.info(f"Stage 2 starts from the stage-1 checkpoint {path} ({marker.get('steps')} steps).")


def stages(settings: DiffAugSettings) -> list[Stage]:
    """Stage 1 (prefix tuning on NLI, frozen backbone) unless skipped or loaded, then stage 2 (joint tuning)."""
    stage2 = Stage(
        name="stage2",
        build_loss=stage2_loss,
        columns=stage2_columns,
        load_data=stage2_data,
        prepare=stage2_prepare,
        learning_rates=stage2_learning_rates,
        select_model=True,
    )
    if settings.skip_stage1 or settings.stage1_from:
        return [stage2]
    stage1 = Stage(
        name="stage1",
        build_loss=nli_loss,
        columns=lambda s: NLI_COLUMNS,
        load_data=stage1_data,
        prepare=stage1_prepare,
        callbacks=stage1_callbacks,
        max_steps=lambda s: s.stage1_steps,
        select_model=False,
        learning_rate=lambda s: s.stage1_learning_rate,
        batch_size=lambda s: s.stage1_batch_size,
        schedule_steps=lambda s, data: stage2_steps(s, data) if s.stage1_schedule == "official" else None,
        gradient_accumulation=lambda s: 1,
    )
    return [stage1, stage2]


METHOD = Method(
    name="diffaug",
    summary="two prefixes as a differentiable augmentation, prefix tuning then joint tuning (Wang & Lu 2022)",
    settings_class=DiffAugSettings,
    presets=presets,
    build_model=build_model,
    stages=stages,
    prompts_only=False,
    side_outputs=lambda s: (STAGE1_SUFFIX,) if s.save_stage1 and not (s.stage1_from or s.skip_stage1) else (),
)
