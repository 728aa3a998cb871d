"""How texts become index vectors: the model's query/document encoding, then L2 normalisation (cosine scores)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from st_prompts.errors import ConfigurationError, first_line
from st_prompts.numbers import whole
from st_prompts.search._warnings import warn_at_caller

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


def encode_texts(model: SentenceTransformer, texts: Sequence[str], *, kind: str, batch_size: int, progress: bool,
                 task: str | None = None, pool: dict[str, Any] | None = None) -> np.ndarray:
    """Encode with ``encode_{kind}`` (``"query"`` or ``"document"``; plain ``encode`` for a model without it), or
    ``encode(task=task)``, and L2-normalise (``pool``: a sentence-transformers multi-process pool)."""
    check_encode_length(model)
    if not whole(batch_size, 1, 1 << 20):
        raise ConfigurationError(f"batch_size must be a whole number from 1 to {1 << 20}, got {str(batch_size)[:40]}")
    kwargs = {"batch_size": batch_size, "show_progress_bar": progress, "convert_to_numpy": True,
              **({"pool": pool} if pool is not None else {})}
    with chat_template_errors():
        if task is not None:
            return l2_normalize(model.encode(list(texts), task=task, **kwargs))
        method = getattr(model, f"encode_{kind}", None) or model.encode
        return l2_normalize(method(list(texts), **kwargs))


def check_encode_length(model: SentenceTransformer, name: str | None = None) -> None:
    """Refuse a model whose ``max_seq_length`` is not a positive whole number or is longer than its backbone's
    position table (a long text would index past it). ``name``: the model's name or folder, for the message."""
    from st_prompts.modules.lengths import position_capacity

    limit = getattr(model, "max_seq_length", None)
    if limit is None:
        return
    which = f"the model {name}" if name else "the model"
    if not whole(limit, 1):
        raise ConfigurationError(f"{which} has max_seq_length {str(limit)[:40]}, not a positive whole number: fix "
                                 "max_seq_length in its sentence_bert_config.json")
    capacity = position_capacity(model)
    if capacity is not None and limit > capacity:
        raise ConfigurationError(f"{which} has max_seq_length {limit} (tokens), but its backbone's position table "
                                 f"holds {capacity}: set max_seq_length to at most {capacity} in its "
                                 "sentence_bert_config.json")


@contextmanager
def chat_template_errors() -> Iterator[None]:
    """Turn a Jinja error of the model's chat template into one :class:`ConfigurationError` line."""
    try:
        yield
    except Exception as exc:
        import jinja2

        if not isinstance(exc, jinja2.TemplateError):
            raise
        reason = first_line(exc, 200)
        raise ConfigurationError(f"the model's chat template failed to render ({reason}); fix or remove its "
                                 "chat_template") from exc


def documents_over_limit(model: SentenceTransformer, texts: Sequence[str],
                         batch: int = 10_000) -> tuple[int, int | None]:
    """``(how many of texts are longer than the model's max_seq_length in tokens, that limit)``; ``(0, None)`` when
    the model has no tokenizer or limit."""
    limit = getattr(model, "max_seq_length", None)
    tokenizer = getattr(model, "tokenizer", None)
    if not isinstance(limit, int) or tokenizer is None:
        return 0, None
    longer = 0
    for start in range(0, len(texts), batch):
        ids = tokenizer(list(texts[start:start + batch]), add_special_tokens=True, truncation=False,
                        verbose=False)["input_ids"]
        longer += sum(len(row) > limit for row in ids)
    return longer, limit


def warn_over_length(model: SentenceTransformer, texts: Sequence[str]) -> int:
    """Warn how many of ``texts`` are cut to the model's limit (:func:`documents_over_limit`); return that count."""
    longer, limit = documents_over_limit(model, texts)
    if longer and limit is not None:
        warn_at_caller(f"{longer} of {len(texts)} documents are longer than the model encodes ({limit} tokens): each "
                       f"is indexed by its first {limit} tokens; split long documents into passages to index all of "
                       "their text")
    return longer
