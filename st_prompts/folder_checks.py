"""The check before a model folder is loaded: :func:`untrusted_reason` walks, loading nothing, every module,
configuration, route, JSON file, link, weight file and referred-to backbone a loader would read, against the
allow-list of :mod:`st_prompts.trust`. Imports neither ``st_prompts.modules`` nor ``st_prompts.loading``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import huggingface_hub
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.file_download import _CACHED_NO_EXIST  # try_to_load_from_cache: known not to exist
from sentence_transformers.base.modules.module import Module
from sentence_transformers.base.modules.router import Router
from sentence_transformers.base.modules.transformer import Transformer
from sentence_transformers.util import import_from_string

from st_prompts import trust
from st_prompts.errors import ConfigurationError, DataNotFoundError, UntrustedCodeError, first_line
from st_prompts.hub import check_hub_model
from st_prompts.utils import resolve_gguf, resolve_model_name

logger = logging.getLogger(__name__)

__all__ = ["TRUSTED_MODULE_PREFIXES", "backbone_reason", "require_safe_backbone", "safe_loading",
           "should_trust_remote_code", "untrusted_reason"]

#: Module classes from these packages are installed code, not code from the model: they may be loaded.
TRUSTED_MODULE_PREFIXES = ("sentence_transformers.", "st_prompts.")
#: Keyword arguments of ``SentenceTransformer`` that say where to read a hub model's files from.
HUB_KWARGS = {"cache_folder": "cache_dir", "revision": "revision", "token": "token",
              "local_files_only": "local_files_only"}
#: Configuration files of a hub model that can point to code or hold loader options (locally: every ``*.json``).
_HUB_CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                     "adapter_config.json", "router_config.json", "sentence_bert_config.json")
#: The names sentence-transformers reads a ``Transformer`` module's configuration from, in its order.
_TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                        "sentence_distilbert_config.json", "sentence_camembert_config.json",
                        "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                        "sentence_xlnet_config.json")
#: How deep models may refer to models (a backbone's backbone, an adapter's base model, a route's nested model).
_MAX_DEPTH = 4


class _Missing(Exception):
    """The file is known not to exist (as opposed to: it could not be read)."""


def is_local(model: str) -> bool:
    return os.path.isdir(model) or os.path.exists(model) or model.startswith((".", "/", "~"))


def _model_file(model: str, filename: str, hub: dict[str, Any]) -> str:
    """Local path of ``filename`` of ``model`` (a folder or a hub id: from the cache, else downloaded); raises
    :class:`_Missing` when it does not exist, anything else when it cannot be reached."""
    if os.path.isdir(model):
        path = os.path.join(model, filename)
        if not os.path.isfile(path):
            raise _Missing(path)
        return path
    if is_local(model):
        raise OSError(f"{model} is not a model folder")

    options = {target: hub[source] for source, target in HUB_KWARGS.items() if hub.get(source) is not None}
    # The cache first: a cached file is read without any request (offline, a request would retry for minutes).
    cached = huggingface_hub.try_to_load_from_cache(model, filename, cache_dir=options.get("cache_dir"),
                                                    revision=options.get("revision"))
    if isinstance(cached, str):
        return cached
    if cached is _CACHED_NO_EXIST:
        raise _Missing(f"{model}/{filename}")
    try:
        return huggingface_hub.hf_hub_download(model, filename, **options)
    except EntryNotFoundError as exc:
        raise _Missing(f"{model}/{filename}") from exc


def read_model_json(model: str, filename: str, hub: dict[str, Any]) -> Any:
    """The parsed JSON file, or ``None`` if it does not exist; raises ``UnreadableFile`` when it cannot be read."""
    try:
        with open(_model_file(model, filename, hub), encoding="utf-8") as handle:
            return json.load(handle)
    except _Missing:
        return None
    except Exception as exc:  # any failure to reach or parse it
        raise UnreadableFile(f"{filename} could not be read ({first_line(exc)})") from exc


class UnreadableFile(Exception):
    """A file that may name code could not be read: the model cannot be checked."""


def _config_files(model: str, folder: str) -> list[str]:
    """The JSON files of ``folder`` in ``model`` to check: every ``*.json`` locally, the known names on the hub."""
    names = _HUB_CONFIG_FILES
    if os.path.isdir(model):
        try:
            names = sorted(n for n in os.listdir(os.path.join(model, folder)) if n.endswith(".json"))
        except OSError:
            return []
    return [f"{folder}/{n}" if folder else n for n in names]


def _foreign_types(types: list[Any]) -> list[str]:
    return [str(t) for t in types if not (isinstance(t, str) and t.startswith(TRUSTED_MODULE_PREFIXES))]


def _unsafe_path(folder: Any) -> bool:
    """A module path that leaves its model folder (:func:`st_prompts.trust.unsafe_file_name`, or a drive)."""
    return folder is None or trust.unsafe_file_name(folder) or ":" in folder


def _outside(model: str, folder: str) -> bool:
    """Whether the local module folder ``folder`` of ``model`` resolves (through links) outside ``model``."""
    if not os.path.isdir(model):
        return False
    root = os.path.realpath(model)
    target = os.path.realpath(os.path.join(model, folder))
    return target != root and not target.startswith(root + os.sep)


def _module_class(type_name: str) -> Any:
    """What a trusted ``modules.json`` type names, maybe not a class (``None`` when it cannot be imported)."""
    try:
        return import_from_string(type_name)
    except Exception:  # noqa: BLE001 - an unknown name of a trusted package: the load reports it
        return None


def _is_prompted(module_class: type) -> bool:
    """Whether ``module_class`` is (a subclass of) ``PromptedTransformer``, by class path (no import of it)."""
    return any(f"{c.__module__}.{c.__qualname__}" == "st_prompts.modules.prompted_transformer.PromptedTransformer"
               for c in module_class.__mro__)


def _check_files(model: str, folder: str, hub: dict[str, Any]) -> str | None:
    """The rules every JSON file of a folder meets (:func:`st_prompts.trust.hf_files_reason`)."""
    for name in _config_files(model, folder):
        reason = trust.hf_files_reason(name, read_model_json(model, name, hub), trust.known_model_type)
        if reason:
            return reason
    return None


def _check_links(model: str, folder: str) -> str | None:
    """Why something under the local module folder ``folder`` of ``model`` is a link resolving outside the model
    folder, or ``None``. A Hugging Face cache snapshot may link into its repository's ``blobs``."""
    if not os.path.isdir(model):
        return None
    root = os.path.realpath(model)
    allowed = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    for directory, folders, files in os.walk(os.path.join(model, folder)):
        for name in folders + files:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                target = os.path.realpath(path)
                if not any(target == place or target.startswith(place + os.sep) for place in allowed):
                    return f"{os.path.relpath(path, model)} is a link to {target}, outside the model folder"
    return None


def _check_local(model: str, folder: str, pickles: bool = True) -> str | None:
    """The local files of a module folder: no link out of the model folder, no pickle without safetensors."""
    if not os.path.isdir(model):
        return None
    label = os.path.join(model, folder).rstrip("/")
    return _check_links(model, folder) or (trust.pickle_reason(os.path.join(model, folder), label=label)
                                           if pickles else None)


def _too_deep(depth: int) -> str | None:
    return (f"it refers to models nested more than {_MAX_DEPTH} deep (a backbone's backbone, a route's route), "
            "which are not checked") if depth > _MAX_DEPTH else None


def _check_transformer_folder(model: str, folder: str, hub: dict[str, Any], seen: set[str],
                              prompted: bool, depth: int) -> str | None:
    """The folder of a ``Transformer`` module (or a plain transformers model): its configuration, files, links and
    weights, a PEFT adapter's base model, the backbone a prompts-only checkpoint refers to."""
    prefix = f"{folder}/" if folder else ""
    configs = {}
    for filename in _TRANSFORMER_CONFIGS if os.path.isdir(model) else _TRANSFORMER_CONFIGS[:1]:
        config = read_model_json(model, prefix + filename, hub)
        if config is not None:
            configs[filename] = config
            reason = trust.transformer_config_reason(prefix + filename, config, prompted=prompted)
            if reason:
                return reason
    config = next(iter(configs.values()), {})
    if isinstance(config, dict) and config.get("prompts_only"):
        reason = _check_local(model, folder, pickles=False) or _check_backbone(
            config.get("backbone_name_or_path"), hub, seen, depth + 1, f"the prompts-only checkpoint {model!r}")
        return f"{prefix}{_TRANSFORMER_CONFIGS[0]}: the backbone it refers to: {reason}" if reason else None
    reason = _check_files(model, folder, hub) or _check_local(model, folder)
    if reason:
        return reason
    adapter = read_model_json(model, prefix + "adapter_config.json", hub)
    if isinstance(adapter, dict) and adapter.get("base_model_name_or_path"):
        reason = _check_backbone(adapter["base_model_name_or_path"], hub, seen, depth + 1,
                                 f"the PEFT adapter {model!r}")
        if reason:
            return f"{prefix}adapter_config.json: its base model: {reason}"
    return None


def _is_whole_model(module_class: type) -> bool:
    """Whether ``module_class`` is a whole model (``SentenceTransformer``, ``CrossEncoder``, ...)."""
    from sentence_transformers.base.model import BaseModel

    return issubclass(module_class, BaseModel)


def _check_module(model: str, entry: dict[str, Any], hub: dict[str, Any], seen: set[str], depth: int,
                  route: bool = False) -> str | None:
    """One module (of ``modules.json``, or a ``Router``'s route when ``route``): where it is, what its
    configuration holds, what it loads; a route that is a whole model is checked as one, at any depth."""
    folder = entry.get("path", "")
    where = "a router_config.json route" if route else "modules.json has a module path"
    if _unsafe_path(folder) or _outside(model, folder):
        return f"{where} outside the model: {folder!r}"
    module_class = _module_class(entry["type"])
    named = f"{entry['type']} ({folder or 'the model folder'})"
    if module_class is None:  # a name in a trusted package that is not there: nothing to install, a bad folder
        return f"{named} is not a class of sentence_transformers or st_prompts"
    if isinstance(module_class, type) and _is_whole_model(module_class):
        if not route:  # sentence-transformers would build it from the parent folder, with the module's options
            return f"modules.json: the module {folder!r} is a whole model ({entry['type']}), not a module"
        # A whole model as a route (the Router's documented use) loads as a model of its own: checked as one.
        return _too_deep(depth + 1) or _check_model(model, folder, hub, seen, depth + 1)
    if not (isinstance(module_class, type) and issubclass(module_class, Module)):
        return f"{named} is not a sentence-transformers module class"
    if issubclass(module_class, Transformer):
        return _check_transformer_folder(model, folder, hub, seen, _is_prompted(module_class), depth)
    reason = _check_files(model, folder, hub)
    if reason:
        return reason
    prefix = f"{folder}/" if folder else ""
    if issubclass(module_class, Router):
        reason = _check_router(model, prefix, hub, seen, depth)
    else:
        name = prefix + getattr(module_class, "config_file_name", "config.json")
        config = read_model_json(model, name, hub)
        reason = None if config is None else trust.module_config_reason(name, module_class, config)
    return reason or _check_local(model, folder)


def _check_router(model: str, prefix: str, hub: dict[str, Any], seen: set[str], depth: int) -> str | None:
    """A ``Router``'s routes (``router_config.json``, else ``config.json``), each checked as a module."""
    name = prefix + "router_config.json"
    config = read_model_json(model, name, hub)
    if config is None:
        name = prefix + "config.json"
        config = read_model_json(model, name, hub)
    if config is None:
        return None  # nothing to route: loading says so
    types = config.get("types") if isinstance(config, dict) else None
    if not isinstance(types, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in types.items()):
        return f"{name}: 'types' is not an object of route folders and module classes"
    foreign = _foreign_types(list(types.values()))
    if foreign:
        return f"{name} names classes outside sentence_transformers and st_prompts: {', '.join(foreign)}"
    for sub, type_name in types.items():
        reason = _check_module(model, {"path": f"{prefix}{sub}".rstrip("/"), "type": type_name}, hub, seen, depth,
                               route=True)
        if reason:
            return reason
    return None


def _check_backbone(reference: Any, hub: dict[str, Any], seen: set[str], depth: int = 1,
                    needed_by: str | None = None) -> str | None:
    """Why the backbone a prompts-only checkpoint (or a PEFT adapter) refers to is unsafe to load, or ``None``."""
    if not isinstance(reference, str) or not reference or reference in seen:
        return None
    if depth > _MAX_DEPTH:
        return _too_deep(depth)
    seen.add(reference)
    # A backbone that cannot be had: one line now, not minutes of retries later.
    check_hub_model(reference, what="backbone", needed_by=needed_by)
    backbone = os.path.expanduser(resolve_model_name(reference))
    try:
        location, gguf_file, _ = resolve_gguf(backbone)
    except DataNotFoundError:
        return None  # a missing .gguf: loading says so
    if gguf_file:
        reason = trust.gguf_reason(os.path.join(location, gguf_file))
        if reason:
            return reason
        backbone = location
    if is_local(backbone) and not os.path.isdir(backbone):
        return None  # a missing local backbone: loading says so
    hub = {k: v for k, v in hub.items() if k != "revision"}
    try:
        return _check_transformer_folder(backbone, "", hub, seen, prompted=True, depth=depth)
    except UnreadableFile as exc:
        if is_local(backbone):
            return f"{backbone}: its {exc}"
        raise DataNotFoundError(f"the backbone {reference!r} could not be read: its {exc}") from exc


#: Why a Router may not route to a prompt bank (one line, what to do instead).
ROUTER_UNSUPPORTED = ("a prompt bank inside a sentence-transformers Router is not supported: the Router and the bank "
                      "both read encode's task= (the Router to pick a route, the bank a prompt set), so rows would "
                      "reach the wrong set; use the bank itself, with its query and document roles for "
                      "encode_query/encode_document (st-prompts bank roles BANK --query SET --document SET)")
#: Why a Router route may not be a whole st_prompts model.
WHOLE_MODEL_ROUTE = ("a Router route that is a whole st_prompts model cannot be loaded (sentence-transformers loads "
                     "such a route without st_prompts' classes); route to its modules instead "
                     "(Router.for_query_document(query_modules=list(model), ...))")


def prompted_routes(name_or_path: str, **hub: Any) -> bool:
    """Whether a saved model has a ``Router`` (at any depth) with st_prompts modules among its routes. Raises
    :class:`ConfigurationError` for a route to a prompt bank or a whole model holding st_prompts modules. Reads
    JSON files only; what cannot be read gives ``False`` (left to the loader and the trust checks)."""
    model = os.path.expanduser(resolve_model_name(name_or_path))
    try:
        return _prompted_routes(model, "", hub, depth=0)
    except (UnreadableFile, OSError, DataNotFoundError):
        return False


def _prompted_routes(model: str, folder: str, hub: dict[str, Any], depth: int, in_route: bool = False) -> bool:
    if depth > _MAX_DEPTH:
        return False
    found = False
    prefix = f"{folder}/" if folder else ""
    modules = read_model_json(model, prefix + "modules.json", hub)
    for entry in modules if isinstance(modules, list) else []:
        type_name = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(type_name, str):
            continue
        if in_route and type_name.startswith("st_prompts."):
            raise ConfigurationError(WHOLE_MODEL_ROUTE + ".")
        module_class = _module_class(type_name) if type_name.startswith("sentence_transformers.") else None
        if not (isinstance(module_class, type) and issubclass(module_class, Router)):
            continue
        path = entry.get("path", "") if isinstance(entry.get("path", ""), str) else ""
        sub_prefix = f"{prefix}{path}/" if path else prefix
        config = (read_model_json(model, sub_prefix + "router_config.json", hub)
                  or read_model_json(model, sub_prefix + "config.json", hub))
        types = config.get("types") if isinstance(config, dict) else None
        for sub, route_type in (types.items() if isinstance(types, dict) else ()):
            if not isinstance(route_type, str) or not isinstance(sub, str):
                continue
            if route_type.startswith("st_prompts."):
                saved = read_model_json(model, f"{sub_prefix}{sub}/sentence_bert_config.json", hub)
                if isinstance(saved, dict) and saved.get("prompt_sets") is not None:  # a prompt bank
                    raise ConfigurationError(ROUTER_UNSUPPORTED + ".")
                found = True
            route_class = _module_class(route_type) if route_type.startswith("sentence_transformers.") else None
            if isinstance(route_class, type) and _is_whole_model(route_class):
                _prompted_routes(model, f"{sub_prefix}{sub}".strip("/"), hub, depth + 1, in_route=True)
    return found


def backbone_reason(name_or_path: str, **hub: Any) -> str | None:
    """Why loading ``name_or_path`` as a *backbone* (a transformers folder, hub id, alias or ``.gguf`` file) would run
    code, unpickle a weight file or ask a loader for more than the allow-list; ``None`` if it would not."""
    return _check_backbone(str(name_or_path), hub, set(), depth=0)


def require_safe_backbone(name_or_path: str, trust_remote_code: bool | None = False, what: str = "backbone") -> None:
    """Raise :class:`UntrustedCodeError` for a backbone (or generator, LLM, ...) :func:`backbone_reason` finds unsafe,
    unless ``trust_remote_code=True``."""
    if trust_remote_code is True:
        return
    reason = backbone_reason(name_or_path)
    if reason is not None:
        raise refusal(f"the {what}", str(name_or_path), reason)


def refusal(what: str, name_or_path: Any, reason: str) -> UntrustedCodeError:
    """The error refusing to load ``what`` (``"model"``, ``"the backbone"``) ``name_or_path`` for ``reason``."""
    return UntrustedCodeError(f"refused to load {what} {name_or_path!r}: {reason}. Nothing of it was run; pass "
                              "--trust-remote-code (trust_remote_code=True in Python) only if you trust that code.")


@contextmanager
def safe_loading(trust_remote_code: bool | None = False) -> Iterator[dict[str, Any]]:
    """Around a ``from_pretrained`` of a checked, untrusted folder: ``torch.load`` refuses; yields the keyword
    arguments to add (safetensors only). With ``trust_remote_code=True`` nothing changes."""
    if trust_remote_code is True:
        yield {}
        return
    with trust.no_unpickling():
        yield dict(trust.SAFE_MODEL_KWARGS)


def untrusted_reason(name_or_path: str, **hub: Any) -> str | None:
    """Why loading ``name_or_path`` would run code that ships with the model, hand a loader an option outside the
    allow-list, or unpickle a weight file; ``None`` if it would not. A file that cannot be read counts as a reason.
    ``**hub``: ``cache_folder``, ``revision``, ``token``, ``local_files_only``, ``model_kwargs``, as for
    ``SentenceTransformer``. Raises :class:`DataNotFoundError` for a hub model neither cached nor reachable.
    """
    model = os.path.expanduser(resolve_model_name(name_or_path))
    seen: set[str] = set()
    try:
        reason = _check_model(model, "", hub, seen, depth=0)
        if reason:
            return reason
        override = (hub.get("model_kwargs") or {}).get("backbone_name_or_path")
        if override:
            reason = _check_backbone(override, hub, seen)
            if reason:
                return f"the backbone given in model_kwargs: {reason}"
    except UnreadableFile as exc:
        return f"its {exc}, so the code it would load is unknown"
    return None


def _modules_reason(name: str, modules: Any) -> str | None:
    """Why the parsed ``modules.json`` ``name`` is not a list of modules sentence-transformers can load, or ``None``."""
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict) for m in modules):
        return f"its {name} is not a list of modules"
    for index, entry in enumerate(modules):
        for key in ("type", "name", "path"):
            if not isinstance(entry.get(key), str) or (key != "path" and not entry[key]):
                return f"its {name}: module {index} has no {key!r} (a string)"
        if not (isinstance(entry.get("kwargs", []), list) and all(isinstance(k, str) for k in entry.get("kwargs", []))):
            return f"its {name}: module {index} has 'kwargs' that are not a list of names"
        extra = sorted(set(entry) - {"idx", "name", "path", "type", "kwargs"})
        if extra:
            return f"its {name} has keys that are not module settings: {', '.join(map(repr, extra))}"
    if len({m["name"] for m in modules}) < len(modules):
        return f"its {name} names two modules the same"
    foreign = _foreign_types([m["type"] for m in modules])
    if foreign:
        return f"its {name} names classes outside sentence_transformers and st_prompts: {', '.join(foreign)}"
    return None


def _check_model(model: str, folder: str, hub: dict[str, Any], seen: set[str], depth: int) -> str | None:
    """A whole model in ``folder`` of ``model`` (``""``: the model itself): its ``modules.json`` and every module, or
    a plain transformers model."""
    prefix = f"{folder}/" if folder else ""
    modules = read_model_json(model, prefix + "modules.json", hub)
    if modules is None:  # a plain transformers model: sentence-transformers adds mean pooling
        return _check_transformer_folder(model, folder, hub, seen, prompted=False, depth=depth)
    reason = _modules_reason(prefix + "modules.json", modules) or (None if folder else _check_links(model, ""))
    if reason:
        return reason
    if not any(m["path"] in ("", ".", "./") for m in modules):
        reason = _check_files(model, folder, hub) or (_check_local(model, folder) if folder else None)
        if reason:
            return reason
    for entry in modules:
        path = entry["path"] if _unsafe_path(entry["path"]) else f"{prefix}{entry['path']}".rstrip("/")
        reason = _check_module(model, {**entry, "path": path}, hub, seen, depth)
        if reason:
            return reason
    return None


def should_trust_remote_code(name_or_path: str, **hub: Any) -> bool:
    """Whether ``name_or_path`` loads without running any code that ships with it (:func:`untrusted_reason`)."""
    return untrusted_reason(name_or_path, **hub) is None
