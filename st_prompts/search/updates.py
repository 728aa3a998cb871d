"""Updating a :class:`~st_prompts.search.SemanticIndex` in place: :meth:`add` and :meth:`remove` (no retraining;
ids are never reused), with the drift warning of IVF lists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError, shorten
from st_prompts.numbers import whole
from st_prompts.search._warnings import warn_at_caller
from st_prompts.search.corpus import prepare_corpus
from st_prompts.search.encoding import encode_texts, l2_normalize, warn_over_length
from st_prompts.search.faiss_index import (DRIFT_WARN_RATIO, add_vectors, apply_search_params, ivf_sq_distances,
                                           remove_rows)


class IndexUpdates:
    """The updates of :class:`~st_prompts.search.SemanticIndex` (a mixin)."""

    def add(self, documents: Sequence[str], ids: Sequence[int | str] | None = None, *, embeddings: Any = None,
            batch_size: int = 64, show_progress_bar: bool = False) -> list[int | str]:
        """Add documents without rebuilding (nothing is written until :meth:`save`); return their ids.

        The documents are encoded with the index's model unless ``embeddings`` gives their vectors. Ids: the given
        ones, else the integers after :meth:`next_id`. An IVF / IVF-PQ index keeps its trained lists, with a warning
        when the new documents lie much farther from the centroids than the training ones
        (:data:`~st_prompts.search.faiss_index.DRIFT_WARN_RATIO`).

        Raises:
            ConfigurationError: a read-only (memory-mapped) index, non-integer existing ids without ``ids``.
            DataFormatError: blank or non-string documents, duplicate or existing ids, wrong embedding count.
        """
        self._check_writable("add to")
        documents = list(documents)
        if not documents:
            return []
        if isinstance(documents, str) or not all(isinstance(d, str) and d.strip() for d in documents):
            raise DataFormatError("add() needs a list of non-blank strings")
        if ids is None:
            if not all(isinstance(i, int) for i in self.ids):
                raise ConfigurationError("this index has non-integer ids: pass the new documents' ids")
            first = self.next_id()
            ids = list(range(first, first + len(documents)))
        new_ids, documents = prepare_corpus(documents, ids, source="added documents", id_kind="position")
        positions = self._position_map()
        clashes = [i for i in new_ids if i in positions]
        if clashes:
            shown = ", ".join(shorten(i, 60) for i in clashes[:5]) + (", ..." if len(clashes) > 5 else "")
            raise DataFormatError(f"{len(clashes)} id(s) of the added documents are already in the index: {shown}")
        if embeddings is None:
            if self.model is None:
                self.use_recorded_model()
            task = self.model_identity.task if self.model_identity is not None else None
            warn_over_length(self.model, documents)
            vectors = encode_texts(self.model, documents, kind="document", batch_size=batch_size,
                                   progress=show_progress_bar, task=task)  # fmt: skip
        else:
            vectors = l2_normalize(embeddings)
            if vectors.shape[0] != len(documents):
                raise DataFormatError(f"got {vectors.shape[0]} embeddings for {len(documents)} documents")
        if vectors.shape[1] != self.dimension:
            raise BackboneMismatchError(f"embeddings have {vectors.shape[1]} dimensions, the index has "
                                        f"{self.dimension}")
        if self.index_type in ("ivf", "ivfpq"):
            self._check_drift(vectors)
        add_vectors(self.index, vectors, self.index_type, progress=show_progress_bar)
        if self.vectors is not None:
            self.vectors = np.concatenate([np.asarray(self.vectors), vectors.astype(self.vectors.dtype)])
        positions.update((doc_id, row) for row, doc_id in enumerate(new_ids, start=len(self.ids)))
        self.ids.extend(new_ids)
        self.texts.extend(documents)
        self._remember_next_id()
        self.info["updated"] = True
        return new_ids

    def remove(self, ids: Sequence[int | str]) -> int:
        """Remove the documents with these ids (others keep their ids and order; an HNSW graph is rebuilt); return
        how many were removed. Nothing is written until :meth:`save`.

        Raises:
            ConfigurationError: a read-only (memory-mapped) index.
            DataFormatError: an unknown id, or removing every document (an index cannot be empty).
        """
        self._check_writable("remove from")
        if isinstance(ids, (str, int)):
            ids = [ids]
        wanted = list(dict.fromkeys(ids))
        positions = self._position_map()
        unknown = [i for i in wanted if i not in positions]
        if unknown:
            shown = ", ".join(shorten(i, 60) for i in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise DataFormatError(f"{len(unknown)} id(s) are not in the index: {shown}")
        if not wanted:
            return 0
        if len(wanted) >= len(self):
            raise DataFormatError("removing every document would leave the index empty; build a new index instead")
        self._remember_next_id()  # before the largest id may go: ids are never handed out twice
        rows = np.array(sorted(positions[i] for i in wanted), dtype=np.int64)
        self.index = remove_rows(self.index, rows, self.index_type, self.exact_vectors, self.index_params)
        apply_search_params(self.index, self.index_type, self.index_params)
        keep = np.ones(len(self.ids), dtype=bool)
        keep[rows] = False
        if self.vectors is not None:
            self.vectors = np.asarray(self.vectors)[keep]
        self.ids = [doc_id for doc_id, kept in zip(self.ids, keep) if kept]
        self.texts = [text for text, kept in zip(self.texts, keep) if kept]
        self._positions = None
        self.info["updated"] = True
        return len(rows)

    def next_id(self) -> int:
        """The integer id :meth:`add` gives the next document: above every id this index has ever held."""
        largest = max((i for i in self.ids if whole(i)), default=-1)
        return max(int(self.info.get("next_id", 0)), largest + 1)

    def _remember_next_id(self) -> None:
        if all(isinstance(i, int) for i in self.ids):
            self.info["next_id"] = self.next_id()

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ConfigurationError(f"cannot {what} an index loaded with mmap=True (read-only); load it without mmap "
                                     "to update it")

    def _position_map(self) -> dict[int | str, int]:
        if self._positions is None:
            self._positions = {doc_id: row for row, doc_id in enumerate(self.ids)}
        return self._positions

    def _check_drift(self, vectors: np.ndarray) -> None:
        reference = (self.info.get("ivf_training") or {}).get("mean_sq_distance")
        if not reference:
            return
        added = float(np.mean(ivf_sq_distances(self.index, vectors)))
        ratio = added / reference
        self.info["drift"] = {"last_add_mean_sq_distance": round(added, 5), "ratio_to_training": round(ratio, 3)}
        if ratio > DRIFT_WARN_RATIO:
            warn_at_caller(f"the added documents lie far from the IVF centroids: mean squared distance {added:.3f}, "
                           f"{ratio:.1f}x that of the documents the lists were trained on ({reference:.3f}); they "
                           "come from another distribution, so recall may drop: recalibrate (calibrate()) or rebuild "
                           "the index")

