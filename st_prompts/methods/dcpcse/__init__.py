"""DCPCSE (Jiang & Wang, 2022): deep continuous prompts on a frozen backbone, SimCSE's InfoNCE, optional MLM.

Trainable per-layer key/value prefixes (~0.1-0.3% of the backbone's parameters), [CLS] pooling with SimCSE's MLP
(training only for unsupervised runs, kept at inference for supervised runs, as in the official code), unsupervised
dropout positives or supervised NLI triplets with hard negatives, and the optional auxiliary MLM loss with weight
0.1 · 0.95^(step/100).

Presets: the paper's appendix tables 3 (unsupervised) and 4 (supervised) at ``scale="paper"``; the packaged MiniLM
with batch 64 on the shared data at ``scale="cpu"``.
"""
