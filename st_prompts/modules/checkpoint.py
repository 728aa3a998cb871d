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
    """A SHA-256 over the names, dtypes, shapes and bytes of every tensor in ``model.state_dict()``.

    Used by prompts-only checkpoints to make sure the prompts are put back on exactly the weights they were trained on.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
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


def is_local_reference(reference: str) -> bool:
    """Whether a backbone reference is a local path (it loads only where that path exists)."""
    return os.path.isabs(reference)


def resolve_quietly(name_or_path: str) -> str:
    """Resolve a packaged-model alias if the package is there; otherwise keep the name (used for references only: no
    hub access)."""
    try:
        return utils.resolve_alias(name_or_path)
    except DataNotFoundError:
        return name_or_path


def write_prompts(state: dict[str, torch.Tensor], folder: str) -> None:
    """Write the prompts' state dict to ``folder/soft_prompts.safetensors``."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(folder, PROMPTS_FILE), metadata={"format": "pt"})


def read_prompts(path: str | None, source: str, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The prompts stored at ``path`` (``None``: the checkpoint has none), checked against the expected shapes.

    Raises:
        DataNotFoundError: no prompts file.
        DataFormatError: a damaged file.
        ConfigurationError: prompts of another shape than the module's configuration.
    """
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
        raise BackboneMismatchError(
            f"The prompts in {checkpoint!r} were trained on a backbone with fingerprint {expected}, but the backbone "
            f"loaded from {source!r} has fingerprint {actual}: its weights differ. Load the original backbone "
            f"(model_kwargs={{'backbone_name_or_path': ...}}) or use a full checkpoint."
        )


@contextmanager
def dequantized_gguf(model: torch.nn.Module):
    """Let transformers save a backbone loaded from a GGUF file whose weights it de-quantised on loading.

    transformers marks such a model as quantized and refuses ``save_pretrained``, although without a GGUF kernel
    (``kernels``) it holds plain float weights. Within this context the GGUF marker is lifted when every weight is a
    plain floating-point tensor, so the folder gets an ordinary safetensors checkpoint that loads without the GGUF
    file; weights still in GGUF blocks keep transformers' refusal.
    """
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
        raise BackboneMismatchError(
            f"Cannot check the backbone against {source!r} ({exc}): a prompts-only checkpoint referring to it could "
            "not be loaded either. Save the full model with model.save(path)."
        ) from exc
    if backbone_fingerprint(reference) != backbone_fingerprint(backbone):
        raise BackboneMismatchError(
            f"The backbone's weights differ from those at {source!r} (it was trained, e.g. by DiffAug's stage 2, or "
            "loaded from elsewhere): a prompts-only checkpoint would refer to weights it was not trained with and "
            "could not be loaded. Save the full model with model.save(path)."
        )


def save_prompts_only(model, path: str, *, keep_projection: bool = False) -> None:
    """Save a SentenceTransformer whose first module is a :class:`PromptedTransformer` without the backbone weights.

    The folder holds the soft prompts, the other (small) modules, and a reference to the backbone (name or path and a
    fingerprint of its weights): kilobytes per task instead of the whole backbone. Load it as usual with
    ``SentenceTransformer(path, trust_remote_code=True)``; loading fails clearly if the referenced backbone's weights
    differ from the ones the prompts were trained with.

    A model whose backbone was trained (e.g. DiffAug's stage 2) cannot be saved this way: the checkpoint would name the
    original backbone, whose weights differ, and would never load. This is refused with
    :class:`~st_prompts.errors.BackboneMismatchError` before anything is written (see
    :meth:`PromptedTransformer.check_backbone_unchanged`); save such a model with ``model.save(path)``.

    A reparameterised prefix (``prefix_projection=True``) is stored as the prefix its MLP computes, exactly, and
    reloads as a plain prefix (a 16-position MiniLM prefix: 295 KB instead of 10 MB); ``keep_projection=True`` keeps
    the embedding table and the MLP instead (for a checkpoint that training resumes from, e.g. DiffAug's stage 1).
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
