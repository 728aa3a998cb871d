"""D2CSE (Lee, 2022): deep prompts, an optional [CLS] prompt, and conditional replaced-token detection (CRTD) by the
same frozen encoder (:class:`~st_prompts.losses.CRTDLoss`); only the prompts are saved. Presets:
``docs/methods/d2cse.md``."""
