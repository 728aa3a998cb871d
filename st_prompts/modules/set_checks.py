"""Checks of prompt sets read from a bank's config or a checkpoint, made before anything is allocated: a malformed or
out-of-range value is one :class:`~st_prompts.errors.ConfigurationError` (or ``DataFormatError`` for stored weights),
never a traceback or a huge allocation."""

from __future__ import annotations

import math
from typing import Any

from st_prompts.errors import ConfigurationError, DataFormatError, TrainingDivergedError, shorten
from st_prompts.modules.checks import check_room_for_text
from st_prompts.prompts.names import check_set_name
from st_prompts.prompts.spec import MAX_PREFIX_LENGTH, PromptSetSpec


def check_prompt_sets(raw: Any, where: str = "the bank's config") -> dict[str, PromptSetSpec] | None:
    """A bank config's ``prompt_sets`` checked: ``None``, or an object mapping each set's name (the grammar of
    :mod:`st_prompts.prompts.names`) to its options (:meth:`PromptSetSpec.from_config`). Returns name -> spec."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigurationError(f"{where}: prompt_sets must be an object of name -> options, got "
                                 f"{type(raw).__name__}.")
    specs = {}
    for name, options in raw.items():
        check_set_name(name, where)  # the one grammar: a hand-edited config cannot smuggle a newline or "x@1" in
        specs[name] = PromptSetSpec.from_config(options, f"{where}: prompt set {shorten(name)}")
    return specs


def config_prompt_sets(config: Any, path: str) -> dict[str, PromptSetSpec]:
    """The checked ``prompt_sets`` of a prompted encoder's config read from ``path`` (``{}`` without any)."""
    if not isinstance(config, dict):
        raise ConfigurationError(f"The prompted encoder's configuration in {path!r} is not a JSON object.")
    return check_prompt_sets(config.get("prompt_sets"), repr(path)) or {}


def check_prefix_fits(module: Any, prefix_length: int, gated: bool, template_tokens: int = 0) -> None:
    """Refuse, before it is allocated, a prefix that leaves too little room for text (an ungated prefix on learned
    absolute positions) or is longer than the position table (a gated prefix, rotary positions)."""
    positions = min(module.max_positions, MAX_PREFIX_LENGTH)
    if module.backbone_plan.absolute_positions and not gated:
        check_room_for_text(module.max_positions, module._position_offset,
                            module.tokenizer.num_special_tokens_to_add(pair=False), template_tokens, prefix_length)
    elif prefix_length > positions:
        raise ConfigurationError(f"prefix_length={prefix_length} is longer than the backbone's position table "
                                 f"({positions} positions): use prefix_length <= {positions}.")


def finite(tensor: Any) -> bool:
    """Whether every value of the floating-point ``tensor`` is finite. Its sum first (NaN and infinity carry into it,
    and it writes no mask: much faster); only a sum that overflowed is checked value by value."""
    import torch

    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite_prompts(state: dict[str, Any], label: str) -> dict[str, Any]:
    """``state``, unless its weights hold NaN or infinite values: then :class:`~st_prompts.errors.DataFormatError`."""
    import torch

    for key, tensor in state.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not finite(tensor):
            raise DataFormatError(f"The prompt set in {label} holds non-finite values (NaN or infinity) in {key!r}: "
                                  "it cannot join the bank (retrain it, or add an earlier copy).")
    return state


def check_finite_training(model: Any, best_metric: float | None) -> None:
    """Refuse to save a diverged model: raise :class:`~st_prompts.errors.TrainingDivergedError` (one line) if the
    model-selection score ``best_metric`` is NaN or infinite, or if a weight (parameter or buffer) of ``model`` is."""

    hint = "the model was not saved; train again with a smaller learning rate"
    if best_metric is not None and not math.isfinite(best_metric):
        raise TrainingDivergedError(f"training diverged: the model-selection score is {best_metric}; {hint}")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    bad = [name for name, t in tensors if t.is_floating_point() and not finite(t.detach())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise TrainingDivergedError(f"training diverged: {len(bad)} weight tensor(s) hold NaN or infinite values "
                                    f"({shown}); {hint}")
