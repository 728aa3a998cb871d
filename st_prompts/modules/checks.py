"""Checks of a :class:`~st_prompts.PromptedTransformer`'s options against its backbone and tokenizer."""

from __future__ import annotations

from st_prompts.errors import ConfigurationError
from st_prompts.prompts.spec import PromptSetSpec
from st_prompts.prompts.templates import TEMPLATE_MODES

#: The fewest text tokens (besides special and template tokens) the prompts must leave room for: a prefix (plus
#: template) that leaves fewer positions of the backbone's position embeddings is refused at construction.
MIN_TEXT_TOKENS = 8


def validate_prompt_options(prefix_length, template, template_mode, cls_prompt, prefix_hidden_size, prefix_dropout,
                             prefix_init_std=None, bank: bool = False) -> None:
    # the prefix's options by the one spec of a prompt set (kinds and ranges); prefix_length None: no deep prompts
    PromptSetSpec.from_config({"prefix_length": 1 if prefix_length is None else prefix_length,
                               "prefix_hidden_size": prefix_hidden_size, "prefix_dropout": prefix_dropout,
                               "init_std": prefix_init_std}, "PromptedTransformer")
    if prefix_length is None and template is None and not cls_prompt and not bank:
        raise ConfigurationError("Give prefix_length (deep prompts), template (soft or hard), cls_prompt=True, "
                                 "prompt_sets (a bank), or a combination.")
    if template is not None and not isinstance(template, str):
        raise ConfigurationError(f"template must be a string with [X] and [MASK], got {type(template).__name__}.")
    if template_mode not in TEMPLATE_MODES:
        raise ConfigurationError(f"template_mode must be one of {', '.join(TEMPLATE_MODES)}, got {template_mode!r}.")


def cls_token_id(tokenizer) -> int:
    """The id of the token at position 0 that a [CLS] prompt replaces ([CLS] or <s>), checked to be there."""
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    if cls_id is None:
        raise ConfigurationError(f"cls_prompt needs a tokenizer with a [CLS] (or <s>) token; {type(tokenizer).__name__} has none.")
    if tokenizer.padding_side != "right" or tokenizer("a")["input_ids"][0] != cls_id:
        raise ConfigurationError("cls_prompt needs the [CLS] token at position 0 (right padding).")
    return cls_id

def check_room_for_text(max_positions: int, position_offset: int, special: int, template: int,
                        prefix_length: int | None) -> None:
    """Refuse prompts that leave fewer than :data:`MIN_TEXT_TOKENS` positions for text."""
    left = max_positions - position_offset - special - template  # for the prefix and the text
    text = left - (prefix_length or 0)
    if text < MIN_TEXT_TOKENS:
        largest = left - MIN_TEXT_TOKENS
        hint = f"use prefix_length <= {largest}" if largest >= 1 else "use a shorter template or a longer backbone"
        raise ConfigurationError(f"prefix_length={prefix_length} leaves {max(text, 0)} positions "
                                 f"for text: the backbone has {max_positions} position embeddings, of which "
                                 f"{position_offset} are reserved (position offset), {special} go to special tokens "
                                 f"and {template} to the template; at least {MIN_TEXT_TOKENS} are needed "
                                 f"(MIN_TEXT_TOKENS): {hint}.")
