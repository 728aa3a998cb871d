"""What a model folder may ask of a loader: an allow-list, checked before anything of the folder is loaded
(transformers' ``from_pretrained`` honours options that load other files or unpickle weights). No torch import at
module level; ``docs/trust.md`` explains each entry."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from st_prompts.unpickling import (  # noqa: F401 - part of the allow-list, re-exported
    PICKLE_SUFFIXES, SAFE_MODEL_KWARGS, UNREAD_PICKLES, no_unpickling, pickle_reason, refuse_pickle)
from st_prompts.numbers import real, whole

__all__ = ["CONFIG_OPTIONS", "MODEL_OPTIONS", "PROCESSOR_OPTIONS", "SAFE_MODEL_KWARGS", "TRANSFORMER_KEYS",
           "gguf_reason", "hf_files_reason", "module_config_reason", "no_unpickling", "pickle_reason",
           "shard_index_reason", "transformer_config_reason", "trusted_in_kwargs"]

# ----------------------------------------------------------------------------------------------------- value checks
Check = Callable[[Any], bool]

#: dtypes a folder may ask for (strings, as transformers reads them from JSON).
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64", "torch.float32", "torch.float16", "torch.bfloat16",
          "torch.float64", "fp32", "fp16", "bf16")
#: Attention implementations a folder may ask for: transformers' own torch code, never a hub kernel (which
#: ``flash_attention_*`` falls back to without ``flash_attn``).
ATTENTION = ("sdpa", "eager", "flex_attention")
#: Mixture-of-experts implementations a folder may ask for: transformers' own torch code (no hub kernels).
EXPERTS = ("eager", "batched_mm", "grouped_mm")


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _int(value: Any) -> bool:
    return whole(value, 1, 10**7 - 1)


def _fraction(value: Any) -> bool:
    return real(value, 0.0, 1.0)


def _one_of(*allowed: Any) -> Check:
    def check(value: Any) -> bool:
        return isinstance(value, (str, type(None))) and value in allowed
    check.allowed = allowed  # type: ignore[attr-defined]
    return check


def _text(value: Any) -> bool:
    return isinstance(value, str) and len(value) < 100_000


def _name(value: Any) -> bool:
    """A short plain name (no path, no dotted import path)."""
    return isinstance(value, str) and 0 < len(value) < 200 and not any(c in value for c in "/\\.:\x00")


def _optional(check: Check) -> Check:
    return lambda value: value is None or check(value)


#: ``model_kwargs`` / ``model_args`` (``AutoModel.from_pretrained``): only how the folder's weights are laid out or run.
MODEL_OPTIONS: dict[str, Check] = {
    "dtype": _one_of(*DTYPES), "torch_dtype": _one_of(*DTYPES), "attn_implementation": _one_of(*ATTENTION),
    "add_pooling_layer": _bool, "output_hidden_states": _bool, "output_attentions": _bool, "low_cpu_mem_usage": _bool,
}
#: ``config_kwargs`` / ``config_args`` (``AutoConfig``): attributes that change numerics or outputs, never what loads.
CONFIG_OPTIONS: dict[str, Check] = {
    "dtype": _one_of(*DTYPES), "torch_dtype": _one_of(*DTYPES), "attn_implementation": _one_of(*ATTENTION),
    "use_cache": _bool, "output_hidden_states": _bool, "output_attentions": _bool,
    "hidden_dropout_prob": _fraction, "attention_probs_dropout_prob": _fraction,
    "classifier_dropout": _optional(_fraction),
}
#: ``processor_kwargs`` / ``tokenizer_args`` (``AutoProcessor``/``AutoTokenizer``): how the folder's vocabulary applies.
PROCESSOR_OPTIONS: dict[str, Check] = {
    "model_max_length": _int, "do_lower_case": _bool, "padding_side": _one_of("left", "right"),
    "truncation_side": _one_of("left", "right"), "use_fast": _bool, "add_prefix_space": _bool,
    "clean_up_tokenization_spaces": _bool, "legacy": _bool, "strip_accents": _optional(_bool),
    "tokenize_chinese_chars": _bool,
    "chat_template": _text,  # rendered by transformers in a sandboxed Jinja environment
}
#: The three option dicts under their new and older names, with their allow-lists.
OPTION_DICTS: dict[str, dict[str, Check]] = {
    "model_kwargs": MODEL_OPTIONS, "model_args": MODEL_OPTIONS,
    "config_kwargs": CONFIG_OPTIONS, "config_args": CONFIG_OPTIONS,
    "processor_kwargs": PROCESSOR_OPTIONS, "tokenizer_args": PROCESSOR_OPTIONS,
}
#: Methods of a transformers model that ``modality_config`` may name (what sentence-transformers itself infers).
MODALITY_METHODS = ("forward", "get_text_features", "get_image_features", "get_audio_features",
                    "get_video_features", "get_vision_features", "get_multimodal_features")
#: ``processing_kwargs`` sections sentence-transformers knows.
PROCESSING_SECTIONS = ("common", "text", "audio", "image", "video", "chat_template")


def _scalar_tree(value: Any, depth: int = 0) -> bool:
    """JSON made of numbers, booleans, short strings, and lists/dicts of them (a few levels deep)."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return len(value) < 100_000
    if depth > 4:
        return False
    if isinstance(value, list):
        return all(_scalar_tree(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _scalar_tree(v, depth + 1) for k, v in value.items())
    return False


def _modality_config(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, dict):
        return False
    for entry in value.values():
        if not isinstance(entry, dict) or set(entry) - {"method", "method_output_name", "format"}:
            return False
        if entry.get("method") not in MODALITY_METHODS or not _name(entry.get("method_output_name", "x")):
            return False
    return True


def _processing_kwargs(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and set(value) <= set(PROCESSING_SECTIONS)
                             and _scalar_tree(value))


def _transformer_task() -> Check:
    try:
        from sentence_transformers.base.modules.transformer import TRANSFORMER_TASK_TO_AUTO_MODEL
        tasks = tuple(TRANSFORMER_TASK_TO_AUTO_MODEL)
    except ImportError:  # pragma: no cover - an older sentence-transformers
        tasks = ("feature-extraction",)
    return _one_of(*tasks)


#: The other keys of a ``Transformer`` module's configuration. ``backend`` only ``torch`` (ONNX/OpenVINO load other
#: files); ``tokenizer_name_or_path`` only ``null`` (it would load a tokenizer from elsewhere).
TRANSFORMER_KEYS: dict[str, Check] = {
    "max_seq_length": _optional(_int), "do_lower_case": _bool, "transformer_task": _transformer_task(),
    "modality_config": _modality_config, "module_output_name": _optional(_name), "unpad_inputs": _optional(_bool),
    "query_length": _optional(_int), "document_length": _optional(_int),
    "query_expansion": lambda v: v is None or (isinstance(v, dict) and _scalar_tree(v)),
    "processing_kwargs": _processing_kwargs, "backend": _one_of("torch"), "tokenizer_name_or_path": lambda v: v is None,
}
#: Keys of a :class:`~st_prompts.PromptedTransformer` configuration besides sentence-transformers' (its constructor
#: validates them; ``backbone_name_or_path`` is checked as a model of its own).
PROMPTED_KEYS: dict[str, Check] = {
    "prefix_length": _optional(_int), "prefix_projection": _bool, "prefix_hidden_size": _optional(_int),
    "prefix_dropout": _optional(_fraction), "prefix_dropout_shared": _bool,
    "prefix_init_std": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
    "template": _optional(_text), "template_mode": _one_of("soft", "hard"), "cls_prompt": _bool,
    "template_denoising": _bool, "freeze_backbone": _bool, "backbone_name_or_path": _optional(_text),
    "prefix_injection": _one_of("attention", "cache"), "prompt_sets": lambda v: v is None or _scalar_tree(v),
    "prompt_set_info": lambda v: v is None or (isinstance(v, dict) and _scalar_tree(v)),
    "default_task": _optional(_text), "query_task": _optional(_text), "document_task": _optional(_text),
    "prompts_only": _bool, "backbone_fingerprint": _optional(_text), "prefix_gate": _bool,
}


def _describe(check: Check) -> str:
    allowed = getattr(check, "allowed", None)
    return f" (one of {', '.join(map(str, allowed))})" if allowed else ""


def _options_reason(name: str, key: str, value: Any) -> str | None:
    allowed = OPTION_DICTS[key]
    if not isinstance(value, dict):
        return f"{name}: {key} must be an object of loader options, got {type(value).__name__}"
    for option, setting in value.items():
        check = allowed.get(option)
        if check is None:
            return (f"{name}: {key}.{option} is not a loader option a model folder may set (allowed: "
                    f"{', '.join(sorted(allowed))})")
        if not check(setting):
            return f"{name}: {key}.{option}={_short(setting)} is not allowed{_describe(check)}"
    return None


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def transformer_config_reason(name: str, config: Any, prompted: bool = False) -> str | None:
    """Why the configuration ``name`` of a ``Transformer`` module asks a loader for something outside the allow-list,
    or ``None``. ``prompted``: a :class:`~st_prompts.PromptedTransformer`'s (prompt options allowed too)."""
    if not isinstance(config, dict):
        return f"{name} is not a JSON object"
    for key, value in config.items():
        if key in OPTION_DICTS:
            reason = _options_reason(name, key, value)
        else:
            check = TRANSFORMER_KEYS.get(key) or (PROMPTED_KEYS.get(key) if prompted else None)
            if check is None:
                return f"{name}: {key!r} is not a setting this module reads"
            reason = None if check(value) else f"{name}: {key}={_short(value)} is not allowed{_describe(check)}"
        if reason:
            return reason
    return None


# ------------------------------------------------------------------------------------------- other modules' configs
def _accepted_keys(module_class: type) -> set[str] | None:
    """The keys a module's constructor takes (``None``: any, it takes ``**kwargs``)."""
    import inspect

    try:
        parameters = inspect.signature(module_class.__init__).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keys = {p.name for p in parameters if p.name != "self"}
    keys |= set(getattr(module_class, "config_key_renames", {}) or {})
    if module_class.__name__ == "Pooling":
        try:
            from sentence_transformers.sentence_transformer.modules.pooling import _LEGACY_POOLING_MODE_KWARGS
            keys |= set(_LEGACY_POOLING_MODE_KWARGS)
        except ImportError:  # pragma: no cover
            pass
    return keys


def torch_nn_class(dotted: str) -> type | None:
    """The ``torch.nn.Module`` subclass ``dotted`` names (``torch.nn.Tanh``), found by attribute walk without any
    import, or ``None``."""
    import torch

    parts = dotted.split(".")
    if len(parts) < 3 or parts[:2] != ["torch", "nn"] or not all(p.isidentifier() and not p.startswith("_")
                                                                 for p in parts):
        return None
    target: Any = torch.nn
    for part in parts[2:]:
        target = getattr(target, part, None)
        if target is None:
            return None
    return target if isinstance(target, type) and issubclass(target, torch.nn.Module) else None


def module_config_reason(name: str, module_class: type, config: Any) -> str | None:
    """Why the configuration ``name`` of a (non-``Transformer``) module holds what its constructor does not take, or
    names code (a ``Dense`` activation must be a class under ``torch.nn``)."""
    if not isinstance(config, dict):
        return f"{name} is not a JSON object"
    accepted = _accepted_keys(module_class)
    for key, value in config.items():
        if accepted is not None and key not in accepted:
            return f"{name}: {key!r} is not a setting of {module_class.__name__}"
        if key == "activation_function":
            if not isinstance(value, str) or torch_nn_class(value) is None:
                return (f"{name} names the activation function {_short(value)}, which is not a torch.nn module "
                        "class")
        elif key == "tokenizer_class":
            if not (isinstance(value, str) and value.startswith("sentence_transformers.")):
                return f"{name} names the tokenizer class {_short(value)}, not one of sentence-transformers'"
        elif not _scalar_tree(value):
            return f"{name}: {key} holds something other than plain values"
    return None


# ------------------------------------------------------------------------------------------------ transformers files
#: Keys that make transformers or PEFT import code from the folder (or a package it names), at any depth.
CODE_KEYS = ("auto_map", "custom_pipelines", "auto_mapping")
#: Keys whose value transformers resolves as a class name: only its own classes (no dotted import paths).
CLASS_KEYS = ("tokenizer_class", "processor_class", "feature_extractor_type", "image_processor_type",
              "video_processor_type")
#: Keys (at any depth) from which transformers picks an attention / experts implementation: anything but
#: :data:`ATTENTION` / :data:`EXPERTS` can make it fetch and import a kernel from the hub.
KERNEL_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal",
               "experts_implementation", "_experts_implementation",
               "_experts_implementation_internal", "use_kernels", "kernel_config")
#: Keys that name a file the loader opens: plain file names inside the folder only.
FILE_KEYS = ("tokenizer_file", "vocab_file", "merges_file", "spm_file", "sentencepiece_model_file",
             "added_tokens_file", "special_tokens_map_file", "gguf_file", "chat_template_file")


def _each_key(value: Any, keys: tuple[str, ...]) -> list[tuple[str, Any]]:
    """Every ``(key, value)`` among ``keys`` anywhere in a parsed JSON value, depth first; a value nested more than 20
    deep counts as one ``("(nested too deep)", None)``. Fills one list (generators were slow on ``tokenizer.json``)."""
    found: list[tuple[str, Any]] = []
    _walk(value, frozenset(keys), 0, found)
    return found


def _walk(value: Any, keys: frozenset[str], depth: int, found: list[tuple[str, Any]]) -> None:
    if depth > 20:
        found.append(("(nested too deep)", None))
    elif isinstance(value, dict):
        named = not keys.isdisjoint(value)
        for key, item in value.items():
            if named and key in keys:
                found.append((key, item))
            if depth >= 20 or isinstance(item, (dict, list)):
                _walk(item, keys, depth + 1, found)
    elif isinstance(value, list):
        for item in value:
            if depth >= 20 or isinstance(item, (dict, list)):
                _walk(item, keys, depth + 1, found)


def _find_key(found: list[tuple[str, Any]], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """The first of ``found`` (:func:`_each_key`) among ``keys`` with a non-empty value, or the too-deep mark."""
    return next(((k, v) for k, v in found if k.startswith("(") or (k in keys and v not in (None, {}, [], ""))), None)


def _local_implementation(key: str, value: Any) -> bool:
    """Whether ``value`` of the kernel key ``key`` (or each value of a dict) names only transformers' own code."""
    if key in ("use_kernels", "kernel_config"):
        return value in (None, False, {})
    allowed = EXPERTS if "experts" in key else ATTENTION
    if isinstance(value, dict):
        return all(isinstance(k, str) and (v is None or v in allowed) for k, v in value.items())
    return value is None or (isinstance(value, str) and value in allowed)


def unsafe_file_name(value: Any) -> bool:
    """A file name (read from a file) that leaves its folder: absolute, ``~``, ``..``, a NUL, not a string."""
    if value is None:
        return False
    if not isinstance(value, str):
        return True
    return (os.path.isabs(value) or value.startswith("~") or ".." in value.replace("\\", "/").split("/")
            or "\x00" in value)


def hf_files_reason(name: str, config: Any, known_model_types: Callable[[str], bool] | None = None) -> str | None:
    """Why the transformers JSON file ``name`` would make a loader run code, read a file outside the folder, load a
    quantizer, or fail on an unknown architecture; ``None`` if it would not."""
    keyed = _each_key(config, CODE_KEYS + FILE_KEYS + KERNEL_KEYS)  # one walk for the three rules
    found = _find_key(keyed, CODE_KEYS)
    if found:
        return f"{name} points to custom code ({found[0]})"
    if not isinstance(config, dict):
        return None
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    for key in CLASS_KEYS:
        value = config.get(key)
        if value is not None and not _name(value):
            return f"{name} names the class {_short(value)} ({key}), not one of transformers'"
    for key, value in ((k, v) for k, v in keyed if k in FILE_KEYS):
        if unsafe_file_name(value):
            return f"{name}: {key}={_short(value)} names a file outside the model folder"
    for key, value in ((k, v) for k, v in keyed if k in KERNEL_KEYS):
        if not _local_implementation(key, value):
            return (f"{name}: {key}={_short(value)} may fetch a kernel from the hub; a model folder may only ask for "
                    f"{', '.join(EXPERTS if 'experts' in key else ATTENTION)}")
    if base.endswith(".index.json"):
        reason = shard_index_reason(name, config)
        if reason:
            return reason
    if base == "config.json":
        if config.get("quantization_config"):
            return f"{name} asks for a quantizer (quantization_config)"
        model_type = config.get("model_type")
        if model_type is not None and (not isinstance(model_type, str)
                                       or (known_model_types and not known_model_types(model_type))):
            return f"{name} names model_type {_short(model_type)}, which this transformers does not know"
        architectures = config.get("architectures")
        if architectures is not None and not (isinstance(architectures, list)
                                              and all(isinstance(a, str) and _name(a) for a in architectures)):
            return f"{name} names architectures {_short(architectures)} that are not transformers classes"
    return None


def shard_index_reason(name: str, index: Any) -> str | None:
    """Why the shard index ``name`` is not an index or names a weight file outside its folder; ``None`` otherwise."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return f"{name} has no weight_map object"
    for shard in weight_map.values():
        if not isinstance(shard, str) or unsafe_file_name(shard) or ":" in shard or shard.startswith("\\"):
            return f"{name} names the weight file {_short(shard)} outside the model folder"
    return None


def known_model_type(model_type: str) -> bool:
    """Whether transformers knows ``model_type`` (read from its registry; nothing is imported from a folder)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


# ------------------------------------------------------------------------------------------------------------- GGUF
def gguf_reason(path: str) -> str | None:
    """Why the file ``path`` is not a GGUF model (its first four bytes are ``GGUF``), or ``None``."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        return f"{path} could not be read ({exc.strerror or exc})"
    if magic != b"GGUF":
        return f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)"
    return None


def trusted_in_kwargs(kwargs: dict[str, Any]) -> bool:
    """Whether a module's keyword arguments carry the user's ``trust_remote_code=True`` (in any option dict)."""
    return any(isinstance(kwargs.get(key), dict) and kwargs[key].get("trust_remote_code") is True
               for key in ("model_kwargs", "config_kwargs", "processor_kwargs"))
