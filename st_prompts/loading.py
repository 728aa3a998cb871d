"""Load a sentence-transformers model without running code that ships with it; describe its pooling.

Every file a loader will read is checked first (:mod:`st_prompts.folder_checks`); a model with st_prompts modules is
assembled from its modules, each loaded with ``trust_remote_code=False`` (sentence-transformers 6 wants it ``True``)."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.router import Router
from sentence_transformers.util import import_from_string

from st_prompts import trust
from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, StPromptsError, first_line
from st_prompts.folder_checks import (HUB_KWARGS, TRUSTED_MODULE_PREFIXES, UnreadableFile, backbone_reason, is_local,
                                      prompted_routes, read_model_json, refusal, require_safe_backbone, safe_loading,
                                      should_trust_remote_code, untrusted_reason)
from st_prompts.hub import cached_and_unreachable
from st_prompts.storage import interrupted_save_hint
from st_prompts.utils import resolve_model_name

logger = logging.getLogger(__name__)

__all__ = ["TRUSTED_MODULE_PREFIXES", "backbone_reason", "check_device", "check_loadable", "load_sentence_model",
           "pooling_label", "require_safe_backbone", "safe_loading", "should_trust_remote_code", "untrusted_reason"]

#: ``SentenceTransformer`` keyword arguments :func:`load_sentence_model` passes on when it assembles a model itself.
_ASSEMBLY_KWARGS = ("cache_folder", "revision", "token", "local_files_only", "model_kwargs", "processor_kwargs",
                    "config_kwargs", "backend", "prompts", "default_prompt_name", "similarity_fn_name",
                    "truncate_dim", "model_card_data")
#: How :func:`pooling_label` names sentence-transformers' ``Pooling`` modes.
_POOLING_MODE_LABELS = {"cls": "[CLS]", "mean": "mean", "max": "max", "mean_sqrt_len_tokens": "mean/sqrt(len)",
                        "weightedmean": "weighted mean", "lasttoken": "last token"}


def load_sentence_model(name_or_path: str, trust_remote_code: bool | None = False, *, device: str | None = None,
                        quantize: str | None = None, dtype: Any = None, **kwargs: Any) -> SentenceTransformer:
    """Load ``name_or_path`` (a folder, a hub id or ``minilm``) as a ``SentenceTransformer``, running no code that
    ships with it unless ``trust_remote_code=True`` (then passed to sentence-transformers as is).

    ``device``: default sentence-transformers' choice, the CPU with ``quantize`` (``"int8"``:
    :func:`~st_prompts.quantization.quantize_model`); ``dtype``: ``"bfloat16"``/``"float16"``
    (:func:`~st_prompts.precision.apply_dtype`), not with ``quantize``; ``**kwargs``: for ``SentenceTransformer``.
    Raises DataNotFoundError, DataFormatError (a damaged weight file), UntrustedCodeError, ConfigurationError (an
    unknown ``quantize`` or ``dtype``, both, or a device this machine lacks).
    """
    from st_prompts.precision import apply_dtype, check_combination, check_dtype

    dtype = check_dtype(dtype)  # before anything loads
    check_combination(dtype, quantize)
    check_device(device)
    if quantize not in (None, "none"):
        from st_prompts.quantization import check_mode, quantize_model

        check_mode(quantize)
        model = load_sentence_model(name_or_path, trust_remote_code, device=device or "cpu", **kwargs)
        return quantize_model(model, quantize)
    if dtype != "float32":
        return apply_dtype(load_sentence_model(name_or_path, trust_remote_code, device=device, **kwargs), dtype)
    model, routed = _preflight(name_or_path, trust_remote_code, kwargs)
    try:
        if trust_remote_code is True:
            return SentenceTransformer(model, trust_remote_code=True, device=device, **kwargs)
        # Safetensors only: transformers never falls back to a pickle (the caller's own model_kwargs win).
        kwargs["model_kwargs"] = {**trust.SAFE_MODEL_KWARGS, **(kwargs.get("model_kwargs") or {})}
        with trust.no_unpickling():
            modules = read_model_json(model, "modules.json", kwargs) or []
            if routed or any(m["type"].startswith("st_prompts.") for m in modules):
                return _assemble(model, modules, device, kwargs)
            return SentenceTransformer(model, trust_remote_code=False, device=device, **kwargs)
    except StPromptsError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a loader raises reaches the user as one line
        raise _load_error(name_or_path, exc) from exc


def check_loadable(name_or_path: str, trust_remote_code: bool | None = False, **kwargs: Any) -> None:
    """The checks of :func:`load_sentence_model` without loading (the model exists and names no code unless
    trusted); raises as it does."""
    _preflight(name_or_path, trust_remote_code, dict(kwargs))


def _preflight(name_or_path: str, trust_remote_code: bool | None, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """The checks before a load (``kwargs`` completed in place): the resolved model and its prompted routes."""
    model = os.path.expanduser(resolve_model_name(name_or_path))
    if is_local(model) and not os.path.isdir(model):
        hint = interrupted_save_hint(model) if not os.path.exists(model) else ""
        raise DataNotFoundError(f"could not load model {name_or_path!r}: no such folder{hint}")
    if "local_files_only" not in kwargs and cached_and_unreachable(model):
        kwargs["local_files_only"] = True  # cached, and the hub cannot be reached: no request would succeed
    # trusted or not: st_prompts modules behind a Router would silently read the Router's task (see there)
    routed = prompted_routes(model, **{k: v for k, v in kwargs.items() if k in HUB_KWARGS})
    if trust_remote_code is True:
        return model, routed
    try:
        reason = untrusted_reason(model, **kwargs)
    except StPromptsError:
        raise  # e.g. a hub backbone it refers to, neither cached nor reachable: already one line
    except OSError as exc:
        raise DataNotFoundError(f"could not load model {name_or_path!r}: {first_line(exc)}") from exc
    if reason is not None:
        raise refusal("model", name_or_path, reason)
    return model, routed


def check_device(device: str | None) -> None:
    """Raise :class:`ConfigurationError` for a ``device`` torch does not know or this machine does not have (no CUDA
    context is created)."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"{device!r} is not a device ({first_line(exc)})") from exc
    if parsed.type in ("cuda", "mps", "xpu"):
        backend = getattr(torch, parsed.type)
        count = backend.device_count() if backend.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ConfigurationError(f"{device!r} is not here (this machine has {count} {parsed.type} device(s))")


def _load_error(name_or_path: str, exc: BaseException) -> StPromptsError:
    """The one-line error for an exception a loader raised on a model that passed the checks."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain and len(chain) <= 10:
        chain.append(nxt)
    refused = next((e for e in chain if isinstance(e, StPromptsError)), None)
    if refused is not None:
        return refused
    logger.debug("loading %s failed", name_or_path, exc_info=exc)
    where = f"could not load model {name_or_path!r}"
    if isinstance(exc, UnreadableFile):
        return DataNotFoundError(f"{where}: its {exc}")
    if isinstance(exc, OSError):
        return DataNotFoundError(f"{where}: {first_line(exc)}")
    if isinstance(exc, ImportError):
        # trusted code naming a module that is not installed: a message, not a traceback from importlib
        return DataNotFoundError(f"{where}: it names code that cannot be imported ({first_line(exc)}); install the "
                                 "package that provides it.")
    if _is_pickle_refusal(chain):
        return DataFormatError(f"{where}: torch refused to unpickle one of its weight files ({first_line(exc)}); "
                               "a pickled weight file can run code: convert it to safetensors.")
    if _is_damaged_weights(exc):
        return DataFormatError(f"{where}: a safetensors weight file is damaged ({first_line(exc)}); save or "
                               "download it again.")
    return DataFormatError(f"{where}: {type(exc).__name__}: {first_line(exc)}")


def _is_pickle_refusal(chain: list[BaseException]) -> bool:
    """Whether torch's ``weights_only`` unpickler refused a pickle somewhere in ``chain``."""
    return any(type(e).__name__ == "UnpicklingError" or "weights only load failed" in str(e).lower() for e in chain)


def _is_damaged_weights(exc: BaseException) -> bool:
    """Whether ``exc`` is safetensors' complaint about an unreadable weight file."""
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    return bool(names & {"SafetensorError", "HeaderTooLarge", "HeaderTooSmall", "InvalidHeaderDeserialization"}) \
        or "deserializ" in str(exc).lower()


class _OurClasses(dict):
    """st_prompts' classes by name, imported on ``get``: a ``Router``'s ``module_classes``, so that its routes load
    without the global ``trust_remote_code`` too."""

    def get(self, key: Any, default: Any = None) -> Any:
        if isinstance(key, str) and key.startswith("st_prompts."):
            return import_from_string(key)
        return default

    def __bool__(self) -> bool:  # never empty: Router.load replaces a false mapping by {}
        return True


def _assemble(model: str, modules_config: list[dict[str, Any]], device: str | None,
              kwargs: dict[str, Any]) -> SentenceTransformer:
    """A ``SentenceTransformer`` built from the (already checked) modules of a saved model, each loaded by its own
    class with ``trust_remote_code=False`` (sentence-transformers 6 has no public way to do this)."""
    unknown = sorted(set(kwargs) - set(_ASSEMBLY_KWARGS))
    if unknown:
        raise StPromptsError(f"load_sentence_model() cannot pass {', '.join(unknown)} to a model with st_prompts "
                             "modules; give them to the model after loading")
    hub = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
    ours = _OurClasses()
    modules: OrderedDict[str, Any] = OrderedDict()
    module_kwargs: OrderedDict[str, Any] = OrderedDict()
    for config in modules_config:
        module_class = ours.get(config["type"]) or import_from_string(config["type"])
        load_kwargs: dict[str, Any] = {
            "subfolder": config.get("path", ""), **hub, "trust_remote_code": False,
            "model_kwargs": kwargs.get("model_kwargs"), "processor_kwargs": kwargs.get("processor_kwargs"),
            "config_kwargs": kwargs.get("config_kwargs"), "backend": kwargs.get("backend", "torch"),
        }
        if issubclass(module_class, Router):
            load_kwargs["module_classes"] = ours  # a Router over st_prompts modules resolves them the same way
        modules[config["name"]] = module_class.load(model, **load_kwargs)
        module_kwargs[config["name"]] = config.get("kwargs", [])
    saved = read_model_json(model, "config_sentence_transformers.json", hub) or {}
    options = {key: kwargs[key] for key in ("prompts", "default_prompt_name", "similarity_fn_name", "truncate_dim",
                                            "model_card_data", "backend") if kwargs.get(key) is not None}
    prompts = {**(saved.get("prompts") or {}), **(options.pop("prompts", None) or {})}
    options.setdefault("default_prompt_name", saved.get("default_prompt_name"))
    if saved.get("similarity_fn_name"):
        options.setdefault("similarity_fn_name", saved["similarity_fn_name"])
    if saved.get("truncate_dim") is not None:
        options.setdefault("truncate_dim", saved["truncate_dim"])
    result = SentenceTransformer(modules=modules, device=device, prompts=prompts or None, **options)
    result.module_kwargs = module_kwargs
    return result


def pooling_label(model: Any) -> str:
    """How ``model`` pools token embeddings, for table headers and legends: ``"[CLS]"``, ``"mean"``, ... (several
    modes joined by ``+``), ``"[MASK]"`` for ``MaskTokenPooling``, ``"unknown"`` when it cannot tell."""
    try:
        modules = list(model)
    except TypeError:
        return "unknown"
    for module in modules:
        kind = type(module).__name__
        if kind == "MaskTokenPooling":
            return "[MASK]"
        if kind == "StaticEmbedding":
            return "mean"
        mode = getattr(module, "pooling_mode", None)
        if kind == "Pooling" and mode:
            modes = (mode,) if isinstance(mode, str) else tuple(mode)
            return "+".join(_POOLING_MODE_LABELS.get(m, m) for m in modes)
    return "unknown"
