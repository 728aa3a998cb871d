"""SCPCSE, the shallow-prompt ablation of DCPCSE: trainable input embeddings around a template.

Template ``This sentence : "[X]" means [MASK] .``: its tokens become trainable vectors initialised from their
word embeddings; the sentence embedding is the last hidden state at [MASK] (MaskTokenPooling). Frozen backbone.

--scale paper: batch 256, lr 1e-3, 5 epochs, STS-B dev every 125 steps (unsupervised unless --supervised).
--scale cpu (default): packaged all-MiniLM-L6-v2, batch 64, lr 1e-3, 1 epoch.

    python recipes/scpcse.py --data-dir ../shared/data
"""

from _common import main

if __name__ == "__main__":
    main("scpcse", supervised=None, description=__doc__)
