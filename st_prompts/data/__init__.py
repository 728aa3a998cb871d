"""Data loading: SentEval STS files (and their hub copies) and SimCSE-format training data."""

from st_prompts.data.senteval import STS_TASKS, STSPairs, check_senteval_dir, load_sts, load_sts_from_hub
from st_prompts.data.training_data import (
    load_training_dataset,
    read_nli_triplets,
    read_sentences,
    supervised_dataset,
    unsupervised_dataset,
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
