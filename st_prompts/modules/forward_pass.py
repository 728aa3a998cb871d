"""One forward pass of :class:`~st_prompts.PromptedTransformer`, step by step.

:meth:`ForwardPassMixin._encode` reads as the pass it runs:

1. :meth:`~ForwardPassMixin._input_vectors`: the token embeddings, with the soft template tokens and the [CLS]
   prompt (or a caller's [CLS] override) written into their slots;
2. :meth:`~st_prompts.modules.prompt_sets.PromptSetsMixin.select_prompts`: which prefix the rows use (one set, none,
   or a mix of sets, one per row);
3. :meth:`~ForwardPassMixin._positions`: the position ids (after the prefix's positions, or the caller's);
4. :meth:`~ForwardPassMixin._backbone_inputs`: what the backbone takes besides (token types, no cache);
5. the prefix: a mix of sets (:meth:`~st_prompts.modules.prompt_sets.PromptSetsMixin._mixed_prefix`) or one set for
   every row (:meth:`~ForwardPassMixin._one_prefix`: its keys/values, the positions each row attends, key padding
   at inference, and the attention interface that carries it);
6. the backbone, whose last hidden states become ``features["token_embeddings"]``.
"""

from __future__ import annotations

from typing import Any

import torch

from st_prompts.errors import ConfigurationError
from st_prompts.modules.backbones import check_checkpointing
from st_prompts.modules.prompt_sets import PromptSelection
from st_prompts.prompts.features import (
    CLS_OVERRIDE,
    POSITION_IDS,
    PREFIX_ATTENTION_MASK,
    PREFIX_VALUES,
    PROMPT_TASK,
    PROMPT_TASKS,
    SOFT_PROMPT_POSITIONS,
)
from st_prompts.prompts.injection import PREFIX_KWARG, PrefixInjection
from st_prompts.prompts.prefix import PrefixDraw, PrefixEncoder, key_padding, pad_prefix
from st_prompts.prompts.shallow import place_vectors


class ForwardPassMixin:
    """The steps of one pass of the prompted backbone (see the module docstring)."""

    def _encode(self, features: dict[str, Any]) -> dict[str, Any]:
        """One pass of the prompted backbone (see :meth:`~st_prompts.PromptedTransformer.forward`)."""
        input_ids = features["input_ids"]
        inputs_embeds = self._input_vectors(features)
        selection = self.select_prompts(features.get(PROMPT_TASKS), features.get(PROMPT_TASK), input_ids.shape[0],
                                        input_ids.device)
        model_inputs = self._backbone_inputs(features, inputs_embeds, self._positions(features, selection))
        attention_mask = self._prefix_inputs(model_inputs, features, selection)
        output = self.auto_model(**model_inputs, attention_mask=attention_mask, return_dict=True)
        features["token_embeddings"] = output.last_hidden_state
        return features

    # ------------------------------------------------------------------ inputs
    def _input_vectors(self, features: dict[str, Any]) -> torch.Tensor:
        """The input embeddings of the batch, with the trainable vectors (soft template tokens, [CLS] prompt) in their
        slots and ``features["cls_override"]``, if given, at position 0."""
        inputs_embeds = self.auto_model.get_input_embeddings()(features["input_ids"])
        slots = self._vector_slots(features)
        if slots is not None:
            inputs_embeds = self.shallow_prompt(inputs_embeds, slots)
        if features.get(CLS_OVERRIDE) is not None:
            inputs_embeds = place_vectors(inputs_embeds, features[CLS_OVERRIDE], position=0)
        return inputs_embeds

    def _vector_slots(self, features: dict[str, Any]) -> torch.Tensor | None:
        """Which trainable vector goes to each input position (-1: none), or ``None`` when there is none."""
        slots = None
        if self._template is not None and self.template_mode == "soft":
            if SOFT_PROMPT_POSITIONS not in features:
                raise ConfigurationError(
                    f"features lack {SOFT_PROMPT_POSITIONS!r}: tokenise with this module's preprocess() when it has a "
                    "soft template."
                )
            slots = features[SOFT_PROMPT_POSITIONS]
        if self._cls_slot is not None:
            input_ids = features["input_ids"]
            slots = input_ids.new_full(input_ids.shape, -1) if slots is None else slots.to(input_ids.device).clone()
            slots[:, 0] = self._cls_slot
        return slots

    def _positions(self, features: dict[str, Any], selection: PromptSelection) -> torch.Tensor:
        """``features["position_ids"]`` (checked), else the positions after the prefix each row uses (a gated
        prefix, or none, takes no positions)."""
        input_ids = features["input_ids"]
        position_ids = features.get(POSITION_IDS)
        if position_ids is None:
            encoder = selection.encoder
            lengths = selection.offsets if selection.mixed else (encoder.position_length if encoder is not None else 0)
            return self.position_ids(features["attention_mask"], lengths)
        if position_ids.shape != input_ids.shape:
            raise ConfigurationError(f"features['position_ids'] must have shape {tuple(input_ids.shape)}, got "
                                     f"{tuple(position_ids.shape)}.")
        return position_ids

    def _backbone_inputs(self, features: dict[str, Any], inputs_embeds: torch.Tensor,
                         position_ids: torch.Tensor) -> dict[str, Any]:
        """The backbone's keyword arguments (the attention mask and the prefix aside)."""
        model_inputs: dict[str, Any] = {"inputs_embeds": inputs_embeds, "position_ids": position_ids}
        accepted = self.backbone_plan.forward_arguments
        if "token_type_ids" in features and "token_type_ids" in accepted:
            model_inputs["token_type_ids"] = features["token_type_ids"]
        if "use_cache" in accepted:
            model_inputs["use_cache"] = False
        return model_inputs

    # ------------------------------------------------------------------ the prefix
    def _prefix_inputs(self, model_inputs: dict[str, Any], features: dict[str, Any],
                       selection: PromptSelection) -> torch.Tensor:
        """Put the rows' prefix into ``model_inputs``; returns the attention mask the backbone takes."""
        attention_mask = features["attention_mask"]
        if selection.mixed:
            self._mixed_prefix(model_inputs, features, selection, features["input_ids"].shape[1])
        elif selection.encoder is not None:
            attention_mask = self._one_prefix(model_inputs, features, selection.encoder)
        elif features.get(PREFIX_ATTENTION_MASK) is not None:
            raise ConfigurationError("features['prefix_attention_mask'] was given but this encoder has no prefix.")
        return attention_mask

    def _one_prefix(self, model_inputs: dict[str, Any], features: dict[str, Any],
                    encoder: PrefixEncoder) -> torch.Tensor:
        """One prefix for every row: its keys/values (:meth:`_prefix_draw`), the positions each row attends
        (:meth:`_prefix_mask`), masked-out padding keys at inference (see
        :func:`~st_prompts.prompts.prefix.key_padding`), carried by the attention interface. Returns the attention
        mask."""
        attention_mask = features["attention_mask"]
        values = self._prefix_draw(features, encoder, attention_mask.shape[0])
        check_checkpointing(self)
        prefix_mask, given_mask = self._prefix_mask(features, encoder.prefix_length)
        # At inference (no per-example draw), pad the keys to a multiple of 16 with masked-out positions: the CPU
        # attention kernel is up to twice as fast there (see key_padding). Not in training, where attention runs
        # through matrix products (dropout) and extra keys would only cost.
        padding = 0
        if not self.training and not encoder.gated and (isinstance(values, torch.Tensor) or values.keep is None):
            padding = key_padding(encoder.prefix_length, features["input_ids"].shape[1])
        if padding:
            values = pad_prefix(values, padding)
            prefix_mask = torch.cat([prefix_mask, prefix_mask.new_zeros(prefix_mask.shape[0], padding)], dim=1)
        if isinstance(values, torch.Tensor):
            values = PrefixDraw(values, values.shape[1], gate=encoder.gate_values())
        model_inputs[PREFIX_KWARG] = PrefixInjection(values, prefix_mask if given_mask or padding else None)
        return attention_mask

    @staticmethod
    def _prefix_draw(features: dict[str, Any], encoder: PrefixEncoder, batch_size: int) -> PrefixDraw | torch.Tensor:
        """This pass's prefix keys/values (a new dropout draw in training), or those of an earlier pass given in
        ``features["prefix_values"]`` (to share its draw); written back there for a later pass. The prefix is
        broadcast over the batch; views of the prefix are made by the attention mask alone."""
        values = features.get(PREFIX_VALUES)
        if values is None:
            values = encoder.values(batch_size)
        elif values.shape[1] != batch_size:
            raise ConfigurationError(f"features['{PREFIX_VALUES}'] holds a prefix for {values.shape[1]} rows, the "
                                     f"batch has {batch_size}.")
        features[PREFIX_VALUES] = values
        return values

    @staticmethod
    def _prefix_mask(features: dict[str, Any], length: int) -> tuple[torch.Tensor, bool]:
        """The prefix positions each row attends (``features["prefix_attention_mask"]``, checked, else all of them)
        as the attention mask's device and dtype, and whether the caller gave it."""
        attention_mask = features["attention_mask"]
        batch_size = attention_mask.shape[0]
        prefix_mask = features.get(PREFIX_ATTENTION_MASK)
        if prefix_mask is None:
            prefix_mask, given = attention_mask.new_ones(batch_size, length), False
        elif tuple(prefix_mask.shape) != (batch_size, length):
            raise ConfigurationError(
                f"features['prefix_attention_mask'] must have shape (batch, prefix_length) = "
                f"{(batch_size, length)}, got {tuple(prefix_mask.shape)}."
            )
        else:
            given = True
        return prefix_mask.to(device=attention_mask.device, dtype=attention_mask.dtype), given
