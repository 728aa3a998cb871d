"""Data loading: SentEval STS files (and their hub copies) and SimCSE-format training data.

The training-data helpers need ``datasets``; they are imported on first use, so that importing
:mod:`st_prompts.data.senteval` (e.g. for the CLI's ``--help``) stays light.
"""

from importlib import import_module
from typing import Any

from st_prompts.data.senteval import STS_TASKS, STSPairs, check_senteval_dir, load_sts, load_sts_from_hub

_TRAINING_DATA = (
    "load_training_dataset",
    "read_nli_triplets",
    "read_sentences",
    "supervised_dataset",
    "unsupervised_dataset",
)

__all__ = [
    "STS_TASKS",
    "STSPairs",
    "check_senteval_dir",
    "load_sts",
    "load_sts_from_hub",
    "load_training_dataset",
    "read_nli_triplets",
    "read_sentences",
    "supervised_dataset",
    "unsupervised_dataset",
]


def __getattr__(name: str) -> Any:
    if name in _TRAINING_DATA:
        return getattr(import_module("st_prompts.data.training_data"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
