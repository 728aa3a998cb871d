"""Start a server: load the model and the indexes, bind the socket, run uvicorn until SIGTERM or Ctrl-C. On SIGTERM
it drains: ``/health`` answers 503, new work is refused, and once no accepted request is left (at most
``drain_timeout`` seconds) what is left is answered 503 and it exits with status 0. No traceback unless
``ST_PROMPTS_TRACEBACK=1``."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

import uvicorn

from st_prompts.errors import ConfigurationError, StPromptsError, first_line, printable, tracebacks_asked
from st_prompts.serving.limits import RequestError, ServingLimits
from st_prompts.serving.protocol import ConnectionGuard, guarded_protocol

logger = logging.getLogger(__name__)

__all__ = ["ServerOptions", "run_server"]


@dataclass
class ServerOptions:
    """What :func:`run_server` needs (the command line's options)."""

    model: str
    indexes: list[tuple[str, str]] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    device: str | None = None
    limits: ServingLimits = field(default_factory=ServingLimits)
    admin_token: str | None = None
    drain_timeout: float = 30.0
    threads: int | None = None
    guard: ConnectionGuard = field(default_factory=ConnectionGuard)  # the connections' bounds (no callbacks)
    quantize: str = "none"
    dtype: str = "float32"
    workers: int = 1
    devices: tuple[str, ...] = ()  # one started worker per device; the parent loads nothing
    verbose: int = 0  # the command line's ``-v`` count, for the logging of started workers


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one), refused in one line when it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def run_server(options: ServerOptions) -> int:
    """Serve ``options.model`` until SIGTERM (returns 0) or Ctrl-C (``KeyboardInterrupt``; workers: 130)."""
    import torch

    devices = check_devices(options)  # each started, loading the model on its device: the parent loads nothing
    workers = len(devices) or int(options.workers)
    if workers > 1 and not devices:
        if options.device not in (None, "cpu"):
            raise ConfigurationError(f"--workers {workers} serves on the CPU only (a forked process cannot use "
                                     f"{options.device!r}); use --devices to start one worker per device")
        # one thread until the fork: a parent that ran OpenMP on several threads leaves its forked workers hanging
        torch.set_num_threads(1)
    elif options.threads is not None and not devices:
        torch.set_num_threads(options.threads)
    if workers > 1 and options.indexes:  # (no index: the search modules, and faiss, stay unimported)
        _refuse_shared_files(options.indexes, workers)
    sock = _bind(options.host, options.port)  # before the model loads: a taken port fails at once
    served, registry = _load(options) if not devices else (None, None)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def ready() -> None:
        admin = "on" if options.admin_token else "off (no token)"
        logger.info("listening on %s (POST /v1/embeddings, /search; admin %s); SIGTERM drains and stops", url, admin)
        if host not in ("127.0.0.1", "::1", "localhost"):
            logger.info("note: %s is reachable from other machines", url)

    if not devices and workers <= 1:
        try:
            return _serve(options, sock, served, registry, ready)
        finally:
            sock.close()
    from st_prompts.serving.balance import Balancer
    from st_prompts.serving.workers import Supervisor

    threads = options.threads or max(1, (os.cpu_count() or 1) // workers)
    sock.listen(2048)  # connections queue from here; the workers accept them
    # --max-queue-rows is the server's: rows queue in the workers, so each takes its share
    total_rows = options.limits.max_queue_rows
    options = dataclasses.replace(options, limits=dataclasses.replace(options.limits,
                                                                      max_queue_rows=max(1, total_rows // workers)))

    def start_worker(link, journal) -> int:
        torch.set_num_threads(threads)
        return _serve_worker(options, served, registry, link, journal)

    logger.info("%s %d workers%s, %d torch thread%s each; at most %d connections open in all, %d rows queued in "
                "each (--max-queue-rows %d shared)", "starting" if devices else "forking", workers,
                f" (on {', '.join(devices)}, each loading the model)" if devices else "", threads,
                "s" * (threads != 1), options.guard.max_connections, options.limits.max_queue_rows, total_rows)
    spawn = (run_device_worker, (options, devices, threads)) if devices else None
    balancer = Balancer(sock, workers, max_connections=options.guard.max_connections)
    supervisor = Supervisor(workers, None if devices else start_worker, on_ready=ready,
                            drain_timeout=options.drain_timeout, keep=[sock], balancer=balancer, spawn=spawn)
    code = supervisor.run()
    sock.close()
    if code == 1:
        raise ConfigurationError(supervisor.failed or "a worker failed")
    logger.info("stopped after %s: every worker drained", supervisor.stopping)
    return code


def check_devices(options: ServerOptions) -> list[str]:
    """``options.devices`` checked, without initialising CUDA in this process (a started worker does)."""
    from st_prompts.loading import check_device, check_loadable

    devices = list(options.devices)
    if not devices:
        return devices
    if options.device is not None or int(options.workers) != 1:
        raise ConfigurationError("--devices starts one worker per device: leave out --device and --workers")
    for device in devices:
        try:
            check_device(device)
        except ConfigurationError as exc:
            raise ConfigurationError(f"--devices: {exc}") from exc
    check_loadable(options.model)  # a model that is missing or names code: one line here, not one per worker
    return devices


def run_device_worker(link, journal, options: ServerOptions, devices: list[str], threads: int) -> int:
    """A started worker of ``--devices``: load the model on its device, replay the changes, serve."""
    import torch

    from st_prompts.cli import configure_output
    from st_prompts.serving.workers import label_log

    configure_output(options.verbose, progress=False)
    label_log(link.index)
    torch.set_num_threads(threads)
    served, registry = _load(dataclasses.replace(options, device=devices[link.index], devices=()))
    return _serve_worker(options, served, registry, link, journal)


def _serve_worker(options: ServerOptions, served, registry, link, journal: list[tuple[str, tuple]]) -> int:
    """Replay the changes made since the server started, then serve the connections the parent hands over."""
    from st_prompts.serving.changes import apply_change

    for op, args in journal:
        try:
            apply_change(served, registry, op, args)
        except Exception as exc:  # noqa: BLE001 - the others went on with it; this one logs and serves
            logger.warning("could not replay %s: %s", op, first_line(exc))
    return _serve(options, None, served, registry, lambda: link.tell(("ready",)), link=link)


def _load(options: ServerOptions):
    """The served model and its indexes (before any fork)."""
    from st_prompts.precision import cpu_summary
    from st_prompts.serving.indexes import IndexRegistry
    from st_prompts.serving.model import ServedModel

    start = time.perf_counter()
    logger.info("loading %s ...", options.model)
    served = ServedModel.load(options.model, device=options.device, name=options.model_name,
                              quantize=options.quantize, dtype=options.dtype)
    names = served.names()
    kind = "a prompt bank" if served.is_bank else "a model"
    if served.quantization != "none":
        kind += f" ({served.quantization}: its backbone's linear layers)"
    kind += f" in {served.dtype} on {served.device}"
    if served.device.startswith("cpu"):
        kind += f" (CPU: {cpu_summary()})"
    # names come from a folder or a request: printed escaped, so that none can break the line or act on a terminal
    shown = ", ".join(printable(name) for name in names[:6]) + (", ..." if len(names) > 6 else "")
    logger.info("loaded %s serving %d task name%s (%s) in %.1f s", kind, len(names), "s" * (len(names) != 1), shown,
                time.perf_counter() - start)
    registry = IndexRegistry(served)
    for name, path in options.indexes:
        try:
            registry.load(name, path)
        except RequestError as exc:
            raise ConfigurationError(f"index {name!r}: {exc.message}") from exc
        except StPromptsError as exc:
            raise type(exc)(f"index {name!r}: {exc}") from exc
    return served, registry


def _refuse_shared_files(indexes: list[tuple[str, str]], workers: int) -> None:
    """A Milvus Lite file is open in one process at a time (it holds a lock): several workers cannot share one."""
    from st_prompts.search.vector_db import is_address, parse_address

    for name, path in indexes:
        if is_address(path) and parse_address(path).embedded:
            raise ConfigurationError(f"index {name!r}: a Milvus Lite file opens in one process at a time, not in "
                                     f"{workers} workers: serve it with one worker, or from a Milvus server "
                                     "(http://HOST:PORT#COLLECTION)")


def _serve(options: ServerOptions, sock: socket.socket | None, served, registry, ready, link=None) -> int:
    """Run uvicorn on ``sock`` until stopped, or (a worker: ``sock`` None) on the connections its parent hands over."""
    from st_prompts.serving.app import ServerContext, create_app

    served.warm_up()
    if options.limits.max_batch_rows is None and not served.device.startswith("cpu"):
        rows = served.measure_batch_rows()
        logger.info("passes of up to %d rows and %d padded tokens on %s (measured: the fewest rows within 10%% of the "
                    "best rate; --max-batch-rows / --max-batch-tokens set them)", rows,
                    options.limits.max_batch_tokens or served.batch_tokens, served.device)
    if options.limits.pass_overhead_tokens is None:
        overhead = served.measure_pass_overhead()
        logger.info("a forward pass costs as much as %.0f tokens beyond its own (measured; --pass-overhead-tokens "
                    "sets it): passes are split by length to minimise padding plus that", overhead)
    gc.collect()
    gc.freeze()  # what the model and its libraries hold is never collected: no collection walks it, nor the exit's
    context = ServerContext(served, registry, options.limits, options.admin_token, link=link)
    receiver = getattr(link, "receiver", None)
    app = create_app(context, on_ready=ready)
    metrics = context.metrics

    def count(open_connections: int) -> None:
        metrics.connections.set(open_connections)
        if receiver is not None:  # what the parent balances on
            receiver.on_count(open_connections)

    def shed() -> bool:  # a worker: whether the parent asks it to move one more keep-alive client (counted)
        moved = receiver.shed()
        if moved:
            metrics.rebalanced.inc()
        return moved

    guard = dataclasses.replace(options.guard, on_drop=lambda reason: metrics.dropped.labels(reason=reason).inc(),
                                on_malformed=lambda status: metrics.observe_request("malformed", status, 0.0),
                                on_count=count, shed=shed if receiver is not None else None)
    config = uvicorn.Config(app, http=guarded_protocol(guard), log_level="warning", access_log=False, lifespan="on",
                            server_header=False, timeout_graceful_shutdown=options.drain_timeout,
                            timeout_keep_alive=options.guard.idle_timeout)
    _quiet_uvicorn()
    server = _Server(config, context, options.drain_timeout, receiver)
    # uvicorn re-raises the signal it stopped on: taken here, so that a drained server exits with status 0
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if sock is not None:
        sock.listen(2048)  # connections queue from here: "listening on" is logged just before uvicorn accepts them
    try:
        server.run(sockets=[sock] if sock is not None else [])
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sock is not None:
            sock.close()
    if server.stopping_signal is None and not server.started:
        raise ConfigurationError("the server could not start (see the lines above)")
    answered = sum(sample.value for metric in context.metrics.requests.collect() for sample in metric.samples
                   if sample.name.endswith("_total"))
    logger.info("stopped after %s: %d requests answered, none left waiting", server.stopping_signal or "exit", answered)
    gc.freeze()  # the interpreter's last collection would walk the whole heap: seconds on a busy machine
    return 0


def _quiet_uvicorn() -> None:
    """uvicorn's log records without their tracebacks (one line each), unless ``ST_PROMPTS_TRACEBACK`` asks."""
    if tracebacks_asked():
        return
    for name in ("uvicorn.error", "uvicorn", "asyncio"):
        target = logging.getLogger(name)
        if _one_line not in target.filters:
            target.addFilter(_one_line)


def _one_line(record: logging.LogRecord) -> bool:
    """A log filter turning a record's traceback into one line: its exception's type and message."""
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        first = first_line(exc, 300)
        record.msg = f"{record.getMessage()} ({type(exc).__name__}{': ' + first if first else ''})"
        record.args = None
        record.exc_info = None
        record.exc_text = None
    return True


class _Server(uvicorn.Server):
    """uvicorn's server, draining as the module docstring says (uvicorn's own stops listening at once)."""

    def __init__(self, config: uvicorn.Config, context, drain_timeout: float, receiver=None) -> None:
        super().__init__(config)
        self.receiver = receiver  # a worker's: the connections its parent hands over
        self.context = context
        self.drain_timeout = drain_timeout
        self.stopping_signal: str | None = None
        self.deadline: float | None = None
        self.draining_line: tuple | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.stopping_signal is not None:  # a second signal: stop waiting (Ctrl-C twice: uvicorn's force exit)
            super().handle_exit(sig, frame)
            return
        self.stopping_signal = signal.Signals(sig).name
        self._captured_signals.append(sig)  # raised again after the shutdown (Ctrl-C: exit status 130)
        self.deadline = self.context.drain_deadline = time.monotonic() + self.drain_timeout
        self.context.draining = True
        batcher = self.context.batcher
        # logged by the loop: a signal that lands inside a log write (the "listening on" line) would make a write here
        # reentrant, and logging's traceback on stderr
        self.draining_line = (self.stopping_signal, self.drain_timeout, self.context.in_flight,
                              batcher.queued_rows + batcher.running_rows)

    def _log_draining(self) -> None:
        if self.draining_line is not None:
            logger.info("%s: draining (at most %g s): /health answers 503, new work is refused, %d requests in flight "
                        "(%d rows queued)", *self.draining_line)
            self.draining_line = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.receiver is not None and self.started:
            config = self.config

            def protocol() -> asyncio.Protocol:  # what uvicorn's own listener makes for each connection
                return config.http_protocol_class(config=config, server_state=self.server_state,
                                                  app_state=self.lifespan.state)

            self.receiver.attach(asyncio.get_running_loop(), protocol)

    async def on_tick(self, counter: int) -> bool:
        self._log_draining()
        if await super().on_tick(counter):
            return True
        if self.deadline is None:
            return False
        # stop once nothing accepted is left, or a little before the deadline (the answers still have to be sent)
        return self.context.idle() or time.monotonic() >= self.deadline - min(1.0, 0.1 * self.drain_timeout)

    async def shutdown(self, sockets=None) -> None:
        self._log_draining()
        if self.deadline is None:  # stopped otherwise (uvicorn's own limits): the same bound from now
            self.deadline = self.context.drain_deadline = time.monotonic() + self.drain_timeout
        self.context.draining = True
        if self.receiver is not None:
            self.receiver.detach()
        left = self.deadline - time.monotonic()
        if not self.context.idle():
            failed = self.context.batcher.abort_queued("The server is shutting down: its drain timeout passed "
                                                       "before this request's turn; retry.")
            logger.warning("drain timeout: %d requests still queued are answered 503", failed)
        self.config.timeout_graceful_shutdown = max(0.2, left)  # type: ignore[assignment]
        await super().shutdown(sockets)
        for connection in list(self.server_state.connections):  # still open after the wait: closed on the client
            connection.transport.abort()
        await asyncio.sleep(0)
