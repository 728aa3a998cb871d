"""Pooling modules that sentence-transformers' ``Pooling`` does not provide."""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers.base.modules.module import Module

from st_prompts.errors import ConfigurationError


class MaskTokenPooling(Module):
    """Sentence embedding = last hidden state at the template's ``[MASK]`` position (PromptBERT / SCPCSE pooling),
    read from ``features["prompt_mask_index"]``. With template denoising, the template-alone ``[MASK]`` state
    (``features["template_token_embeddings"]``) is subtracted. ``embedding_dimension``: the encoder's hidden size."""

    config_keys = ["embedding_dimension"]

    def __init__(self, embedding_dimension: int) -> None:
        super().__init__()
        self.embedding_dimension = embedding_dimension

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        if "prompt_mask_index" not in features:
            raise ConfigurationError("MaskTokenPooling needs a PromptedTransformer with a template (it pools the "
                                     "[MASK] position).")
        tokens = features["token_embeddings"]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        embedding = tokens[rows, features["prompt_mask_index"].to(tokens.device)]
        if features.get("template_token_embeddings") is not None:
            template = features["template_token_embeddings"]
            embedding = embedding - template[rows, features["template_mask_index"].to(tokens.device)]
        features["sentence_embedding"] = embedding
        return features

    def get_embedding_dimension(self) -> int:
        return self.embedding_dimension

    def save(self, output_path: str, *args, **kwargs) -> None:
        self.save_config(output_path)
