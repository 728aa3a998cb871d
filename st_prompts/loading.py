"""Load a sentence-transformers model for a command, deciding whether to trust its code; describe its pooling.

Every ``st-prompts`` command that loads a model goes through :func:`load_sentence_model`. With
``trust_remote_code=True``, sentence-transformers imports whatever class a model's ``modules.json`` names, and
transformers runs the modelling code a ``config.json`` points to with ``auto_map``: loading then executes code that
came with the model. st_prompts' own modules (``st_prompts.modules.PromptedTransformer``, ``MaskTokenPooling``) sit
outside ``sentence_transformers.*``, so sentence-transformers 6 needs ``trust_remote_code=True`` for them too. The
rule, when the caller does not decide (``trust_remote_code=None``, the default; :func:`should_trust_remote_code`):

* the ``minilm`` alias is resolved first (:func:`st_prompts.utils.resolve_model_name`);
* the model's ``modules.json`` is read: from the folder for a local path, through ``huggingface_hub.hf_hub_download``
  (the cached copy when there is one) for a hub id;
* trust is given only when that file can be read, every module ``type`` in it names a class in
  ``sentence_transformers.*`` or ``st_prompts.*``, and no module's ``config.json`` has an ``auto_map`` (custom
  transformers code);
* otherwise the model is loaded without trust, so that sentence-transformers (or transformers) refuses to import the
  foreign code; the refusal reaches the user as :class:`~st_prompts.errors.UntrustedCodeError`, which says why and
  how to override.

An explicit ``trust_remote_code=True`` (the commands' ``--trust-remote-code``) or ``False`` is passed on as is.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from st_prompts.errors import DataNotFoundError, StPromptsError, UntrustedCodeError
from st_prompts.utils import resolve_model_name

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

__all__ = ["TRUSTED_MODULE_PREFIXES", "load_sentence_model", "pooling_label", "should_trust_remote_code"]

#: Module classes from these packages are trusted without asking: they are installed code, not code from the model.
TRUSTED_MODULE_PREFIXES = ("sentence_transformers.", "st_prompts.")
#: Keyword arguments of ``SentenceTransformer`` that say where to read a hub model's files from.
_HUB_KWARGS = {
    "cache_folder": "cache_dir",
    "revision": "revision",
    "token": "token",
    "local_files_only": "local_files_only",
}
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
    if os.path.exists(model) or model.startswith((".", "/", "~")):
        raise OSError(f"{model} is not a model folder")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    options = {target: hub[source] for source, target in _HUB_KWARGS.items() if hub.get(source) is not None}
    try:
        return hf_hub_download(model, filename, **options)
    except LocalEntryNotFoundError:
        raise  # not in the cache and no network: unknown, not missing
    except EntryNotFoundError as exc:
        raise _Missing(f"{model}/{filename}") from exc


def _untrusted_reason(model: str, hub: dict[str, Any]) -> str | None:
    """Why ``model`` should not be loaded with ``trust_remote_code=True`` (``None``: it may be)."""
    try:
        with open(_model_file(model, "modules.json", hub), encoding="utf-8") as handle:
            modules = json.load(handle)
    except _Missing:
        return "it has no modules.json, so the classes it would load are unknown"
    except Exception as exc:  # any failure to read it: do not trust
        return f"its modules.json could not be read ({_first_line(exc)})"
    if not isinstance(modules, list) or not all(
        isinstance(m, dict) and isinstance(m.get("type"), str) and isinstance(m.get("path", ""), str) for m in modules
    ):
        return "its modules.json is not a list of modules with a 'type'"
    foreign = [m["type"] for m in modules if not m["type"].startswith(TRUSTED_MODULE_PREFIXES)]
    if foreign:
        return f"its modules.json names classes outside sentence_transformers and st_prompts: {', '.join(foreign)}"
    for module in modules:
        folder = module.get("path", "")
        if os.path.isabs(folder) or ".." in folder.replace("\\", "/").split("/"):
            return f"its modules.json has a module path outside the model: {folder!r}"
        try:
            config_path = _model_file(model, f"{folder}/config.json" if folder else "config.json", hub)
            with open(config_path, encoding="utf-8") as handle:
                config = json.load(handle)
        except _Missing:
            continue
        except Exception as exc:
            return f"{folder or '.'}/config.json could not be read ({_first_line(exc)})"
        if isinstance(config, dict) and config.get("auto_map"):
            return f"{folder or '.'}/config.json points to custom modelling code (auto_map)"
    return None


def should_trust_remote_code(name_or_path: str, **hub: Any) -> bool:
    """Whether :func:`load_sentence_model` would pass ``trust_remote_code=True`` for ``name_or_path`` by itself.

    True only when the model's ``modules.json`` can be read and names only ``sentence_transformers.*`` and
    ``st_prompts.*`` classes, and no module's ``config.json`` has an ``auto_map`` (see the module docstring).
    ``**hub``: ``cache_folder``, ``revision``, ``token``, ``local_files_only``, as for ``SentenceTransformer``.
    """
    model = os.path.expanduser(resolve_model_name(name_or_path))
    return _untrusted_reason(model, hub) is None


def load_sentence_model(
    name_or_path: str,
    trust_remote_code: bool | None = None,
    *,
    device: str | None = None,
    **kwargs: Any,
) -> SentenceTransformer:
    """Load ``name_or_path`` (``minilm`` = the packaged all-MiniLM-L6-v2) as a ``SentenceTransformer``.

    Args:
        name_or_path: a local folder, a hub id or an alias of :data:`st_prompts.utils.PACKAGED_MINILM_ALIASES`.
        trust_remote_code: ``None`` (default): decided by :func:`should_trust_remote_code`; ``True``/``False``:
            passed on as given (the user's explicit choice).
        device: device to put the model on (default: sentence-transformers' choice).
        **kwargs: further ``SentenceTransformer`` arguments (``cache_folder``, ``revision``, ``model_kwargs``, ...).

    Raises:
        DataNotFoundError: the model cannot be found or read.
        UntrustedCodeError: the model needs code outside sentence_transformers/st_prompts, it was not trusted, and
            sentence-transformers (or transformers) refused to import that code.
    """
    from sentence_transformers import SentenceTransformer

    model = os.path.expanduser(resolve_model_name(name_or_path))
    reason = None
    if trust_remote_code is None:
        reason = _untrusted_reason(model, kwargs)
        trust_remote_code = reason is None
        if reason is not None:
            logger.debug("loading %s without trust_remote_code: %s", name_or_path, reason)
    try:
        return SentenceTransformer(model, trust_remote_code=bool(trust_remote_code), device=device, **kwargs)
    except OSError as exc:
        raise DataNotFoundError(f"could not load model {name_or_path!r}: {_first_line(exc)}") from exc
    except ImportError as exc:
        # trusted code naming a module that is not installed: a message, not a traceback from importlib
        raise DataNotFoundError(
            f"could not load model {name_or_path!r}: its modules.json names code that cannot be imported "
            f"({_first_line(exc)}); install the package that provides it."
        ) from exc
    except ValueError as exc:
        if isinstance(exc, StPromptsError) or trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        refusal = " ".join(str(exc).split())
        why = f"it was loaded without trust_remote_code because {reason}. " if reason else ""
        raise UntrustedCodeError(
            f"refused to load model {name_or_path!r}: {refusal} ({why}If you trust this code, pass "
            "--trust-remote-code, or trust_remote_code=True in Python.)"
        ) from exc


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
