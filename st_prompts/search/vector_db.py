"""A semantic index in a Milvus collection: export a FAISS index folder into one, open it, search it. Addresses
(:func:`parse_address`): ``milvus:PATH`` or ``PATH.db`` (Milvus Lite), ``http(s)://HOST:PORT`` (a server; token
from ``MILVUS_TOKEN``), with an optional ``#COLLECTION``. ``NAME`` is an alias to the latest finished version
``NAME__st_vSTAMP``, whose record (``...__st_prompts``) holds the model identity (design: ``docs/search.md``)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, first_line, shorten
from st_prompts.numbers import positive_int
from st_prompts.search.checks import whole
from st_prompts.search.embedding_files import identity_from_record, identity_record
from st_prompts.search.identity import PROBE_SENTENCES, ModelIdentity
from st_prompts.storage import managed_ancestor

if TYPE_CHECKING:  # pragma: no cover
    from st_prompts.search.index import SearchHit, SemanticIndex

RECORD_SUFFIX = "__st_prompts"
VERSION_MARK = "__st_v"  # between NAME and each version's stamp; names with "__st_" are reserved
#: An unfinished version on a server older than this is an export that broke off; a younger one may still be filling.
STALE_SECONDS = 24 * 3600
RECORD_FORMAT = "st-prompts-collection"
RECORD_VERSION = 1
RECORD_PART_CHARS = 60_000  # a VARCHAR holds at most 65,535 bytes; the record is ASCII JSON, cut into parts this long
MAX_VARCHAR_BYTES = 65_535
MAX_TOP_K = 16_384  # Milvus's limit on k
INSTALL_HINT = 'pip install "st-prompts[scale]"'
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}")
_STAMP = re.compile(r"[0-9]{14}_[0-9a-f]{8}")

#: How each FAISS index type is mirrored: (Milvus type, build parameters, search parameters); IVF-PQ becomes IVF_SQ8
#: (Milvus Lite has no IVF_PQ).
_MIRRORS = {
    "flat": ("FLAT", (), ()),
    "ivf": ("IVF_FLAT", (("nlist", "nlist"),), (("nprobe", "nprobe"),)),
    "ivfpq": ("IVF_SQ8", (("nlist", "nlist"),), (("nprobe", "nprobe"),)),
    "hnsw": ("HNSW", (("m", "M"), ("ef_construction", "efConstruction")), (("ef_search", "ef"),)),
}


@dataclass(frozen=True)
class CollectionAddress:
    """Where a collection lives: ``uri`` as ``MilvusClient`` takes it (a ``.db`` path or a server URL), its name."""

    uri: str
    collection: str
    embedded: bool

    def __str__(self) -> str:
        return f"{'milvus:' if self.embedded else ''}{self.uri}#{self.collection}"


def is_address(text: str) -> bool:
    """Whether ``text`` names a vector-database collection rather than a FAISS index folder (one with ``meta.json``)."""
    if text.startswith(("milvus:", "http://", "https://")):
        return True
    location = text.partition("#")[0]
    return location.endswith(".db") and not os.path.isfile(os.path.join(location, "meta.json"))


def parse_address(text: str, default_collection: str | None = None) -> CollectionAddress:
    """Read ``[milvus:]PATH.db[#NAME]``, ``milvus:PATH[#NAME]`` or ``http(s)://HOST:PORT[#NAME]``.

    Raises ConfigurationError for an unknown scheme, an empty path, or a missing or bad collection name.
    """
    location, _, collection = str(text).partition("#")
    collection = collection or default_collection or ""
    if location.startswith("milvus://"):
        location = "http://" + location[len("milvus://"):]
    if location.startswith(("http://", "https://")):
        host = location.split("://", 1)[1].rstrip("/")
        if not host or "/" in host or any(c.isspace() for c in host):
            raise ConfigurationError(f"{shorten(text)} is not a server address: use http://HOST:PORT[#COLLECTION]")
        uri, embedded = location.rstrip("/"), False
    elif location.startswith("milvus:") or (location.endswith(".db") and "://" not in location):
        path = location.removeprefix("milvus:")
        if not path:
            raise ConfigurationError(f"{shorten(text)} names no file: use milvus:PATH[#COLLECTION]")
        uri, embedded = os.path.abspath(os.path.expanduser(path)), True
    else:
        raise ConfigurationError(f"{shorten(text)} is not a vector database address: use milvus:PATH.db[#COLLECTION] "
                                 "(an embedded Milvus Lite file) or http://HOST:PORT[#COLLECTION] (a Milvus server)")
    if not collection:
        raise ConfigurationError(f"{shorten(text)} names no collection: add #COLLECTION")
    if not _NAME.fullmatch(collection) or "__st_" in collection:
        raise ConfigurationError(f"collection name {shorten(collection)}: use letters, digits and '_' (not starting "
                                 "with a digit; '__st_' is st-prompts' own)")
    return CollectionAddress(uri=uri, collection=collection, embedded=embedded)


def collection_name_for(folder: str | os.PathLike) -> str:
    """A collection name from an index folder's name (``docs.index`` -> ``docs_index``)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", os.path.basename(os.path.abspath(folder)))[:200] or "documents"
    return name if not name[0].isdigit() else f"c_{name}"


def connect(address: CollectionAddress) -> Any:
    """A ``pymilvus.MilvusClient`` for ``address``; ConfigurationError if pymilvus / milvus-lite is missing or the
    file or server cannot be opened."""
    try:
        from pymilvus import MilvusClient
    except ImportError:
        raise ConfigurationError(f"a vector database needs pymilvus: {INSTALL_HINT}") from None
    # pymilvus logs every failed call with its traceback; the errors raised here say what failed, in one line
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
    if address.embedded:
        try:
            import milvus_lite  # noqa: F401 - pymilvus opens a .db file through it
        except ImportError:
            raise ConfigurationError(f"a Milvus Lite file needs milvus-lite: {INSTALL_HINT}") from None
        # milvus-lite and its gRPC server log tracebacks for a locked file and for calls pymilvus then does without
        logging.getLogger("milvus_lite.server_manager").setLevel(logging.CRITICAL)
        logging.getLogger("grpc._server").setLevel(logging.CRITICAL)
        if not os.path.isdir(os.path.dirname(address.uri)):
            raise DataNotFoundError(f"no folder {os.path.dirname(address.uri)} for the Milvus Lite file {address.uri}")
    try:
        return MilvusClient(address.uri, token=os.environ.get("MILVUS_TOKEN", ""))
    except Exception as exc:  # pymilvus raises MilvusException, milvus-lite its own (the file's LOCK is held), ...
        where = f"the Milvus Lite file {address.uri}" if address.embedded else f"the Milvus server {address.uri}"
        raise ConfigurationError(f"cannot open {where}: {first_line(exc, 300)}") from None


@contextmanager
def database_errors(address: CollectionAddress, doing: str) -> Iterator[None]:
    """Turn the database's own errors into one :class:`ConfigurationError` line."""
    from pymilvus.exceptions import MilvusException

    try:
        yield
    except MilvusException as exc:
        raise ConfigurationError(f"{doing} {address.collection!r} at {address.uri} failed: "
                                 f"{first_line(exc, 300)}") from None


def release(address: CollectionAddress) -> None:
    """Close the Milvus Lite file of ``address`` in this process (pymilvus keeps it locked until exit otherwise)."""
    if address.embedded:
        from milvus_lite.server_manager import server_manager_instance

        server_manager_instance.release_server(address.uri)


def _read_record(client: Any, collection: str) -> dict[str, Any] | None:
    """The record beside ``collection``, or ``None`` when it has none."""
    name = collection + RECORD_SUFFIX
    if not client.has_collection(name):
        return None
    client.load_collection(name)  # a collection is "released" when its file was opened again
    rows = client.query(name, filter="key >= 0", output_fields=["key", "part"], limit=1000)
    text = "".join(row["part"] for row in sorted(rows, key=lambda row: row["key"]))
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) and record.get("format") == RECORD_FORMAT else {}


def _write_record(client: Any, collection: str, record: dict[str, Any]) -> None:
    """Write the record beside ``collection``, JSON in parts, in a collection of its own (with a 2-d placeholder
    vector, as Milvus needs one); upsert, then drop parts left over."""
    from pymilvus import DataType

    name = collection + RECORD_SUFFIX
    if not client.has_collection(name):
        schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("key", DataType.INT64, is_primary=True)
        schema.add_field("part", DataType.VARCHAR, max_length=MAX_VARCHAR_BYTES)
        schema.add_field("placeholder", DataType.FLOAT_VECTOR, dim=2)
        params = client.prepare_index_params()
        params.add_index(field_name="placeholder", index_type="FLAT", metric_type="L2")
        client.create_collection(name, schema=schema, index_params=params, consistency_level="Strong")
    text = json.dumps(record, ensure_ascii=True)
    parts = [text[i:i + RECORD_PART_CHARS] for i in range(0, len(text), RECORD_PART_CHARS)]
    client.upsert(name, [{"key": i, "part": part, "placeholder": [0.0, 0.0]} for i, part in enumerate(parts)])
    client.delete(name, filter=f"key >= {len(parts)}")
    client.flush(name)


def _target(client: Any, name: str) -> tuple[str | None, bool]:
    """The collection ``name`` reads (its alias's target, a collection of that name, or ``None``), and whether it is
    an alias."""
    from pymilvus.exceptions import MilvusException

    try:
        target = client.describe_alias(name).get("collection_name")
    except MilvusException:  # not an alias
        target = None
    if target:
        return target, True
    return (name, False) if client.has_collection(name) else (None, False)


def _versions(client: Any, name: str) -> list[str]:
    """The versions of ``name`` in the database (collections ``NAME__st_v<stamp>``), oldest first."""
    prefix = name + VERSION_MARK
    return sorted(c for c in client.list_collections() if c.startswith(prefix) and not c.endswith(RECORD_SUFFIX)
                  and _STAMP.fullmatch(c[len(prefix):]))


def _drop(client: Any, collection: str) -> None:
    """Drop ``collection`` and its record (a server refuses to drop a collection an alias still names: kept)."""
    from pymilvus.exceptions import MilvusException

    with suppress(MilvusException):
        client.drop_collection(collection)
        if client.has_collection(collection + RECORD_SUFFIX):
            client.drop_collection(collection + RECORD_SUFFIX)


def _drop_superseded(client: Any, name: str, keep: set[str], embedded: bool) -> None:
    """Drop the versions of ``name`` not in ``keep`` nor the alias's target: finished ones, and unfinished ones no
    export can still be filling (a Lite file has one writer; on a server, after :data:`STALE_SECONDS`)."""
    from pymilvus.exceptions import MilvusException

    for version in _versions(client, name):
        try:
            if version in keep or version == _target(client, name)[0]:  # read again: another export may move it
                continue
            record = _read_record(client, version)
        except MilvusException:  # a record collection of another shape (not ours): never dropped
            continue
        if not record:  # not st-prompts' record: never dropped
            continue
        started = record.get("started")
        stale = embedded or not isinstance(started, (int, float)) or time.time() - started > STALE_SECONDS
        if record.get("complete") or stale:
            _drop(client, version)


def _vector_batches(index: SemanticIndex, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, vectors)`` of the index, ``rows`` at a time (read block by block where FAISS allows)."""
    import faiss

    total = len(index)
    source = reader = None
    if index.vectors is None and index.index_type in ("flat", "hnsw"):  # read by blocks: no copy of every vector
        reader = index.index if index.index_type == "flat" else faiss.downcast_index(index.index).storage
    else:
        source = index.exact_vectors()  # IVF-PQ's stored float16 vectors, or an IVF index's inverted lists
    for first in range(0, total, rows):
        count = min(rows, total - first)
        block = source[first:first + count] if source is not None else reader.reconstruct_n(first, count)
        yield first, np.ascontiguousarray(block, dtype=np.float32)


def _id_kind(ids: Any) -> str:
    kinds = {"str" if isinstance(i, str) else "int" if isinstance(i, (int, np.integer)) and not isinstance(i, bool)
             else "other" for i in ids}
    if kinds == {"int"}:
        if ids and (min(ids) < -2**63 or max(ids) >= 2**63):
            raise DataFormatError("a document id does not fit Milvus's INT64 ids")
        return "int"
    if kinds == {"str"}:
        return "str"
    raise DataFormatError("a collection needs ids of one kind: all integers or all strings")


def export_index(index: SemanticIndex, address: CollectionAddress, *, overwrite: bool = False, rows: int = 2_000,
                 progress: bool = False, source: str | None = None) -> dict[str, Any]:
    """Copy ``index`` (ids, texts, vectors, model identity) into the collection at ``address``, ``rows`` documents
    per insert; returns the record written beside it.

    Raises:
        ConfigurationError: the collection exists (without ``overwrite``) or was not written by st-prompts.
        DataFormatError: mixed or oversized ids, a document longer than a VARCHAR holds.
    """
    rows = positive_int(rows, "rows")
    if index.vectors is None and index.index_type == "ivfpq":
        raise ConfigurationError("this IVF-PQ index keeps no vectors (built with rerank 0): it cannot be exported "
                                 "exactly; rebuild it with --rerank, or as another type")
    id_kind = _id_kind(index.ids)
    for doc_id, text in zip(index.ids, index.texts):  # before anything is written
        if len(text) * 4 > MAX_VARCHAR_BYTES and len(text.encode("utf-8")) > MAX_VARCHAR_BYTES:
            raise DataFormatError(f"document {shorten(doc_id)} is longer than the {MAX_VARCHAR_BYTES:,} bytes a "
                                  "Milvus VARCHAR holds: split it into shorter documents")
    owner = managed_ancestor(address.uri) if address.embedded else None
    if owner is not None:  # the file would be one the folder's manifest does not list: every later change refused
        raise ConfigurationError(f"{address.uri} lies inside {owner[0]}, a {owner[1]} st-prompts saved (it holds only "
                                 "the files it lists): write the Milvus Lite file elsewhere")
    index_type, build_names, search_names = _MIRRORS[index.index_type]
    build = {theirs: index.index_params[ours] for ours, theirs in build_names if ours in index.index_params}
    search = {theirs: index.index_params[ours] for ours, theirs in search_names if ours in index.index_params}
    client = connect(address)
    try:
        with database_errors(address, "exporting to"):
            return _export(client, index, address, overwrite=overwrite, rows=rows, progress=progress, source=source,
                           id_kind=id_kind, mirror=(index_type, build, search))
    finally:
        client.close()
        release(address)


def _export(client: Any, index: SemanticIndex, address: CollectionAddress, *, overwrite: bool, rows: int,
            progress: bool, source: str | None, id_kind: str, mirror: tuple[str, dict, dict]) -> dict[str, Any]:
    """:func:`export_index` once connected."""
    from pymilvus import DataType
    from tqdm.auto import tqdm

    index_type, build, search = mirror
    name = address.collection
    target, aliased = _target(client, name)
    existing = _read_record(client, target) if target is not None else None
    if target is not None and existing is None:
        raise ConfigurationError(f"the collection {name!r} at {address.uri} exists and was not written by "
                                 "st-prompts: it is never replaced; choose another #COLLECTION")
    if target is not None and not overwrite:
        raise ConfigurationError(f"the collection {name!r} already exists at {address.uri}; pass --overwrite to "
                                 "replace it")
    version = f"{name}{VERSION_MARK}{time.strftime('%Y%m%d%H%M%S', time.gmtime())}_{uuid.uuid4().hex[:8]}"
    record = {
        "format": RECORD_FORMAT, "format_version": RECORD_VERSION, "complete": False, "collection": name,
        "version": version, "started": round(time.time(), 3),
        "documents": len(index), "dimension": index.dimension, "id_kind": id_kind,
        "source": {"path": source, "index_type": index.index_type, "index_params": {
            k: v for k, v in index.index_params.items() if isinstance(v, (int, float, str, bool))}},
        "search": {"index_type": index_type, "metric_type": "IP", "build": build, "params": search},
        "model": identity_record(index.model_identity) if index.model_identity is not None else None,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_record(client, version, record)  # unfinished: the version is ours, and not yet to be read
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    if id_kind == "int":
        schema.add_field("id", DataType.INT64, is_primary=True)
    else:
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_VARCHAR_BYTES)
    schema.add_field("text", DataType.VARCHAR, max_length=MAX_VARCHAR_BYTES)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=index.dimension)
    params = client.prepare_index_params()
    # build parameters under "params": the form every Milvus reads (Milvus Lite 3 ignores them spread out)
    params.add_index(field_name="vector", index_type=index_type, metric_type="IP", params={"params": build})
    client.create_collection(version, schema=schema, index_params=params)
    with tqdm(total=len(index), unit="doc", desc=f"Exporting to {name}", disable=not progress) as bar:
        for first, vectors in _vector_batches(index, rows):
            ids = index.ids[first:first + len(vectors)]
            texts = index.texts[first:first + len(vectors)]
            client.insert(version, [{"id": doc_id if id_kind == "str" else int(doc_id), "text": text,
                                     "vector": vector} for doc_id, text, vector in zip(ids, texts, vectors)])
            bar.update(len(vectors))
    client.flush(version)
    client.load_collection(version)
    record["complete"] = True
    _write_record(client, version, record)
    _point(client, name, version, target, aliased)
    _drop_superseded(client, name, {version, target} if aliased else {version}, address.embedded)
    return record


def _point(client: Any, name: str, version: str, target: str | None, aliased: bool) -> None:
    """Make ``name`` read ``version``: move or create its alias (dropping first a collection called ``name``)."""
    from pymilvus.exceptions import MilvusException

    if aliased:
        client.alter_alias(version, name)
        return
    if target is not None:
        client.drop_collection(target)
        client.drop_collection(target + RECORD_SUFFIX)
    try:
        client.create_alias(version, name)
    except MilvusException:  # another export created the alias meanwhile: the later one wins
        client.alter_alias(version, name)


def _check_record(record: dict[str, Any], address: CollectionAddress) -> None:
    """Check the values of a record that a search uses (a database is input like a folder)."""
    search = record.get("search")
    good = (whole(record.get("dimension"), 1, 1 << 16) and whole(record.get("documents"), 0, 1 << 62)
            and isinstance(search, dict) and isinstance(search.get("index_type"), str)
            and isinstance(search.get("params"), dict)
            and all(k in ("nprobe", "ef") and whole(v, 1, 1 << 20) for k, v in search["params"].items()))
    if good and record.get("model") is not None:
        try:
            identity = identity_from_record(record["model"])
            good = identity.dimension == record["dimension"] and np.shape(identity.probe_embeddings) == (
                len(PROBE_SENTENCES), record["dimension"])
        except Exception:  # a missing key, a wrong type, probe embeddings that are not a matrix
            good = False
    if not good:
        raise DataFormatError(f"the record of the collection {address.collection!r} at {address.uri} is damaged: "
                              "export the index again with --overwrite")


class VectorCollection:
    """A collection written by :func:`export_index`, searched like a :class:`~st_prompts.search.SemanticIndex`.

    It searches the version its name pointed to when opened; the client is opened per process (a gRPC channel does
    not survive a fork)."""

    def __init__(self, address: CollectionAddress, record: dict[str, Any], client: Any,
                 collection: str | None = None) -> None:
        self.address = address
        self.collection = collection or address.collection  # the version opened: searched until reloaded
        self.record = record
        self.index_type = f"milvus:{record['search']['index_type']}"
        self.index_params = dict(record["search"]["params"])
        model = record.get("model")
        self.model_identity: ModelIdentity | None = identity_from_record(model) if model else None
        self._client = client
        self._pid = os.getpid()

    @classmethod
    def open(cls, address: CollectionAddress) -> VectorCollection:
        """Open the collection at ``address`` and read its record.

        Raises:
            DataNotFoundError: no such collection.
            DataFormatError: it was not written by st-prompts, or its export did not finish.
        """
        if address.embedded and not os.path.exists(address.uri):  # opening it would create an empty one
            raise DataNotFoundError(f"no Milvus Lite file {address.uri}")
        client = connect(address)
        try:
            with database_errors(address, "opening"):
                return cls._checked(address, client)
        except BaseException:
            client.close()
            raise

    @classmethod
    def _checked(cls, address: CollectionAddress, client: Any) -> VectorCollection:
        name = address.collection
        target, _ = _target(client, name)
        if target is None:
            if _versions(client, name):  # an export has begun and not finished, or broke off
                raise DataFormatError(f"the export to {name!r} at {address.uri} did not finish: run st-prompts index "
                                      "export again")
            raise DataNotFoundError(f"no collection {name!r} at {address.uri}")
        record = _read_record(client, target)
        if record is None:
            raise DataFormatError(f"the collection {name!r} at {address.uri} was not written by st-prompts index "
                                  "export: it records no model")
        if not record:
            raise DataFormatError(f"the record of the collection {name!r} is unreadable")
        if not record.get("complete"):
            raise DataFormatError(f"the export to {name!r} at {address.uri} did not finish: run st-prompts index "
                                  "export again with --overwrite")
        if record.get("format_version") != RECORD_VERSION:
            raise DataFormatError(f"the collection {name!r} was written by another st-prompts "
                                  f"(record version {shorten(record.get('format_version'))})")
        _check_record(record, address)
        client.load_collection(target)
        return cls(address, record, client, target)

    @property
    def dimension(self) -> int:
        return int(self.record["dimension"])

    def __len__(self) -> int:
        return int(self.record["documents"])

    def _connection(self) -> Any:
        if self._pid != os.getpid():
            self._client, self._pid = connect(self.address), os.getpid()
        return self._client

    def search_embeddings(self, query_embeddings: Any, k: int = 10) -> list[list[SearchHit]]:
        """The ``k`` best documents of each query vector (normalised here), best first, as in FAISS."""
        from st_prompts.search.encoding import l2_normalize
        from st_prompts.search.index import SearchHit

        queries = l2_normalize(query_embeddings)
        if queries.shape[1] != self.dimension:
            raise DataFormatError(f"query embeddings have {queries.shape[1]} dimensions, the collection "
                                  f"{self.dimension}")
        limit = max(1, min(int(k), len(self), MAX_TOP_K))
        try:
            results = self._connection().search(
                self.collection, data=list(queries), limit=limit, output_fields=["text"],
                search_params={"metric_type": "IP", "params": self.index_params})
        except Exception as exc:  # the server went away, the collection was dropped meanwhile, ...
            raise ConfigurationError(f"searching the collection {self.address.collection!r} at {self.address.uri} "
                                     f"failed: {first_line(exc, 300)}") from None
        return [[SearchHit(hit["id"], hit["entity"]["text"], float(hit["distance"])) for hit in row]
                for row in results]

    def close(self) -> None:
        """Close this process's client (a Milvus Lite file stays open: :func:`release` closes it)."""
        if self._pid == os.getpid():
            self._client.close()
