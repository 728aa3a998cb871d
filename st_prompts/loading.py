"""Load a sentence-transformers model without running code that ships with it; describe its pooling.

Every ``st-prompts`` command that loads a model goes through :func:`load_sentence_model`, and Python users can too::

    from st_prompts.loading import load_sentence_model
    model = load_sentence_model("runs/dcpcse")          # st_prompts' and sentence-transformers' own classes only

Why not ``SentenceTransformer(path, trust_remote_code=True)``: sentence-transformers 6 wants that flag for any module
class outside ``sentence_transformers.*`` (so for st_prompts' ``PromptedTransformer`` too), and the flag then also
lets the model import any class its ``modules.json`` names, any ``Dense`` activation, and lets transformers run the
``auto_map`` code of its configuration, its tokenizer or (for a prompts-only checkpoint) its backbone. Here:

* **the decision comes first** (:func:`untrusted_reason`): every file that can name code is read before anything is
  loaded: ``modules.json`` (every type must be a class of ``sentence_transformers.*`` or ``st_prompts.*``), each
  module's configuration (a ``Dense`` activation must be a ``torch.*`` class; a ``Router``'s types are checked like
  ``modules.json``), the ``auto_map`` / ``custom_pipelines`` of ``config.json``, ``tokenizer_config.json`` and the
  processor configurations of every folder involved, and the backbone a prompts-only checkpoint refers to;
* **nothing is granted**: the model is then loaded with ``trust_remote_code=False``. sentence-transformers loads its
  own classes as usual; a model with st_prompts modules is assembled here from its modules (each loaded by its own
  class with ``trust_remote_code=False``), so that sentence-transformers never needs the global flag;
* a model that names code is refused with :class:`~st_prompts.errors.UntrustedCodeError`, one line naming what and
  where, unless the user passed ``trust_remote_code=True`` (``--trust-remote-code``), which is handed to
  sentence-transformers as is.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import huggingface_hub
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.file_download import _CACHED_NO_EXIST  # try_to_load_from_cache: known not to exist
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.router import Router
from sentence_transformers.base.modules.transformer import Transformer
from sentence_transformers.util import import_from_string

from st_prompts import trust
from st_prompts.errors import DataFormatError, DataNotFoundError, StPromptsError, UntrustedCodeError
from st_prompts.hub import cached_and_unreachable
from st_prompts.modules import PromptedTransformer
from st_prompts.storage import interrupted_save_hint
from st_prompts.utils import resolve_gguf, resolve_model_name

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

__all__ = ["TRUSTED_MODULE_PREFIXES", "backbone_reason", "load_sentence_model", "pooling_label",
           "require_safe_backbone", "safe_loading", "should_trust_remote_code", "untrusted_reason"]

#: Module classes from these packages are installed code, not code from the model: they may be loaded.
TRUSTED_MODULE_PREFIXES = ("sentence_transformers.", "st_prompts.")
#: Keyword arguments of ``SentenceTransformer`` that say where to read a hub model's files from.
_HUB_KWARGS = {
    "cache_folder": "cache_dir",
    "revision": "revision",
    "token": "token",
    "local_files_only": "local_files_only",
}
#: Configuration files a loader reads beside a model, any of which can point to code or hold loader options. On the
#: hub they are fetched by name; in a local folder every ``*.json`` file is read.
_HUB_CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                     "adapter_config.json", "router_config.json", "sentence_bert_config.json")
#: The names sentence-transformers reads a ``Transformer`` module's configuration from, in its order.
_TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                        "sentence_distilbert_config.json", "sentence_camembert_config.json",
                        "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                        "sentence_xlnet_config.json")
#: ``SentenceTransformer`` keyword arguments :func:`load_sentence_model` passes on when it assembles a model itself.
_ASSEMBLY_KWARGS = ("cache_folder", "revision", "token", "local_files_only", "model_kwargs", "processor_kwargs",
                    "config_kwargs", "backend", "prompts", "default_prompt_name", "similarity_fn_name",
                    "truncate_dim", "model_card_data")
#: How :func:`pooling_label` names sentence-transformers' ``Pooling`` modes.
_POOLING_MODE_LABELS = {
    "cls": "[CLS]",
    "mean": "mean",
    "max": "max",
    "mean_sqrt_len_tokens": "mean/sqrt(len)",
    "weightedmean": "weighted mean",
    "lasttoken": "last token",
}


class _Missing(Exception):
    """The file is known not to exist (as opposed to: it could not be read)."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _is_local(model: str) -> bool:
    return os.path.isdir(model) or os.path.exists(model) or model.startswith((".", "/", "~"))


def _model_file(model: str, filename: str, hub: dict[str, Any]) -> str:
    """Local path of ``filename`` of ``model`` (a folder or a hub id; hub files via the cache or a download).

    Raises:
        _Missing: the file does not exist (in the folder, or in the hub repository).
        OSError / ValueError / ...: it could not be read (no network, invalid id, ...).
    """
    if os.path.isdir(model):
        path = os.path.join(model, filename)
        if not os.path.isfile(path):
            raise _Missing(path)
        return path
    if _is_local(model):
        raise OSError(f"{model} is not a model folder")

    options = {target: hub[source] for source, target in _HUB_KWARGS.items() if hub.get(source) is not None}
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


def _read_json(model: str, filename: str, hub: dict[str, Any]) -> Any:
    """The parsed JSON file, or ``None`` if it does not exist; raises ``_Unreadable`` when it cannot be read."""
    try:
        path = _model_file(model, filename, hub)
    except _Missing:
        return None
    except Exception as exc:  # any failure to reach it
        raise _Unreadable(f"{filename} could not be read ({_first_line(exc)})") from exc
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise _Unreadable(f"{filename} could not be read ({_first_line(exc)})") from exc


class _Unreadable(Exception):
    """A file that may name code could not be read: the model cannot be checked."""


def _config_files(model: str, folder: str) -> list[str]:
    """The JSON files of ``folder`` in ``model`` to check: every ``*.json`` of a local folder, the known names on the
    hub."""
    if os.path.isdir(model):
        directory = os.path.join(model, folder)
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
        except OSError:
            return []
        return [f"{folder}/{n}" if folder else n for n in names]
    return [f"{folder}/{n}" if folder else n for n in _HUB_CONFIG_FILES]


def _foreign_types(types: list[Any]) -> list[str]:
    return [str(t) for t in types if not (isinstance(t, str) and t.startswith(TRUSTED_MODULE_PREFIXES))]


def _unsafe_path(folder: Any) -> bool:
    """A module path that leaves its model folder (absolute, ``..``, a drive, not a string)."""
    if not isinstance(folder, str):
        return True
    parts = folder.replace("\\", "/").split("/")
    return os.path.isabs(folder) or folder.startswith("~") or ".." in parts or ":" in folder or "\x00" in folder


def _outside(model: str, folder: str) -> bool:
    """Whether the local module folder ``folder`` of ``model`` resolves (through links) outside ``model``."""
    if not os.path.isdir(model):
        return False
    root = os.path.realpath(model)
    target = os.path.realpath(os.path.join(model, folder))
    return target != root and not target.startswith(root + os.sep)


def _module_class(type_name: str) -> type | None:
    """The installed class a trusted ``modules.json`` type names (``None`` when it cannot be imported: loading then
    says so in one line)."""
    try:
        module_class = import_from_string(type_name)
    except Exception:  # noqa: BLE001 - an unknown name of a trusted package: the load reports it
        return None
    return module_class if isinstance(module_class, type) else None


def _is_transformer(module_class: type | None) -> bool:
    return module_class is not None and issubclass(module_class, Transformer)


def _check_files(model: str, folder: str, hub: dict[str, Any]) -> str | None:
    """The rules every JSON file of a folder meets (:func:`st_prompts.trust.hf_files_reason`)."""
    for name in _config_files(model, folder):
        reason = trust.hf_files_reason(name, _read_json(model, name, hub), trust.known_model_type)
        if reason:
            return reason
    return None


def _check_transformer_folder(model: str, folder: str, hub: dict[str, Any], seen: set[str],
                              prompted: bool, depth: int) -> str | None:
    """The folder of a ``Transformer`` module (or a plain transformers model): its module configuration against the
    allow-list, its transformers files, its weights (no pickle), a PEFT adapter's base model, and the backbone a
    prompts-only checkpoint refers to."""
    prefix = f"{folder}/" if folder else ""
    configs = {}
    for filename in _TRANSFORMER_CONFIGS if os.path.isdir(model) else _TRANSFORMER_CONFIGS[:1]:
        config = _read_json(model, prefix + filename, hub)
        if config is not None:
            configs[filename] = config
            reason = trust.transformer_config_reason(prefix + filename, config, prompted=prompted)
            if reason:
                return reason
    config = next(iter(configs.values()), {})
    if isinstance(config, dict) and config.get("prompts_only") and depth < 2:
        reason = _check_backbone(config.get("backbone_name_or_path"), hub, seen)
        return f"{prefix}{_TRANSFORMER_CONFIGS[0]}: the backbone it refers to: {reason}" if reason else None
    reason = _check_files(model, folder, hub)
    if reason:
        return reason
    if os.path.isdir(model):
        reason = trust.pickle_reason(os.path.join(model, folder), label=os.path.join(model, folder).rstrip("/"))
        if reason:
            return reason
    adapter = _read_json(model, prefix + "adapter_config.json", hub)
    if isinstance(adapter, dict) and adapter.get("base_model_name_or_path") and depth < 2:
        reason = _check_backbone(adapter["base_model_name_or_path"], hub, seen, depth + 1)
        if reason:
            return f"{prefix}adapter_config.json: its base model: {reason}"
    return None


def _check_module(model: str, entry: dict[str, Any], hub: dict[str, Any], seen: set[str], depth: int) -> str | None:
    """One module of ``modules.json``: where it is, what its configuration holds, what it loads."""
    folder = entry.get("path", "")
    if _unsafe_path(folder) or _outside(model, folder):
        return f"modules.json has a module path outside the model: {folder!r}"
    module_class = _module_class(entry["type"])
    if _is_transformer(module_class):
        return _check_transformer_folder(model, folder, hub, seen, issubclass(module_class, PromptedTransformer),
                                         depth)
    reason = _check_files(model, folder, hub)
    if reason:
        return reason
    prefix = f"{folder}/" if folder else ""
    if module_class is not None and issubclass(module_class, Router):
        config = _read_json(model, prefix + "router_config.json", hub)
        if isinstance(config, dict):
            types = config.get("types") or {}
            foreign = _foreign_types(list(types.values()) if isinstance(types, dict) else [types])
            if foreign:
                return (f"{prefix}router_config.json names classes outside sentence_transformers and st_prompts: "
                        f"{', '.join(foreign)}")
            if isinstance(types, dict):
                for sub, type_name in types.items():
                    reason = _check_module(model, {"path": f"{prefix}{sub}", "type": type_name}, hub, seen, depth)
                    if reason:
                        return reason
    elif module_class is not None:
        config = _read_json(model, prefix + getattr(module_class, "config_file_name", "config.json"), hub)
        if config is not None:
            reason = trust.module_config_reason(prefix + getattr(module_class, "config_file_name", "config.json"),
                                                module_class, config)
            if reason:
                return reason
    if os.path.isdir(model):
        return trust.pickle_reason(os.path.join(model, folder), label=os.path.join(model, folder).rstrip("/"))
    return None


def _check_backbone(reference: Any, hub: dict[str, Any], seen: set[str], depth: int = 1) -> str | None:
    """Why the backbone a prompts-only checkpoint (or a PEFT adapter) refers to would run code that ships with it, or
    ask a loader for more than the allow-list; ``None`` if it would not."""
    if not isinstance(reference, str) or not reference or reference in seen:
        return None
    seen.add(reference)
    try:
        backbone = os.path.expanduser(resolve_model_name(reference))
        location, gguf_file, _ = resolve_gguf(backbone)
    except DataNotFoundError:
        return None  # the packaged alias without its package, a missing .gguf: loading says so
    if gguf_file:
        reason = trust.gguf_reason(os.path.join(location, gguf_file))
        if reason:
            return reason
        backbone = location
    if _is_local(backbone) and not os.path.isdir(backbone):
        return None  # a missing local backbone: loading says so
    hub = {k: v for k, v in hub.items() if k != "revision"}
    try:
        return _check_transformer_folder(backbone, "", hub, seen, prompted=True, depth=depth)
    except _Unreadable as exc:
        if _is_local(backbone):
            return f"{backbone}: its {exc}"
        return None  # an unreachable hub backbone cannot be loaded either: loading says so


def backbone_reason(name_or_path: str, **hub: Any) -> str | None:
    """Why loading ``name_or_path`` as a *backbone* (a transformers model folder, hub id, alias or ``.gguf`` file:
    what ``--backbone`` and prompts-only checkpoints name) would run code that ships with it, unpickle a weight file,
    or ask a loader for more than the allow-list; ``None`` if it would not. Reads JSON files and lists folders only."""
    return _check_backbone(str(name_or_path), hub, set(), depth=0)


def require_safe_backbone(name_or_path: str, trust_remote_code: bool | None = False, what: str = "backbone") -> None:
    """Refuse, in one line, a backbone (or generator, LLM, ...) that :func:`backbone_reason` finds unsafe, unless the
    user trusts it (``trust_remote_code=True``).

    Raises:
        UntrustedCodeError: naming what and where, and ``--trust-remote-code``.
    """
    if trust_remote_code is True:
        return
    reason = backbone_reason(name_or_path)
    if reason is not None:
        raise UntrustedCodeError(
            f"refused to load the {what} {str(name_or_path)!r}: {reason}. Nothing of it was run; pass "
            "--trust-remote-code (trust_remote_code=True in Python) only if you trust that code."
        )


@contextmanager
def safe_loading(trust_remote_code: bool | None = False) -> Iterator[dict[str, Any]]:
    """Around a transformers ``from_pretrained`` of a checked, untrusted folder: ``torch.load`` refuses
    (:func:`st_prompts.trust.no_unpickling`); yields the keyword arguments to add (safetensors only). With
    ``trust_remote_code=True`` nothing changes."""
    if trust_remote_code is True:
        yield {}
        return
    with trust.no_unpickling():
        yield dict(trust.SAFE_MODEL_KWARGS)


def untrusted_reason(name_or_path: str, **hub: Any) -> str | None:
    """Why loading ``name_or_path`` would run code that ships with the model, or hand a loader an option outside the
    allow-list (:mod:`st_prompts.trust`), or unpickle a weight file; ``None`` if it would not.

    Reads, without loading anything: ``modules.json`` (every type must be a class of ``sentence_transformers.*`` or
    ``st_prompts.*``, every path inside the model), each module's configuration (a ``Transformer``'s loader options
    against the allow-list; the other modules' keys against their constructor; a ``Dense`` activation under
    ``torch.nn``; a ``Router``'s types like ``modules.json``), every JSON file of every folder involved (no
    ``auto_map`` or ``custom_pipelines`` at any depth, no foreign class name, no file outside the folder, no
    quantizer, a known ``model_type``), the weights (no pickle without safetensors), a PEFT adapter's base model, and
    the same of the backbone a prompts-only checkpoint refers to (``model_kwargs={"backbone_name_or_path": ...}``
    included). A file that cannot be read counts as a reason. ``**hub``: ``cache_folder``, ``revision``, ``token``,
    ``local_files_only`` (and ``model_kwargs``), as for ``SentenceTransformer``.
    """
    model = os.path.expanduser(resolve_model_name(name_or_path))
    seen: set[str] = set()
    try:
        modules = _read_json(model, "modules.json", hub)
        if modules is None:  # a plain transformers model: sentence-transformers adds mean pooling
            return _check_transformer_folder(model, "", hub, seen, prompted=False, depth=0)
        if not isinstance(modules, list) or not all(
            isinstance(m, dict) and isinstance(m.get("type"), str) and isinstance(m.get("path", ""), str)
            for m in modules
        ):
            return "its modules.json is not a list of modules with a 'type'"
        foreign = _foreign_types([m["type"] for m in modules])
        if foreign:
            return f"its modules.json names classes outside sentence_transformers and st_prompts: {', '.join(foreign)}"
        for entry in modules:
            extra = sorted(set(entry) - {"idx", "name", "path", "type", "kwargs"})
            if extra:
                return f"its modules.json has keys that are not module settings: {', '.join(map(repr, extra))}"
        if not any(m.get("path", "") == "" for m in modules):
            reason = _check_files(model, "", hub)
            if reason:
                return reason
        for entry in modules:
            reason = _check_module(model, entry, hub, seen, depth=0)
            if reason:
                return reason
        override = (hub.get("model_kwargs") or {}).get("backbone_name_or_path")
        if override:
            reason = _check_backbone(override, hub, seen)
            if reason:
                return f"the backbone given in model_kwargs: {reason}"
    except _Unreadable as exc:
        return f"its {exc}, so the code it would load is unknown"
    return None


def should_trust_remote_code(name_or_path: str, **hub: Any) -> bool:
    """Whether ``name_or_path`` loads without running any code that ships with it (:func:`untrusted_reason` is
    ``None``): what :func:`load_sentence_model` needs to load it without ``trust_remote_code=True``."""
    return untrusted_reason(name_or_path, **hub) is None


def load_sentence_model(
    name_or_path: str,
    trust_remote_code: bool | None = False,
    *,
    device: str | None = None,
    **kwargs: Any,
) -> SentenceTransformer:
    """Load ``name_or_path`` (``minilm`` = the packaged all-MiniLM-L6-v2) as a ``SentenceTransformer``, running no
    code that ships with it unless ``trust_remote_code=True`` (see the module docstring).

    Args:
        name_or_path: a local folder, a hub id or an alias of :data:`st_prompts.utils.PACKAGED_MINILM_ALIASES`.
        trust_remote_code: ``True``: the user trusts the model's code; it is passed to sentence-transformers as is.
            ``False``/``None`` (default): only sentence-transformers' and st_prompts' own classes are loaded; a model
            that names any other code is refused before anything of it is loaded.
        device: device to put the model on (default: sentence-transformers' choice).
        **kwargs: further ``SentenceTransformer`` arguments (``cache_folder``, ``revision``, ``model_kwargs``, ...).

    Raises:
        DataNotFoundError: the model cannot be found or read.
        DataFormatError: one of its weight files is damaged.
        UntrustedCodeError: it names code that ships with it, and ``trust_remote_code`` is not ``True``.
    """
    model = os.path.expanduser(resolve_model_name(name_or_path))
    if _is_local(model) and not os.path.isdir(model):
        hint = interrupted_save_hint(model) if not os.path.exists(model) else ""
        raise DataNotFoundError(f"could not load model {name_or_path!r}: no such folder{hint}")
    if "local_files_only" not in kwargs and cached_and_unreachable(model):
        kwargs["local_files_only"] = True  # cached, and the hub cannot be reached: no request would succeed
    if trust_remote_code is True:
        try:
            return SentenceTransformer(model, trust_remote_code=True, device=device, **kwargs)
        except StPromptsError:
            raise
        except Exception as exc:  # noqa: BLE001 - one line, whatever the trusted code raised
            raise _load_error(name_or_path, exc) from exc
    try:
        reason = untrusted_reason(model, **kwargs)
    except OSError as exc:
        raise DataNotFoundError(f"could not load model {name_or_path!r}: {_first_line(exc)}") from exc
    if reason is not None:
        raise UntrustedCodeError(
            f"refused to load model {name_or_path!r}: {reason}. Nothing of it was run; pass --trust-remote-code "
            "(trust_remote_code=True in Python) only if you trust that code."
        )
    # Safetensors only: transformers never falls back to a pickle (the caller's own model_kwargs win).
    kwargs["model_kwargs"] = {**trust.SAFE_MODEL_KWARGS, **(kwargs.get("model_kwargs") or {})}
    try:
        with trust.no_unpickling():
            modules = _read_json(model, "modules.json", kwargs) or []
            if any(m["type"].startswith("st_prompts.") for m in modules):
                return _assemble(model, modules, device, kwargs)
            return SentenceTransformer(model, trust_remote_code=False, device=device, **kwargs)
    except StPromptsError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a loader raises reaches the user as one line
        raise _load_error(name_or_path, exc) from exc


def _load_error(name_or_path: str, exc: BaseException) -> StPromptsError:
    """The one-line error for an exception a loader raised on a model that passed the checks."""
    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt in chain or len(chain) > 10:
            break
        chain.append(nxt)
    refused = next((e for e in chain if isinstance(e, StPromptsError)), None)
    if refused is not None:
        return refused
    logger.debug("loading %s failed", name_or_path, exc_info=exc)
    where = f"could not load model {name_or_path!r}"
    if isinstance(exc, _Unreadable):
        return DataNotFoundError(f"{where}: its {exc}")
    if isinstance(exc, OSError):
        return DataNotFoundError(f"{where}: {_first_line(exc)}")
    if isinstance(exc, ImportError):
        # trusted code naming a module that is not installed: a message, not a traceback from importlib
        return DataNotFoundError(f"{where}: it names code that cannot be imported ({_first_line(exc)}); install the "
                                 "package that provides it.")
    if _is_pickle_refusal(chain):
        return DataFormatError(f"{where}: torch refused to unpickle one of its weight files ({_first_line(exc)}); "
                               "a pickled weight file can run code: convert it to safetensors.")
    if _is_damaged_weights(exc):
        return DataFormatError(f"{where}: a safetensors weight file is damaged ({_first_line(exc)}); save or "
                               "download it again.")
    return DataFormatError(f"{where}: {type(exc).__name__}: {_first_line(exc)}")


def _is_pickle_refusal(chain: list[BaseException]) -> bool:
    """Whether torch's ``weights_only`` unpickler refused a pickle somewhere in ``chain``."""
    return any(type(e).__name__ == "UnpicklingError" or "weights only load failed" in str(e).lower() for e in chain)


def _is_damaged_weights(exc: BaseException) -> bool:
    """Whether ``exc`` is safetensors' complaint about an unreadable weight file."""
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    return bool(names & {"SafetensorError", "HeaderTooLarge", "HeaderTooSmall", "InvalidHeaderDeserialization"}) \
        or "deserializ" in str(exc).lower()


def _assemble(model: str, modules_config: list[dict[str, Any]], device: str | None,
              kwargs: dict[str, Any]) -> SentenceTransformer:
    """A ``SentenceTransformer`` built from the modules of a saved model, each loaded by its own class with
    ``trust_remote_code=False``: how a model with st_prompts modules loads without sentence-transformers' global
    ``trust_remote_code`` (:func:`untrusted_reason` has already checked every type it names).

    Written here because sentence-transformers 6 offers no public way to resolve a type outside its own namespace
    without granting that flag to everything the model names.
    """
    unknown = sorted(set(kwargs) - set(_ASSEMBLY_KWARGS))
    if unknown:
        raise StPromptsError(f"load_sentence_model() cannot pass {', '.join(unknown)} to a model with st_prompts "
                             "modules; give them to the model after loading")
    hub = {key: kwargs[key] for key in ("token", "cache_folder", "revision", "local_files_only") if key in kwargs}
    ours = {m["type"]: import_from_string(m["type"]) for m in modules_config if m["type"].startswith("st_prompts.")}
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
    saved = _read_json(model, "config_sentence_transformers.json", hub) or {}
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
    """How ``model`` pools token embeddings into a sentence embedding, for table headers and legends.

    ``"[CLS]"``, ``"mean"``, ``"max"``, ... for sentence-transformers' ``Pooling`` (several modes joined by ``+``),
    ``"[MASK]"`` for :class:`~st_prompts.modules.MaskTokenPooling`, ``"mean"`` for a ``StaticEmbedding`` (a mean of
    word vectors), ``"unknown"`` otherwise. Anything but a ``SentenceTransformer`` gives ``"unknown"``.
    """
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
