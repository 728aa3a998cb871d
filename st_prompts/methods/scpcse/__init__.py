"""SCPCSE: DCPCSE's shallow-prompt ablation: the template ``This sentence : "[X]" means [MASK] .`` as trainable input
vectors (initialised from its word embeddings) on a frozen backbone, the last hidden state at ``[MASK]`` pooled. Paper
setting: batch 256, lr 1e-3, 5 epochs."""
