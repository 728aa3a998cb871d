"""DCPCSE, unsupervised: deep continuous prompts on a frozen backbone, SimCSE dropout positives.

Each Wikipedia sentence is paired with itself; the frozen backbone runs in train mode so dropout makes the two
views differ. InfoNCE with tau = 0.05 (MultipleNegativesRankingLoss), [CLS] pooling, training-only MLP.

--scale paper (DCPCSE table 3; SimCSE's 1M Wikipedia sentences from the hub unless --data-dir):
    bert-base-uncased   batch 256, lr 3e-2, prefix 16, no MLM, 1 epoch
    bert-large-uncased  batch 256, lr 3e-2, prefix 10, no MLM, 1 epoch
    roberta-base        batch  64, lr 3e-2, prefix 14, MLM 0.1 * 0.95^(step/100), 1 epoch
    roberta-large       batch  64, lr 1e-2, prefix 10, MLM, 1 epoch
--scale cpu (default): packaged all-MiniLM-L6-v2, batch 64, lr 1e-1 (selected on STS-B dev), prefix 16, 1 epoch over --data-dir.
Model selection: STS-B dev every 125 (paper) / 50 (cpu) steps.

    python recipes/dcpcse_unsup.py --data-dir ../shared/data
    python recipes/dcpcse_unsup.py --scale paper --backbone roberta-base --senteval-dir ../shared/data/senteval
"""

from _common import main

if __name__ == "__main__":
    main("dcpcse", supervised=False, description=__doc__)
