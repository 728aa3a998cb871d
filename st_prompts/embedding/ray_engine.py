"""Embedding on a Ray cluster with Ray Data (optional, imported only here): a pool of actors, each loading the model
once, fed by ``map_batches``. :func:`encode_parts_on_ray` (``--engine ray``) sends each unfinished part as a descriptor
that a task on a node reads from the input (the same file on every node), the vectors going back to the driver, the
folder's one writer; :func:`embed_dataset` adds a ``vector`` column to a user's ``ray.data.Dataset``."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from st_prompts.embedding.encoder import ModelSpec, check_tasks, encode_part
from st_prompts.embedding.inputs import InputSource, read_part
from st_prompts.errors import ConfigurationError, DataFormatError, StPromptsError

INSTALL = 'pip install "st-prompts[scale]"'


def import_ray() -> Any:
    """``ray`` with Ray Data, or a one-line :class:`ConfigurationError` saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401 - the [data] extra: pandas, pyarrow and Ray Data itself
    except ImportError as exc:
        raise ConfigurationError(f"the Ray engine needs Ray Data ({exc.name or 'ray'} is not installed): "
                                 f"{INSTALL}") from None
    return ray


def node_info() -> dict[str, Any]:
    """Where this process runs: Ray's node id and address, the host and the process (recorded in each part)."""
    import socket

    import ray

    return {"engine": "ray", "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "host": socket.gethostname(), "pid": os.getpid()}


def _read_descriptors(batch: dict[str, np.ndarray], source: InputSource) -> dict[str, np.ndarray]:
    """``--engine ray``'s first stage: part descriptors in, the parts' rows out (``part``, ``row``, ``text``,
    ``task``), each read on the node and checked against the driver's digest."""
    columns: dict[str, list] = {"part": [], "row": [], "text": [], **({"task": []} if source.task_column else {})}
    for number, first_row, locator, digest in zip(batch["part"], batch["first_row"], batch["locator"],
                                                   batch["digest"]):
        part = read_part(source, int(number), int(first_row), json.loads(str(locator)))
        if part.digest != str(digest):
            raise DataFormatError(f"{source.path} on node {node_info()['node_ip']} holds other rows than on the "
                                  f"driver (part {int(number)}): the input must be the same file on every node")
        columns["part"] += [int(number)] * len(part.texts)
        columns["row"] += range(len(part.texts))
        columns["text"] += part.texts
        if source.task_column:
            columns["task"] += [t if t is not None else "" for t in part.tasks]
    return {"part": np.asarray(columns["part"], dtype=np.int64), "row": np.asarray(columns["row"], dtype=np.int64),
            **{name: np.asarray(values, dtype=object) for name, values in columns.items() if name in ("text", "task")}}


class _DatasetEncoder:
    """``map_batches`` class of :func:`embed_dataset`: a user's rows in, the same rows with their vectors out (the
    actor's model loaded once, on a thread budget of its CPUs, and its identity). ``identity_column``: each call's
    first row also carries the actor's identity record (recorded under ``name``); ``keep``: the input columns kept
    (default all), dropped here (a ``select_columns`` stage would need a CPU the actors hold, holding every part
    back until the last)."""

    def __init__(self, spec: ModelSpec, task: str | None, batch_size: int, threads: int, text_column: str = "text",
                 task_column: str | None = None, output_column: str = "vector", node_column: str | None = None,
                 identity_column: str | None = None, keep: list[str] | None = None,
                 identity: dict[str, Any] | None = None, name: str | None = None) -> None:
        import torch

        from st_prompts.search.embedding_files import identity_from_record, identity_record
        from st_prompts.search.identity import ModelIdentity

        torch.set_num_threads(max(1, threads))  # Ray also sets OMP_NUM_THREADS; torch may have read it before
        self.model = spec.load()
        self.task, self.batch_size = task, batch_size
        check_tasks(self.model, [task])
        own = ModelIdentity.of(self.model, name=name, task=task)
        if identity is not None:  # the same path may hold another model on another node
            identity_from_record(identity).check_compatible(own)
        self.identity = json.dumps(identity_record(own))
        self.node = json.dumps({**node_info(), "fingerprint": own.fingerprint,
                                "ready": round(time.time(), 3)})  # when its model was loaded
        self.text_column, self.task_column, self.output_column = text_column, task_column, output_column
        self.node_column, self.identity_column, self.keep = node_column, identity_column, keep

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.text_column not in batch:
            raise DataFormatError(f"the dataset has no column {self.text_column!r} (columns: {', '.join(batch)})")
        texts = [str(t) if t is not None else "" for t in batch[self.text_column]]
        tasks = None
        if self.task_column is not None:
            tasks = [str(t) if isinstance(t, str) and t.strip() else None for t in batch[self.task_column]]
            check_tasks(self.model, tasks)
        kept = batch if self.keep is None else {name: batch[name] for name in self.keep}
        out = {**kept, self.output_column: encode_part(self.model, texts, tasks, self.task, self.batch_size)}
        if self.node_column is not None:
            out[self.node_column] = np.array([self.node] * len(texts), dtype=object)
        if self.identity_column is not None:  # the whole record (kilobytes) once a call: its first row
            out[self.identity_column] = np.array([self.identity] + [""] * (len(texts) - 1), dtype=object)[:len(texts)]
        return out


def _actors(ray: Any, wanted: int | None, num_cpus: float, num_gpus: float, work: int) -> int:
    """``wanted`` actors, or as many as the cluster's CPUs (GPUs, when each actor takes some) hold, at most one a
    part of ``work`` and at least one."""
    if wanted is not None:
        return max(1, int(wanted))
    resources = ray.cluster_resources()
    fits = (math.floor(resources.get("GPU", 0) / num_gpus) if num_gpus > 0
            else math.floor(resources.get("CPU", 1) / max(num_cpus, 1e-3)))
    return max(1, min(fits, max(work, 1)))


def _user_error(exc: BaseException) -> StPromptsError | None:
    """The package's own error inside what Ray raised (a task's or an actor's), if any: shown as its one line."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, StPromptsError):
            return error
        todo += [error.__cause__, error.__context__, getattr(error, "cause", None)]
        if hasattr(error, "as_instanceof_cause"):
            with suppress(Exception):  # a cause Ray cannot rebuild is no cause of ours
                todo.append(error.as_instanceof_cause())
    return None


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Refuse a ``[ray://]HOST:PORT`` where nothing listens (Ray 2.60's ``ray.init`` retries it for over ten
    minutes); other forms (``auto``, ``local``) are Ray's to resolve."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigurationError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} (is `ray start` "
                                 "running there, and is this its address?)") from None


def _connect(ray: Any, address: str | None) -> bool:
    """Join ``address``'s cluster, or start a local Ray; ``True`` when this call started it (to shut it down)."""
    if ray.is_initialized():
        return False
    if address:
        _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR,
                 log_to_driver=logging.getLogger("st_prompts").isEnabledFor(logging.DEBUG))
    except ConnectionError as exc:
        # Ray 2.59+'s `ray start` turns token authentication on, a client joining by address only when told; the
        # token is the cluster's secret, so this says how rather than sending it unasked
        hint = ("; a cluster with token authentication (Ray's default for `ray start` since 2.59) needs "
                "RAY_AUTH_MODE=token here too" if address and not os.environ.get("RAY_AUTH_MODE") else "")
        raise ConfigurationError(f"cannot reach the Ray cluster at {address}: {str(exc).splitlines()[0][:200]}"
                                 f"{hint}") from None
    return True


def encode_parts_on_ray(spec: ModelSpec, source: InputSource, todo: Sequence[tuple], *, task: str | None,
                        batch_size: int, options: Any, name: str | None, accept: Callable[[dict[str, Any]], None],
                        progress: bool = False, timing: dict[str, float] | None = None
                        ) -> Iterator[tuple[int, int, dict[str, int], str, np.ndarray, dict[str, Any]]]:
    """Encode the parts of ``todo`` (``(number, first_row, locator, digest, rows)`` each) on the pool and yield
    ``(number, first_row, locator, digest, vectors, node)`` as each part completes (in any order).

    The driver loads no model: ``accept(record)`` is called once for each distinct model identity the actors send
    (recorded under ``name``), before any part that model encoded is yielded; it raises to refuse it. ``timing``
    receives ``ray_start``: the seconds spent starting or joining Ray."""
    ray = import_ray()
    clock = time.perf_counter()
    started_here = _connect(ray, options.address)
    if timing is not None:
        timing["ray_start"] = time.perf_counter() - clock
    try:
        # Ray Data's progress bars only when ours are shown; its execution logs only with -v
        ray.data.DataContext.get_current().enable_progress_bars = progress
        if not logging.getLogger("st_prompts").isEnabledFor(logging.DEBUG):
            logging.getLogger("ray.data").setLevel(logging.ERROR)
        actors = min(_actors(ray, options.actors, options.num_cpus, options.num_gpus, len(todo)), len(todo))
        descriptors = [{"part": number, "first_row": first_row, "locator": json.dumps(locator), "digest": digest}
                       for number, first_row, locator, digest, _ in todo]
        expected = {number: (first_row, locator, digest, rows) for number, first_row, locator, digest, rows in todo}
        # Stage 1: Ray tasks read the parts, one at a time (no CPU reserved: reading is light, and each task in
        # flight would start a worker process). Stage 2: the actor pool; a call takes a whole part up to 4,096 rows
        # (sentence-transformers sorts a call's texts by length, so large calls keep padding low).
        rows = ray.data.from_items(descriptors, override_num_blocks=len(descriptors)).map_batches(
            _read_descriptors, batch_size=1, batch_format="numpy", fn_kwargs={"source": source}, num_cpus=0,
            concurrency=1)
        largest = max(entry[4] for entry in todo)
        dataset = _encode_stage(rows, spec, task=task, task_column="task" if source.task_column else None,
                                batch_size=batch_size, concurrency=actors, num_cpus=options.num_cpus,
                                num_gpus=options.num_gpus, rows_per_call=max(batch_size, min(largest, 4096)),
                                node_column="node", identity_column="identity", name=name, keep=["part", "row"])
        held: dict[int, list[tuple[np.ndarray, np.ndarray, str]]] = {}
        counts: dict[int, int] = {}
        accepted: set[str] = set()  # fingerprints of the models accept() took
        waiting: list[int] = []  # whole parts from a model whose record has not arrived yet
        try:
            for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
                for text in sorted({str(t) for t in batch["identity"] if t}):
                    record = json.loads(text)
                    if record.get("fingerprint") not in accepted:
                        accept(record)
                        accepted.add(record.get("fingerprint"))
                for number in np.unique(batch["part"]):
                    mask = batch["part"] == number
                    number = int(number)
                    held.setdefault(number, []).append((batch["row"][mask], batch["vector"][mask],
                                                        str(batch["node"][mask][0])))
                    counts[number] = counts.get(number, 0) + int(mask.sum())
                    if counts[number] == expected[number][3]:
                        waiting.append(number)
                ready = [n for n in waiting if {json.loads(p[2]).get("fingerprint") for p in held[n]} <= accepted]
                for number in ready:
                    waiting.remove(number)
                    yield (number, *expected[number][:3], *_whole_part(held.pop(number)))
            if waiting:  # every call sends its model's record: a bug if one did not
                raise DataFormatError(f"no model identity came back with part {waiting[0]}; run again")
        except Exception as exc:
            user = _user_error(exc)
            if user is None:
                raise
            raise type(user)(str(user).splitlines()[0]) from None
    finally:
        if started_here:
            ray.shutdown()


def _whole_part(pieces: list[tuple[np.ndarray, np.ndarray, str]]) -> tuple[np.ndarray, dict[str, Any]]:
    """A part's vectors in row order and the actor that encoded it (``also``: others that encoded some rows)."""
    order = np.argsort(np.concatenate([p[0] for p in pieces]), kind="stable")
    vectors = np.concatenate([p[1] for p in pieces]).astype(np.float32, copy=False)[order]
    node = json.loads(pieces[0][2])
    others = sorted({p[2] for p in pieces} - {pieces[0][2]})
    if others:  # a part's rows may be split between actors
        node["also"] = [json.loads(other) for other in others]
    return vectors, node


def embed_dataset(dataset: Any, model: str | ModelSpec, *, text_column: str = "text", task: str | None = None,
                  task_column: str | None = None, output_column: str = "vector", batch_size: int = 64,
                  concurrency: int | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
                  rows_per_call: int = 1024, node_column: str | None = None,
                  identity: dict[str, Any] | None = None) -> Any:
    """``dataset`` (a ``ray.data.Dataset`` with a ``text_column``) with the float32 vector of each row in
    ``output_column``, computed lazily by ``concurrency`` actors (default: as many as the cluster holds), each loading
    ``model`` once; ``num_cpus`` is also each actor's torch threads. The vectors are ``st-prompts embed``'s (``task``:
    one prompt set; ``task_column``: each row's, blank = ``task``). ``node_column``: also record which node encoded
    each row. ``identity``: an :func:`~st_prompts.search.embedding_files.identity_record` every actor's model must
    match."""
    ray = import_ray()
    if not isinstance(dataset, ray.data.Dataset):
        raise ConfigurationError(f"embed_dataset takes a ray.data.Dataset, got {type(dataset).__name__}")
    return _encode_stage(dataset, model, text_column=text_column, task=task, task_column=task_column,
                         output_column=output_column, batch_size=batch_size, concurrency=concurrency,
                         num_cpus=num_cpus, num_gpus=num_gpus, rows_per_call=rows_per_call, node_column=node_column,
                         identity=identity)


def _encode_stage(dataset: Any, model: str | ModelSpec, *, concurrency: int | None, num_cpus: float, num_gpus: float,
                  rows_per_call: int, **options: Any) -> Any:
    """:func:`embed_dataset`'s stage (``options``: the :class:`_DatasetEncoder`'s)."""
    import ray

    spec = model if isinstance(model, ModelSpec) else ModelSpec(str(model))
    actors = _actors(ray, concurrency, num_cpus, num_gpus, 1 << 30)
    # two calls in flight per actor: the first actor loaded would otherwise queue the work meant for the others
    pool = ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=2)
    return dataset.map_batches(
        _DatasetEncoder, batch_size=rows_per_call, batch_format="numpy", compute=pool, num_cpus=num_cpus,
        num_gpus=num_gpus or None, fn_constructor_kwargs={"spec": spec, "threads": max(1, int(num_cpus)), **options})
