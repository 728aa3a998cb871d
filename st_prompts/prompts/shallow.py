"""Shallow continuous prompts: trainable input embeddings around a template (the SCPCSE ablation of DCPCSE).

A template such as ``This sentence : "[X]" means [MASK] .`` is tokenised once. ``[X]`` is where the sentence goes and
``[MASK]`` (written literally, whatever the tokenizer's own mask token is) is the position whose last hidden state is
the sentence embedding. Every other template token becomes a trainable vector initialised from that token's input
embedding; the ``[MASK]`` token and the special tokens ([CLS]/[SEP], <s>/</s>) stay real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from st_prompts.errors import ConfigurationError

SENTENCE_SLOT = "[X]"
MASK_SLOT = "[MASK]"
#: The SCPCSE template of the DCPCSE paper (appendix A).
SCPCSE_TEMPLATE = 'This sentence : "[X]" means [MASK] .'


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
        slots, k = [], 0
        for token in self.left_ids + self.right_ids:
            if token == mask_token_id:
                slots.append(-1)
            else:
                slots.append(k)
                k += 1
        return slots[: len(self.left_ids)], slots[len(self.left_ids) :]


def parse_template(template: str, tokenizer) -> ParsedTemplate:
    """Tokenise ``template`` around its ``[X]`` slot and locate its ``[MASK]`` token.

    Raises:
        ConfigurationError: if the template lacks exactly one ``[X]`` or exactly one ``[MASK]``, or the tokenizer has no
            mask token.
    """
    if template.count(SENTENCE_SLOT) != 1 or template.count(MASK_SLOT) != 1:
        raise ConfigurationError(
            f"A prompt template needs exactly one {SENTENCE_SLOT} (where the sentence goes) and one {MASK_SLOT} "
            f"(the position used as the sentence embedding); got {template!r}."
        )
    if tokenizer.mask_token is None:
        raise ConfigurationError(f"The tokenizer {type(tokenizer).__name__} has no mask token; templates need one.")
    left, right = template.split(SENTENCE_SLOT)
    left = left.replace(MASK_SLOT, tokenizer.mask_token)
    right = right.replace(MASK_SLOT, tokenizer.mask_token)
    left_ids = tuple(tokenizer(left, add_special_tokens=False)["input_ids"]) if left.strip() else ()
    right_ids = tuple(tokenizer(right, add_special_tokens=False)["input_ids"]) if right.strip() else ()
    mask_id = tokenizer.mask_token_id
    if mask_id in left_ids:
        return ParsedTemplate(left_ids, right_ids, True, left_ids.index(mask_id))
    return ParsedTemplate(left_ids, right_ids, False, right_ids.index(mask_id))


class ShallowPrompt(nn.Module):
    """Trainable template embeddings (one vector per non-mask template token).

    Args:
        template_ids: the template token ids in order (left part then right part), mask token included.
        mask_token_id: id of the mask token, which is left as a real token (not trainable).
        init_embeddings: the backbone's input embedding matrix used to initialise the soft tokens.
    """

    def __init__(self, template_ids: list[int], mask_token_id: int, init_embeddings: torch.Tensor) -> None:
        super().__init__()
        soft_ids = [i for i in template_ids if i != mask_token_id]
        if not soft_ids:
            raise ConfigurationError("The template has no token besides [X] and [MASK]: nothing to train.")
        self.embeddings = nn.Parameter(init_embeddings[torch.tensor(soft_ids)].detach().clone())

    @property
    def num_soft_tokens(self) -> int:
        return self.embeddings.shape[0]

    def forward(self, inputs_embeds: torch.Tensor, soft_positions: torch.Tensor) -> torch.Tensor:
        """Replace the template slots of ``inputs_embeds`` (``soft_positions >= 0``) by the trainable vectors."""
        is_soft = (soft_positions >= 0).unsqueeze(-1)
        soft = self.embeddings[soft_positions.clamp(min=0)].to(inputs_embeds.dtype)
        return torch.where(is_soft, soft, inputs_embeds)
