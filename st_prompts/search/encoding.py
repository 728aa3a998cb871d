"""How texts become index vectors: the model's query/document encoding, then L2 normalisation (cosine scores).

:func:`encode_texts` encodes in one go; :func:`st_prompts.search.chunked.encode_in_chunks` encodes a large corpus chunk
by chunk (resumable, optionally multi-process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from st_prompts.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer


def l2_normalize(embeddings: Any) -> np.ndarray:
    """Return a C-contiguous float32 copy of ``embeddings`` with unit-norm rows (zero rows stay zero)."""
    if hasattr(embeddings, "detach"):  # torch tensor
        embeddings = embeddings.detach().float().cpu().numpy()
    array = np.array(embeddings, dtype=np.float32, copy=True, order="C")
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2:
        raise ConfigurationError(f"embeddings must be a 2-D array, got shape {array.shape}")
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    np.divide(array, norms, out=array, where=norms > 0)
    return array


def encode_texts(
    model: SentenceTransformer, texts: Sequence[str], *, kind: str, batch_size: int, progress: bool,
    task: str | None = None,
) -> np.ndarray:
    """Encode with ``encode_{kind}`` (``kind`` = ``"query"`` or ``"document"``: the model's prompt or prompt set for
    that side, when it has one; plain ``encode`` otherwise), or with ``encode(task=task)`` for one prompt set of a bank
    on both sides, and L2-normalise."""
    kwargs = {"batch_size": batch_size, "show_progress_bar": progress, "convert_to_numpy": True}
    if task is not None:
        return l2_normalize(model.encode(list(texts), task=task, **kwargs))
    method = getattr(model, f"encode_{kind}", None) or model.encode
    return l2_normalize(method(list(texts), **kwargs))


# ---------------------------------------------------------------------------------------------------------------------
# Large corpora: chunked, resumable, optionally multi-process encoding
# ---------------------------------------------------------------------------------------------------------------------

#: Documents per cached chunk of :func:`encode_in_chunks` (one ``.npy`` file each).
