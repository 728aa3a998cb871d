"""Training: the shared multi-stage runner (:func:`train`) and trainer callbacks.

``from st_prompts.training import train`` imports torch and sentence-transformers; the callbacks alone are light.
"""

from __future__ import annotations

from typing import Any

from st_prompts.training.callbacks import LossStepCallback

__all__ = ["LossStepCallback", "PrefixDiagnosticsCallback", "TrainResult", "build_loss", "build_model",
           "count_parameters", "representation_divergence", "train", "weight_convergence"]

_DIAGNOSTICS = ("PrefixDiagnosticsCallback", "representation_divergence", "weight_convergence")


def __getattr__(name: str) -> Any:
    if name in ("TrainResult", "build_loss", "build_model", "count_parameters", "train"):
        from st_prompts.training import run

        return getattr(run, name)
    if name in _DIAGNOSTICS:
        from st_prompts.training import diagnostics

        return getattr(diagnostics, name)
    raise AttributeError(f"module 'st_prompts.training' has no attribute {name!r}")
