"""Which model encoded an index: its name, path, dimension and its embeddings of :data:`PROBE_SENTENCES` (with their
fingerprint). A model matches when its probe embeddings agree up to numeric noise (cosine >=
:data:`FINGERPRINT_MIN_COSINE`), else :class:`~st_prompts.errors.BackboneMismatchError`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from st_prompts.errors import BackboneMismatchError
from st_prompts.numbers import whole
from st_prompts.search._warnings import warn_at_caller
from st_prompts.search.encoding import encode_texts
from st_prompts.utils import PACKAGED_MINILM_ALIASES, packaged_minilm_path

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

#: Minimum cosine between the stored and the recomputed embedding of every probe sentence for a model to match.
FINGERPRINT_MIN_COSINE = 0.999
#: Fixed sentences whose embeddings fingerprint a model.
PROBE_SENTENCES = (
    "A man is playing a guitar on the street.", "The stock market fell sharply after the announcement.",
    "How do I reset my password?", "Photosynthesis converts light energy into chemical energy.",
    "Der Hund schläft auf dem Sofa.", "The quick brown fox jumps over the lazy dog.",
    "Scores were tied 2-2 at half time.", "an unusually short one",
)
_FINGERPRINT_DECIMALS = 3


def _config_name_or_path(model: SentenceTransformer) -> str | None:
    """``_name_or_path`` of the first module's transformers config: where the backbone was loaded from."""
    try:
        first = model[0]
    except (IndexError, TypeError, KeyError):  # pragma: no cover - exotic model without modules
        return None
    auto_model = getattr(first, "auto_model", None) or getattr(first, "model", None)
    name = getattr(getattr(auto_model, "config", None), "_name_or_path", None)
    return name if isinstance(name, str) and name else None


def model_name(model: SentenceTransformer) -> str:
    """A portable name for ``model``: ``minilm`` for the packaged MiniLM, else the hub id or path it came from."""
    card = getattr(model, "model_card_data", None)
    candidates = [getattr(card, "model_id", None), getattr(card, "base_model", None), _config_name_or_path(model)]
    name = next((c for c in candidates if isinstance(c, str) and c), None)
    if name is None:
        return type(model).__name__
    try:
        if os.path.realpath(name) == os.path.realpath(packaged_minilm_path()):
            return "minilm"
    except Exception:  # pragma: no cover - packaged model absent
        pass
    return name


def _max_seq_length(model: SentenceTransformer) -> int | None:
    value = getattr(model, "max_seq_length", None)
    return value if whole(value, high=999_999) else None


def embedding_dimension(model: SentenceTransformer) -> int | None:
    """The model's sentence-embedding dimension (``None`` when it cannot tell)."""
    getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return getter()


def _loadable(name: str) -> bool:
    """Whether ``name`` can plausibly be loaded: an alias, an existing path, or a hub-style id (not a dead path)."""
    if name in PACKAGED_MINILM_ALIASES or os.path.exists(name):
        return True
    return not (os.path.isabs(name) or name.startswith((".", "~")))


@dataclass
class ModelIdentity:
    """Who encoded an index: name, path, dimension and a fingerprint of the normalised probe-sentence embeddings."""
    name: str
    dimension: int
    fingerprint: str
    probe_embeddings: np.ndarray = field(repr=False)
    path: str | None = None
    task: str | None = None  # the bank's prompt set of documents and queries (None: encode_document / encode_query)
    max_seq_length: int | None = None  # None for indexes that predate it
    # how the documents were encoded, and so the queries are: "int8" (quantized), "bfloat16" / "float16"; None: fp32
    quantize: str | None = None
    dtype: str | None = None

    @classmethod
    def of(cls, model: SentenceTransformer, name: str | None = None, task: str | None = None) -> ModelIdentity:
        """Compute the identity of ``model`` (encoding the :data:`PROBE_SENTENCES` with the prompt set ``task``)."""
        probe = encode_texts(model, PROBE_SENTENCES, kind="document", batch_size=len(PROBE_SENTENCES), progress=False,
                             task=task)
        return cls(name=name or model_name(model), dimension=int(probe.shape[1]), fingerprint=cls.fingerprint_of(probe),
                   probe_embeddings=probe, path=_config_name_or_path(model), task=task,
                   max_seq_length=_max_seq_length(model), quantize=getattr(model, "st_prompts_quantization", None),
                   dtype=getattr(model, "st_prompts_dtype", None))

    @classmethod
    def from_json(cls, info: dict[str, Any], probe_embeddings: np.ndarray) -> ModelIdentity:
        """The identity saved by :meth:`to_json` (``meta.json``) and its probe embeddings (``probe.npy``)."""
        return cls(name=info["name"], dimension=int(info["dimension"]), fingerprint=info["fingerprint"],
                   probe_embeddings=probe_embeddings, path=info.get("path"), task=info.get("task"),
                   max_seq_length=info.get("max_seq_length") if isinstance(info.get("max_seq_length"), int) else None,
                   quantize="int8" if info.get("quantize") == "int8" else None,
                   dtype=info["dtype"] if info.get("dtype") in ("bfloat16", "float16") else None)

    @staticmethod
    def fingerprint_of(probe_embeddings: np.ndarray) -> str:
        """SHA-256 of the probe embeddings rounded to 3 decimals (a quick identity; matching uses a tolerance)."""
        rounded = np.round(np.asarray(probe_embeddings, dtype=np.float64) * 10**_FINGERPRINT_DECIMALS)
        rounded = rounded.astype(np.int32) + 0  # "+ 0" turns -0 into 0
        digest = hashlib.sha256(np.ascontiguousarray(rounded).tobytes()).hexdigest()
        return f"sha256:{digest}"

    def to_json(self) -> dict[str, Any]:
        """The JSON-able part (the probe embeddings are saved separately, in ``probe.npy``)."""
        optional = {"task": self.task, "max_seq_length": self.max_seq_length, "quantize": self.quantize,
                    "dtype": self.dtype}
        return {"name": self.name, "path": self.path, "dimension": self.dimension, "fingerprint": self.fingerprint,
                "probe_sentences": list(PROBE_SENTENCES), **{k: v for k, v in optional.items() if v is not None}}

    def loadable_name(self) -> str:
        """The recorded name, or the recorded local path when the name is a dead path and the path exists here."""
        if self.path and not _loadable(self.name) and os.path.isdir(self.path):
            return self.path
        return self.name

    def check_compatible(self, other: ModelIdentity) -> None:
        """Raise :class:`BackboneMismatchError` unless ``other`` (a candidate model) encodes like ``self``."""
        if other.task != self.task:
            raise BackboneMismatchError(f"the index was encoded with the prompt set {self.task!r}, not {other.task!r}: "
                                        "queries must be encoded with the documents' set")
        if other.dimension != self.dimension:
            raise BackboneMismatchError(f"model {other.name!r} produces {other.dimension}-dimensional embeddings but "
                                        f"the index was built with {self.name!r} ({self.dimension} dimensions); use "
                                        "the index's model or rebuild the index")
        if other.max_seq_length is not None and self.max_seq_length is not None and \
                other.max_seq_length != self.max_seq_length:
            warn_at_caller(f"the index's documents were encoded at up to {self.max_seq_length} tokens each, but model "
                           f"{other.name!r} now encodes up to {other.max_seq_length}: queries and new documents are "
                           "encoded at another length than the corpus; rebuild the index to encode them alike")
        if other.fingerprint == self.fingerprint:
            return
        cosines = np.sum(self.probe_embeddings * other.probe_embeddings, axis=1)
        worst = float(np.min(cosines))
        if worst < FINGERPRINT_MIN_COSINE and other.quantize != self.quantize:
            raise BackboneMismatchError(f"the index was encoded by the {self.quantize or 'fp32'} model and this one is "
                                        f"{other.quantize or 'fp32'} (lowest probe cosine {worst:.4f}): load it with "
                                        f"quantize={self.quantize or 'none'!r} (--quantize {self.quantize or 'none'}) "
                                        "or rebuild the index")
        if worst < FINGERPRINT_MIN_COSINE:
            raise BackboneMismatchError(f"model {other.name!r} does not match the index's model {self.name!r}: its "
                                        f"embeddings of the probe sentences differ (lowest cosine {worst:.4f} < "
                                        f"{FINGERPRINT_MIN_COSINE}); use the index's model or rebuild the index")
        logger.debug("fingerprints differ only by numeric noise (lowest probe cosine %.6f)", worst)
