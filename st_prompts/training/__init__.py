"""Training helpers: callbacks and the shared training loop used by recipes and the CLI."""

from st_prompts.training.callbacks import LossStepCallback

__all__ = ["LossStepCallback"]
