"""DCPCSE, supervised: deep continuous prompts on a frozen backbone, NLI triplets with hard negatives.

(premise, entailment, contradiction) triplets; the contradiction is an extra in-batch hard negative of
MultipleNegativesRankingLoss (InfoNCE, tau = 0.05); [CLS] pooling. At --scale paper the MLP over [CLS] is part of the
saved model and applied at inference (--mlp-head saved), as in the official supervised code; --mlp-head train_only
uses it in training only (the CPU default, chosen on STS-B dev and checked on SICK-R trial: see the README).

--scale paper (DCPCSE table 4, 10 epochs, no MLM; SimCSE's 275k NLI triplets from the hub unless --data-dir):
    bert-base-uncased / bert-large-uncased  batch 256, lr 5e-3, prefix 12
    roberta-base                            batch 256, lr 1e-2, prefix 10
    roberta-large                           batch 256, lr 5e-3, prefix 10
--scale cpu (default): packaged all-MiniLM-L6-v2, batch 64, lr 1e-1 (selected on STS-B dev), prefix 12, 1 epoch over the
5.9k SNLI triplets.

    python recipes/dcpcse_sup.py --data-dir ../shared/data
"""

from _common import main

if __name__ == "__main__":
    main("dcpcse", supervised=True, description=__doc__)
