"""DCPCSE (Jiang & Wang, 2022): deep continuous prompts (per-layer key/value prefixes) on a frozen backbone, [CLS]
pooling with SimCSE's MLP, SimCSE's InfoNCE and an optional auxiliary MLM loss. Presets: ``docs/methods/dcpcse.md``."""
