"""The method registry: one folder ``st_prompts/methods/<name>/`` per method, found by its ``config.py``
(``CONFIG = MethodConfig(...)``, no torch) beside ``method.py`` (``METHOD = Method(CONFIG, ...)``); a method living
elsewhere joins with :func:`register`. :func:`config` and :func:`names` import only ``config.py`` files; :func:`get`
imports ``method.py``. Adding a method: CONTRIBUTING.md. ::

    settings = methods.settings("dcpcse", supervised=False, scale="cpu", learning_rate=1e-2)
    model = methods.build("dcpcse", backbone="bert-base-uncased")   # an untrained SentenceTransformer
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any

from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import (MLP_HEAD_MODES, SCALES, Method, MethodConfig, PrefixSettings, Stage, TrainSettings,
                                     option)

__all__ = ["MLP_HEAD_MODES", "SCALES", "Method", "MethodConfig", "PrefixSettings", "Stage", "TrainSettings", "build",
           "config", "get", "names", "option", "register", "settings"]

#: name -> package of the method (``<package>.config`` and ``<package>.method``).
_REGISTRY: dict[str, str] = {}


def register(name: str, package: str) -> None:
    """Register the method ``name`` whose ``config.py`` and ``method.py`` live in ``package``."""
    if name in _REGISTRY and _REGISTRY[name] != package:
        raise ConfigurationError(f"method {name!r} is already registered (by {_REGISTRY[name]})")
    _REGISTRY[name] = package


def _discover() -> None:
    """Register every folder of this package holding a ``config.py`` under its name (imports nothing)."""
    for folder in sorted(Path(__file__).parent.iterdir()):
        if (folder / "config.py").is_file() and (folder / "__init__.py").is_file():
            register(folder.name, f"{__name__}.{folder.name}")


_discover()


def names() -> list[str]:
    """The registered method names, sorted (imports nothing)."""
    return sorted(_REGISTRY)


def _package(name: str) -> str:
    if name not in _REGISTRY:
        raise ConfigurationError(f"Unknown method {name!r}; choose one of {', '.join(names())}.")
    return _REGISTRY[name]


def config(name: str) -> MethodConfig:
    """The :class:`MethodConfig` of ``name`` (imports only the method's ``config.py``: no torch)."""
    found = getattr(import_module(f"{_package(name)}.config"), "CONFIG", None)
    if not isinstance(found, MethodConfig) or found.name != name:
        raise ConfigurationError(f"{_package(name)}.config does not define CONFIG = MethodConfig(name={name!r}, ...).")
    return found


def get(name: str) -> Method:
    """The :class:`Method` registered as ``name`` (imports its ``method.py``)."""
    found = getattr(import_module(f"{_package(name)}.method"), "METHOD", None)
    if not isinstance(found, Method) or found.name != name:
        raise ConfigurationError(f"{_package(name)}.method does not define METHOD = Method(CONFIG, ...) for {name!r}.")
    return found


def settings(name: str, supervised: bool = False, scale: str = "paper", backbone: str | None = None,
             **overrides: Any) -> TrainSettings:
    """The :class:`TrainSettings` of method ``name`` at a scale (``paper`` or ``cpu``), with ``overrides``."""
    return config(name).settings(supervised=supervised, scale=scale, backbone=backbone, **overrides)


def build(name: str, backbone: str | None = None, supervised: bool = False, scale: str = "paper", **overrides: Any):
    """Build the (untrained) SentenceTransformer of a method, e.g. ``build("dcpcse", backbone="roberta-base")``.

    The options are those of :func:`settings`; the result trains with ``SentenceTransformerTrainer``, ``model.fit``
    or :func:`st_prompts.training.train`, and saves/loads like any SentenceTransformer.
    """
    run_settings = settings(name, supervised=supervised, scale=scale, backbone=backbone, **overrides)
    return get(name).build_model(run_settings)
