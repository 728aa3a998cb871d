"""SCPCSE: DCPCSE's shallow-prompt ablation — trainable template embeddings on a frozen backbone, [MASK] pooling.

The template ``This sentence : "[X]" means [MASK] .`` (DCPCSE appendix A) is tokenised once; its tokens become
trainable input vectors initialised from their word embeddings; the sentence embedding is the last hidden state at
``[MASK]``. Paper setting: batch 256, lr 1e-3, 5 epochs.
"""
