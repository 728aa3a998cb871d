"""Training: the one pipeline (:func:`train_and_save`: data, training with model selection, saving) and the multi-stage
runner under it (:func:`train`).

Names are imported on first use: ``import st_prompts.training`` loads no torch.
"""

from __future__ import annotations

from st_prompts.utils import lazy_exports

_LAZY = {
    "TrainResult": "st_prompts.training.run",
    "build_loss": "st_prompts.training.run",
    "build_model": "st_prompts.training.run",
    "count_parameters": "st_prompts.training.run",
    "train": "st_prompts.training.run",
    "save_run": "st_prompts.training.pipeline",
    "train_and_save": "st_prompts.training.pipeline",
    "LossStepCallback": "st_prompts.losses.steps",
    # DiffAug's stage-1 diagnostics (they live with the method)
    "PrefixDiagnosticsCallback": "st_prompts.methods.diffaug.diagnostics",
    "representation_divergence": "st_prompts.methods.diffaug.diagnostics",
    "weight_convergence": "st_prompts.methods.diffaug.diagnostics",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
