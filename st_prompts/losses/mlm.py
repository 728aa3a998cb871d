"""Auxiliary masked-language-modelling objective run through the prompted encoder (DCPCSE's multi-task setting)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling

logger = logging.getLogger(__name__)


def mlm_weight(step: int, weight: float = 0.1, decay: float = 0.95, decay_steps: int = 100) -> float:
    """DCPCSE's auxiliary MLM weight at optimisation step ``step``: ``weight · decay^(step / decay_steps)``."""
    return weight * decay ** (step / decay_steps)


class MLMHead(nn.Module):
    """The backbone's masked-LM head, with its output projection tied to the encoder's input embeddings.

    The head comes from the checkpoint when it has one (``BertForMaskedLM.cls``, ``RobertaForMaskedLM.lm_head``, ...)
    and is then frozen like the rest of the pre-trained model. When the checkpoint has no MLM head weights (e.g. the
    sentence-tuned all-MiniLM-L6-v2), the head's transform (dense → activation → LayerNorm) is freshly initialised and
    *trained* with the prompts, while the vocabulary projection stays tied to the frozen input embeddings; this
    fallback is logged as a warning.

    Attributes:
        from_checkpoint: whether the head's weights were found in the checkpoint.
    """

    def __init__(self, encoder, source: str | None = None) -> None:
        super().__init__()
        config = encoder.auto_model.config
        source = source or encoder.backbone_name_or_path
        mlm_model, missing = None, None
        try:
            mlm_model, info = AutoModelForMaskedLM.from_pretrained(source, output_loading_info=True)
            missing = info["missing_keys"]
        except (OSError, ValueError) as exc:
            logger.warning(f"Could not load a masked-LM checkpoint from {source!r} ({exc}).")
        if mlm_model is None:
            mlm_model = AutoModelForMaskedLM.from_config(config)
        prefix = mlm_model.base_model_prefix
        head_modules = [(name, child) for name, child in mlm_model.named_children() if name != prefix]
        head_names = [name for name, _ in head_modules]
        self.from_checkpoint = missing is not None and not any(
            key.split(".")[0] in head_names for key in missing
        )
        self.head = nn.Sequential(*[child for _, child in head_modules])
        # Tie the vocabulary projection to the encoder's own input embeddings (no second copy in memory).
        decoder = mlm_model.get_output_embeddings()
        decoder.weight = encoder.auto_model.get_input_embeddings().weight
        del mlm_model
        trainable = not self.from_checkpoint
        for parameter in self.head.parameters():
            parameter.requires_grad = trainable and parameter is not decoder.weight
        if self.from_checkpoint:
            logger.info(f"Auxiliary MLM uses the masked-LM head of {source!r} (frozen).")
        else:
            logger.warning(
                f"{source!r} has no masked-LM head weights: the auxiliary MLM loss uses a freshly initialised head "
                "transform trained together with the prompts (vocabulary projection tied to the frozen input embeddings)."
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_states)


class TokenMasker:
    """BERT-style masking (15% of the tokens; 80% → mask token, 10% → random token, 10% unchanged).

    Reuses transformers' ``DataCollatorForLanguageModeling.torch_mask_tokens``; special tokens and padding are never
    masked.
    """

    def __init__(self, tokenizer, mlm_probability: float = 0.15, seed: int | None = None) -> None:
        self.tokenizer = tokenizer
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability)
        self.collator.generator = generator
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)))

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = input_ids.device
        ids = input_ids.detach().to("cpu").clone()
        special = torch.isin(ids, self.special_ids) | (attention_mask.to("cpu") == 0)
        masked, labels = self.collator.torch_mask_tokens(ids, special_tokens_mask=special)
        return masked.to(device), labels.to(device)
