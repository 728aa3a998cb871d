"""Prompts-only checkpoints: a backbone reference (portable name and weight fingerprint) and the soft prompts, so that a
task costs kilobytes; :func:`save_prompts_only` writes one, :meth:`PromptedTransformer.load` reads it."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from contextlib import contextmanager

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from st_prompts import utils
from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError, DataNotFoundError, first_line

logger = logging.getLogger(__name__)

#: File holding the soft prompts (and nothing else) next to the module config.
PROMPTS_FILE = "soft_prompts.safetensors"


def backbone_fingerprint(model: torch.nn.Module) -> str:
    """A SHA-256 over the names, dtypes, shapes and bytes of every tensor in ``model.state_dict()``: prompts-only
    checkpoints check with it that the prompts are put back on exactly the weights they were trained on."""
    return tensors_fingerprint(model.state_dict())


def tensors_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """:func:`backbone_fingerprint` of a state dict (e.g. read from a safetensors file)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return "sha256:" + digest.hexdigest()


def portable_backbone_reference(name_or_path: str) -> str:
    """What identifies a backbone portably: the packaged alias (``"minilm"``) for the packaged MiniLM, the hub id for
    a hub id or a folder of the Hugging Face cache (``.../models--org--name/snapshots/<rev>``), else the absolute path.
    """
    name_or_path = str(name_or_path)
    alias = utils.packaged_minilm_alias(name_or_path)
    if alias is not None:
        return alias
    if not os.path.exists(name_or_path):
        return name_or_path  # a hub id
    real = os.path.realpath(name_or_path)
    match = re.search(r"(?:^|/)models--([^/]+)/snapshots/[^/]+/?$", real.replace(os.sep, "/"))
    if match:
        return match.group(1).replace("--", "/")
    return os.path.abspath(name_or_path)


def backbone_identity(name_or_path: str) -> tuple[str, str | None]:
    """What two backbone names must share to be the same weights: the resolved folder (or hub id) and GGUF file."""
    location, gguf_file, _ = utils.resolve_gguf(resolve_quietly(str(name_or_path)))
    return (os.path.realpath(location) if os.path.exists(location) else location), gguf_file


def load_backbone(name_or_path: str, **kwargs) -> torch.nn.Module:
    """The plain transformers model behind a backbone name (packaged aliases and GGUF files resolved)."""
    from st_prompts.folder_checks import safe_loading

    location, gguf_file, _ = utils.resolve_gguf(utils.resolve_model_name(str(name_or_path)))
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    with safe_loading(kwargs.get("trust_remote_code") is True) as safe:  # never a pickle without trust
        return AutoModel.from_pretrained(location, **{**safe, **kwargs})


def resolve_quietly(name_or_path: str) -> str:
    """Resolve a packaged-model alias if its package is there, else keep the name (no hub access)."""
    try:
        return utils.resolve_alias(name_or_path)
    except DataNotFoundError:
        return name_or_path


def write_prompts(state: dict[str, torch.Tensor], folder: str) -> None:
    """Write the prompts' state dict to ``folder/soft_prompts.safetensors``."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(folder, PROMPTS_FILE), metadata={"format": "pt"})


def read_prompts(path: str | None, source: str, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The prompts stored at ``path`` (``None``: the checkpoint has none), checked against the expected shapes:
    DataNotFoundError without a file, DataFormatError for a damaged one, ConfigurationError for other shapes."""
    if path is None:
        raise DataNotFoundError(f"{source!r} has no {PROMPTS_FILE}: it is not a saved PromptedTransformer.")
    try:
        state = load_file(path)
    except Exception as exc:  # safetensors' SafetensorError (a truncated or foreign file), OSError
        raise DataFormatError(f"{PROMPTS_FILE} in {source!r} is damaged ({first_line(exc)}); save or "
                              "download the model again.") from exc
    found = {k: tuple(v.shape) for k, v in state.items()}
    if found != expected:
        raise ConfigurationError(f"{PROMPTS_FILE} in {source!r} holds {found} but this configuration expects {expected}.")
    return state


def check_fingerprint(expected: str | None, backbone: torch.nn.Module, checkpoint: str, source: str) -> None:
    """Refuse a backbone whose weights are not those the prompts of ``checkpoint`` were trained on."""
    actual = backbone_fingerprint(backbone)
    if expected != actual:
        raise BackboneMismatchError(f"The prompts in {checkpoint!r} were trained on a backbone with fingerprint "
                                    f"{expected}, but the backbone loaded from {source!r} has fingerprint {actual}: "
                                    "its weights differ. Load the original backbone (model_kwargs="
                                    "{'backbone_name_or_path': ...}) or use a full checkpoint.")


@contextmanager
def dequantized_gguf(model: torch.nn.Module):
    """Let transformers save a backbone it de-quantised from a GGUF file (it marks it quantized and refuses to save
    it): within this context the marker is lifted when every weight is a plain floating-point tensor."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = model.config
    plain = type(quantizer).__name__ == "GgufHfQuantizer" and all(
        type(p) is torch.nn.Parameter and p.is_floating_point() for p in model.parameters()
    )
    if not plain:
        yield
        return
    had_config = "quantization_config" in config.__dict__
    saved_config = config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if had_config:
            config.quantization_config = saved_config


def check_backbone_at(source: str, backbone: torch.nn.Module) -> None:
    """Refuse, with :class:`BackboneMismatchError`, a ``backbone`` whose weights are not those at ``source`` (what a
    prompts-only checkpoint of it would refer to), or whose ``source`` cannot be loaded to compare."""
    try:
        reference = load_backbone(source)
    except (OSError, DataNotFoundError) as exc:
        raise BackboneMismatchError(f"Cannot check the backbone against {source!r} ({exc}): a prompts-only checkpoint "
                                    "referring to it could not be loaded either. Save the full model with "
                                    "model.save(path).") from exc
    if backbone_fingerprint(reference) != backbone_fingerprint(backbone):
        raise BackboneMismatchError(f"The backbone's weights differ from those at {source!r} (it was trained, e.g. by "
                                    "DiffAug's stage 2, or loaded from elsewhere): a prompts-only checkpoint would "
                                    "refer to weights it was not trained with and could not be loaded. Save the full "
                                    "model with model.save(path).")


def save_prompts_only(model, path: str, *, keep_projection: bool = False) -> None:
    """Save a SentenceTransformer whose first module is a :class:`PromptedTransformer` without the backbone weights.

    The folder holds the soft prompts, the other (small) modules and a reference to the backbone (name or path and a
    fingerprint of its weights); loading fails clearly if the referenced weights differ. A model whose backbone was
    trained is refused with :class:`~st_prompts.errors.BackboneMismatchError` before anything is written.
    A reparameterised prefix is stored as the prefix it computes, unless ``keep_projection=True`` (to resume training).
    """
    encoders = [m for m in model.modules() if hasattr(m, "prompts_only") and hasattr(m, "check_backbone_unchanged")]
    if len(encoders) != 1:
        raise ConfigurationError(f"save_prompts_only needs exactly one PromptedTransformer in the model, found {len(encoders)}.")
    encoder = encoders[0]
    from st_prompts.quantization import quantization_mode

    if quantization_mode(model) != "none" or quantization_mode(encoder) != "none":
        raise ConfigurationError("save_prompts_only refused: this model's backbone is quantized to int8 for "
                                 "inference; save the prompts of the model loaded without quantize.")
    encoder.check_backbone_unchanged()
    card = model.model_card_data
    was = getattr(card, "prompts_only", None)
    if was is not None:
        card.prompts_only = True  # the card says what this folder is and where its backbone comes from
    try:
        with encoder.prompts_only(keep_projection=keep_projection):
            model.save(path, create_model_card=was is not None)
    finally:
        if was is not None:
            card.prompts_only = was
