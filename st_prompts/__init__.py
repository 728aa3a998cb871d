"""st_prompts: prompt-based, parameter-efficient contrastive sentence embeddings for sentence-transformers.

Main entry points:

* :class:`PromptedTransformer` — a sentence-transformers module with deep (prefix) and/or shallow (template) soft
  prompts on a frozen backbone;
* :class:`MaskTokenPooling` — pooling at a template's ``[MASK]`` slot;
* :func:`save_prompts_only` — a kilobyte-sized checkpoint holding only the prompts and a backbone reference;
* :mod:`st_prompts.losses`, :mod:`st_prompts.training`, :mod:`st_prompts.evaluation` — losses, callbacks, evaluators.
"""

from st_prompts.modules import MaskTokenPooling, PromptedTransformer, save_prompts_only
from st_prompts.prompts.shallow import SCPCSE_TEMPLATE

__version__ = "0.1.0"

__all__ = ["MaskTokenPooling", "PromptedTransformer", "SCPCSE_TEMPLATE", "save_prompts_only", "__version__"]
