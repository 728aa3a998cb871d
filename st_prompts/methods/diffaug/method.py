"""DiffAug's model, data and two stages (settings and presets: :mod:`.config`; the stage-1 checkpoint:
:mod:`.checkpoint`; δ/κ: :mod:`.diagnostics`)."""

from __future__ import annotations

import math
import random

from datasets import Dataset
from transformers import TrainerCallback

from st_prompts.data.training_data import (nli_path, read_nli_triplets, read_sentences, sample_fraction, sentences_path,
                                           supervised_dataset)
from st_prompts.errors import ConfigurationError
from st_prompts.losses import ColumnSplitLoss, LossStepCallback, PromptContrastiveLoss, simcse_mlp
from st_prompts.methods.base import Method, Stage
from st_prompts.methods.diffaug.checkpoint import load_stage1, save_stage1
from st_prompts.methods.diffaug.config import CONFIG, STAGE1_SUFFIX, DiffAugSettings
from st_prompts.methods.diffaug.diagnostics import PrefixDiagnosticsCallback
from st_prompts.methods.diffaug.state import nli_loss, run_state, training_mlp
from st_prompts.methods.models import assemble, prompted_encoder, seed_everything


def build_model(settings: DiffAugSettings):
    """Frozen backbone + reparameterised prefix of ``2l`` positions + hard PromptBERT template with [MASK] pooling
    (or, with ``pooling`` ``"cls"`` / ``"mean"``, no template). The saved encoder denoises only with
    ``inference_denoising``."""
    seed_everything(settings.seed)
    encoder = prompted_encoder(
        settings, **{**settings.prefix_options(), "prefix_length": settings.encoder_prefix_length},
        template=settings.template if settings.uses_template else None, template_mode="hard",
        template_denoising=settings.inference_denoising and settings.uses_template, freeze_backbone=True,
        max_seq_length=None)  # set below
    # max_seq_length counts the sentence's tokens; the template and special tokens come on top.
    encoder.max_seq_length = settings.max_seq_length + encoder.template_num_tokens + 2
    model = assemble(settings, encoder, pooling_mode=settings.pooling)
    if settings.mlp_train:
        run_state(model)["mlp"] = simcse_mlp(model)  # built now, so that the seed fixes its random start
    return model


NLI_COLUMNS = ("premise", "entailment", "contradiction")


def _nli_triplets(settings: DiffAugSettings, data_dir, limit):
    triplets = read_nli_triplets(nli_path(data_dir), limit, settings.seed)
    return sample_fraction(triplets, settings.label_fraction, settings.seed)


def stage1_data(settings: DiffAugSettings, data_dir, limit):
    """(premise, entailment, contradiction) triplets: a share ``label_fraction`` of the NLI file."""
    triplets = _nli_triplets(settings, data_dir, limit)
    return Dataset.from_dict({name: [t[i] for t in triplets] for i, name in enumerate(NLI_COLUMNS)})


def stage2_columns(settings: DiffAugSettings) -> tuple[str, ...]:
    if settings.supervised:
        return ("anchor", "positive", "negative")
    return ("anchor", "positive", *(NLI_COLUMNS if settings.aux_weight > 0 else ()))  # + the auxiliary NLI triplet


def stage2_data(settings: DiffAugSettings, data_dir, limit):
    """Supervised: NLI triplets (a share ``label_fraction``). Semi-supervised: unlabelled sentences paired with
    themselves, plus (with ``aux_weight``) one NLI triplet per row, cycled over the (sampled) triplets."""
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


def stage1_prepare(model, settings: DiffAugSettings) -> None:
    """Freeze the backbone and the training-only MLP (random in stage 1, as the official stage-1 optimiser holds only
    the prefix and the classifier); template denoising only with ``stage1_template_denoising``."""
    model[0].freeze_backbone = True
    mlp = training_mlp(model, settings)
    if mlp is not None:
        mlp.requires_grad_(False)
    nli_loss(model, settings).template_denoising = bool(settings.uses_template and settings.stage1_template_denoising)


def stage1_callbacks(loss, settings: DiffAugSettings) -> list:
    model = loss.model

    class _Done(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            run_state(model)["stage1_done"] = True
            run_state(model)["stage1_steps"] = state.global_step

    views = (None, None) if settings.same_prefix else (0, 1)
    diagnostics = PrefixDiagnosticsCallback(
        model, every=settings.diagnostics_steps, samples=settings.diagnostics_samples,
        pair_columns=("premise", "entailment") if settings.supervised else ("premise", "premise"),
        num_views=2, views=views, stop_rule=settings.stage1_switch == "diagnostics",
        kappa_threshold=settings.kappa_threshold,
    )
    return [LossStepCallback(loss), diagnostics, _Done()]


def stage2_prepare(model, settings: DiffAugSettings) -> None:
    """Start stage 2: from the stage-1 checkpoint ``stage1_from``, from the stage 1 just run (saved beside the
    output), or (``skip_stage1``) from the random prefix; then unfreeze the backbone and the MLP."""
    state = run_state(model)
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
    mlp = training_mlp(model, settings)
    if mlp is not None:
        mlp.requires_grad_(True)
    if "nli_loss" in state:
        state["nli_loss"].template_denoising = False  # the auxiliary NLI rows are never denoised
    model[0].template_denoising = settings.uses_template and settings.inference_denoising  # selection, saved model


def stage2_loss(model, settings: DiffAugSettings):
    """InfoNCE with the two views (anchor: view 0; positive and negative: view 1), template denoising and the MLP,
    plus the auxiliary NLI loss over triplets (not denoised)."""
    columns = 3 if settings.supervised else 2
    views = None if settings.same_prefix else (0,) + (1,) * (columns - 1)
    contrastive = PromptContrastiveLoss(model, scale=1.0 / settings.temperature, prefix_views=views, num_views=2,
                                        mlp=training_mlp(model, settings) or False,
                                        template_denoising=settings.denoising_positions
                                        if settings.uses_template and settings.template_denoising else False)
    if settings.aux_weight > 0 and not settings.supervised:
        return ColumnSplitLoss(model, contrastive, nli_loss(model, settings), main_columns=2, weight=settings.aux_weight)
    return contrastive


def stage2_learning_rates(model, settings: DiffAugSettings) -> dict[str, float]:
    """The backbone's own learning rate (regex over the loss's parameter names: ``model.0.model.*``)."""
    if settings.backbone_learning_rate is None:
        return {}
    return {r"^model\.0\.model\.": settings.backbone_learning_rate}


def stages(settings: DiffAugSettings) -> list[Stage]:
    """Stage 1 (prefix tuning on NLI, frozen backbone) unless skipped or loaded, then stage 2 (joint tuning)."""
    stage2 = Stage(
        name="stage2",
        build_loss=stage2_loss,
        columns=stage2_columns,
        load_data=stage2_data,
        prepare=stage2_prepare,
        learning_rates=stage2_learning_rates,
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


METHOD = Method(CONFIG, build_model=build_model, stages=stages)
