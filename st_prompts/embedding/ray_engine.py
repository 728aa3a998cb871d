"""Embedding on a Ray cluster with Ray Data: a pool of actors, each loading the model once through the safe loader
(:func:`st_prompts.loading.load_sentence_model`), fed by ``map_batches``.

Two entry points: :func:`encode_parts_on_ray` (``st-prompts embed --engine ray``: one task per part of an input file)
and :func:`embed_dataset` (a user's own ``ray.data.Dataset`` in, the same Dataset with a ``vector`` column out).

How parts travel (``--engine ray``): the driver scans the input (it must anyway, to know which parts a resumed run
has finished), then hands each unfinished part to Ray as a *descriptor* (its byte or row range and the digest of its
rows); a Ray task reads that range from the input file on its node and checks the digest, the actors of
:func:`embed_dataset` encode the rows, and the vectors come back to the driver, which writes the part. So the INPUT
must be readable at the same path on every node (a shared file system; the reading task refuses, in one line, a file
whose rows differ from the driver's), while OUTPUT need only be on the driver's machine: the folder's lock, its run
file and every part have one writer, and no node needs write access or a lock that works across machines. The price:
the vectors cross the network to the driver (1.5 KB a document for 384 dimensions), which a cluster's network
carries far faster than CPUs encode.

Ray is optional (``pip install "st-prompts[scale]"``): imported inside these functions only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
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


class _Loaded:
    """An actor's model, loaded once when the actor starts, on a thread budget of its CPUs, and its identity (the probe
    sentences' embeddings: a few milliseconds), which every row it encodes names by its fingerprint."""

    def __init__(self, spec: ModelSpec, task: str | None, batch_size: int, threads: int,
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


def _read_descriptors(batch: dict[str, np.ndarray], source: InputSource) -> dict[str, np.ndarray]:
    """``map_batches`` function of ``--engine ray``'s first stage (Ray tasks): part descriptors in, the parts' rows
    out (``part``, ``row``, ``text``, and ``task`` with a task column), each part read from the input file on the
    node and checked against the driver's digest."""
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


class _DatasetEncoder(_Loaded):
    """``map_batches`` class of :func:`embed_dataset`: a user's rows in, the same rows with their vectors out."""

    def __init__(self, text_column: str, task_column: str | None, output_column: str, node_column: str | None,
                 identity_column: str | None = None, keep: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
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
            try:
                todo.append(error.as_instanceof_cause())
            except Exception:  # noqa: BLE001 - a cause Ray cannot rebuild is no cause of ours
                pass
    return None


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Refuse, in one line, a ``HOST:PORT`` (or ``ray://HOST:PORT``) where nothing listens: Ray 2.60's ``ray.init``
    retries such an address for more than ten minutes (measured: a closed port on this machine, still waiting after
    600 s). Other forms (``auto``, ``local``) are Ray's to resolve."""
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
        # Ray 2.59-2.60's `ray start` turns token authentication on, but a client joining by address does not unless
        # told (measured with 2.60: "Failed to connect" after 10 s of "InvalidAuthToken" log lines); the token is the
        # cluster's secret, so this says how rather than sending it unasked.
        hint = ("; a cluster with token authentication (Ray's default for `ray start` since 2.59) needs "
                "RAY_AUTH_MODE=token here too" if address and not os.environ.get("RAY_AUTH_MODE") else "")
        raise ConfigurationError(f"cannot reach the Ray cluster at {address}: {str(exc).splitlines()[0][:200]}"
                                 f"{hint}") from None
    return True


def _quiet_data(ray: Any, progress: bool) -> None:
    """Ray Data's progress bars only when ours are shown; its execution logs only with ``-v``."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    if not logging.getLogger("st_prompts").isEnabledFor(logging.DEBUG):
        logging.getLogger("ray.data").setLevel(logging.ERROR)


def encode_parts_on_ray(spec: ModelSpec, source: InputSource, todo: Sequence[tuple], *, task: str | None,
                        batch_size: int, options: Any, name: str | None, accept: Callable[[dict[str, Any]], None],
                        progress: bool = False, timing: dict[str, float] | None = None
                        ) -> Iterator[tuple[int, int, dict[str, int], str, np.ndarray, dict[str, Any]]]:
    """Encode the parts of ``todo`` (``(number, first_row, locator, digest, rows)`` each) on the pool and yield
    ``(number, first_row, locator, digest, vectors, node)`` as each part completes (in any order).

    The driver loads no model (``st-prompts embed --engine ray`` imports neither torch nor sentence-transformers: on
    two CPUs the actors' start took as long again when the driver loaded its copy first; a head node needs no
    accelerator and no memory for it): each actor sends its model's identity record (``name``: the name it records)
    with the first row of every call, and ``accept(record)`` is called once for each distinct fingerprint, before any
    part encoded by that model is yielded; it raises to refuse the model. ``timing``, when given, receives
    ``ray_start``: the seconds spent starting or joining Ray (0 when it was running already)."""
    if not todo:
        return
    ray = import_ray()
    clock = time.perf_counter()
    started_here = _connect(ray, options.address)
    if timing is not None:
        timing["ray_start"] = time.perf_counter() - clock
    try:
        _quiet_data(ray, progress)
        actors = min(_actors(ray, options.actors, options.num_cpus, options.num_gpus, len(todo)), len(todo))
        descriptors = [{"part": number, "first_row": first_row, "locator": json.dumps(locator), "digest": digest}
                       for number, first_row, locator, digest, _ in todo]
        expected = {number: (first_row, locator, digest, rows) for number, first_row, locator, digest, rows in todo}
        # Stage 1, Ray tasks: each reads its part on its node (no CPU reserved: reading is light, and the actors may
        # hold every CPU), one at a time: Ray otherwise starts a worker process per task in flight, each importing
        # Ray and this package (400 sentences on a local Ray of 2 CPUs: 54 s end to end, 46 s with one reader; one
        # reader reads a 100,000-row text part in 0.13 s, faster than many actors encode it). Stage 2, the
        # actor pool of embed_dataset: the model loaded once per actor. A call takes a whole part up to 4,096 rows:
        # sentence-transformers sorts a call's texts by length, so calls as large as --engine local's keep padding as
        # low. Only part, row, vector, node and identity come back.
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
    ``output_column``, computed lazily by a pool of ``concurrency`` actors (default: as many as the cluster's CPUs,
    or GPUs with ``num_gpus``, hold), each loading ``model`` (a name or folder, or a :class:`ModelSpec`) once through
    the safe loader; ``num_cpus`` is also each actor's torch threads. The vectors are ``st-prompts embed``'s (the
    document side; ``task``: one prompt set of a bank; ``task_column``: each row's set, blank = ``task`` or the
    document side). ``node_column``: also record which Ray node encoded each row (JSON, with the model's
    fingerprint). ``identity``: an :func:`~st_prompts.search.embedding_files.identity_record` every actor's model
    must match (the same folder may hold another model on another node)."""
    ray = import_ray()
    if not isinstance(dataset, ray.data.Dataset):
        raise ConfigurationError(f"embed_dataset takes a ray.data.Dataset, got {type(dataset).__name__}")
    return _encode_stage(dataset, model, text_column=text_column, task=task, task_column=task_column,
                         output_column=output_column, batch_size=batch_size, concurrency=concurrency,
                         num_cpus=num_cpus, num_gpus=num_gpus, rows_per_call=rows_per_call, node_column=node_column,
                         identity=identity)


def _encode_stage(dataset: Any, model: str | ModelSpec, *, text_column: str = "text", task: str | None,
                  task_column: str | None, output_column: str = "vector", batch_size: int, concurrency: int | None,
                  num_cpus: float, num_gpus: float, rows_per_call: int, node_column: str | None,
                  identity: dict[str, Any] | None = None, identity_column: str | None = None,
                  name: str | None = None, keep: list[str] | None = None) -> Any:
    """:func:`embed_dataset`'s stage; ``identity_column`` (``--engine ray``): each call's first row also carries its
    actor's identity record (JSON; the other rows are blank), recorded under ``name``; ``keep``: the input columns
    the output keeps (default all). The actors drop the others themselves: a ``select_columns`` after them is a
    stage of Ray tasks that needs a CPU, which actors holding every CPU free only when they end, so no part reached
    the driver before the last was encoded (measured: 8 parts of 250 rows on 2 CPUs, all written in the last 0.4 s of
    a 57 s run) and a killed run had written nothing."""
    import ray

    spec = model if isinstance(model, ModelSpec) else ModelSpec(str(model))
    actors = _actors(ray, concurrency, num_cpus, num_gpus, 1 << 30)
    # Two calls in flight per actor (not Ray's default of more): the first actor to load its model would otherwise
    # queue the work that the actors still loading theirs are started for.
    pool = ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=2)
    return dataset.map_batches(
        _DatasetEncoder, batch_size=rows_per_call, batch_format="numpy", compute=pool, num_cpus=num_cpus,
        num_gpus=num_gpus or None, fn_constructor_kwargs={
            "text_column": text_column, "task_column": task_column, "output_column": output_column,
            "node_column": node_column, "identity_column": identity_column, "spec": spec, "task": task,
            "batch_size": batch_size, "threads": max(1, int(num_cpus)), "identity": identity, "name": name,
            "keep": keep})
