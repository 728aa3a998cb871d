"""The method registry: one file per method in this package, each defining ``METHOD = Method(...)``.

Entry points::

    import st_prompts.methods as methods

    methods.names()                                   # ['dcpcse', 'scpcse', 'simcse', ...]
    settings = methods.settings("dcpcse", supervised=False, scale="cpu", learning_rate=1e-2)
    model = methods.build("dcpcse", backbone="bert-base-uncased")   # an untrained SentenceTransformer
    # train it with SentenceTransformerTrainer / model.fit, or with st_prompts.training.train(settings, dataset)

Methods are discovered from the module names of this package (files starting with ``_`` and ``base`` are not
methods), so adding a method is adding a file; nothing here needs editing. Listing the names imports nothing.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import MLP_HEAD_MODES, SCALES, Method, Stage, TrainSettings, option

__all__ = ["MLP_HEAD_MODES", "SCALES", "Method", "Stage", "TrainSettings", "build", "get", "names", "option",
           "settings"]

_NOT_METHODS = {"base"}


def names() -> list[str]:
    """The registered method names, sorted (read from the file names; imports nothing)."""
    found = [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])]
    return sorted(n for n in found if not n.startswith("_") and n not in _NOT_METHODS)


def get(name: str) -> Method:
    """The :class:`Method` registered as ``name``."""
    if name not in names():
        raise ConfigurationError(f"Unknown method {name!r}; choose one of {', '.join(names())}.")
    module = importlib.import_module(f"{__name__}.{name}")
    method = getattr(module, "METHOD", None)
    if not isinstance(method, Method) or method.name != name:
        raise ConfigurationError(f"st_prompts.methods.{name} does not define METHOD = Method(name={name!r}, ...).")
    return method


def settings(name: str, supervised: bool = False, scale: str = "paper", backbone: str | None = None,
             **overrides: Any) -> TrainSettings:
    """The :class:`TrainSettings` of method ``name`` at a scale (``paper`` or ``cpu``), with ``overrides``."""
    return get(name).settings(supervised=supervised, scale=scale, backbone=backbone, **overrides)


def build(name: str, backbone: str | None = None, supervised: bool = False, scale: str = "paper", **overrides: Any):
    """Build the (untrained) SentenceTransformer of a method, e.g. ``build("dcpcse", backbone="roberta-base")``.

    The options are those of :func:`settings`; the result trains with ``SentenceTransformerTrainer``, ``model.fit``
    or :func:`st_prompts.training.train`, and saves/loads like any SentenceTransformer.
    """
    run_settings = settings(name, supervised=supervised, scale=scale, backbone=backbone, **overrides)
    return get(name).build_model(run_settings)
