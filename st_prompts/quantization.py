"""int8 inference on the CPU: each ``torch.nn.Linear`` of a backbone becomes an :class:`Int8Linear` (inputs quantized
per row, so a row's vector is the same alone and in any batch); prompt sets and gates untouched, saves refused.
Measurements and why this engine: ``docs/serving.md``."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from st_prompts.errors import ConfigurationError, first_line
from st_prompts.precision import refuse_saves

__all__ = ["QUANTIZE_MODES", "Int8Linear", "is_quantized", "quantization_mode", "quantize_model"]

#: The values of ``quantize=`` / ``--quantize``.
QUANTIZE_MODES = ("none", "int8")
#: Why a quantized model's saves are refused (:func:`~st_prompts.precision.refuse_saves`).
_INT8_REASON = ("this model's backbone is quantized to int8 for inference and its fp32 weights are not kept; save the "
                "model loaded without quantize")
#: Attribute on the model and on each quantized module: the mode it is quantized to.
MODE_ATTRIBUTE = "st_prompts_quantization"


class Int8Linear(torch.nn.Module):
    """``y = x Wᵀ + b`` with ``W`` int8 per output channel and ``x`` quantized per row (token) when it runs; inference
    only. The packed weights live in fbgemm's format outside ``state_dict`` (the bias stays fp32, inside)."""

    def __init__(self, in_features: int, out_features: int, packed: Any, bias: torch.Tensor | None,
                 weight_sums: torch.Tensor, input_bits: int = 7) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        #: Each input row is mapped from its minimum to its maximum onto ``2**input_bits - 1`` levels.
        self.input_bits = input_bits
        self._levels = float((1 << input_bits) - 1)
        self._packed = packed
        self.register_buffer("bias", bias, persistent=True)
        #: Each output's sum of its (dequantized int8) weights: what a row's offset adds to that output.
        self.register_buffer("weight_sums", weight_sums, persistent=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, input_bits: int | None = None) -> Int8Linear:
        """The int8 version of ``linear``; its inputs in ``input_bits`` (default: ``precision.int8_input_bits``)."""
        weight = linear.weight.detach().to(device="cpu", dtype=torch.float32)
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch warns that its quantized tensors are deprecated: see docs/serving.md
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qweight, None)
            weight_sums = qweight.dequantize().sum(dim=1)
        bias = None if linear.bias is None else linear.bias.detach().to(device="cpu", dtype=torch.float32).clone()
        if input_bits is None:
            from st_prompts.precision import int8_input_bits

            input_bits = int8_input_bits()
        return cls(linear.in_features, linear.out_features, packed, bias, weight_sums, input_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        low = x.amin(dim=-1, keepdim=True)
        step = (x.amax(dim=-1, keepdim=True) - low).clamp_(min=1e-12) / self._levels
        # each row mapped onto 0..levels; fbgemm computes W q with the weights' per-channel scales
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            (x - low).div_(step).contiguous(), 1.0, 0, self._packed)
        # W x = step * W q + low * (W 1): the row's scale and offset back, and the bias
        y = torch.addcmul(self.bias, y, step) if self.bias is not None else y.mul_(step)
        return y.addcmul_(low, self.weight_sums).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights=int8 per channel, inputs={self.input_bits}-bit per token")


def quantization_mode(model: Any) -> str:
    """``"int8"`` for a model (or module) :func:`quantize_model` quantized, else ``"none"``."""
    return getattr(model, MODE_ATTRIBUTE, "none")


def is_quantized(model: Any) -> bool:
    """Whether :func:`quantize_model` quantized ``model``."""
    return quantization_mode(model) != "none"


def check_mode(quantize: Any) -> str:
    """``quantize`` as one of :data:`QUANTIZE_MODES` (``None`` is ``"none"``); else :class:`ConfigurationError`."""
    mode = "none" if quantize is None else quantize
    if mode not in QUANTIZE_MODES:
        raise ConfigurationError(f"unknown quantization {quantize!r}: choose one of {', '.join(QUANTIZE_MODES)}")
    return mode


def quantize_model(model: Any, mode: str = "int8") -> Any:
    """Quantize, in place, the linear layers of the backbone of ``model`` for int8 inference on the CPU, and return
    it (idempotent; ``mode="none"``: unchanged). The fp32 fingerprint is kept, so sets trained on the fp32 backbone
    still join; the model is put in eval mode and its saves refuse. Raises :class:`ConfigurationError` for an unknown
    ``mode``, a model off the CPU or without a backbone or linear layers, a CPU without fbgemm's int8 kernels."""
    mode = check_mode(mode)
    if mode == "none" or quantization_mode(model) == mode:
        return model
    backbones = [module for module in _modules(model) if isinstance(getattr(module, "auto_model", None),
                                                                     torch.nn.Module)]
    if not backbones:
        raise ConfigurationError(f"cannot quantize a {type(model).__name__}: it has no transformer backbone")
    for module in backbones:
        device = next(module.auto_model.parameters()).device
        if device.type != "cpu":
            raise ConfigurationError(f"int8 inference runs on the CPU; the model is on {device}: load it with "
                                     "device='cpu' (--device cpu)")
    _check_kernels()
    for module in backbones:
        if hasattr(module, "fingerprint"):
            _ = module.fingerprint  # of the fp32 weights, cached before they go (prompt sets are checked against it)
            if not module.freeze_backbone:
                module.freeze_backbone = True  # int8 weights do not train; keeps the cached fingerprint
        if _replace_linears(module.auto_model) == 0:
            raise ConfigurationError(f"cannot quantize {type(module.auto_model).__name__}: it has no linear layers")
        setattr(module, MODE_ATTRIBUTE, mode)
        refuse_saves(module, _INT8_REASON, ("save",))
        # the transformers model too: its save_pretrained would write no linear weight (they live outside state_dict)
        refuse_saves(module.auto_model, _INT8_REASON, ("save_pretrained", "push_to_hub"))
        if not _row_exact_attention(module):
            module.forward = functools.partial(exact_rows_forward, module, module.forward)
    model.eval()
    setattr(model, MODE_ATTRIBUTE, mode)
    refuse_saves(model, _INT8_REASON)
    return model


#: Features a row-exact pass can split: token-level ones (trimmed to a group's length) and per-row ones.
_TOKEN_FEATURES = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
_ROW_FEATURES = ("prompt_task", "prompt_tasks", "prompt_mask_index", "modality")


def exact_rows_forward(module: torch.nn.Module, forward: Any, features: dict[str, Any], **kwargs: Any) -> Any:
    """``forward(features)`` run once per group of rows of equal length and prefix length, the outputs put back in
    the rows' order (token-level ones zero-padded). Why: padding shifts fp32 attention by ~1e-7, enough to flip the
    next layer's int8 rounding. Only right-padded inputs with known features are split; others run as one batch."""
    mask = features.get("attention_mask")
    if (not torch.is_tensor(mask) or mask.dim() != 2 or mask.shape[0] <= 1
            or any(key not in _TOKEN_FEATURES + _ROW_FEATURES for key in features)
            or getattr(getattr(module, "tokenizer", None), "padding_side", "right") != "right"):
        return forward(features, **kwargs)
    batch, seq = mask.shape
    lengths = mask.sum(dim=1).tolist()
    if not all(bool(mask[row, :length].all()) for row, length in enumerate(lengths)):
        return forward(features, **kwargs)  # not right-padded after all
    prefixes = _prefix_lengths(module, features, batch, kwargs.get("task"))
    groups: dict[tuple[int, int], list[int]] = {}
    for row, key in enumerate(zip(lengths, prefixes)):
        groups.setdefault(key, []).append(row)
    if len(groups) == 1 and lengths[0] == seq:
        return forward(features, **kwargs)
    parts = []
    for (length, _), rows in groups.items():
        index = torch.tensor(rows, device=mask.device)
        part = {}
        for key, value in features.items():
            if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == batch:
                value = value.index_select(0, index)
                part[key] = value[:, :length] if key in _TOKEN_FEATURES and value.dim() >= 2 else value
            elif isinstance(value, (list, tuple)) and len(value) == batch:
                part[key] = [value[row] for row in rows]
            else:
                part[key] = value
        parts.append((index, length, forward(part, **kwargs)))
    merged = dict(features)
    for key, first in parts[0][2].items():
        if key in features or not torch.is_tensor(first) or first.shape[0] != len(parts[0][0]):
            continue  # inputs stay the batch's; draws and other per-pass objects are not merged
        token_level = first.dim() >= 2 and first.shape[1] == parts[0][1]
        shape = (batch, seq, *first.shape[2:]) if token_level else (batch, *first.shape[1:])
        out = first.new_zeros(shape)
        for index, length, result in parts:
            out.index_copy_(0, index, result[key] if not token_level else
                            torch.nn.functional.pad(result[key], (0, 0) * (first.dim() - 2) + (0, seq - length)))
        merged[key] = out
    return merged


def _row_exact_attention(module: torch.nn.Module) -> bool:
    """Make ``module``'s backbone compute attention row by row where it can (a bidirectional encoder on sdpa or
    eager attention): then a pass needs no grouping (:func:`exact_rows_forward`)."""
    from st_prompts.prompts.injection import BACKENDS, register_attention_functions, wrapped_backend
    from st_prompts.prompts.row_exact import ROW_EXACT_ATTRIBUTE

    backbone = module.auto_model
    backend = wrapped_backend(getattr(backbone.config, "_attn_implementation", None))
    if backend is None or any(getattr(m, "is_causal", False) for m in backbone.modules()):
        return False
    if backbone.config._attn_implementation != BACKENDS[backend]:  # a plain backbone: the same backend, wrapped
        register_attention_functions()
        try:
            backbone.set_attn_implementation(BACKENDS[backend])
        except (ValueError, KeyError):
            return False
    for submodule in backbone.modules():
        setattr(submodule, ROW_EXACT_ATTRIBUTE, True)
    return True


def _prefix_lengths(module: torch.nn.Module, features: dict[str, Any], batch: int, task: Any) -> list[int]:
    """Each row's prefix length (its prompt set's; 0 without), the other half of a row-exact group's key."""
    resolve = getattr(module, "resolve_task", None)
    if resolve is None:
        return [0] * batch
    tasks = features.get("prompt_tasks")
    if not isinstance(tasks, (list, tuple)) or len(tasks) != batch:
        tasks = [features.get("prompt_task", task)] * batch
    lengths = {name: int(getattr(resolve(name), "prefix_length", 0) or 0) for name in set(tasks)}
    return [lengths[name] for name in tasks]


def _modules(model: Any) -> list[torch.nn.Module]:
    """The modules of a ``SentenceTransformer`` (a ``Router``'s routes included), or the module itself."""
    found = []
    for module in model.modules() if isinstance(model, torch.nn.Module) else []:
        if hasattr(module, "auto_model") and not any(module is f or _inside(module, f) for f in found):
            found.append(module)
    return found


def _inside(module: torch.nn.Module, outer: torch.nn.Module) -> bool:
    return any(module is m for m in outer.auto_model.modules())


def _replace_linears(root: torch.nn.Module) -> int:
    """Replace every ``torch.nn.Linear`` under ``root`` by an :class:`Int8Linear`; how many were replaced."""
    count = 0
    for name, child in list(root.named_children()):
        if type(child) is torch.nn.Linear:
            setattr(root, name, Int8Linear.from_linear(child))
            count += 1
        else:
            count += _replace_linears(child)
    return count


@functools.cache
def _check_kernels() -> None:
    """Run the int8 kernel once on a tiny layer: a CPU without fbgemm (e.g. ARM) fails here, in one line."""
    try:
        Int8Linear.from_linear(torch.nn.Linear(4, 2))(torch.ones(1, 4))
    except (RuntimeError, NotImplementedError) as exc:
        raise ConfigurationError(f"int8 inference needs torch's fbgemm kernels (an x86 CPU), which failed here: "
                                 f"{first_line(exc)}") from exc

