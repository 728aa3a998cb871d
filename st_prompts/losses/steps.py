"""Telling a loss the trainer's optimisation step (for step-dependent loss weights)."""

from __future__ import annotations

from transformers import TrainerCallback


class LossStepCallback(TrainerCallback):
    """Tell losses with a step-dependent schedule (``global_step`` attribute) the trainer's optimisation step (exact
    with gradient accumulation): ``SentenceTransformerTrainer(..., callbacks=[LossStepCallback(loss)])``."""

    def __init__(self, *losses) -> None:
        self.losses = losses

    def on_step_begin(self, args, state, control, **kwargs):
        for loss in self.losses:
            loss.global_step = state.global_step
