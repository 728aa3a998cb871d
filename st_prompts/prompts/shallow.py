"""Input-embedding prompts: trainable vectors (:class:`ShallowPrompt`) that a per-batch *slot* tensor places at input
positions (``-1``: the token's own embedding): soft template tokens and the [CLS] prompt. A template such as
``This sentence : "[X]" means [MASK] .`` is *soft* (its tokens trainable) or *hard* (real tokens, PromptBERT).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from st_prompts.errors import ConfigurationError
from st_prompts.prompts.features import POSITION_IDS, PREFIX_ATTENTION_MASK, SOFT_PROMPT_POSITIONS
from st_prompts.prompts.templates import MASK_SLOT, PROMPTBERT_TEMPLATE, SCPCSE_TEMPLATE, SENTENCE_SLOT  # noqa: F401


@dataclass(frozen=True)
class ParsedTemplate:
    """Token ids of a template split around the sentence slot.

    ``left_ids``/``right_ids`` are the template tokens before/after the sentence (no special tokens);
    ``mask_offset`` is the index of the mask token inside ``left_ids`` (if ``mask_in_left``) or ``right_ids``.
    """

    left_ids: tuple[int, ...]
    right_ids: tuple[int, ...]
    mask_in_left: bool
    mask_offset: int

    @property
    def num_tokens(self) -> int:
        return len(self.left_ids) + len(self.right_ids)

    def soft_slots(self, mask_token_id: int) -> tuple[list[int], list[int]]:
        """Index of the trainable vector for every template token (``-1`` for the mask token), left and right part."""
        vector = itertools.count()
        slots = [-1 if token == mask_token_id else next(vector) for token in self.left_ids + self.right_ids]
        return slots[: len(self.left_ids)], slots[len(self.left_ids) :]


def parse_template(template: str, tokenizer) -> ParsedTemplate:
    """Tokenise ``template`` around its ``[X]`` slot and locate its ``[MASK]`` token.

    Raises:
        ConfigurationError: if the template lacks exactly one ``[X]`` or exactly one ``[MASK]``, or the tokenizer has no
            mask token.
    """
    if template.count(SENTENCE_SLOT) != 1 or template.count(MASK_SLOT) != 1:
        raise ConfigurationError(f"A prompt template needs exactly one {SENTENCE_SLOT} (where the sentence goes) and "
                                 f"one {MASK_SLOT} (the position used as the sentence embedding); got {template!r}.")
    if tokenizer.mask_token is None:
        raise ConfigurationError(f"The tokenizer {type(tokenizer).__name__} has no mask token; templates need one.")
    parts = template.replace(MASK_SLOT, tokenizer.mask_token).split(SENTENCE_SLOT)
    left_ids, right_ids = (tuple(tokenizer(part, add_special_tokens=False)["input_ids"]) if part.strip() else ()
                           for part in parts)
    mask_id = tokenizer.mask_token_id
    if mask_id in left_ids:
        return ParsedTemplate(left_ids, right_ids, True, left_ids.index(mask_id))
    return ParsedTemplate(left_ids, right_ids, False, right_ids.index(mask_id))


class ShallowPrompt(nn.Module):
    """Trainable vectors placed at given input positions, initialised from ``init_vectors`` (``(n, dim)``)."""

    def __init__(self, init_vectors: torch.Tensor) -> None:
        super().__init__()
        if init_vectors.dim() != 2 or init_vectors.shape[0] == 0:
            raise ConfigurationError("A shallow prompt needs at least one vector to train.")
        self.embeddings = nn.Parameter(init_vectors.detach().clone())

    @classmethod
    def from_token_ids(cls, token_ids: list[int], embedding_matrix: torch.Tensor) -> ShallowPrompt:
        """One trainable vector per token id, initialised from that token's row of ``embedding_matrix``."""
        return cls(embedding_matrix[torch.tensor(token_ids, dtype=torch.long, device=embedding_matrix.device)])

    @property
    def num_soft_tokens(self) -> int:
        return self.embeddings.shape[0]

    def forward(self, inputs_embeds: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Replace the rows of ``inputs_embeds`` where ``slots`` is ``>= 0`` by the trainable vector it names."""
        slots = slots.to(inputs_embeds.device)
        is_soft = (slots >= 0).unsqueeze(-1)
        soft = self.embeddings[slots.clamp(min=0)].to(inputs_embeds.dtype)
        return torch.where(is_soft, soft, inputs_embeds)


def place_vectors(inputs_embeds: torch.Tensor, vectors: torch.Tensor, position: int = 0) -> torch.Tensor:
    """Replace the input row at ``position`` (0: the [CLS] / <s> row) of ``inputs_embeds`` (``(batch, seq, dim)``) by
    the matching row of ``vectors`` (``(batch, dim)``, not detached: gradient flows into it)."""
    batch, _, dim = inputs_embeds.shape
    if vectors.dim() != 2 or vectors.shape != (batch, dim):
        raise ConfigurationError(f"An input-row override needs shape (batch, input embedding size) = {(batch, dim)}, "
                                 f"got {tuple(vectors.shape)}.")
    vectors = vectors.to(device=inputs_embeds.device, dtype=inputs_embeds.dtype).unsqueeze(1)
    return torch.cat([inputs_embeds[:, :position], vectors, inputs_embeds[:, position + 1 :]], dim=1)


def tokenize_with_template(tokenizer, template: ParsedTemplate, soft: bool, texts: list[str],
                       max_seq_length: int) -> dict[str, torch.Tensor]:
    """Tokenise ``texts`` into ``template``'s ``[X]`` slot (``[CLS] left sentence right [SEP]``, padded), truncating
    only the sentence; writes ``prompt_mask_index`` and, for a soft template, the trainable-vector slots."""
    budget = max_seq_length - template.num_tokens - 2
    if budget < 1:
        raise ConfigurationError(f"max_seq_length={max_seq_length} leaves no room for text after the template.")
    sentence_ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=budget)["input_ids"]
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    left_slots, right_slots = template.soft_slots(tokenizer.mask_token_id)
    rows, slots, mask_index = [], [], []
    for ids in sentence_ids:
        rows.append([cls_id, *template.left_ids, *ids, *template.right_ids, sep_id])
        if soft:
            slots.append([-1, *left_slots, *([-1] * len(ids)), *right_slots, -1])
        before = 0 if template.mask_in_left else len(template.left_ids) + len(ids)  # tokens before the mask's part
        mask_index.append(1 + before + template.mask_offset)
    length = max(len(r) for r in rows) if rows else 0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = {
        "input_ids": torch.tensor([r + [pad_id] * (length - len(r)) for r in rows], dtype=torch.long),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows], dtype=torch.long),
        "prompt_mask_index": torch.tensor(mask_index, dtype=torch.long),
    }
    if soft:
        batch[SOFT_PROMPT_POSITIONS] = torch.tensor([s + [-1] * (length - len(s)) for s in slots], dtype=torch.long)
    if "token_type_ids" in tokenizer.model_input_names:
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    return batch


def template_only_features(template: ParsedTemplate, features: dict[str, Any], positions: torch.Tensor
                           ) -> dict[str, torch.Tensor]:
    """Features for ``template`` alone (the sentence removed from every row of ``features``), each template token
    keeping its position id of ``positions`` (template denoising); the per-row prefix attention mask is kept."""
    input_ids, attention_mask = features["input_ids"], features["attention_mask"]
    num_left = len(template.left_ids)
    sentence_length = attention_mask.sum(dim=1) - (template.num_tokens + 2)
    base = torch.arange(template.num_tokens + 2, device=input_ids.device)
    index = base.unsqueeze(0) + torch.where(base > num_left, sentence_length.unsqueeze(1), 0)
    mask_index = 1 + template.mask_offset + (0 if template.mask_in_left else num_left)
    out = {
        "input_ids": input_ids.gather(1, index),
        "attention_mask": torch.ones_like(index),
        POSITION_IDS: positions.gather(1, index),
        "prompt_mask_index": torch.full_like(sentence_length, mask_index),
    }
    for key in ("token_type_ids", SOFT_PROMPT_POSITIONS):
        if key in features:
            out[key] = features[key].gather(1, index)
    if PREFIX_ATTENTION_MASK in features:
        out[PREFIX_ATTENTION_MASK] = features[PREFIX_ATTENTION_MASK]
    return out
