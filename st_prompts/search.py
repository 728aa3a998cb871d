"""Semantic search over an encoded corpus with FAISS.

:class:`SemanticIndex` encodes a corpus with a :class:`~sentence_transformers.SentenceTransformer`, puts the embeddings
in a FAISS index and answers queries with ranked :class:`SearchHit` s::

    from sentence_transformers import SentenceTransformer
    from st_prompts.search import SemanticIndex
    from st_prompts.utils import packaged_minilm_path

    model = SentenceTransformer(packaged_minilm_path())
    index = SemanticIndex.from_text_file(model, "corpus.txt")          # one document per line
    index.save("corpus.index")                                         # a directory, written atomically
    index = SemanticIndex.load("corpus.index", model=model)            # checks that ``model`` is the index's model
    for hit in index.search("how do cats sleep?", k=5)[0]:
        print(hit.score, hit.id, hit.text)

Conventions (all documented here once, and relied upon by the CLI and the tests):

* **Scores are cosine similarities.** Corpus and query embeddings are always L2-normalised before they reach FAISS
  (whether or not the model ends with a ``Normalize`` module), and every index uses the inner-product metric. A model
  that differs from the index's model only by a final ``Normalize`` module is therefore compatible with it.
* **Index types.** ``"flat"`` (default, exact: ``IndexFlatIP``), ``"ivf"`` (``IVF{nlist},Flat``: k-means trained
  inverted lists; ``nlist`` defaults to ``4·sqrt(n)``, capped at ``n // 39`` so that each centroid gets the 39 training
  points FAISS asks for, ``nprobe`` to :data:`DEFAULT_NPROBE`) and ``"hnsw"`` (``HNSW{M},Flat`` graph; ``M`` =
  :data:`DEFAULT_HNSW_M`, ``ef_construction`` = :data:`DEFAULT_EF_CONSTRUCTION`, ``ef_search`` =
  :data:`DEFAULT_EF_SEARCH`). An *explicit* ``nlist`` larger than the corpus is a :class:`ConfigurationError`; the
  default adapts to small corpora (down to a single list, i.e. an exact search).
* **Document ids.** 1-based line numbers for a text file (blank lines are skipped but keep their numbers, so
  ``sed -n 'IDp' corpus.txt`` prints the document); 0-based positions for a list or a dataset without ``id_column``;
  otherwise the given ids, which must be unique ``str`` or ``int`` values (duplicates are a :class:`DataFormatError`).
* **Blank documents** (empty or whitespace only) are skipped with a warning; a corpus with no non-blank document is a
  :class:`DataFormatError`.
* **Duplicate texts are kept**, each under its own id, with one warning saying how many there are: deduplicating
  silently would lose ids the caller may rely on. A search can then return the same text twice.
* **k larger than the corpus** is clamped to the corpus size with a warning. Slots FAISS leaves empty (id ``-1``,
  possible with IVF/HNSW when too few candidates are visited) are dropped, so a query may get fewer than ``k`` hits but
  never a made-up one.
* **Model identity.** ``meta.json`` records the model's name/path and dimension and a fingerprint: the SHA-256 of the
  (rounded) normalised embeddings of :data:`PROBE_SENTENCES`; the embeddings themselves are kept in ``probe.npy``. A
  model given to :meth:`SemanticIndex.load` (or used for a search) must have the same dimension and give the same
  probe embeddings (cosine ≥ :data:`FINGERPRINT_MIN_COSINE` for every probe sentence, which tolerates CPU/GPU numeric
  noise), else :class:`BackboneMismatchError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from st_prompts.errors import (
    BackboneMismatchError,
    ConfigurationError,
    DataFormatError,
    DataNotFoundError,
)

if TYPE_CHECKING:  # pragma: no cover
    import faiss
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_EF_CONSTRUCTION",
    "DEFAULT_EF_SEARCH",
    "DEFAULT_HNSW_M",
    "DEFAULT_NPROBE",
    "FINGERPRINT_MIN_COSINE",
    "INDEX_TYPES",
    "PROBE_SENTENCES",
    "ModelIdentity",
    "SearchHit",
    "SemanticIndex",
    "load_model",
]

#: Index types accepted by :meth:`SemanticIndex.build` and friends.
INDEX_TYPES = ("flat", "ivf", "hnsw")
#: Default number of inverted lists visited per query by an IVF index (tuned with ``benchmarks/search.py``).
DEFAULT_NPROBE = 64
#: Default number of neighbours per node of an HNSW graph.
DEFAULT_HNSW_M = 32
#: Default size of the candidate list while building an HNSW graph.
DEFAULT_EF_CONSTRUCTION = 80
#: Default size of the candidate list while searching an HNSW graph (tuned with ``benchmarks/search.py``).
DEFAULT_EF_SEARCH = 128
#: Minimum cosine between the stored and the recomputed embedding of every probe sentence for a model to match.
FINGERPRINT_MIN_COSINE = 0.999
#: Fixed sentences whose embeddings fingerprint a model.
PROBE_SENTENCES = (
    "A man is playing a guitar on the street.",
    "The stock market fell sharply after the announcement.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy.",
    "Der Hund schläft auf dem Sofa.",
    "The quick brown fox jumps over the lazy dog.",
    "Scores were tied 2-2 at half time.",
    "an unusually short one",
)

FORMAT_NAME = "st-prompts-semantic-index"
FORMAT_VERSION = 1
INDEX_FILE = "index.faiss"
DOCS_FILE = "docs.jsonl"
META_FILE = "meta.json"
PROBE_FILE = "probe.npy"
_DATASET_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_FINGERPRINT_DECIMALS = 3
# Keys of meta.json written by SemanticIndex._meta() itself; any other key is kept in SemanticIndex.info.
_CORE_META_KEYS = frozenset(
    {
        "format", "format_version", "model", "dimension", "num_docs", "index_type", "index_params",
        "faiss_factory", "metric", "normalization", "score", "duplicate_texts", "created",
        "st_prompts_version", "faiss_version",
    }
)  # fmt: skip


class SearchHit(NamedTuple):
    """One search result: the document's id and text and its cosine similarity to the query."""

    id: int | str
    text: str
    score: float


def load_model(name_or_path: str, device: str | None = None) -> "SentenceTransformer":
    """Load a model the way the CLI does: aliases such as ``minilm`` resolved, ``trust_remote_code=True``."""
    from sentence_transformers import SentenceTransformer

    from st_prompts.utils import resolve_model_name

    resolved = resolve_model_name(name_or_path)
    try:
        return SentenceTransformer(resolved, trust_remote_code=True, device=device)
    except OSError as exc:
        raise DataNotFoundError(f"cannot load model {name_or_path!r}: {exc}") from exc


def _model_name(model: "SentenceTransformer") -> str:
    """A portable name for ``model``: ``minilm`` for the packaged MiniLM, else the hub id or path it came from."""
    candidates = []
    card = getattr(model, "model_card_data", None)
    if card is not None:
        candidates += [getattr(card, "model_id", None), getattr(card, "base_model", None)]
    try:
        first = model[0]
        auto_model = getattr(first, "auto_model", None) or getattr(first, "model", None)
        candidates.append(getattr(getattr(auto_model, "config", None), "_name_or_path", None))
    except (IndexError, TypeError, KeyError):  # pragma: no cover - exotic model without modules
        pass
    name = next((c for c in candidates if isinstance(c, str) and c), None)
    if name is None:
        return type(model).__name__
    try:
        from st_prompts.utils import packaged_minilm_path

        if os.path.realpath(name) == os.path.realpath(packaged_minilm_path()):
            return "minilm"
    except Exception:  # pragma: no cover - packaged model absent
        pass
    return name


def _embedding_dimension(model: "SentenceTransformer") -> int | None:
    getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return getter()


def _l2_normalize(embeddings: Any) -> np.ndarray:
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


def _encode(model: "SentenceTransformer", texts: Sequence[str], *, kind: str, batch_size: int, progress: bool):
    """Encode with the model's query/document prompt when it has one (``encode_query``/``encode_document``)."""
    method = getattr(model, f"encode_{kind}", None) or model.encode
    embeddings = method(list(texts), batch_size=batch_size, show_progress_bar=progress, convert_to_numpy=True)
    return _l2_normalize(embeddings)


@dataclass
class ModelIdentity:
    """Who encoded an index: name, path, dimension and a fingerprint of the normalised probe-sentence embeddings."""

    name: str
    dimension: int
    fingerprint: str
    probe_embeddings: np.ndarray = field(repr=False)
    path: str | None = None

    @classmethod
    def of(cls, model: "SentenceTransformer", name: str | None = None) -> "ModelIdentity":
        """Compute the identity of ``model`` (encodes the :data:`PROBE_SENTENCES`, a few milliseconds)."""
        probe = _encode(model, PROBE_SENTENCES, kind="document", batch_size=len(PROBE_SENTENCES), progress=False)
        path = None
        try:
            first = model[0]
            auto_model = getattr(first, "auto_model", None) or getattr(first, "model", None)
            path = getattr(getattr(auto_model, "config", None), "_name_or_path", None)
        except (IndexError, TypeError, KeyError):  # pragma: no cover
            pass
        return cls(
            name=name or _model_name(model),
            dimension=int(probe.shape[1]),
            fingerprint=cls.fingerprint_of(probe),
            probe_embeddings=probe,
            path=path if isinstance(path, str) else None,
        )

    @staticmethod
    def fingerprint_of(probe_embeddings: np.ndarray) -> str:
        """SHA-256 of the probe embeddings rounded to 3 decimals (a quick identity; matching uses a tolerance)."""
        rounded = np.round(np.asarray(probe_embeddings, dtype=np.float64) * 10**_FINGERPRINT_DECIMALS)
        rounded = rounded.astype(np.int32) + 0  # "+ 0" turns -0 into 0
        digest = hashlib.sha256(np.ascontiguousarray(rounded).tobytes()).hexdigest()
        return f"sha256:{digest}"

    def to_json(self) -> dict[str, Any]:
        """The JSON-able part (the probe embeddings are saved separately, in ``probe.npy``)."""
        return {
            "name": self.name,
            "path": self.path,
            "dimension": self.dimension,
            "fingerprint": self.fingerprint,
            "probe_sentences": list(PROBE_SENTENCES),
        }

    def check_compatible(self, other: "ModelIdentity") -> None:
        """Raise :class:`BackboneMismatchError` unless ``other`` (a candidate model) encodes like ``self``."""
        if other.dimension != self.dimension:
            raise BackboneMismatchError(
                f"model {other.name!r} produces {other.dimension}-dimensional embeddings but the index was built "
                f"with {self.name!r} ({self.dimension} dimensions); use the index's model or rebuild the index"
            )
        if other.fingerprint == self.fingerprint:
            return
        cosines = np.sum(self.probe_embeddings * other.probe_embeddings, axis=1)
        worst = float(np.min(cosines))
        if worst < FINGERPRINT_MIN_COSINE:
            raise BackboneMismatchError(
                f"model {other.name!r} does not match the index's model {self.name!r}: its embeddings of the probe "
                f"sentences differ (lowest cosine {worst:.4f} < {FINGERPRINT_MIN_COSINE}); use the index's model or "
                "rebuild the index"
            )
        logger.debug("fingerprints differ only by numeric noise (lowest probe cosine %.6f)", worst)


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigurationError(f"k must be a positive integer, got {k!r}")
    return int(k)


def _check_id(value: Any, where: str) -> int | str:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise DataFormatError(f"document ids must be str or int, got {type(value).__name__} ({value!r}) {where}")
    return value


def _prepare_corpus(
    texts: Iterable[Any], ids: Iterable[Any] | None, *, source: str, id_kind: str
) -> tuple[list[int | str], list[str]]:
    """Validate a corpus: drop blank documents (warning), reject duplicate ids, warn about duplicate texts."""
    texts = list(texts)
    if ids is None:
        ids = list(range(1, len(texts) + 1)) if id_kind == "line_number" else list(range(len(texts)))
    else:
        ids = list(ids)
        if len(ids) != len(texts):
            raise DataFormatError(f"{source}: got {len(ids)} ids for {len(texts)} documents")
    kept_ids: list[int | str] = []
    kept_texts: list[str] = []
    blank = 0
    for i, (doc_id, text) in enumerate(zip(ids, texts)):
        if text is None or (isinstance(text, str) and not text.strip()):
            blank += 1
            continue
        if not isinstance(text, str):
            raise DataFormatError(f"{source}: document {i} is a {type(text).__name__}, not a string: {text!r:.80}")
        kept_ids.append(_check_id(doc_id, f"(document {i} of {source})"))
        kept_texts.append(text)
    if not kept_texts:
        raise DataFormatError(f"{source} is empty: it has no non-blank document to index")
    if blank:
        warnings.warn(f"{source}: skipped {blank} blank document(s)", UserWarning, stacklevel=3)
    seen: set[int | str] = set()
    duplicates = []
    for doc_id in kept_ids:
        if doc_id in seen:
            duplicates.append(doc_id)
        seen.add(doc_id)
    if duplicates:
        shown = ", ".join(repr(d) for d in duplicates[:5]) + (", ..." if len(duplicates) > 5 else "")
        raise DataFormatError(f"{source}: document ids must be unique; {len(duplicates)} duplicate(s): {shown}")
    duplicate_texts = len(kept_texts) - len(set(kept_texts))
    if duplicate_texts:
        warnings.warn(
            f"{source}: {duplicate_texts} document(s) repeat the text of an earlier one; they are kept, each under "
            "its own id",
            UserWarning,
            stacklevel=3,
        )
    return kept_ids, kept_texts


def _resolve_index_params(index_type: str, n: int, params: dict[str, Any]) -> dict[str, Any]:
    """Fill in the defaults of ``index_type`` for a corpus of ``n`` documents and validate the given values."""
    if index_type not in INDEX_TYPES:
        raise ConfigurationError(f"unknown index_type {index_type!r}; choose one of {', '.join(INDEX_TYPES)}")
    allowed = {"flat": set(), "ivf": {"nlist", "nprobe"}, "hnsw": {"m", "ef_construction", "ef_search"}}[index_type]
    params = {key: value for key, value in params.items() if value is not None}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigurationError(
            f"unknown parameter(s) for a {index_type!r} index: {', '.join(unknown)}"
            + (f" (accepted: {', '.join(sorted(allowed))})" if allowed else "")
        )
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigurationError(f"{key} must be a positive integer, got {value!r}")
    if index_type == "ivf":
        if "nlist" in params:
            nlist = int(params["nlist"])
            if nlist > n:
                raise ConfigurationError(
                    f"an IVF index with nlist={nlist} needs at least {nlist} documents to train (ideally "
                    f"{39 * nlist}); the corpus has {n}. Use a smaller nlist, or index_type='flat'"
                )
        else:
            nlist = max(1, min(int(round(4 * math.sqrt(n))), n // 39))
        nprobe = min(int(params.get("nprobe", DEFAULT_NPROBE)), nlist)
        return {"nlist": nlist, "nprobe": nprobe}
    if index_type == "hnsw":
        return {
            "m": int(params.get("m", DEFAULT_HNSW_M)),
            "ef_construction": int(params.get("ef_construction", DEFAULT_EF_CONSTRUCTION)),
            "ef_search": int(params.get("ef_search", DEFAULT_EF_SEARCH)),
        }
    return {}


def _factory_string(index_type: str, params: dict[str, Any]) -> str:
    if index_type == "ivf":
        return f"IVF{params['nlist']},Flat"
    if index_type == "hnsw":
        return f"HNSW{params['m']},Flat"
    return "Flat"


def _apply_search_params(index: "faiss.Index", index_type: str, params: dict[str, Any]) -> None:
    import faiss

    if index_type == "ivf":
        faiss.extract_index_ivf(index).nprobe = int(params["nprobe"])
    elif index_type == "hnsw":
        faiss.downcast_index(index).hnsw.efSearch = int(params["ef_search"])


def _build_faiss_index(
    embeddings: np.ndarray, index_type: str, params: dict[str, Any], *, progress: bool
) -> "faiss.Index":
    import faiss

    n, dim = embeddings.shape
    index = faiss.index_factory(dim, _factory_string(index_type, params), faiss.METRIC_INNER_PRODUCT)
    if index_type == "ivf":
        logger.info("training IVF index (%d lists) on %d vectors", params["nlist"], n)
        faiss.extract_index_ivf(index).cp.seed = 1234
        index.train(embeddings)
    elif index_type == "hnsw":
        faiss.downcast_index(index).hnsw.efConstruction = int(params["ef_construction"])
    _apply_search_params(index, index_type, params)
    chunk = n if index_type == "flat" else 10_000
    starts = range(0, n, chunk)
    if progress and len(starts) > 1:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"Adding to {index_type} index", unit="chunk")
    for start in starts:
        index.add(embeddings[start : start + chunk])
    return index


def _read_text_file(path: Path, encoding: str) -> list[str]:
    if not path.exists():
        raise DataNotFoundError(f"corpus file not found: {path}")
    if path.is_dir():
        raise DataFormatError(f"corpus must be a text file with one document per line, got a directory: {path}")
    try:
        with path.open(encoding=encoding, newline=None) as handle:
            return [line.rstrip("\n").strip() for line in handle]
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"{path} is not a {encoding} text file: {exc}") from exc


def _load_dataset_file(path: Path) -> Any:
    """Load a .jsonl/.json/.csv/.parquet file as a :class:`datasets.Dataset`."""
    import datasets

    if not path.exists():
        raise DataNotFoundError(f"corpus file not found: {path}")
    loader = {
        "json": datasets.Dataset.from_json,
        "csv": datasets.Dataset.from_csv,
        "parquet": datasets.Dataset.from_parquet,
    }
    try:
        return loader[_DATASET_SUFFIXES[path.suffix.lower()]](str(path))
    except Exception as exc:  # datasets raises many different errors for a malformed file
        raise DataFormatError(f"cannot read {path} as a dataset: {exc}") from exc


class SemanticIndex:
    """A FAISS index over the L2-normalised embeddings of a corpus, with the documents' ids and texts.

    Build one with :meth:`build`, :meth:`from_text_file`, :meth:`from_dataset`, :meth:`from_file` or, from
    precomputed embeddings, :meth:`from_embeddings`; persist it with :meth:`save` / :meth:`load`; query it with
    :meth:`search` (texts) or :meth:`search_embeddings` (vectors). See the module docstring for the conventions
    (scores, ids, duplicates, ``k``).

    Attributes:
        index: the underlying ``faiss.Index`` (row ``i`` is document ``ids[i]``).
        ids: document ids, in FAISS order.
        texts: document texts, in FAISS order.
        index_type: ``"flat"``, ``"ivf"`` or ``"hnsw"``.
        index_params: the resolved parameters (e.g. ``{"nlist": 400, "nprobe": 32}``).
        model_identity: the :class:`ModelIdentity` of the encoding model, or ``None`` for an index built from bare
            embeddings.
        model: the model used to encode queries (``None`` until needed; loaded lazily from ``model_identity.name``).
        info: extra metadata saved in ``meta.json`` (e.g. ``id_source``).
    """

    def __init__(
        self,
        index: "faiss.Index",
        ids: Sequence[int | str],
        texts: Sequence[str],
        *,
        index_type: str,
        index_params: dict[str, Any],
        model_identity: ModelIdentity | None = None,
        model: "SentenceTransformer | None" = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        if index.ntotal != len(ids) or len(ids) != len(texts):
            raise DataFormatError(
                f"inconsistent index: {index.ntotal} vectors, {len(ids)} ids and {len(texts)} texts"
            )
        self.index = index
        self.ids = list(ids)
        self.texts = list(texts)
        self.index_type = index_type
        self.index_params = dict(index_params)
        self.model_identity = model_identity
        self.model = model
        self.info = dict(info or {})

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_embeddings(
        cls,
        embeddings: Any,
        documents: Sequence[str],
        ids: Sequence[int | str] | None = None,
        index_type: str = "flat",
        *,
        model: "SentenceTransformer | None" = None,
        model_identity: ModelIdentity | None = None,
        show_progress_bar: bool = False,
        **index_params: Any,
    ) -> "SemanticIndex":
        """Index precomputed embeddings (one row per document; they are L2-normalised here).

        Blank documents are *not* skipped here (the rows must line up with ``documents``); ids default to 0-based
        positions. ``model`` / ``model_identity`` record which model produced the embeddings (needed to search with
        texts and to check a model on :meth:`load`); without them only :meth:`search_embeddings` works.
        """
        documents = list(documents)
        if not documents:
            raise DataFormatError("the corpus is empty: there is no document to index")
        vectors = _l2_normalize(embeddings)
        if vectors.shape[0] != len(documents):
            raise DataFormatError(f"got {vectors.shape[0]} embeddings for {len(documents)} documents")
        if any(isinstance(text, str) and not text.strip() for text in documents):
            raise DataFormatError("from_embeddings() needs non-blank documents (their rows cannot be dropped here)")
        ids_list, documents = _prepare_corpus(documents, ids, source="corpus", id_kind="position")
        if model is not None and model_identity is None:
            model_identity = ModelIdentity.of(model)
        return cls._assemble(
            vectors,
            ids_list,
            documents,
            index_type,
            index_params,
            model=model,
            model_identity=model_identity,
            show_progress_bar=show_progress_bar,
        )

    @classmethod
    def _assemble(
        cls,
        vectors: np.ndarray,
        ids: list[int | str],
        texts: list[str],
        index_type: str,
        index_params: dict[str, Any],
        *,
        model: "SentenceTransformer | None",
        model_identity: ModelIdentity | None,
        show_progress_bar: bool,
    ) -> "SemanticIndex":
        if model_identity is not None and model_identity.dimension != vectors.shape[1]:
            raise BackboneMismatchError(
                f"embeddings have {vectors.shape[1]} dimensions but the model {model_identity.name!r} produces "
                f"{model_identity.dimension}"
            )
        params = _resolve_index_params(index_type, len(texts), index_params)
        faiss_index = _build_faiss_index(vectors, index_type, params, progress=show_progress_bar)
        return cls(
            faiss_index,
            ids,
            texts,
            index_type=index_type,
            index_params=params,
            model_identity=model_identity,
            model=model,
        )

    @classmethod
    def build(
        cls,
        model: "SentenceTransformer",
        documents: Any,
        ids: Sequence[int | str] | None = None,
        index_type: str = "flat",
        batch_size: int = 64,
        show_progress_bar: bool = True,
        *,
        text_column: str = "text",
        id_column: str | None = None,
        model_name: str | None = None,
        _source: str = "corpus",
        _id_kind: str = "position",
        **index_params: Any,
    ) -> "SemanticIndex":
        """Encode ``documents`` with ``model`` and index them.

        Args:
            model: the sentence-transformers model (documents go through ``encode_document``, so a model with a
                ``document`` prompt uses it).
            documents: a list/iterable of strings, or a ``datasets.Dataset`` (its ``text_column``; ids from
                ``id_column`` if given). A bare string is rejected (use :meth:`from_text_file` for a file).
            ids: one unique ``str``/``int`` id per document (default: 0-based positions).
            index_type: ``"flat"`` (exact), ``"ivf"`` or ``"hnsw"``.
            batch_size: encoding batch size.
            show_progress_bar: show progress bars while encoding and while adding to an approximate index.
            text_column / id_column: columns to use when ``documents`` is a dataset.
            model_name: the name to record for the model (default: derived from the model; ``minilm`` for the
                packaged MiniLM). :meth:`search` on a loaded index reloads the model by this name when no model is
                given, so prefer a hub id or an alias to a machine-specific path.
            **index_params: ``nlist``/``nprobe`` for IVF, ``m``/``ef_construction``/``ef_search`` for HNSW.

        Raises:
            DataFormatError: empty corpus, duplicate ids, non-string documents, missing column.
            ConfigurationError: unknown ``index_type`` or parameter, ``nlist`` larger than the corpus.
        """
        if isinstance(documents, (str, bytes, os.PathLike)):
            raise ConfigurationError(
                "documents must be a list of strings or a datasets.Dataset; to index a file use "
                "SemanticIndex.from_text_file() or SemanticIndex.from_file()"
            )
        if _is_dataset(documents):
            if ids is not None:
                raise ConfigurationError("pass either ids or id_column for a dataset, not both")
            columns = documents.column_names
            for column in (text_column, id_column):
                if column is not None and column not in columns:
                    raise DataFormatError(
                        f"{_source}: no column {column!r} in the dataset (columns: {', '.join(columns)})"
                    )
            ids = documents[id_column] if id_column is not None else None
            documents = documents[text_column]
        # Resolve parameters before the (long) encoding so that a bad option fails fast.
        ids_list, texts = _prepare_corpus(documents, ids, source=_source, id_kind=_id_kind)
        _resolve_index_params(index_type, len(texts), index_params)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive integer, got {batch_size!r}")
        identity = ModelIdentity.of(model, name=model_name)
        embeddings = _encode(model, texts, kind="document", batch_size=batch_size, progress=show_progress_bar)
        index = cls._assemble(
            embeddings,
            ids_list,
            texts,
            index_type,
            index_params,
            model=model,
            model_identity=identity,
            show_progress_bar=show_progress_bar,
        )
        index.info["id_source"] = (
            f"column:{id_column}" if id_column is not None else ("given" if ids is not None else _id_kind)
        )
        index.info["source"] = _source
        return index

    @classmethod
    def from_text_file(
        cls, model: "SentenceTransformer", path: str | os.PathLike, *, encoding: str = "utf-8", **kw: Any
    ) -> "SemanticIndex":
        """Index a text file with one document per line; ids are 1-based line numbers, blank lines are skipped.

        Lines are stripped of surrounding whitespace. ``**kw`` go to :meth:`build`.
        """
        path = Path(path)
        lines = _read_text_file(path, encoding)
        return cls.build(model, lines, None, _source=str(path), _id_kind="line_number", **kw)

    @classmethod
    def from_dataset(
        cls,
        model: "SentenceTransformer",
        dataset: Any,
        text_column: str = "text",
        id_column: str | None = None,
        **kw: Any,
    ) -> "SemanticIndex":
        """Index the ``text_column`` of a ``datasets.Dataset``; ids from ``id_column`` or 0-based row positions."""
        if not _is_dataset(dataset):
            raise ConfigurationError(f"expected a datasets.Dataset, got {type(dataset).__name__}")
        return cls.build(model, dataset, text_column=text_column, id_column=id_column, **kw)

    @classmethod
    def from_file(
        cls,
        model: "SentenceTransformer",
        path: str | os.PathLike,
        text_column: str = "text",
        id_column: str | None = None,
        **kw: Any,
    ) -> "SemanticIndex":
        """Index a file: ``.jsonl``/``.json``/``.csv``/``.parquet`` via ``datasets`` (``text_column``,
        ``id_column``), anything else as a text file with one document per line (:meth:`from_text_file`)."""
        path = Path(path)
        if path.suffix.lower() not in _DATASET_SUFFIXES:
            if id_column is not None:
                raise ConfigurationError(f"--id-column needs a dataset file (.jsonl/.csv/.parquet), not {path}")
            return cls.from_text_file(model, path, **kw)
        dataset = _load_dataset_file(path)
        return cls.build(model, dataset, text_column=text_column, id_column=id_column, _source=str(path), **kw)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike, *, overwrite: bool = True) -> None:
        """Write the index to ``directory`` (``index.faiss``, ``docs.jsonl``, ``meta.json``, ``probe.npy``).

        The files are written into a temporary directory next to the target, which is then renamed into place, so
        an interrupted save never leaves a half-written index. An existing index at ``directory`` is replaced
        (unless ``overwrite=False``); an existing directory that is not empty and not an index is never touched.
        """
        import faiss

        target = Path(directory)
        if target.exists():
            if not target.is_dir():
                raise ConfigurationError(f"cannot save the index to {target}: it exists and is not a directory")
            if not overwrite:
                raise ConfigurationError(f"{target} already exists (pass overwrite=True / --overwrite to replace it)")
            if any(target.iterdir()) and not (target / META_FILE).is_file():
                raise ConfigurationError(
                    f"refusing to replace {target}: it is a non-empty directory that is not a semantic index"
                )
        parent = target.parent
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            faiss.write_index(self.index, str(tmp / INDEX_FILE))
            with (tmp / DOCS_FILE).open("w", encoding="utf-8") as handle:
                for doc_id, text in zip(self.ids, self.texts):
                    handle.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
            if self.model_identity is not None:
                np.save(tmp / PROBE_FILE, self.model_identity.probe_embeddings.astype(np.float32))
            with (tmp / META_FILE).open("w", encoding="utf-8") as handle:
                json.dump(self._meta(), handle, indent=2, ensure_ascii=False)
                handle.write("\n")
            for name in os.listdir(tmp):
                _fsync(tmp / name)
            os.chmod(tmp, 0o755)
            if target.exists():
                old = parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
                os.rename(target, old)
                try:
                    os.rename(tmp, target)
                except BaseException:
                    os.rename(old, target)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("saved %s index of %d documents to %s", self.index_type, len(self), target)

    def _meta(self) -> dict[str, Any]:
        import faiss

        from st_prompts import __version__

        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model": self.model_identity.to_json() if self.model_identity is not None else None,
            "dimension": int(self.index.d),
            "num_docs": len(self),
            "index_type": self.index_type,
            "index_params": self.index_params,
            "faiss_factory": _factory_string(self.index_type, self.index_params),
            "metric": "inner_product",
            "normalization": "l2",
            "score": "cosine",
            "duplicate_texts": len(self.texts) - len(set(self.texts)),
            **self.info,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "st_prompts_version": __version__,
            "faiss_version": getattr(faiss, "__version__", None),
        }

    @classmethod
    def load(
        cls, directory: str | os.PathLike, model: "SentenceTransformer | str | None" = None
    ) -> "SemanticIndex":
        """Load an index saved by :meth:`save`.

        Args:
            directory: the index directory.
            model: optional model (or model name, loaded with :func:`load_model`) to encode queries with. It is
                checked against the index's recorded model identity (dimension and probe fingerprint). Without it,
                the recorded model is loaded (and checked) by name at the first text search.

        Raises:
            DataNotFoundError: the directory does not exist.
            DataFormatError: it is not a complete, consistent semantic index.
            BackboneMismatchError: ``model`` is not the index's model.
        """
        import faiss

        root = Path(directory)
        if not root.exists():
            raise DataNotFoundError(f"index directory not found: {root}")
        if not root.is_dir():
            raise DataFormatError(f"{root} is not an index directory (expected {META_FILE}, {INDEX_FILE}, ...)")
        for name in (META_FILE, INDEX_FILE, DOCS_FILE):
            if not (root / name).is_file():
                raise DataFormatError(f"{root} is not a complete semantic index: {name} is missing")
        try:
            meta = json.loads((root / META_FILE).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataFormatError(f"{root / META_FILE} is not valid JSON: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise DataFormatError(f"{root / META_FILE} does not describe a st-prompts semantic index")
        if int(meta.get("format_version", 0)) > FORMAT_VERSION:
            raise DataFormatError(
                f"{root} was written by a newer st-prompts (format {meta['format_version']} > {FORMAT_VERSION})"
            )
        try:
            faiss_index = faiss.read_index(str(root / INDEX_FILE))
        except RuntimeError as exc:
            raise DataFormatError(f"cannot read {root / INDEX_FILE}: {str(exc).strip().splitlines()[-1]}") from exc
        ids, texts = [], []
        with (root / DOCS_FILE).open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    record = json.loads(line)
                    ids.append(record["id"])
                    texts.append(record["text"])
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataFormatError(f"{root / DOCS_FILE}, line {number}: bad record ({exc})") from exc
        if not (faiss_index.ntotal == len(ids) == meta.get("num_docs")):
            raise DataFormatError(
                f"{root} is inconsistent: {faiss_index.ntotal} vectors, {len(ids)} documents, "
                f"meta.json says {meta.get('num_docs')}"
            )
        identity = None
        if meta.get("model") is not None:
            if not (root / PROBE_FILE).is_file():
                raise DataFormatError(f"{root} is not a complete semantic index: {PROBE_FILE} is missing")
            info = meta["model"]
            identity = ModelIdentity(
                name=info["name"],
                dimension=int(info["dimension"]),
                fingerprint=info["fingerprint"],
                probe_embeddings=np.load(root / PROBE_FILE),
                path=info.get("path"),
            )
        index_type = meta["index_type"]
        params = dict(meta.get("index_params") or {})
        if index_type not in INDEX_TYPES:
            raise DataFormatError(f"{root / META_FILE}: unknown index_type {index_type!r}")
        if params:
            _apply_search_params(faiss_index, index_type, params)
        info = {key: value for key, value in meta.items() if key not in _CORE_META_KEYS}
        loaded = cls(
            faiss_index, ids, texts, index_type=index_type, index_params=params, model_identity=identity, info=info
        )
        if model is not None:
            loaded.set_model(model)
        return loaded

    # ------------------------------------------------------------------ querying
    def set_model(self, model: "SentenceTransformer | str") -> None:
        """Use ``model`` (an object or a name for :func:`load_model`) to encode queries, after checking it matches."""
        if isinstance(model, (str, os.PathLike)):
            model = load_model(str(model))
        if self.model_identity is not None:
            self.model_identity.check_compatible(ModelIdentity.of(model))
        elif _embedding_dimension(model) not in (None, self.dimension):
            raise BackboneMismatchError(
                f"the model produces {_embedding_dimension(model)}-dimensional embeddings, the index has "
                f"{self.dimension} dimensions"
            )
        self.model = model

    def set_search_params(self, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Change the speed/recall trade-off of an approximate index (saved with the index)."""
        if nprobe is not None:
            if self.index_type != "ivf":
                raise ConfigurationError(f"nprobe applies to an 'ivf' index, this one is {self.index_type!r}")
            self.index_params["nprobe"] = min(_check_k(nprobe), self.index_params["nlist"])
        if ef_search is not None:
            if self.index_type != "hnsw":
                raise ConfigurationError(f"ef_search applies to an 'hnsw' index, this one is {self.index_type!r}")
            self.index_params["ef_search"] = _check_k(ef_search)
        _apply_search_params(self.index, self.index_type, self.index_params)

    def search(
        self,
        queries: str | Sequence[str],
        k: int = 10,
        *,
        batch_size: int = 64,
        show_progress_bar: bool = False,
    ) -> list[list[SearchHit]]:
        """Return the ``k`` nearest documents of each query, best first, as :class:`SearchHit` (id, text, cosine).

        ``queries`` is a string or a list of strings; the result always has one list per query. Queries are encoded
        with ``encode_query`` of the index's model (loaded by name on first use if the index has none yet). ``k`` is
        clamped to the corpus size with a warning.
        """
        single = isinstance(queries, str)
        queries = [queries] if single else list(queries)
        if not all(isinstance(query, str) for query in queries):
            raise ConfigurationError("queries must be a string or a list of strings")
        k = _check_k(k)
        if not queries:
            return []
        model = self._query_model()
        embeddings = _encode(model, queries, kind="query", batch_size=batch_size, progress=show_progress_bar)
        return self.search_embeddings(embeddings, k, _stacklevel=3)

    def search_embeddings(self, query_embeddings: Any, k: int = 10, *, _stacklevel: int = 2) -> list[list[SearchHit]]:
        """Like :meth:`search` for precomputed query embeddings (one row per query; normalised here)."""
        k = _check_k(k)
        queries = _l2_normalize(query_embeddings)
        if queries.shape[1] != self.dimension:
            raise BackboneMismatchError(
                f"query embeddings have {queries.shape[1]} dimensions, the index has {self.dimension}"
            )
        if k > len(self):
            warnings.warn(
                f"k={k} is larger than the corpus ({len(self)} documents); returning at most {len(self)} hits",
                UserWarning,
                stacklevel=_stacklevel,
            )
            k = len(self)
        scores, positions = self.index.search(queries, k)
        results = []
        for row_scores, row_positions in zip(scores, positions):
            results.append(
                [
                    SearchHit(self.ids[pos], self.texts[pos], float(score))
                    for score, pos in zip(row_scores, row_positions)
                    if pos >= 0
                ]
            )
        return results

    def _query_model(self) -> "SentenceTransformer":
        if self.model is None:
            if self.model_identity is None:
                raise ConfigurationError(
                    "this index was built from bare embeddings and has no model: pass one with set_model()/load(), "
                    "or use search_embeddings()"
                )
            identity = self.model_identity
            name = identity.name
            if identity.path and not _loadable_name(name) and os.path.isdir(identity.path):
                name = identity.path
            logger.info("loading the index's model %r", name)
            self.set_model(name)
        return self.model

    # ------------------------------------------------------------------ misc
    @property
    def dimension(self) -> int:
        """Embedding dimension of the index."""
        return int(self.index.d)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        model = self.model_identity.name if self.model_identity is not None else None
        return (
            f"SemanticIndex(type={self.index_type!r}, params={self.index_params}, docs={len(self)}, "
            f"dim={self.dimension}, model={model!r})"
        )


def _is_dataset(obj: Any) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, datasets.Dataset)


def _loadable_name(name: str) -> bool:
    """Whether ``name`` can plausibly be loaded: an alias, an existing path, or a hub-style id (not a dead path)."""
    from st_prompts.utils import PACKAGED_MINILM_ALIASES

    if name in PACKAGED_MINILM_ALIASES or os.path.exists(name):
        return True
    return not (os.path.isabs(name) or name.startswith((".", "~")))


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
