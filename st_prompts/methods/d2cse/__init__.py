"""D2CSE (Lee, 2022): deep prompts, an optional [CLS] prompt, and conditional replaced-token detection (CRTD) by the
same frozen encoder.

Training optimises ``InfoNCE + λ · CRTD`` (:class:`~st_prompts.losses.CRTDLoss`): the corrupted copy of each sentence
goes through the same prompted encoder with its [CLS] input row replaced by the sentence vector, and a per-token head
detects the replaced tokens. Only the prompts are saved (the CRTD head and the BatchNorm pooler live in the loss).
Presets (table 7 of the paper; the packaged MiniLM with the offline ``backbone-mlm`` generator at ``scale="cpu"``):
``docs/methods/d2cse.md``."""
