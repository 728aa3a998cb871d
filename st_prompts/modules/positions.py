"""Positions of the text under a deep prefix: where it starts, and how many tokens fit."""

from __future__ import annotations

import logging

import torch

from st_prompts.modules.checks import check_room_for_text

logger = logging.getLogger(__name__)


class PositionsMixin:
    """Position ids and length limits of :class:`~st_prompts.PromptedTransformer`.

    With learned absolute position embeddings (the BERT family, DistilBERT, ALBERT) the text's positions start after
    the prefix, exactly as transformers numbers ``input_ids`` after a key/value cache of ``prefix_length`` positions
    (what the official DCPCSE code's transformers did), so the prefix takes positions from the text. With rotary
    positions (ModernBERT, Llama, Qwen, Gemma) the prefix has no position: it enters each layer after the rotation and
    the text keeps the positions it has without a prefix.
    """

    @property
    def prefix_positions(self) -> int:
        """Positions the prefix takes from the text: the longest prefix (own or of a prompt set) with learned absolute
        positions (the text starts after the prefix, as after a key/value cache in the official DCPCSE code), 0 with
        rotary positions."""
        if not self.backbone_plan.absolute_positions:
            return 0
        sets = getattr(self, "prompt_sets", None) or {}
        own = self.prefix_encoder.position_length if getattr(self, "prefix_encoder", None) is not None else 0
        return max([own, *(encoder.position_length for encoder in sets.values())])

    def _check_room(self, prefix_length: int) -> None:
        """Make room for a prompt set of ``prefix_length`` positions (a shorter ``max_seq_length`` if need be)."""
        if not self.backbone_plan.absolute_positions:
            return
        check_room_for_text(self.max_positions, self._position_offset,
                            self.tokenizer.num_special_tokens_to_add(pair=False), self.template_num_tokens,
                            prefix_length)
        limit = self.max_positions - self._position_offset - max(self.prefix_positions, prefix_length)
        if self.tokenizer.model_max_length > limit:
            logger.warning(f"max_seq_length={self.tokenizer.model_max_length} does not fit a prefix of {prefix_length} "
                           f"positions; using {limit}.")
            self.tokenizer.model_max_length = limit

    @property
    def max_positions(self) -> int:
        """The backbone's ``max_position_embeddings`` (a large number when its config has none)."""
        return int(getattr(self.auto_model.config, "max_position_embeddings", None) or 1_000_000)

    @property
    def max_position_limit(self) -> int:
        """The largest ``max_seq_length`` the position embeddings allow once the prefix takes its positions."""
        # RoBERTa-family position ids start at padding_idx + 1; transformers offsets them by the cache length.
        return self.max_positions - self._position_offset - self.prefix_positions

    @property
    def max_seq_length(self) -> int:
        """Maximum number of real tokens (special tokens and template included); longer texts are truncated."""
        return self.tokenizer.model_max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if value is None or value > self.max_position_limit:
            logger.warning(f"max_seq_length={value} exceeds what the backbone allows with the prefix; capping.")
            value = self.max_position_limit
        self.tokenizer.model_max_length = value

    def position_ids(self, attention_mask: torch.Tensor, prefix_lengths: int | torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The position ids of the real tokens, on every path (deep prefix, template, overrides).

        Learned absolute positions: exactly what transformers computes from ``input_ids`` after a cache of
        ``prefix_length`` positions. BERT-style embeddings number the ``seq`` positions ``prefix_length, ...,
        prefix_length + seq - 1``; RoBERTa-style ones (positions from ``padding_idx + 1``) number real tokens
        ``padding_idx + 1 + prefix_length + i`` and give padding ``padding_idx``.

        Args:
            attention_mask: ``(batch, seq)`` mask of the real tokens (without the prefix).
            prefix_lengths: the prefix length of the pass, or of each row (``(batch,)``: rows of several prompt sets);
                default ``prefix_length``.

        Rotary positions: ``0, 1, ...`` over the real tokens, whichever side the padding is on.
        """
        if not self.backbone_plan.absolute_positions:
            # Rotary (or no) positions: the text keeps the positions it has without a prefix, counted over the real
            # tokens so that left and right padding give a row the same positions.
            return (torch.cumsum(attention_mask.long(), dim=1) - 1).clamp(min=0)
        if prefix_lengths is None:
            own = getattr(self, "prefix_encoder", None)
            prefix_lengths = own.position_length if own is not None else 0
        prefix = prefix_lengths
        if isinstance(prefix, torch.Tensor):
            prefix = prefix.to(attention_mask.device).view(-1, 1)
        if self._position_offset:  # RoBERTa family
            padding_idx = self._position_offset - 1
            mask = (attention_mask != 0).long()
            return (torch.cumsum(mask, dim=1) + prefix) * mask + padding_idx
        batch, seq = attention_mask.shape
        return (torch.arange(seq, device=attention_mask.device).unsqueeze(0) + prefix).expand(batch, seq)

