"""Data loading: SentEval STS files (and their hub copies) and SimCSE-format training data (which needs
``datasets``: imported on first use)."""

from st_prompts.data.senteval import STS_TASKS, STSPairs, check_senteval_dir, load_sts, load_sts_from_hub
from st_prompts.utils import lazy_exports

_LAZY = dict.fromkeys(("load_training_dataset", "read_nli_triplets", "read_sentences", "supervised_dataset",
                       "unsupervised_dataset"), "st_prompts.data.training_data")

__all__ = ["STS_TASKS", "STSPairs", "check_senteval_dir", "load_sts", "load_sts_from_hub", *sorted(_LAZY)]
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
