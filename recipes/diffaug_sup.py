"""DiffAug, supervised: stage 1 prefix tuning on NLI pairs, stage 2 joint contrastive tuning on NLI triplets (premise
with the first prefix view, entailment and contradiction with the second).

    python recipes/diffaug_sup.py --data-dir ../shared/data
    python recipes/diffaug_sup.py --data-dir ../shared/data --label-fraction 0.1 --seed 1   # low-label setting

--scale paper (table 5, BERT-base, l = 8): stage 1 lr 1e-3, batch 128, 1250 steps; stage 2 lr 5e-5, batch 128,
3 epochs. --scale cpu (default): packaged all-MiniLM-L6-v2; stage 1 200 steps of 64 pairs at 1e-3, stage 2 one
epoch of batch 64 at 5e-5, [CLS] pooling without the template on that backbone (--pooling mask: the paper's).
The model is saved in full (the backbone changes); the stage-1 result goes to OUTPUT-stage1.
"""

from _common import main

if __name__ == "__main__":
    main("diffaug", supervised=True, description=__doc__)
