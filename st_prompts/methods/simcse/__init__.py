"""SimCSE (Gao et al., 2021): full fine-tuning with InfoNCE, the baseline every prompt method is compared with. Paper
settings (BERT-base): unsupervised batch 64, lr 3e-5, 1 epoch, MLP in training only; supervised batch 512, lr 5e-5,
3 epochs, MLP kept at inference."""
