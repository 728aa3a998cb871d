"""Checks of prompt sets read from a bank's config or a checkpoint, made before anything is allocated.

A bank's ``sentence_bert_config.json`` lists its sets (``prompt_sets``: name -> options); a set's options decide how
much memory its prefix takes (``prefix_length`` positions x layers x heads x head size). Everything here refuses a
malformed or out-of-range value with one :class:`~st_prompts.errors.ConfigurationError` (or
:class:`~st_prompts.errors.DataFormatError` for stored weights) instead of a traceback or a huge allocation.
"""

from __future__ import annotations

import math
from typing import Any

from st_prompts.errors import ConfigurationError, DataFormatError, TrainingDivergedError
from st_prompts.modules.checks import check_room_for_text
from st_prompts.prompts.names import check_set_name

#: The longest prefix any set may have, whatever the backbone (a backbone without a position table included).
MAX_PREFIX_LENGTH = 16_384
#: The largest hidden size of a prefix's reparameterisation MLP.
MAX_PREFIX_HIDDEN_SIZE = 65_536
#: The options a prompt set is made from (what a bank's config lists per set).
SET_OPTION_NAMES = ("prefix_length", "prefix_projection", "prefix_hidden_size", "prefix_dropout", "prefix_gate",
                    "init_std")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_set_options(prefix_length: Any, prefix_projection: Any = False, prefix_hidden_size: Any = None,
                      prefix_dropout: Any = None, prefix_gate: Any = False, init_std: Any = None,
                      where: str = "a prompt set") -> None:
    """Refuse set options of the wrong kind or out of range: ``prefix_length`` a whole number in
    ``[1, MAX_PREFIX_LENGTH]``, ``prefix_hidden_size`` ``None`` or in ``[1, MAX_PREFIX_HIDDEN_SIZE]``,
    ``prefix_dropout`` ``None`` or a finite number in ``[0, 1)``, ``init_std`` ``None`` or a finite positive number,
    the flags ``True``/``False``/``None``."""
    if not _whole(prefix_length) or not 1 <= prefix_length <= MAX_PREFIX_LENGTH:
        raise ConfigurationError(f"{where}: prefix_length must be a whole number from 1 to {MAX_PREFIX_LENGTH}, got "
                                 f"{_short(prefix_length)}.")
    if prefix_hidden_size is not None and (not _whole(prefix_hidden_size)
                                           or not 1 <= prefix_hidden_size <= MAX_PREFIX_HIDDEN_SIZE):
        raise ConfigurationError(f"{where}: prefix_hidden_size must be a whole number from 1 to "
                                 f"{MAX_PREFIX_HIDDEN_SIZE} (or null), got {_short(prefix_hidden_size)}.")
    if prefix_dropout is not None and (not _real(prefix_dropout) or not 0.0 <= prefix_dropout < 1.0):
        raise ConfigurationError(f"{where}: prefix_dropout must be a number in [0, 1) (or null), got "
                                 f"{_short(prefix_dropout)}.")
    if init_std is not None and (not _real(init_std) or not init_std > 0):
        raise ConfigurationError(f"{where}: init_std must be a positive number (or null), got {_short(init_std)}.")
    for name, flag in (("prefix_projection", prefix_projection), ("prefix_gate", prefix_gate)):
        if flag not in (None, True, False):
            raise ConfigurationError(f"{where}: {name} must be true or false, got {_short(flag)}.")


def check_prompt_sets(raw: Any, where: str = "the bank's config") -> dict[str, dict[str, Any]] | None:
    """A bank config's ``prompt_sets`` checked: ``None``, or an object mapping each set's name (the grammar of
    :mod:`st_prompts.prompts.names`)
    to an object of known options (:data:`SET_OPTION_NAMES`) of the right kind and range. Returns it unchanged."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigurationError(f"{where}: prompt_sets must be an object of name -> options, got "
                                 f"{type(raw).__name__}.")
    for name, options in raw.items():
        label = f"{where}: prompt set {_short(name)}"
        check_set_name(name, where)  # the one grammar: a hand-edited config cannot smuggle a newline or "x@1" in
        if not isinstance(options, dict):
            raise ConfigurationError(f"{label}: its options must be an object, got {type(options).__name__}.")
        unknown = sorted(str(key) for key in options if key not in SET_OPTION_NAMES)
        if unknown:
            raise ConfigurationError(f"{label}: unknown option(s) {', '.join(_short(k) for k in unknown[:5])} "
                                     f"(known: {', '.join(SET_OPTION_NAMES)}).")
        if "prefix_length" not in options:
            raise ConfigurationError(f"{label}: prefix_length is missing.")
        check_set_options(**options, where=label)
    return raw


def config_prompt_sets(config: Any, path: str) -> dict[str, dict[str, Any]]:
    """The checked ``prompt_sets`` of a prompted encoder's ``sentence_bert_config.json`` read from ``path`` (``{}``
    when it has none)."""
    if not isinstance(config, dict):
        raise ConfigurationError(f"The prompted encoder's configuration in {path!r} is not a JSON object.")
    return check_prompt_sets(config.get("prompt_sets"), repr(path)) or {}


def check_prefix_fits(module: Any, prefix_length: int, gated: bool, template_tokens: int = 0) -> None:
    """Refuse a prefix the backbone's position table cannot hold, before it is allocated: with learned absolute
    positions an ungated prefix takes positions from the text (at least ``MIN_TEXT_TOKENS`` must stay for it);
    otherwise (a gated prefix, rotary positions) it may not be longer than the position table itself."""
    positions = min(module.max_positions, MAX_PREFIX_LENGTH)
    if module.backbone_plan.absolute_positions and not gated:
        check_room_for_text(module.max_positions, module._position_offset,
                            module.tokenizer.num_special_tokens_to_add(pair=False), template_tokens, prefix_length)
    elif prefix_length > positions:
        raise ConfigurationError(f"prefix_length={prefix_length} is longer than the backbone's position table "
                                 f"({positions} positions): use prefix_length <= {positions}.")


def check_finite_prompts(state: dict[str, Any], label: str) -> dict[str, Any]:
    """``state``, unless its prompt weights hold NaN or infinite values (a set saved from a diverged run, or a damaged
    file): then :class:`~st_prompts.errors.DataFormatError`."""
    import torch

    for key, tensor in state.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DataFormatError(f"The prompt set in {label} holds non-finite values (NaN or infinity) in {key!r}: "
                                  "it cannot join the bank (retrain it, or add an earlier copy).")
    return state


def check_finite_training(model: Any, best_metric: float | None) -> None:
    """Refuse to save a diverged model: raise :class:`~st_prompts.errors.TrainingDivergedError` (one line) if the
    model-selection score ``best_metric`` is NaN or infinite, or if a weight (parameter or buffer) of ``model`` is."""
    import torch

    hint = "the model was not saved; train again with a smaller learning rate"
    if best_metric is not None and not math.isfinite(best_metric):
        raise TrainingDivergedError(f"training diverged: the model-selection score is {best_metric}; {hint}")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    bad = [name for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise TrainingDivergedError(f"training diverged: {len(bad)} weight tensor(s) hold NaN or infinite values "
                                    f"({shown}); {hint}")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        text = f"<a {type(value).__name__} too long to show>"
    return text if len(text) <= 60 else text[:60] + "..."
