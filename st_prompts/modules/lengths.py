"""How many tokens a model reads: the training length, the length a saved model encodes, and full-length evaluation.

The **training length** truncates the training batches only; the **encoding length** is what a saved model encodes
(the backbone's own limit, :func:`backbone_encode_length`, or ``--max-encode-length``). Evaluation tokenizes without
a maximum length, as SentEval does: :func:`full_length` and :class:`FullLengthEvaluator`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sentence_transformers.base.evaluation.evaluator import BaseEvaluator

from st_prompts.numbers import whole

logger = logging.getLogger(__name__)

__all__ = ["FullLengthEvaluator", "backbone_encode_length", "encode_limit", "full_length", "full_length_evaluator",
           "position_capacity", "shipped_max_seq_length"]

#: Tokenizers without a limit of their own report a huge ``model_max_length`` (``int(1e30)``): not a limit.
_NO_LIMIT = 1_000_000


def shipped_max_seq_length(location: str | os.PathLike | None) -> int | None:
    """``max_seq_length`` of the sentence-transformers model saved in the folder ``location``, or ``None``."""
    if not location:
        return None
    try:
        with open(os.path.join(str(location), "sentence_bert_config.json"), encoding="utf-8") as handle:
            value = json.load(handle).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if whole(value, 1) else None


def _input_module(model: Any) -> Any:
    """The module of ``model`` that tokenizes (a ``SentenceTransformer``'s first module, or the module itself)."""
    try:
        first = model[0]
    except (TypeError, IndexError, KeyError):
        return model
    return first if hasattr(first, "tokenizer") else model


def position_capacity(module: Any) -> int | None:
    """The most tokens ``module``'s backbone can take in one input: its position table less the RoBERTa offset (and a
    prefix's positions); ``None`` when the backbone has no position table."""
    module = _input_module(module)
    limit = getattr(module, "max_position_limit", None)
    if isinstance(limit, int):
        return limit if limit < _NO_LIMIT else None
    config = getattr(getattr(module, "auto_model", None), "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    offset = module._infer_flatten_position_offset() if hasattr(module, "_infer_flatten_position_offset") else 0
    return positions - offset


def backbone_encode_length(module: Any, location: str | os.PathLike | None = None) -> int | None:
    """What a model trained from ``module`` should encode: the ``max_seq_length`` of the model saved at ``location``,
    else its ``backbone_max_length``, never more than its position capacity (``None``: nothing is known)."""
    module = _input_module(module)
    capacity = position_capacity(module)
    own = shipped_max_seq_length(location) or getattr(module, "backbone_max_length", None)
    if own is None or own >= _NO_LIMIT:
        return capacity
    return min(own, capacity) if capacity is not None else own


def encode_limit(model: Any) -> int | None:
    """The length :func:`full_length` encodes at: the most tokens the model's backbone can take
    (:func:`position_capacity`), never less than the model's own ``max_seq_length``; ``None`` when unknown."""
    module = _input_module(model)
    capacity = position_capacity(module)
    if capacity is not None:
        return capacity
    current = getattr(module, "max_seq_length", None)
    return current if isinstance(current, int) and current < _NO_LIMIT else None


@contextmanager
def full_length(model: Any, length: int | None = None) -> Iterator[int | None]:
    """Encode at ``length`` (default: :func:`encode_limit`) inside the block (SentEval's protocol), then restore the
    model's ``max_seq_length``. Yields the length used (``None``: the model has no length to set)."""
    module = _input_module(model)
    limit = length if length is not None else encode_limit(module)
    previous = getattr(module, "max_seq_length", None)
    if limit is None or previous is None or limit == previous:
        yield limit if limit is not None else previous
        return
    module.max_seq_length = limit
    try:
        yield module.max_seq_length
    finally:
        module.max_seq_length = previous


class FullLengthEvaluator(BaseEvaluator):
    """Wrap any sentence-transformers evaluator so that it encodes at full length (:func:`full_length`). Every other
    attribute is the wrapped evaluator's; :attr:`max_length` is the length the last call encoded at.

    A ``BaseEvaluator`` (the trainer takes anything else for a list of evaluators) whose own ``__init__`` is not run:
    its attributes would hide the wrapped evaluator's.
    """

    encodes_full_length = True

    def __init__(self, evaluator: Any) -> None:  # no super().__init__ (see above)
        self.__dict__["evaluator"] = evaluator
        self.__dict__["max_length"] = None

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        with full_length(model) as length:
            self.__dict__["max_length"] = length
            return self.evaluator(model, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["evaluator"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["evaluator"], name, value)

    @property
    def description(self) -> str:
        return self.__dict__["evaluator"].description

    def get_config_dict(self) -> dict[str, Any]:
        return {**self.__dict__["evaluator"].get_config_dict(), "max_length": self.__dict__["max_length"]}


def full_length_evaluator(evaluator: Any) -> Any:
    """``evaluator`` wrapped in :class:`FullLengthEvaluator`, once (``None`` stays ``None``)."""
    if evaluator is None or getattr(evaluator, "encodes_full_length", False):
        return evaluator
    return FullLengthEvaluator(evaluator)
