"""Names the losses accept as options (no torch import: the methods' ``config.py`` files read them)."""

#: Readings of SKICSE's supervised terms (see :mod:`st_prompts.losses.multi_positive`).
SUPERVISED_READINGS = ("text", "printed")
#: The offline generator of replaced-token detection: the frozen backbone with a briefly trained masked-LM head.
BACKBONE_GENERATOR = "backbone-mlm"
#: DiffAug's NLI labels: entailment = 1, contradiction = 0 (two classes; neutral pairs are not used).
NLI_LABELS = {"entailment": 1, "contradiction": 0}
