"""DCPCSE's settings and presets (no torch import; the model and stages are in :mod:`.method`)."""

from __future__ import annotations

from dataclasses import dataclass

from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import MLP_HEAD_MODES, MethodConfig, PrefixSettings, option

#: Sentence vectors DCPCSE can pool (sentence-transformers' Pooling modes): [CLS] is the paper's.
POOLING_MODES = ("cls", "mean", "lasttoken")

#: DCPCSE table 3: backbone -> (batch size, learning rate, prefix length, MLM multi-task); 1 epoch
UNSUPERVISED_TABLE = {
    "bert-base-uncased": (256, 3e-2, 16, False),
    "bert-large-uncased": (256, 3e-2, 10, False),
    "roberta-base": (64, 3e-2, 14, True),
    "roberta-large": (64, 1e-2, 10, True),
}
#: DCPCSE table 4: backbone -> (batch size, learning rate, prefix length, MLM multi-task); 10 epochs
SUPERVISED_TABLE = {
    "bert-base-uncased": (256, 5e-3, 12, False),
    "bert-large-uncased": (256, 5e-3, 12, False),
    "roberta-base": (256, 1e-2, 10, False),
    "roberta-large": (256, 5e-3, 10, False),
}


@dataclass
class DCPCSESettings(PrefixSettings):
    """DCPCSE's options (see :class:`~st_prompts.methods.base.PrefixSettings` for the shared ones)."""

    prefix_dropout_shared: bool = option(False, "one prefix dropout mask per batch instead of per example (less memory "
                                         "and time; the official code draws one per example)")
    pooling: str = option("cls", "sentence vector: cls (the paper's), mean, or lasttoken (a decoder has no [CLS]: "
                          "lasttoken or mean)", POOLING_MODES)
    mlp_head: str = option("train_only", "SimCSE MLP over the pooled vector: train_only, saved (kept at inference) or "
                           "none", MLP_HEAD_MODES)
    head_learning_rate: float | None = option(None, "learning rate of the MLP head (default: --learning-rate)")
    mlm_weight: float = option(0.0, "initial weight of the auxiliary MLM loss (paper: 0.1 where used)")
    mlm_decay: float = option(0.95, "MLM weight decay factor per --mlm-decay-steps optimizer steps")
    mlm_decay_steps: int = option(100, "optimizer steps per MLM decay factor")


def presets(scale: str, supervised: bool, backbone: str | None) -> dict:
    if scale == "cpu":
        # Packaged all-MiniLM-L6-v2 on the shared data. The learning rate was selected on STS-B dev; the prefix gate is
        # on where it moved STS-B dev up (unsupervised). Readings: docs/methods/dcpcse.md.
        return dict(backbone="minilm", batch_size=64, learning_rate=1e-1, prefix_length=12 if supervised else 16,
                    epochs=1.0, eval_steps=50, mlp_head="train_only", prefix_gate=not supervised)
    backbone = backbone or "bert-base-uncased"
    table = SUPERVISED_TABLE if supervised else UNSUPERVISED_TABLE
    if backbone not in table:
        raise ConfigurationError(
            f"No paper hyperparameters for {backbone!r}; the DCPCSE tables cover {', '.join(table)}. Use scale='cpu' "
            "(its CPU preset; --scale cpu on the command line), or give batch_size, learning_rate and prefix_length "
            "(--batch-size/--learning-rate/--prefix-length) with it, or one of those backbones."
        )
    batch, lr, prefix, mlm = table[backbone]
    return dict(backbone=backbone, batch_size=batch, learning_rate=lr, prefix_length=prefix,
                mlm_weight=0.1 if mlm else 0.0, epochs=10.0 if supervised else 1.0, eval_steps=125,
                mlp_head="saved" if supervised else "train_only")


CONFIG = MethodConfig(
    name="dcpcse", title="DCPCSE", citation="Jiang & Wang 2022", settings_class=DCPCSESettings, presets=presets,
    paper="Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings (Jiang & Wang, 2022)",
    paper_url="https://arxiv.org/abs/2203.06875",
    description=("deep continuous prompts (per-layer key/value prefixes) on a frozen backbone, [CLS] pooling, "
                 "SimCSE's InfoNCE, optional auxiliary MLM"),
    summary="deep continuous prompts on a frozen backbone (Jiang & Wang 2022)",
)
