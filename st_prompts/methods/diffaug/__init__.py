"""DiffAug (Wang & Lu, 2022): two prefixes as a differentiable data augmentation. The two views are halves of one
reparameterised prefix chosen per row by a prefix attention mask. Stage 1 tunes the prefix and an NLI classifier on a
frozen backbone; stage 2 trains all together, so the model is saved in full (stage 1's result as ``OUTPUT-stage1``).
The official code's choices are the defaults; every choice, preset and reading: ``docs/methods/diffaug.md``."""
