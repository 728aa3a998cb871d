"""Template constants (no torch import: the methods' ``config.py`` files read them).

A template holds one ``[X]`` (where the sentence goes) and one ``[MASK]`` (the position whose last hidden state is
pooled), see :mod:`st_prompts.prompts.shallow`.
"""

SENTENCE_SLOT = "[X]"
MASK_SLOT = "[MASK]"
#: The SCPCSE template of the DCPCSE paper (appendix A).
SCPCSE_TEMPLATE = 'This sentence : "[X]" means [MASK] .'
#: The PromptBERT template (used as a hard template, e.g. by DiffAug).
PROMPTBERT_TEMPLATE = 'This sentence of "[X]" means [MASK].'
#: ``template_mode`` values: ``"soft"`` (template tokens are trainable vectors) or ``"hard"`` (real, untrained tokens).
TEMPLATE_MODES = ("soft", "hard")
