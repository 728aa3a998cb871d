"""Start a server: load the model and the indexes, bind the socket, run uvicorn until SIGTERM or Ctrl-C.

``st-prompts serve`` (:mod:`st_prompts.commands.serve`) calls :func:`run_server`. On SIGTERM uvicorn stops accepting
connections, every request already accepted is answered (the batcher keeps encoding until the last one is done, for
at most ``drain_timeout`` seconds), then the batcher drains and the process exits with status 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from dataclasses import dataclass, field

import uvicorn

from st_prompts.errors import ConfigurationError, StPromptsError
from st_prompts.serving.limits import RequestError, ServingLimits

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
    """Serve ``options.model`` until SIGTERM (drains, returns 0) or Ctrl-C (``KeyboardInterrupt``)."""
    import torch

    from st_prompts.serving.app import ServerContext, create_app
    from st_prompts.serving.indexes import IndexRegistry
    from st_prompts.serving.model import ServedModel

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    sock = _bind(options.host, options.port)  # before the model loads: a taken port fails at once
    start = time.perf_counter()
    logger.info("loading %s ...", options.model)
    served = ServedModel.load(options.model, device=options.device, name=options.model_name)
    names = served.names()
    kind = "a prompt bank" if served.is_bank else "a model"
    logger.info("loaded %s serving %d task name%s (%s) in %.1f s", kind, len(names), "s" * (len(names) != 1),
                ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""), time.perf_counter() - start)
    registry = IndexRegistry(served)
    for name, path in options.indexes:
        try:
            registry.load(name, path)
        except RequestError as exc:
            raise ConfigurationError(f"index {name!r}: {exc.message}") from exc
        except StPromptsError as exc:
            raise type(exc)(f"index {name!r}: {exc}") from exc
    served.warm_up()
    context = ServerContext(served, registry, options.limits, options.admin_token)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"

    def ready() -> None:
        admin = "on" if options.admin_token else "off (no token)"
        logger.info("listening on %s (POST /v1/embeddings, /search; admin %s); SIGTERM drains and stops", url, admin)
        if host not in ("127.0.0.1", "::1", "localhost"):
            logger.info("note: %s is reachable from other machines", url)

    app = create_app(context, on_ready=ready)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", server_header=False,
                            timeout_graceful_shutdown=options.drain_timeout, timeout_keep_alive=5)
    server = _Server(config, context)
    # uvicorn re-raises the signal it stopped on after its graceful shutdown; this handler takes it, so that a
    # drained server exits with status 0 instead of dying by SIGTERM.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    if server.stopping_signal is None and not server.started:
        raise ConfigurationError("the server could not start (see the lines above)")
    answered = sum(sample.value for metric in context.metrics.requests.collect() for sample in metric.samples
                   if sample.name.endswith("_total"))
    logger.info("stopped after %s: %d requests answered, none left waiting", server.stopping_signal or "exit",
                answered)
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it starts to drain."""

    def __init__(self, config: uvicorn.Config, context) -> None:
        super().__init__(config)
        self.context = context
        self.stopping_signal: str | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.stopping_signal is None:
            self.stopping_signal = signal.Signals(sig).name
            self.context.draining = True
            batcher = self.context.batcher
            logger.info("%s: no new connections; answering the requests in flight (%d rows queued)",
                        self.stopping_signal, batcher.queued_rows + batcher.running_rows)
        super().handle_exit(sig, frame)
