"""``st-prompts serve --workers N``: the parent loads the model once and forks N workers sharing its weights; it
replaces a worker that dies, carries admin changes to every worker and merges their metrics (``--devices``: spawned
workers, each loading the model onto its device). Details: ``docs/serving.md`` (Workers)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any

from st_prompts.errors import first_line

logger = logging.getLogger(__name__)

__all__ = ["Supervisor", "WorkerLink", "label_log", "merge_metrics"]

#: Seconds the parent waits for a worker to apply a change; more than MAX_REPLACEMENTS replacements within
#: REPLACEMENT_WINDOW seconds stop the server; seconds it waits beyond the drain timeout before it kills the rest.
APPLY_TIMEOUT = 120.0
MAX_REPLACEMENTS = 5
REPLACEMENT_WINDOW = 60.0
EXIT_GRACE = 10.0


class RemoteError(Exception):
    """A change that a worker refused or failed to apply: ``payload`` is what :func:`error_payload` made of it."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload.get("message", "the change failed"))
        self.payload = payload


def error_payload(exc: BaseException) -> dict[str, Any]:
    """What crosses the pipe of an exception raised by a change (a ``RequestError`` keeps its status and code)."""
    out = {"message": first_line(exc, 500), "type": type(exc).__name__}
    return out | {name: getattr(exc, name) for name in ("status", "param", "code", "headers") if hasattr(exc, name)}


class WorkerLink:
    """A worker's two pipes to the parent: ``up`` its requests and their answers, ``down`` the parent's commands."""

    def __init__(self, index: int, up: connection.Connection, down: connection.Connection,
                 receiver: Any = None) -> None:
        self.index = index
        self.receiver = receiver  # the connections the parent hands over (a balance.Receiver), or None
        self._up = up
        self._down = down
        self._lock = threading.Lock()
        self._sequence = 0

    def ask(self, message: tuple, timeout: float) -> Any:
        """Send ``message`` to the parent and return its answer; raises :class:`RemoteError` (refused or failed),
        ``TimeoutError`` or ``ConnectionError`` (the parent is gone)."""
        with self._lock:
            self._sequence += 1
            deadline = time.monotonic() + timeout
            try:
                self._up.send((self._sequence, *message))
                while True:  # an answer to an earlier request that timed out is dropped
                    if not self._up.poll(max(0.0, deadline - time.monotonic())):
                        raise TimeoutError(f"no answer from the server's parent process within {timeout:g} s")
                    sequence, status, value = self._up.recv()
                    if sequence == self._sequence:
                        break
            except (EOFError, OSError) as exc:
                raise ConnectionError("the server's parent process is gone") from exc
        if status == "error":
            raise RemoteError(value)
        return value

    def tell(self, message: tuple) -> None:
        """Send ``message`` without waiting for an answer (e.g. ``("ready",)``)."""
        with self._lock, contextlib.suppress(OSError):
            self._up.send((0, *message))

    def listen(self, apply: Callable[[str, tuple], Any], render: Callable[[], bytes]) -> threading.Thread:
        """Answer the parent's commands (``("apply", op, args)``, ``("render",)``) in a daemon thread; when the parent
        goes away, the worker stops itself (SIGTERM): nobody would stop it otherwise."""

        def run() -> None:
            while True:
                try:
                    message = self._down.recv()
                except (EOFError, OSError):
                    logger.warning("the server's parent process is gone: stopping")
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                try:  # the parent sends ("apply", op, args) or ("render",)
                    answer = ("ok", apply(message[1], tuple(message[2])) if message[0] == "apply" else render())
                except Exception as exc:  # noqa: BLE001 - the parent reports it to the worker that asked
                    answer = ("error", error_payload(exc))
                try:
                    self._down.send(answer)
                except OSError:
                    return

        thread = threading.Thread(target=run, name="st-prompts-worker-link", daemon=True)
        thread.start()
        return thread


@dataclass
class _Worker:
    index: int
    pid: int
    up: connection.Connection  # the parent's end of the worker's requests
    down: connection.Connection  # the parent's end of the parent's commands
    started: float
    ready: bool = False


class Supervisor:
    """Fork ``count`` workers and look after them: ``start_worker(link, journal) -> exit status`` serves in each
    (``journal``: the changes made since the start, which a replacement replays); ``spawn``: ``(target, args)`` to
    start workers instead; ``keep``: objects open in the parent until it stops; ``balancer``: a ``Balancer`` or None."""

    def __init__(self, count: int, start_worker: Callable[[WorkerLink, list[tuple[str, tuple]]], int] | None,
                 on_ready: Callable[[], None] | None = None, drain_timeout: float = 30.0,
                 keep: list[Any] | None = None, balancer: Any = None,
                 spawn: tuple[Callable[..., int], tuple] | None = None) -> None:
        self.count = count
        self.spawn = spawn
        self.balancer = balancer
        self.start_worker = start_worker
        self.on_ready = on_ready
        self.drain_timeout = drain_timeout
        self.keep = keep or []
        self.workers: dict[int, _Worker] = {}
        self.journal: list[tuple[str, tuple]] = []
        self.stopping: str | None = None
        self.draining_line: tuple[str, int] | None = None
        self.deadline = float("inf")  # when the workers left are killed (set once stopping begins)
        self.failed: str | None = None
        self._announced = False
        self._replaced: list[float] = []

    def _spawn(self, index: int) -> None:
        up_parent, up_child = connection.Pipe()
        down_parent, down_child = connection.Pipe()
        balancer = self.balancer
        handoff = balancer.pair(index) if balancer is not None else None
        # the worker's balance.Receiver: its hand-off socket and the counts shared with the parent
        receiver = None if balancer is None else (handoff, index, balancer.closed, balancer.taken,
                                                  balancer.shed_asked, balancer.shed_done)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if self.spawn is not None:  # a fresh interpreter; the pipes and the socket travel as duplicated descriptors
            import multiprocessing

            process = multiprocessing.get_context("spawn").Process(
                target=_started_worker, name=f"st-prompts-worker-{index}",
                args=(index, up_child, down_child, receiver, list(self.journal), *self.spawn))
            process.start()
            pid = process.pid
        else:
            with balancer.fork_lock if balancer is not None else contextlib.nullcontext():
                pid = os.fork()  # not while the balancer holds an accepted connection (balance.Balancer.fork_lock)
            if pid == 0:  # the worker: never returns

                def serve() -> int:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    for end in [up_parent, down_parent] + [e for w in self.workers.values() for e in (w.up, w.down)]:
                        end.close()
                    label_log(index)
                    if balancer is not None:
                        balancer.close_in_worker()
                    link = WorkerLink(index, up_child, down_child, _receiver(receiver))
                    return self.start_worker(link, list(self.journal))

                code = 1
                try:
                    code = _worker_status(index, serve)
                finally:
                    logging.shutdown()
                    for stream in (sys.stdout, sys.stderr):
                        with contextlib.suppress(Exception):  # exiting: nothing is left to tell
                            stream.flush()
                    os._exit(code)
        up_child.close()
        down_child.close()
        if handoff is not None:
            handoff.close()
        self.workers[index] = _Worker(index, pid, up_parent, down_parent, time.monotonic())

    def run(self) -> int:
        """Start the workers and look after them until they have stopped; returns 0 (SIGTERM), 130 (Ctrl-C) or 1."""
        gc.collect()
        gc.freeze()  # no collection in a worker walks (and so copies) what the parent allocated
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for index in range(self.count):
                self._spawn(index)
            pids = ", ".join(str(w.pid) for w in self.workers.values())
            logger.info("started %d workers (pids %s)", self.count, pids)
            if self.balancer is not None:
                self.balancer.start()
            self._loop()
            self._log_draining()  # (when the workers had gone before the loop logged it)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.failed:
            logger.error("%s", self.failed)
            return 1
        return 130 if self.stopping == "SIGINT" else 0

    def _on_signal(self, signum, frame) -> None:
        first = self.stopping is None
        if first:
            self.stopping = signal.Signals(signum).name
            self.deadline = time.monotonic() + self.drain_timeout + EXIT_GRACE
        self._signal_workers(signal.SIGTERM)  # a worker takes a second SIGTERM as the first
        if first:
            if self.balancer is not None:
                self.balancer.stop()
            for item in self.keep:  # the listening socket: once every worker has closed it, no one connects
                with contextlib.suppress(OSError):
                    item.close()
            self.draining_line = (self.stopping, len(self.workers))  # logged by the loop (see _Server.handle_exit)

    def _log_draining(self) -> None:
        if self.draining_line is not None:
            logger.info("%s: draining %d workers", *self.draining_line)
            self.draining_line = None

    def _signal_workers(self, sig: int) -> None:
        for worker in list(self.workers.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)

    def _stop_all(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
        if self.stopping is None:
            self.stopping = "failure"
            self.deadline = time.monotonic() + self.drain_timeout + EXIT_GRACE
            self._signal_workers(signal.SIGTERM)

    def _loop(self) -> None:
        while self.workers:
            self._log_draining()
            ends = {w.up: w for w in self.workers.values()}
            for end in connection.wait(list(ends), timeout=0.2):
                worker = ends[end]
                try:
                    sequence, *message = end.recv()
                except (EOFError, OSError, ValueError, TypeError):
                    continue  # the worker is gone: reaped below
                self._handle(worker, sequence, tuple(message))
            self._reap()
            if self.stopping is not None and time.monotonic() > self.deadline:
                left = list(self.workers.values())
                logger.warning("%d workers still running %g s after the drain began: killed", len(left),
                               self.drain_timeout + EXIT_GRACE)
                self._signal_workers(signal.SIGKILL)
                for worker in left:
                    os.waitpid(worker.pid, 0)
                self.workers.clear()

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = next((w for w in self.workers.values() if w.pid == pid), None)
            if worker is None:
                continue
            del self.workers[worker.index]
            if self.balancer is not None:
                self.balancer.forget(worker.index)
            worker.up.close()
            worker.down.close()
            if self.stopping is not None:
                continue
            code = os.waitstatus_to_exitcode(status)
            how = f"exit status {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
            now = time.monotonic()
            self._replaced = [t for t in self._replaced if now - t < REPLACEMENT_WINDOW] + [now]
            if not worker.ready:
                self._stop_all(f"worker {worker.index} (pid {pid}) stopped at its start ({how}): the server stops")
                continue
            if len(self._replaced) > MAX_REPLACEMENTS:
                self._stop_all(f"worker {worker.index} (pid {pid}) stopped ({how}), the {len(self._replaced)}th "
                               f"worker to stop within {REPLACEMENT_WINDOW:g} s: the server stops")
                continue
            logger.warning("worker %d (pid %d) stopped (%s): starting another", worker.index, pid, how)
            self._spawn(worker.index)

    def _handle(self, worker: _Worker, sequence: int, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            if self.balancer is not None:
                self.balancer.ready(worker.index)
            if not self._announced and len(self.workers) == self.count and all(w.ready for w in self.workers.values()):
                self._announced = True
                if self.on_ready is not None:
                    self.on_ready()
            return
        # a worker asks ("change", op, args) or ("metrics",)
        answer = self._change(worker, message[1], tuple(message[2])) if kind == "change" else ("ok", self._metrics())
        with contextlib.suppress(OSError):
            worker.up.send((sequence, *answer))

    def _command(self, worker: _Worker, message: tuple) -> tuple[str, Any]:
        try:
            worker.down.send(message)
            if worker.down.poll(APPLY_TIMEOUT):
                return worker.down.recv()
        except (EOFError, OSError):
            return "error", {"message": f"worker {worker.index} is gone"}
        # stuck: its late answer would be read as the next command's, so it goes (and is replaced, the changes replayed)
        logger.error("worker %d did not answer within %g s: it is stopped", worker.index, APPLY_TIMEOUT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)
        return "error", {"message": f"worker {worker.index} did not answer within {APPLY_TIMEOUT:g} s"}

    def _change(self, asking: _Worker, op: str, args: tuple) -> tuple[str, Any]:
        """Apply a change to every worker, the one that asked first (its checks decide; a set is read once, by it)."""
        status, value = self._command(asking, ("apply", "add_set_read" if op == "add_set" else op, args))
        if status != "ok":
            return status, value
        if op == "add_set":
            op, args, value = "add_set_data", (*args, value["data"]), value["answer"]
        self._record(op, args)
        for worker in [w for w in self.workers.values() if w is not asking]:
            other, problem = self._command(worker, ("apply", op, args))
            if other != "ok":  # the workers hold the same state: this is a failure of that worker, not the change
                logger.error("worker %d could not apply %s %s: %s; it is replaced", worker.index, op,
                             ", ".join(repr(a)[:80] for a in args), problem.get("message"))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGTERM)  # its replacement replays the journal
        return status, value

    def _record(self, op: str, args: tuple) -> None:
        """Keep a change for replacements to replay; a removal takes its set's addition out instead."""
        if op == "remove_set":
            for index in range(len(self.journal) - 1, -1, -1):
                if self.journal[index][0] == "add_set_data" and self.journal[index][1][0] == args[0]:
                    del self.journal[index]
                    return
        self.journal.append((op, args))

    def _metrics(self) -> bytes:
        answers = [(worker.index, *self._command(worker, ("render",))) for worker in list(self.workers.values())]
        texts = [(index, value) for index, status, value in answers if status == "ok"]
        return merge_metrics(texts, self.balancer.metrics_text() if self.balancer is not None else None)


def _started_worker(index: int, up: connection.Connection, down: connection.Connection, receiver: tuple | None,
                    journal: list[tuple[str, tuple]], target: Callable[..., int], args: tuple) -> None:
    """The body of a started worker: ``target(link, journal, *args)``, then exit with its status."""

    def serve() -> int:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return target(WorkerLink(index, up, down, _receiver(receiver)), journal, *args)

    # sys.exit, unlike a forked worker: its finalizers run (its libraries' semaphores are released, not leaked)
    sys.exit(_worker_status(index, serve))


def _worker_status(index: int, serve: Callable[[], int]) -> int:
    """``serve()``'s exit status: 130 on Ctrl-C, 2 (logged in one line) on any other exception."""
    try:
        return serve()
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # noqa: BLE001 - one line, and the parent decides what follows
        logger.error("worker %d failed: %s", index, first_line(exc))
        return 2


def _receiver(parts: tuple | None) -> Any:
    """The :class:`~st_prompts.serving.balance.Receiver` made of ``parts`` (None: no balancer)."""
    from st_prompts.serving.balance import Receiver

    return None if parts is None else Receiver(*parts)


def label_log(index: int) -> None:
    """Prefix this worker's log lines with ``worker N:``."""

    def prefix(record: logging.LogRecord) -> bool:
        record.msg = f"worker {index}: {record.getMessage()}"
        record.args = None
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(prefix)


def merge_metrics(texts: list[tuple[int, bytes]], parent: bytes | None = None) -> bytes:
    """Merge the Prometheus texts of the workers (``(index, text)``) and the parent's own samples: each
    ``st_prompts_*`` sample is summed (``_created``: the earliest; :data:`~st_prompts.serving.metrics.
    SAME_IN_EVERY_WORKER`: the largest), other families keep a ``worker`` label; ``st_prompts_workers`` counts them."""
    from prometheus_client.core import CollectorRegistry, Metric
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from st_prompts.serving.metrics import SAME_IN_EVERY_WORKER

    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    sources = list(texts) + ([(None, parent)] if parent else [])
    for index, text in sources:
        for family in text_string_to_metric_families(text.decode("utf-8") if isinstance(text, bytes) else text):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            samples = values.setdefault(family.name, {})
            own = family.name.startswith("st_prompts_")
            for sample in family.samples:
                labels = dict(sample.labels)
                if not own:
                    labels["worker"] = str(index)
                key = (sample.name, tuple(sorted(labels.items())))
                if key not in samples:
                    samples[key] = sample.value
                elif sample.name.endswith("_created"):
                    samples[key] = min(samples[key], sample.value)
                elif family.name in SAME_IN_EVERY_WORKER:
                    samples[key] = max(samples[key], sample.value)
                else:
                    samples[key] += sample.value
    workers = Metric("st_prompts_workers", "Worker processes whose metrics these are", "gauge")
    workers.add_sample("st_prompts_workers", {}, float(len(texts)))

    class _Merged:
        def collect(self):
            for name, family in families.items():
                for (sample_name, labels), value in values[name].items():
                    family.add_sample(sample_name, dict(labels), value)
                yield family
            yield workers

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
