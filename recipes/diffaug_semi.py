"""DiffAug, semi-supervised: stage 1 prefix tuning on NLI pairs, stage 2 joint contrastive tuning on unlabelled
sentences (the two prefix views of a sentence are its positive pair), optionally with the auxiliary NLI loss.

    python recipes/diffaug_semi.py --data-dir ../shared/data                      # without the auxiliary loss
    python recipes/diffaug_semi.py --data-dir ../shared/data --aux-weight 1e-3    # with it (paper: 1e-3)
    python recipes/diffaug_semi.py --data-dir ../shared/data --label-fraction 0.01 --seed 1   # low-label setting

--scale paper (table 5, BERT-base, l = 8, reparameterised prefix; SimCSE's files from the hub unless --data-dir):
    stage 1: lr 1e-3, batch 128, 2000 steps (1500 with --aux-weight)
    stage 2: lr 1e-5 (backbone and prefix), batch 256, 1 epoch
--scale cpu (default): packaged all-MiniLM-L6-v2; stage 1 200 steps of 64 pairs at 1e-3, stage 2 one epoch of batch
64 at 1e-5; [CLS] pooling without the template on that backbone (its [MASK] state carries no NLI signal; --pooling
mask for the paper's template). Model selection: STS-B dev every 125 (paper) / 50 (cpu) steps of stage 2, restoring
every weight that trained, the backbone included. Ablations: --same-prefix, --skip-stage1; --stage1-switch diagnostics ends stage 1 by
the delta/kappa rule. The model is saved in full (the backbone changes); the stage-1 result goes to OUTPUT-stage1.
"""

from _common import main

if __name__ == "__main__":
    main("diffaug", supervised=False, description=__doc__)
