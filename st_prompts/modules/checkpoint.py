"""Prompts-only checkpoints: a backbone reference (portable name and weight fingerprint) and the soft prompts, so that a
task costs kilobytes; :func:`save_prompts_only` writes one, :meth:`PromptedTransformer.load` reads it."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from contextlib import contextmanager
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from st_prompts import utils
from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError, DataNotFoundError, first_line
from st_prompts.hub import check_hub_model
from st_prompts.storage import apply_umask

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


class PromptsCheckpointMixin:
    """Saving and loading of :class:`~st_prompts.PromptedTransformer`: full checkpoints (backbone + prompts) and
    prompts-only ones (:meth:`prompts_only`), with the backbone checks both need."""

    def prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """The soft prompts' state dict (keys relative to this module), without any backbone weight."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("model.")}

    def stored_prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """What a save writes of the prompts: :meth:`prompt_state_dict` with every reparameterised prefix (the
        module's own and each prompt set's) replaced by the prefix it computes
        (:meth:`~st_prompts.prompts.PrefixEncoder.stored_state_dict`), exactly; its config then says
        ``prefix_projection: false``, so the folder reloads as a plain prefix that encodes the same. Inside
        :meth:`prompts_only` with ``keep_projection=True`` (a checkpoint training resumes from) the MLP is kept."""
        state = self.prompt_state_dict()
        if getattr(self, "_keep_projection", False):
            return state
        for prefix, encoder in self._projected_prefixes().items():
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
            state.update({prefix + k: v for k, v in encoder.stored_state_dict().items()})
        return state

    def _projected_prefixes(self) -> dict[str, Any]:
        """State-dict key prefix -> prefix encoder, for every reparameterised prefix of this module."""
        own = getattr(self, "prefix_encoder", None)
        found = {"prefix_encoder.": own} if own is not None and own.projection else {}
        for name, encoder in getattr(self, "prompt_sets", {}).items():
            if encoder.projection:
                found[f"prompt_sets.{name}."] = encoder
        return found

    @property
    def backbone_reference(self) -> str:
        """The portable name of the backbone written to saved configs: the packaged alias (``"minilm"``), a hub id,
        or (for other local folders) an absolute path."""
        return portable_backbone_reference(self.backbone_name_or_path)

    def check_backbone_unchanged(self) -> None:
        """Make sure the backbone's weights are those at :attr:`backbone_name_or_path` (what a prompts-only checkpoint
        refers to); raise :class:`~st_prompts.errors.BackboneMismatchError` if they differ.

        Cheap for the usual case: a backbone loaded from ``backbone_name_or_path`` and never made trainable is the
        same by construction. Otherwise (made trainable at some point, or loaded from a full checkpoint) the weights
        at ``backbone_name_or_path`` are loaded and their fingerprints compared; if they cannot be loaded, the
        check refuses too (a prompts-only checkpoint could not be loaded either).
        """
        if not self._backbone_may_differ:
            return
        source = self.backbone_name_or_path
        try:
            reference = load_backbone(source)
        except (OSError, DataNotFoundError) as exc:
            raise BackboneMismatchError(
                f"Cannot check the backbone against {source!r} ({exc}): a prompts-only checkpoint referring to it could "
                "not be loaded either. Save the full model with model.save(path)."
            ) from exc
        if backbone_fingerprint(reference) != backbone_fingerprint(self.auto_model):
            raise BackboneMismatchError(
                f"The backbone's weights differ from those at {source!r} (it was trained, e.g. by DiffAug's stage 2, or "
                "loaded from elsewhere): a prompts-only checkpoint would refer to weights it was not trained with and "
                "could not be loaded. Save the full model with model.save(path)."
            )

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        config["backbone_name_or_path"] = self.backbone_reference
        if self._prompts_only_save:
            config["prompts_only"] = True
            config["backbone_fingerprint"] = backbone_fingerprint(self.auto_model)
        if getattr(self, "_saving", False) and not getattr(self, "_keep_projection", False):
            # what stored_prompt_state_dict writes: each reparameterised prefix as the plain prefix it computes
            for prefix in self._projected_prefixes():
                if prefix == "prefix_encoder.":
                    config["prefix_projection"] = False
                else:
                    name = prefix[len("prompt_sets."):-1]
                    config["prompt_sets"] = {**config["prompt_sets"],
                                             name: {**config["prompt_sets"][name], "prefix_projection": False}}
        return config

    @contextmanager
    def prompts_only(self, keep_projection: bool = False):
        """Within this context, :meth:`save` writes only the soft prompts and a reference to the backbone;
        ``keep_projection``: a reparameterised prefix keeps its MLP (see :meth:`stored_prompt_state_dict`)."""
        self._prompts_only_save, self._keep_projection = True, bool(keep_projection)
        try:
            yield self
        finally:
            self._prompts_only_save, self._keep_projection = False, False

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        """Save the module: backbone (safetensors), tokenizer, config and ``soft_prompts.safetensors``.

        Inside :meth:`prompts_only` only the config (with the backbone reference and fingerprint) and the prompts are
        written. The reference is portable for the packaged MiniLM (its alias) and hub models (their id); for other
        local folders it is their absolute path, and a warning says so. Weights are always written as safetensors.
        A reparameterised prefix is written as the prefix it computes (:meth:`stored_prompt_state_dict`).
        """
        os.makedirs(output_path, exist_ok=True)
        self._saving = True
        try:
            self._save(output_path)
        finally:
            self._saving = False

    def _save(self, output_path: str) -> None:
        if self._prompts_only_save:
            reference = self.backbone_reference
            if is_local_reference(reference):
                logger.warning(
                    f"The prompts-only checkpoint {output_path!r} refers to its backbone by the local path {reference!r}: "
                    f"it loads only where that path exists, or with model_kwargs={{'backbone_name_or_path': ...}} "
                    f"pointing at a copy with the same weights."
                )
            self.save_config(output_path)
        else:
            with dequantized_gguf(self.auto_model):
                super().save(output_path, safe_serialization=True)
        write_prompts(self.stored_prompt_state_dict(), output_path)
        # safetensors writes its files 0600 whatever the umask (a model.save outside st-prompts' atomic folders too):
        # give them the permissions every other file of the folder has
        for name in os.listdir(output_path):
            if name == PROMPTS_FILE or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", name):
                apply_umask(os.path.join(output_path, name))

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        config_kwargs: dict[str, Any] | None = None,
        backend: str = "torch",
        init_defaults: dict[str, Any] | None = None,
        **kwargs,
    ):
        """Load a saved module (full or prompts-only).

        A prompts-only checkpoint loads its backbone from the recorded ``backbone_name_or_path`` (the packaged-MiniLM
        alias resolves to the installed package); pass ``model_kwargs={"backbone_name_or_path": ...}`` to
        ``SentenceTransformer(...)`` to point elsewhere (e.g. a local copy). The backbone's weights must have the
        recorded fingerprint, else :class:`BackboneMismatchError`.
        """
        hub = dict(subfolder=subfolder, token=token, cache_folder=cache_folder, revision=revision,
                   local_files_only=local_files_only)
        model_kwargs = dict(model_kwargs or {})
        backbone_override = model_kwargs.pop("backbone_name_or_path", None)
        config = cls.load_config(model_name_or_path, **hub)
        if config.pop("prompts_only", False):
            expected = config.pop("backbone_fingerprint", None)
            # Older checkpoints recorded the packaged MiniLM by its absolute path in another environment.
            source = backbone_override or portable_backbone_reference(config["backbone_name_or_path"])
            backbone_hub = {"token": token, "cache_dir": cache_folder, "local_files_only": local_files_only,
                            "trust_remote_code": trust_remote_code}
            init = {k: v for k, v in config.items() if k in cls.config_keys}
            init["backbone_name_or_path"] = source
            # A hub backbone that is neither cached nor reachable: one line in seconds, not minutes of retries.
            check_hub_model(source, what="backbone", needed_by=f"the prompts-only checkpoint {model_name_or_path!r}")
            try:
                module = cls(
                    source,
                    **init,
                    model_kwargs={**backbone_hub, **model_kwargs},
                    processor_kwargs={**backbone_hub, **(processor_kwargs or {})},
                    config_kwargs={**backbone_hub, **(config_kwargs or {})},
                    backend=backend,
                )
            except OSError as exc:
                reason = first_line(exc)
                raise DataNotFoundError(
                    f"The prompts-only checkpoint {model_name_or_path!r} needs its backbone {source!r}, which could not "
                    f"be loaded ({reason}). Pass model_kwargs={{'backbone_name_or_path': '<local copy>'}}."
                ) from exc
            check_fingerprint(expected, module.auto_model, model_name_or_path, source)
        else:
            init_kwargs = cls._load_init_kwargs(
                model_name_or_path, trust_remote_code=trust_remote_code, model_kwargs=model_kwargs,
                processor_kwargs=processor_kwargs, config_kwargs=config_kwargs, backend=backend, **hub,
            )
            for key, value in (init_defaults or {}).items():
                init_kwargs.setdefault(key, value)
            module = cls(model_name_or_path=model_name_or_path, **init_kwargs)
        module._load_prompts(model_name_or_path, **hub)
        return module

    def _load_prompts(self, model_name_or_path: str, **hub) -> None:
        expected = {k: tuple(v.shape) for k, v in self.prompt_state_dict().items()}
        path = self.load_file_path(model_name_or_path, PROMPTS_FILE, **hub)
        self.load_state_dict(read_prompts(path, model_name_or_path, expected), strict=False)


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
    encoders = [m for m in model.modules() if isinstance(m, PromptsCheckpointMixin)]
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
