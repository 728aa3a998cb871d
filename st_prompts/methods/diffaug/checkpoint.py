"""DiffAug's stage-1 checkpoint: a prompts-only model plus the NLI classifier and the training-only MLP, written
beside a run's output (``OUTPUT-stage1``) and read by ``--stage1-from``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataNotFoundError
from st_prompts.methods.diffaug.config import (STAGE1_CLASSIFIER, STAGE1_KIND, STAGE1_MARKER, STAGE1_MLP, STAGE1_SUFFIX,
                                               DiffAugSettings)
from st_prompts.methods.diffaug.state import nli_loss, run_state, training_mlp
from st_prompts.modules import PROMPTS_FILE, backbone_fingerprint, save_prompts_only
from st_prompts.modules.set_checks import check_finite_training
from st_prompts.storage import save_model_folder

logger = logging.getLogger(__name__)


def identity(settings: DiffAugSettings) -> dict:
    return {"prefix_length": settings.prefix_length, "same_prefix": settings.same_prefix,
            "prefix_projection": settings.prefix_projection, "prefix_hidden_size": settings.prefix_hidden_size,
            "template": settings.template, "mlp_train": settings.mlp_train}


def save_stage1(model, settings: DiffAugSettings, path: str) -> str:
    """Save the stage-1 result atomically: a prompts-only checkpoint (the backbone is still the original), the NLI
    classifier and ``diffaug_stage1.json`` (prefix options, backbone reference and fingerprint). Only an earlier
    stage-1 checkpoint at ``path`` is replaced (the pipeline checked it against ``--overwrite`` before training)."""
    check_finite_training(model, None)  # a diverged stage 1 is not saved (nor continued)
    encoder = model[0]
    classifier = run_state(model).get("nli_loss")
    mlp = training_mlp(model, settings)
    marker = {"method": "diffaug", "stage": 1, "steps": run_state(model).get("stage1_steps"),
              "backbone": encoder.backbone_reference, "backbone_fingerprint": backbone_fingerprint(encoder.auto_model),
              **identity(settings)}

    def write(folder: Path) -> None:
        save_prompts_only(model, str(folder), keep_projection=True)  # stage 2 trains on through the MLP
        for module, name in ((getattr(classifier, "classifier", None), STAGE1_CLASSIFIER), (mlp, STAGE1_MLP)):
            if module is not None:
                save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
                          str(folder / name))
        (folder / STAGE1_MARKER).write_text(json.dumps(marker, indent=2))

    save_model_folder(path, write, overwrite=True, kind=STAGE1_KIND)
    logger.info(f"Saved the stage-1 checkpoint to {path}.")
    return path


def load_stage1(model, settings: DiffAugSettings, path: str) -> None:
    """Put a stage-1 checkpoint's prefix (and NLI classifier) into ``model``.

    Raises:
        DataNotFoundError: if ``path`` is not a DiffAug stage-1 checkpoint.
        BackboneMismatchError: if it was trained on another backbone (its fingerprint differs from this model's).
        ConfigurationError: if its prefix options differ from ``settings``.
    """
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
    expected = identity(settings)
    differing = {k: (marker.get(k), v) for k, v in expected.items() if marker.get(k) != v}
    if differing:
        raise ConfigurationError(f"The stage-1 checkpoint {path!r} differs from this run in "
                                 + ", ".join(f"{k} (checkpoint {a!r}, run {b!r})" for k, (a, b) in differing.items()))
    state = load_file(os.path.join(path, PROMPTS_FILE))
    own = encoder.prompt_state_dict()
    if {k: tuple(v.shape) for k, v in state.items()} != {k: tuple(v.shape) for k, v in own.items()}:
        raise ConfigurationError(f"The prompts in {path!r} do not fit this model's prefix.")
    encoder.load_prompt_state_dict(state)
    classifier_path = os.path.join(path, STAGE1_CLASSIFIER)
    if os.path.isfile(classifier_path):
        nli_loss(model, settings).classifier.load_state_dict(load_file(classifier_path))
    mlp, mlp_path = training_mlp(model, settings), os.path.join(path, STAGE1_MLP)
    if mlp is not None and os.path.isfile(mlp_path):  # the frozen random MLP the classifier was trained behind
        mlp.load_state_dict(load_file(mlp_path))
    run_state(model)["stage1_done"] = True
    logger.info(f"Stage 2 starts from the stage-1 checkpoint {path} ({marker.get('steps')} steps).")
