"""The indexes a server searches: FAISS folders (memory-mapped) or vector-database collections, checked against the
served model at load (its probe sentences must encode as the index's model encoded them) and reloaded on demand. An
index built with ``--task NAME`` is queried with that prompt set, one built without with the query side.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from st_prompts.errors import StPromptsError, first_line, printable, shorten
from st_prompts.serving.limits import RequestError
from st_prompts.serving.model import DOCUMENT_ROLE, QUERY_ROLE, ServedModel

logger = logging.getLogger(__name__)

__all__ = ["IndexRegistry", "ServedIndex"]


class ServedIndex:
    """One loaded index (FAISS, or a vector-database collection) and the route its queries take."""

    def __init__(self, name: str, path: str, index: Any, route: Any, task: str | None) -> None:
        self.name = name
        self.path = path
        self.index = index
        self.route = route
        self.task = task
        self.loaded_at = time.time()
        self._lock = threading.Lock()  # a memory-mapped index reads its documents through one file handle

    def search(self, vectors: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
        """The ``k`` best documents of each query vector (``k`` clamped to the index's size), best first."""
        with self._lock:
            hits = self.index.search_embeddings(vectors, min(k, len(self.index)))
        return [[{"rank": rank, "id": hit.id, "score": hit.score, "text": hit.text}
                 for rank, hit in enumerate(row, start=1)] for row in hits]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "documents": len(self.index), "type": self.index.index_type,
                "task": self.task, "loaded_at": int(self.loaded_at)}


class IndexRegistry:
    """The named indexes of a server (see the module docstring)."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self._indexes: dict[str, ServedIndex] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._indexes)

    def get(self, name: str) -> ServedIndex:
        """The index ``name`` as it is now (a reload replaces the object, never changes it)."""
        entry = self._indexes.get(name)
        if entry is None:
            known = ", ".join(repr(n) for n in self._indexes) or "none"
            raise RequestError(404, f"No index {shorten(name)} (served: {known}).", param="index",
                               code="index_not_found")
        return entry

    def load(self, name: str, path: str) -> ServedIndex:
        """Load (or reload) the index ``name`` from ``path`` (a folder, or a collection address) and check it against
        the served model (:class:`StPromptsError` when it does not encode like the index's model)."""
        from st_prompts.search import SemanticIndex
        from st_prompts.search.vector_db import VectorCollection, is_address, parse_address

        if is_address(path):
            address = parse_address(path)
            index, where = VectorCollection.open(address), str(address)
        else:
            index, where = SemanticIndex.load(path, mmap=True), os.path.abspath(path)
        try:
            return self._check_and_register(name, path, where, index)
        except BaseException:
            if isinstance(index, VectorCollection):
                index.close()
            raise

    def _check_and_register(self, name: str, path: str, where: str, index: Any) -> ServedIndex:
        from st_prompts.search.encoding import l2_normalize
        from st_prompts.search.identity import PROBE_SENTENCES, ModelIdentity

        identity = index.model_identity
        if identity is None:
            raise RequestError(422, f"The index at {path} was built from bare embeddings and records no model: a server "
                               "cannot encode its queries.", code="index_without_model")
        task = identity.task
        if task is not None:
            if not self.served.has(task):
                raise RequestError(422, f"The index at {path} was encoded with the prompt set {task!r}, which this "
                                   "model does not serve.", code="task_not_served")
            route = probe_route = self.served.acquire(task)
        else:
            route = QUERY_ROLE
            self.served.pin(route)
            probe_route = DOCUMENT_ROLE  # the probe was encoded like the documents
        try:
            probe = l2_normalize(self.served.encode(list(PROBE_SENTENCES), [probe_route] * len(PROBE_SENTENCES)))
            mine = ModelIdentity(name=self.served.name, dimension=int(probe.shape[1]),
                                 fingerprint=ModelIdentity.fingerprint_of(probe), probe_embeddings=probe, task=task)
            identity.check_compatible(mine)
        except BaseException:
            self.served.release(route)
            raise
        entry = ServedIndex(name, where, index, route, task)
        with self._lock:
            old = self._indexes.get(name)
            self._indexes[name] = entry
        if old is not None:
            self.served.release(old.route)
        logger.info("index %r: %d documents (%s%s) from %s, queries %s", name, len(index), index.index_type,
                    "" if index.index_type.startswith("milvus:") else ", memory-mapped", printable(path),
                    f"with the prompt set {task!r}" if task else "on the query side")
        return entry

    def reload(self, name: str) -> ServedIndex:
        """Read the index ``name`` again from its folder; on failure (404, 422) the loaded one stays."""
        entry = self.get(name)
        try:
            return self.load(name, entry.path)
        except StPromptsError as exc:
            raise RequestError(422, f"Cannot reload the index {name!r}: {first_line(exc)} "
                               "(the loaded one is still served).", code="index_reload_failed") from exc
