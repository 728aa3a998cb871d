"""DiffAug (Wang & Lu, 2022): two prefixes as a differentiable data augmentation, trained in two stages.

What the official code (TianduoWang/DiffAug) does is the default here; each other choice is an option. The two views
are halves of one reparameterised prefix chosen by a per-row prefix attention mask (positions never shift). Stage 1
tunes the prefix and a ``Linear(3H, 2)`` classifier on NLI triplets with the backbone frozen; stage 2 trains backbone,
prefix and the training-only MLP together, STS-B dev restoring the best step. Since the backbone changes, a DiffAug
model is always saved in full; the stage-1 result is saved beside it as a prompts-only checkpoint (``OUTPUT-stage1``).
Every choice, preset and reading: ``docs/methods/diffaug.md``."""
