"""Pickled weight files are never unpickled without trust: the checks and the guard behind them (re-exported by
:mod:`st_prompts.trust`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from st_prompts.errors import UntrustedCodeError

__all__ = ["PICKLE_SUFFIXES", "SAFE_MODEL_KWARGS", "UNREAD_PICKLES", "no_unpickling", "pickle_reason"]

#: File names (patterns) of pickled weights a loader may read: PyTorch's, transformers' shards, PEFT adapters.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: Pickles no loader of a model reads (training state saved beside a checkpoint).
UNREAD_PICKLES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt")


def pickle_reason(folder: str, label: str | None = None) -> str | None:
    """Why the local ``folder`` would make a loader unpickle weights (a pickled weight file and no safetensors file
    read instead), or ``None``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES) and n not in UNREAD_PICKLES
                     and os.path.isfile(os.path.join(folder, n)))
    if not pickles:
        return None
    safetensors = [n for n in names if n.endswith((".safetensors", ".safetensors.index.json"))]
    adapters = [n for n in pickles if n.startswith("adapter_model")]
    if adapters and not any(n.startswith("adapter_model") for n in safetensors):
        return f"{label or folder}/{adapters[0]} is a pickled weight file (unpickling can run any code)"
    weights = [n for n in pickles if not n.startswith("adapter_model")]
    if weights and not [n for n in safetensors if not n.startswith("adapter_model")]:
        return (f"{label or folder}/{weights[0]} is a pickled weight file and the folder has no safetensors weights "
                "(unpickling can run any code)")
    return None


#: Passed to transformers' ``from_pretrained`` for an untrusted model: read safetensors, never a pickle.
SAFE_MODEL_KWARGS = {"use_safetensors": True}

_guard_lock = threading.Lock()
_guard_depth = 0
_guard_saved: dict[str, Any] = {}


def refuse_pickle(*args: Any, **kwargs: Any) -> Any:
    target = args[0] if args else kwargs.get("f")
    raise UntrustedCodeError(
        f"refused to unpickle {str(target)!r}: a pickled weight file can run any code. Convert it to safetensors, or "
        "pass --trust-remote-code (trust_remote_code=True in Python) only if you trust the model.")


@contextmanager
def no_unpickling() -> Iterator[None]:
    """While an untrusted model loads, ``torch.load`` raises :class:`UntrustedCodeError` (the last line of defence).
    Re-entrant; restores ``torch.load`` when the outermost block ends."""
    import torch
    import torch.serialization

    global _guard_depth
    with _guard_lock:
        if _guard_depth == 0:
            _guard_saved["torch"] = torch.load
            _guard_saved["serialization"] = torch.serialization.load
            torch.load = refuse_pickle
            torch.serialization.load = refuse_pickle
        _guard_depth += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard_depth -= 1
            if _guard_depth == 0:
                torch.load = _guard_saved.pop("torch")
                torch.serialization.load = _guard_saved.pop("serialization")
