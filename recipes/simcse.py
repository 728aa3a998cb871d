"""SimCSE full fine-tuning: the baseline every prompt method is compared with (every backbone weight trains).

Same loss (InfoNCE, tau = 0.05), pooling ([CLS]) and data as DCPCSE; the MLP over [CLS] is used in training only
for unsupervised runs and kept at inference for supervised runs at --scale paper (--mlp-head saved), as in SimCSE.
--scale paper: unsupervised batch 64, lr 3e-5, 1 epoch; supervised (--supervised) batch 512, lr 5e-5, 3 epochs.
--scale cpu (default): packaged all-MiniLM-L6-v2, batch 64, lr 3e-5 (5e-5 supervised), 1 epoch.

    python recipes/simcse.py --data-dir ../shared/data
    python recipes/simcse.py --data-dir ../shared/data --supervised
"""

from _common import main

if __name__ == "__main__":
    main("simcse", supervised=None, description=__doc__)
