"""Half precision at inference, and what the CPU's own instructions allow.

``dtype="bfloat16"`` / ``"float16"`` casts a loaded model for inference (saves refused; not with int8). A CPU without
bf16/fp16 instructions emulates them, 4-11x slower (warned); int8 inputs use 8 bits with VNNI and 7 without, where
fbgemm's AVX2 kernel could saturate 16-bit pair sums. Measurements: ``docs/serving.md``."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import torch

from st_prompts.errors import ConfigurationError

logger = logging.getLogger(__name__)

__all__ = ["DTYPES", "ROW_TOLERANCE", "apply_dtype", "check_combination", "check_dtype", "cpu_flags", "cpu_summary",
           "dtype_name", "half_is_native", "int8_input_bits", "refuse_saves"]

#: The values of ``dtype=`` / ``--dtype``, and their torch types.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The largest difference, relative to the row's norm, between a row encoded alone and in a mixed batch.
ROW_TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 2e-3}
#: Attribute on a model cast by :func:`apply_dtype`: the name of its dtype.
DTYPE_ATTRIBUTE = "st_prompts_dtype"
#: The CPU flags (``/proc/cpuinfo``) that run each half type natively.
_NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: The ``SentenceTransformer`` methods that write weights, refused on an inference-only (half or int8) model.
SAVE_METHODS = ("save", "save_pretrained", "push_to_hub", "save_to_hub")


def check_dtype(dtype: Any) -> str:
    """``dtype`` (a name of :data:`DTYPES`, a ``torch.dtype``, or ``None`` for float32) as a name of :data:`DTYPES`;
    else :class:`ConfigurationError`."""
    if dtype is None:
        return "float32"
    if isinstance(dtype, torch.dtype):
        name = next((name for name, value in DTYPES.items() if value == dtype), None)
        if name is not None:
            return name
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return dtype.removeprefix("torch.")
    raise ConfigurationError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


def check_combination(dtype: str, quantize: str | None) -> None:
    """Refuse ``dtype`` (a name of :data:`DTYPES`) beside int8 quantization, in one line (see the module docstring)."""
    if dtype != "float32" and quantize not in (None, "none"):
        raise ConfigurationError(f"dtype {dtype} and quantize {quantize} do not combine: int8 runs the backbone's "
                                 "linear layers with float32 activations on the CPU; choose one")


def refuse_saves(target: Any, reason: str, methods: tuple[str, ...] = SAVE_METHODS) -> None:
    """Make each of ``methods`` that ``target`` has raise ``ConfigurationError("METHOD() refused: REASON")``."""
    for method in methods:
        if hasattr(target, method):
            setattr(target, method, functools.partial(_refuse_save, method, reason))


def dtype_name(model: Any) -> str:
    """The dtype :func:`apply_dtype` cast ``model`` to (``"float32"`` for a model it did not cast)."""
    return getattr(model, DTYPE_ATTRIBUTE, "float32")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags, as ``/proc/cpuinfo`` names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def half_is_native(dtype: str, flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU (``flags``: :func:`cpu_flags`) runs ``dtype`` natively (float32 always)."""
    flags = cpu_flags() if flags is None else flags
    return dtype == "float32" or any(flag in flags for flag in _NATIVE_FLAGS[dtype])


def int8_input_bits(flags: frozenset[str] | None = None) -> int:
    """The bits an int8 layer maps each input row onto: 8 with VNNI, 7 without (see the module docstring)."""
    flags = cpu_flags() if flags is None else flags
    return 8 if any(flag in flags for flag in _VNNI_FLAGS) else 7


def cpu_summary(flags: frozenset[str] | None = None) -> str:
    """One phrase for a start-up line and ``/health``: the CPU's vector instructions that matter here, and what
    st_prompts does with them, e.g. ``"AVX2, no VNNI, no AVX512-BF16: int8 inputs 7-bit, bf16 emulated"``."""
    flags = cpu_flags() if flags is None else flags
    widest = next((name for flag, name in (("avx512f", "AVX512"), ("avx2", "AVX2"), ("sse4_2", "SSE4.2"))
                   if flag in flags), "no AVX")
    parts = [widest, "VNNI" if int8_input_bits(flags) == 8 else "no VNNI",
             "AVX512-BF16/AMX" if half_is_native("bfloat16", flags) else "no AVX512-BF16"]
    bf16 = "bf16 native" if half_is_native("bfloat16", flags) else "bf16 emulated"
    return f"{', '.join(parts)}: int8 inputs {int8_input_bits(flags)}-bit, {bf16}"


def apply_dtype(model: Any, dtype: Any) -> Any:
    """Cast ``model`` (a ``SentenceTransformer``) to ``dtype`` for inference, in place, and return it (float32:
    unchanged). Takes each prompted backbone's fingerprint first, puts the model in eval mode, refuses its saves, and
    warns on a CPU that emulates ``dtype``. :class:`ConfigurationError`: an unknown ``dtype``, a model in int8."""
    name = check_dtype(dtype)
    if name == "float32" or dtype_name(model) == name:
        return model
    check_combination(name, getattr(model, "st_prompts_quantization", None))  # quantization.MODE_ATTRIBUTE
    for module in model.modules():
        if hasattr(module, "fingerprint") and hasattr(module, "freeze_backbone"):
            _ = module.fingerprint  # of the fp32 weights, cached: a set added later is checked against it
            module.freeze_backbone = True  # inference only; keeps the cached fingerprint
    model.to(DTYPES[name])
    model.eval()
    setattr(model, DTYPE_ATTRIBUTE, name)
    refuse_saves(model, f"this model was loaded in {name} for inference and its float32 weights are not kept; save "
                        "the model loaded without dtype")
    device = getattr(model, "device", torch.device("cpu"))
    if torch.device(device).type == "cpu" and not half_is_native(name):
        logger.warning("%s on this CPU (%s) is emulated: 4-11x slower than float32 where measured (docs/serving.md: "
                       "precision)", name, re.sub(r":.*", "", cpu_summary()))
    return model


def _refuse_save(method: str, reason: str, *args: Any, **kwargs: Any) -> None:
    raise ConfigurationError(f"{method}() refused: {reason}")
