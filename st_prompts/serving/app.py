"""The HTTP application (Starlette): OpenAI-compatible embeddings, search, health, metrics and, with an admin token,
``/admin/prompt-sets[/NAME]`` and ``/admin/indexes/NAME/reload``. Bodies are read in chunks and checked by hand, so
that a refusal is one line in OpenAI's error schema."""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from typing import Any

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from st_prompts.errors import first_line, shorten, tracebacks_asked
from st_prompts.precision import cpu_summary
from st_prompts.serving.batcher import DEFAULT_PASS_OVERHEAD_TOKENS, Batcher, BatcherClosed, QueueFull
from st_prompts.serving.indexes import IndexRegistry
from st_prompts.serving.limits import RequestError, ServingLimits, parse_embedding_request, parse_search_request
from st_prompts.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from st_prompts.serving.model import Role, ServedModel
from st_prompts.utils import release_free_memory

logger = logging.getLogger(__name__)

__all__ = ["ServerContext", "create_app"]


class _ClientGone(Exception):
    """The client closed the connection before its answer."""


class ServerContext:
    """What the endpoints share: the served model, its indexes, the batcher, the limits and the metrics."""

    def __init__(self, served: ServedModel, indexes: IndexRegistry, limits: ServingLimits,
                 admin_token: str | None = None, link: Any = None) -> None:
        self.served = served
        self.link = link  # a worker's pipes to its parent (a WorkerLink), or None (one process)
        self.indexes = indexes
        self.limits = limits
        self.admin_token = admin_token
        self.started = int(time.time())
        self.draining = False
        self.drain_deadline: float | None = None  # time.monotonic() by which the drain ends (set on SIGTERM)
        self.in_flight = 0  # requests inside an endpoint now
        self.receiving = 0  # of which still reading their body (not yet accepted: a drain does not wait for them)
        self.metrics = ServerMetrics(queued_rows=lambda: self.batcher.queued_rows,
                                     running_rows=lambda: self.batcher.running_rows,
                                     prompt_sets=lambda: len(served.internal_sets()), label=self.label)
        # the options, else what the start measured (server.py), else the defaults
        overhead = next((v for v in (limits.pass_overhead_tokens, served.pass_overhead_tokens) if v is not None),
                        DEFAULT_PASS_OVERHEAD_TOKENS)
        self.batcher = Batcher(served.encode, max_wait_ms=limits.max_wait_ms,
                               max_batch_tokens=limits.max_batch_tokens or served.batch_tokens,
                               max_batch_rows=limits.max_batch_rows or served.batch_rows,
                               max_queue_rows=limits.max_queue_rows,
                               pass_overhead_tokens=overhead, on_batch=self.metrics.observe_batch,
                               on_idle=release_free_memory)
        self.count_executor: ThreadPoolExecutor | None = None
        self.admin_executor: ThreadPoolExecutor | None = None

    def label(self, route: Any) -> str:
        """The metrics label of a batcher task: a public task name."""
        if isinstance(route, Role):
            return f"({route.name} side)"
        return self.served.public_name(route)  # "name@2" (added again while the old one drains) -> "name"

    def idle(self) -> bool:
        """No request is being answered and no row waits (a draining server may stop)."""
        return self.in_flight - self.receiving == 0 and self.batcher.queued_rows == 0 and self.batcher.running_rows == 0

    def change(self, op: str, args: tuple) -> Any:
        """Apply an admin change (in the admin thread): here, or through the parent to every worker."""
        from st_prompts.serving.changes import apply_change

        if self.link is None:
            return apply_change(self.served, self.indexes, op, args)
        from st_prompts.serving.workers import RemoteError

        try:
            return self.link.ask(("change", op, args), timeout=600.0)
        except RemoteError as exc:
            payload = exc.payload
            if "status" in payload:
                raise RequestError(payload["status"], payload["message"], param=payload.get("param"),
                                   code=payload.get("code"), headers=payload.get("headers")) from None
            raise RuntimeError(payload["message"]) from None

    async def tokenize(self, texts: list[str], route: Any) -> tuple[list[Any], list[int]]:
        """The rows of ``texts`` for the batcher and their token counts (in a thread of its own)."""
        return await asyncio.get_running_loop().run_in_executor(self.count_executor, self.served.tokenize, texts, route)


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)


def _error(error: RequestError) -> Response:
    return _json(error.payload(), error.status, error.headers)


async def _read_json(request: Request, limit: int, context: ServerContext) -> Any:
    """The JSON body, refused early when it is not JSON or larger than ``limit`` bytes."""
    kind = request.headers.get("content-type", "")
    if kind.split(";", 1)[0].strip().lower() != "application/json":
        raise RequestError(415, f"Send the body as JSON with 'Content-Type: application/json' (got "
                           f"{shorten(kind or 'no content type', 100)}).", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, f"Bad Content-Length {shorten(declared, 40)}.")
        if int(declared) > limit:
            raise RequestError(413, f"The request body has {int(declared):,} bytes; the limit is {limit:,}.",
                               code="body_too_large")
    body = bytearray()
    context.receiving += 1
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(413, f"The request body exceeds the limit of {limit:,} bytes.",
                                   code="body_too_large")
    finally:
        context.receiving -= 1
    if not body:
        raise RequestError(400, "The request body is empty: send a JSON object.")
    try:
        return orjson.loads(bytes(body))
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"The request body is not valid JSON ({str(exc)[:200]}).", code="invalid_json") from exc


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has closed the connection (the body has been read by then)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def _unless_gone(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client goes away first, cancel it and raise :class:`_ClientGone`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        if not watcher.done():
            watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError, Exception):
        await task
    raise _ClientGone()


#: Endpoints that take work (refused with 503 while the server drains); /health, /metrics and /v1/models answer on.
_WORK = ("embeddings", "search", "admin")
_CLOSING = {"Retry-After": "5", "Connection": "close"}  # the headers of a 503 while the server shuts down


def _endpoint(context: ServerContext, name: str, handler: Callable[[Request], Awaitable[Response]]):
    """Wrap a handler: errors become OpenAI error responses; answers are counted and timed; a drain refuses work."""

    async def endpoint(request: Request) -> Response:
        start = time.perf_counter()
        context.in_flight += 1
        try:
            if context.draining and name in _WORK:
                raise BatcherClosed("The server is shutting down; retry (on another replica).")
            if name == "admin":
                _authorize(request, context.admin_token)
            response = await handler(request)
        except RequestError as exc:
            response = _error(exc)
        except QueueFull as exc:
            response = _error(RequestError(503, str(exc), code="queue_full",
                                           headers={"Retry-After": str(exc.retry_after)}))
        except BatcherClosed as exc:
            response = _error(RequestError(503, str(exc), code="shutting_down", headers=_CLOSING))
        except (_ClientGone, ClientDisconnect):
            context.metrics.cancelled.inc()
            response = Response(status_code=499)
        except asyncio.CancelledError:
            if not context.draining:
                raise
            # the drain timeout passed while this request waited for a pass: answer instead of a dropped connection
            response = _error(RequestError(503, "The server is shutting down: its drain timeout passed before this "
                                           "request's answer; retry.", code="shutting_down", headers=_CLOSING))
        except Exception as exc:  # a bug or a failed pass: one line to the client (and the log)
            first = first_line(exc, 300)
            logger.error("%s failed: %s: %s", name, type(exc).__name__, first, exc_info=tracebacks_asked())
            if name == "admin":  # an admin call carries a folder or a name: what fails with it is refused, not a 500
                response = _error(RequestError(422, f"The admin request was refused: {first}", code="invalid_request"))
            else:
                response = _error(RequestError(500, f"The server failed to answer: {first}", code="internal_error"))
        finally:
            context.in_flight -= 1
        context.metrics.observe_request(name, response.status_code, time.perf_counter() - start)
        return response

    return endpoint


def _authorize(request: Request, admin_token: str) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), admin_token.encode()):
        raise RequestError(401, "The admin endpoint needs 'Authorization: Bearer <admin token>'.",
                           code="invalid_admin_token")


def _usage(tokens: list[int]) -> dict[str, int]:
    total = int(sum(tokens))
    return {"prompt_tokens": total, "total_tokens": total}


def create_app(context: ServerContext, on_ready: Callable[[], None] | None = None) -> Starlette:
    """The Starlette application of ``context`` (its lifespan starts and drains the batcher)."""
    served, limits, batcher = context.served, context.limits, context.batcher

    async def encode(request: Request, texts: list[str], route: Any) -> tuple[np.ndarray, list[int]]:
        """The vectors and token counts of ``texts`` under a pinned ``route``, released at the end."""
        try:
            rows, tokens = await context.tokenize(texts, route)
            return await _unless_gone(request, batcher.encode(rows, tokens, route)), tokens
        finally:
            served.release(route)

    async def embeddings(request: Request) -> Response:
        body = await _read_json(request, limits.max_body_bytes, context)
        parsed = parse_embedding_request(body, limits)
        if parsed.dimensions is not None and parsed.dimensions != served.dimension:
            raise RequestError(422, f"'dimensions'={parsed.dimensions} is not supported: {parsed.model!r} gives "
                               f"{served.dimension}-dimensional embeddings and does not shorten them.",
                               param="dimensions", code="dimensions_unsupported")
        # the set this request uses, whatever changes meanwhile
        vectors, tokens = await encode(request, parsed.texts, served.acquire(parsed.model))
        if parsed.encoding_format == "base64":
            little = np.ascontiguousarray(vectors, dtype="<f4")
            items = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
        else:
            items = list(vectors)
        data = [{"object": "embedding", "index": i, "embedding": item} for i, item in enumerate(items)]
        return _json({"object": "list", "data": data, "model": parsed.model, "usage": _usage(tokens)})

    async def search(request: Request) -> Response:
        body = await _read_json(request, limits.max_body_bytes, context)
        parsed = parse_search_request(body, limits)
        entry = context.indexes.get(parsed.index)  # this request searches the index as it is now
        served.pin(entry.route)
        vectors, tokens = await encode(request, parsed.queries, entry.route)
        results = await asyncio.get_running_loop().run_in_executor(None, entry.search, vectors, parsed.k)
        data = [{"object": "search_result", "query_index": i, "hits": hits} for i, hits in enumerate(results)]
        return _json({"object": "list", "index": entry.name, "data": data, "usage": _usage(tokens)})

    async def models(request: Request) -> Response:
        data = [_model_card(name, context.started, served) for name in served.names()]
        return _json({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if not served.has(name):
            raise served.unknown(name)
        return _json(_model_card(name, context.started, served))

    async def health(request: Request) -> Response:
        draining = context.draining or batcher.closing
        sets = served.set_digests()  # hashed once per set, then cached: a probe costs microseconds
        payload = {"status": "draining" if draining else "ok", "ready": not draining, "model": served.name,
                   "tasks": len(served.names()), "quantization": served.quantization, "dtype": served.dtype,
                   "device": served.device, "cpu": cpu_summary(), "indexes": context.indexes.names(),
                   "queue_rows": batcher.queued_rows, "admin": context.admin_token is not None, "pid": os.getpid(),
                   "sets": sets, "fingerprint": served.fingerprint(sets)}
        return _json(payload, 503 if draining else 200)

    async def live(request: Request) -> Response:
        # a liveness probe must not fail while the server drains: restarting it then would cut its drain short
        draining = context.draining or batcher.closing
        return _json({"status": "draining" if draining else "ok", "pid": os.getpid()})

    async def in_admin_thread(function, *args):
        return await asyncio.get_running_loop().run_in_executor(context.admin_executor, function, *args)

    async def metrics(request: Request) -> Response:
        if context.link is None:
            return Response(context.metrics.render(), media_type=CONTENT_TYPE_LATEST)
        # every worker's, summed by the parent (asked from the admin thread, not on the event loop)
        return Response(await in_admin_thread(context.link.ask, ("metrics",), 60.0), media_type=CONTENT_TYPE_LATEST)

    async def add_set(request: Request) -> Response:  # the admin endpoints' token is checked by _endpoint
        body = await _read_json(request, limits.max_body_bytes, context)
        if not isinstance(body, dict):
            raise RequestError(400, "The request body must be a JSON object with 'name' and 'source'.")
        info = await in_admin_thread(context.change, "add_set", (body.get("name"), body.get("source")))
        return _json({"object": "model", **info, "created": int(time.time()), "owned_by": "st-prompts"}, 201)

    async def remove_set(request: Request) -> Response:
        name = request.path_params["name"]
        await in_admin_thread(context.change, "remove_set", (name,))
        return _json({"id": name, "object": "model", "deleted": True})

    async def reload_index(request: Request) -> Response:
        return _json(await in_admin_thread(context.change, "reload_index", (request.path_params["name"],)))

    table = [("/v1/embeddings", "embeddings", embeddings, "POST"), ("/embeddings", "embeddings", embeddings, "POST"),
             ("/v1/models", "models", models, "GET"), ("/v1/models/{name:path}", "models", model, "GET"),
             ("/search", "search", search, "POST"), ("/health", "health", health, "GET"),
             ("/live", "live", live, "GET"), ("/metrics", "metrics", metrics, "GET")]
    if context.admin_token is not None:
        table += [("/admin/prompt-sets", "admin", add_set, "POST"),
                  ("/admin/prompt-sets/{name:path}", "admin", remove_set, "DELETE"),
                  ("/admin/indexes/{name}/reload", "admin", reload_index, "POST")]
    routes = [Route(path, _endpoint(context, name, handler), methods=[method]) for path, name, handler, method in table]

    @asynccontextmanager
    async def lifespan(app):
        context.count_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="st-prompts-tokens")
        context.admin_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="st-prompts-admin")
        await batcher.start()
        if context.link is not None:
            from st_prompts.serving.changes import apply_change

            context.link.listen(lambda op, args: apply_change(served, context.indexes, op, args),
                                context.metrics.render)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            context.draining = True
            left = None if context.drain_deadline is None else context.drain_deadline - time.monotonic()
            await batcher.close(drain=True, timeout=left)
            context.count_executor.shutdown(wait=False)
            context.admin_executor.shutdown(wait=False)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        method, path = request.method, request.url.path
        path = path if len(path) <= 200 else f"{path[:200]}... ({len(path):,} characters)"
        message = {404: f"No route {method} {path}.",
                   405: f"{method} is not allowed on {path}."}.get(exc.status_code, str(exc.detail)[:300])
        return _error(RequestError(exc.status_code, message))

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def _model_card(name: str, created: int, served: Any) -> dict[str, Any]:
    """OpenAI's model object, and how the model is stored (``quantization``, ``dtype``: clients ignore them)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "st-prompts",
            "quantization": served.quantization, "dtype": served.dtype}
