"""Whether a model named by a Hugging Face hub id can be loaded here, decided in seconds (offline, huggingface_hub
retries an uncached model's files for minutes): a cached model passes without network access; otherwise one short
request says whether the hub can be reached. huggingface_hub is imported only when a name looks like a hub id."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from st_prompts.aliases import PACKAGED_GGUF_ALIASES, PACKAGED_MINILM_ALIASES
from st_prompts.errors import DataNotFoundError, first_line

__all__ = ["PROBE_TIMEOUT", "cached_and_unreachable", "check_hub_model", "is_cached", "is_hub_id"]

#: Seconds the one request that tells whether the hub can be reached may take.
PROBE_TIMEOUT = 5.0
#: How long a failed probe is remembered (a reachable hub is remembered for the process).
_FAILURE_MEMORY_SECONDS = 30.0
_probes: dict[str, tuple[float, str | None]] = {}
_lock = threading.Lock()


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is a hub repository id, not a local path or file, nor an alias of a packaged model."""
    name = str(name)
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        return False
    if name in PACKAGED_MINILM_ALIASES or name in PACKAGED_GGUF_ALIASES:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def is_cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache (and ``SENTENCE_TRANSFORMERS_HOME``) holds a non-empty snapshot of
    ``repo_id``."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    for cache in filter(None, (constants.HF_HUB_CACHE, os.environ.get("SENTENCE_TRANSFORMERS_HOME"))):
        snapshots = Path(cache) / folder / "snapshots"
        try:
            if any(any(snapshot.iterdir()) for snapshot in snapshots.iterdir() if snapshot.is_dir()):
                return True
        except OSError:
            continue
    return False


def _unreachable_reason(repo_id: str) -> str | None:
    """Why the hub cannot be reached (one request, no retries), or ``None``; any HTTP answer means that it can."""
    from huggingface_hub import constants, get_session

    endpoint = constants.ENDPOINT
    with _lock:
        seen = _probes.get(endpoint)
        if seen is not None and (seen[1] is None or time.monotonic() - seen[0] < _FAILURE_MEMORY_SECONDS):
            return seen[1]
    try:
        get_session().head(f"{endpoint}/api/models/{repo_id}", timeout=PROBE_TIMEOUT, follow_redirects=False)
        reason = None
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS, timeout, proxy, TLS: not reachable
        reason = first_line(exc)
    with _lock:
        _probes[endpoint] = (time.monotonic(), reason)
    return reason


def check_hub_model(name: str, what: str = "model", needed_by: str | None = None) -> None:
    """Make sure the model ``name``, when it is a hub id, is cached or the hub answers; else raise
    :class:`DataNotFoundError` in one line. ``what`` (``"backbone"``) and ``needed_by`` word the message."""
    if not is_hub_id(name) or is_cached(name):
        return
    from huggingface_hub import constants

    subject = f"{needed_by} needs the {what} {name!r}, which is" if needed_by else f"the {what} {name!r} is"
    where = f"{subject} neither a local folder nor in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    fix = (f"download it where there is network ('hf download {name}' with the same HF_HOME / HF_HUB_CACHE) or give "
           "the path of a local copy")
    if constants.HF_HUB_OFFLINE:
        raise DataNotFoundError(f"{where}, and HF_HUB_OFFLINE is set: {fix}")
    reason = _unreachable_reason(name)
    if reason is not None:
        raise DataNotFoundError(f"{where}, and the hub at {constants.ENDPOINT} cannot be reached ({reason}): "
                                f"connect to the network, or {fix}")


def cached_and_unreachable(name: str) -> bool:
    """Whether ``name`` is a cached hub id while the hub cannot be reached (or ``HF_HUB_OFFLINE`` is set): then it must
    load with ``local_files_only=True``, or every file request would retry for minutes."""
    if not is_hub_id(name) or not is_cached(name):
        return False
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or _unreachable_reason(name) is not None
