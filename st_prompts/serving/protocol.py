"""uvicorn's httptools protocol with timeouts, bounds on a request's head, a connection cap and OpenAI errors for
malformed HTTP: a header arriving in pieces is copied each time, so one endless header would stall every client of the
process. A refused connection lingers rather than sending a reset that can destroy its answer (``docs/serving.md``).
"""

from __future__ import annotations

import http
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from st_prompts.errors import first_line
from st_prompts.numbers import whole
from st_prompts.serving.limits import RequestError

logger = logging.getLogger(__name__)

__all__ = ["MAX_URL_BYTES", "ConnectionGuard", "guarded_protocol"]

#: The longest URL any server may accept: httptools' URL parser keeps offsets in 16 bits.
MAX_URL_BYTES = 65_535
#: Seconds a refused connection stays open after its answer, at most, and bytes of it read and dropped meanwhile.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20


@dataclass
class ConnectionGuard:
    """The bounds of every connection and what to call on what happens to one.

    ``header_timeout`` runs from a request's first byte, ``body_timeout`` from its headers (and bounds a client
    that reads nothing of its answer), ``idle_timeout`` between requests. Beyond ``max_connections``: 503; beyond
    ``max_header_bytes`` or ``max_headers``: 431; beyond ``max_url_bytes``: 414. ``on_drop(reason)``,
    ``on_malformed(status)`` and ``on_count(open_connections)`` are told what happens; ``shed()``, asked once per
    keep-alive request, closes the connection after its answer when true (:mod:`st_prompts.serving.balance`).
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    max_connections: int = 1000
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_url_bytes: int = 32 * 1024
    on_drop: Callable[[str], None] | None = None
    on_malformed: Callable[[int], None] | None = None
    on_count: Callable[[int], None] | None = None
    shed: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "max_headers", "max_url_bytes"):
            value = getattr(self, name)
            if not whole(value, 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_url_bytes > MAX_URL_BYTES:
            raise ValueError(f"max_url_bytes must be at most {MAX_URL_BYTES:,} (httptools' URL parser), got "
                             f"{self.max_url_bytes:,}")

    def dropped(self, reason: str) -> None:
        if self.on_drop is not None:
            self.on_drop(reason)


def error_response(status: int, message: str, code: str, default_headers: list[tuple[bytes, bytes]] = ()) -> bytes:
    """A complete ``HTTP/1.1`` answer carrying OpenAI's error object, that closes the connection."""
    body = orjson.dumps(RequestError(status, message, code=code).payload())
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode("ascii")]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return b"".join(head) + body


class _Refusal(Exception):
    """Raised by a parser callback to refuse the request: ``args`` are :meth:`GuardedProtocol._drop`'s."""


def _answering(status: int, message: str, code: str) -> Callable[..., Any]:
    """An ASGI application answering ``status`` with OpenAI's error object and closing (a refused pipelined request)."""
    body = orjson.dumps(RequestError(status, message, code=code).payload())

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return app


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with the bounds of its class attribute ``guard``."""

    guard: ConnectionGuard = ConnectionGuard()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receive_timer = None  # the header or body deadline of the request being received
        self._send_timer = None  # the client does not read its answer
        self._phase = "idle"  # "headers", "body" (a request is being received) or "idle" (none is)
        self.over_capacity = False  # set before connection_made by a worker whose parent counted too many
        self._begun = 0  # requests begun on this connection (tells a head that began within a piece of data)
        self._head_bytes = 0  # bytes of the head being received, counted as they are handed to the parser
        self._seen_head = 0  # bytes of its URL and complete header fields, as the parser's callbacks give them
        self._fields = 0  # its header fields so far
        self._refused = False  # a refusal is answered, or waits for earlier answers: nothing more is read
        self._deferred: bytes | None = None  # that answer, sent once the earlier requests are answered
        self._linger_timer = None  # closes a refused connection that the client does not close
        self._dropped_bytes = 0  # what a refused connection sent since (read and dropped)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        if guard.on_count is not None:
            guard.on_count(len(self.connections))
        if self.over_capacity or len(self.connections) > guard.max_connections:
            self._drop("too_many_connections", 503, f"The server has {guard.max_connections:,} connections open, "
                       "its limit; retry shortly.", "too_many_connections")
            return
        # uvicorn arms its keep-alive timer only after a first answer: a connection that never sends is timed too
        self.timeout_keep_alive_task = self.loop.call_later(guard.idle_timeout, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in ("_receive_timer", "_send_timer", "_linger_timer"):
            self._cancel(timer)
        super().connection_lost(exc)
        if self.guard.on_count is not None:
            self.guard.on_count(len(self.connections))

    def data_received(self, data: bytes) -> None:
        """Feed ``data`` to the parser, a head no more than the bytes left of ``max_header_bytes`` at a time."""
        if self.parser is None:  # closed meanwhile
            return
        if self._refused:  # refused: what follows is dropped, and not read at all beyond LINGER_BYTES
            self._dropped_bytes += len(data)
            if self._dropped_bytes > LINGER_BYTES and not self.transport.is_closing():
                self.transport.pause_reading()
            return
        self._unset_keepalive_if_required()
        limit = self.guard.max_header_bytes
        view = memoryview(data)
        while view:
            if self._phase in ("idle", "headers"):  # a head goes on, or one may begin at the first byte
                room = max(1, limit - (self._head_bytes if self._phase == "headers" else 0))
                piece, view = view[:room], view[room:]
            else:
                piece, view = view, view[:0]
            phase, begun = self._phase, self._begun
            if not self._feed(piece):
                return
            if self._phase != "headers":
                continue
            if self._begun == begun:  # the head went on through the whole piece
                self._head_bytes += len(piece)
            elif self._begun == begun + 1 and phase == "idle":  # it began with the piece (after CRLFs at most)
                self._head_bytes = len(piece)
            else:  # it began within the piece, after another request: what the parser's callbacks saw of it
                self._head_bytes = self._seen_head
            if self._head_bytes >= limit:  # at the limit and not complete: more than the limit
                self._refuse("header_too_large", 431, f"The request's line and headers exceed {limit:,} bytes.",
                             "request_header_fields_too_large")
                return

    def _feed(self, piece: memoryview) -> bool:
        """Feed the parser; ``False`` when the connection is refused or taken over (nothing more is fed)."""
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        except httptools.HttpParserError as exc:  # callback errors (a URL that is not ASCII, ...) included
            refusal = exc.__context__ if isinstance(exc.__context__, _Refusal) else None
            if refusal is not None:
                reason, status, message, code = refusal.args
            else:  # what the parser said, or what it said of a callback's error (a URL it cannot parse)
                cause = exc.__context__ if isinstance(exc.__context__, httptools.HttpParserError) else exc
                reason, status, code = "malformed", 400, "invalid_http_request"
                message = f"Malformed HTTP request: {first_line(cause, 200)}."
            self._refuse(reason, status, message, code)
            return False
        return True

    def _refuse(self, reason: str, status: int, message: str, code: str) -> None:
        """Refuse a request before it reaches the application (counted as malformed)."""
        if self.guard.on_malformed is not None:
            self.guard.on_malformed(status)
        self._drop(reason, status, message, code)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun += 1
        self._head_bytes = self._seen_head = self._fields = 0
        self._phase = "headers"
        self._arm_receive(self.guard.header_timeout, "header_timeout", "headers")

    def on_url(self, url: bytes) -> None:
        limit = self.guard.max_url_bytes
        if len(self.url) + len(url) > limit:
            raise _Refusal("url_too_long", 414, f"The request's URL exceeds {limit:,} bytes.", "url_too_long")
        self._seen_head += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        guard = self.guard
        self._fields += 1
        self._seen_head += len(name) + len(value) + 4  # ": " and CRLF
        if self._fields > guard.max_headers:
            raise _Refusal("header_too_large", 431, f"The request has more than {guard.max_headers:,} header "
                           "fields.", "request_header_fields_too_large")
        if self._seen_head > guard.max_header_bytes:
            raise _Refusal("header_too_large", 431, f"The request's line and headers exceed "
                           f"{guard.max_header_bytes:,} bytes.", "request_header_fields_too_large")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # a URL httptools cannot parse raises here: malformed, before any body phase
        self._phase = "body"
        self._arm_receive(self.guard.body_timeout, "body_timeout", "body")
        cycle = self.cycle
        if self.guard.shed is not None and cycle is not None and cycle.keep_alive and not self.pipeline \
                and self.guard.shed():
            cycle.keep_alive = False  # answered with "connection: close": its client reconnects (to another worker)

    def on_message_complete(self) -> None:
        self._phase = "idle"
        self._cancel("_receive_timer")
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if self._deferred is not None and not self.pipeline and cycle is not None and cycle.response_complete \
                and not self.transport.is_closing():
            self._unset_keepalive_if_required()  # super() armed it: the refusal closes the connection now
            answer, self._deferred = self._deferred, None
            self.transport.write(answer)
            self._linger()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._cancel("_send_timer")
        self._send_timer = self.loop.call_later(self.guard.body_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._cancel("_send_timer")
        super().resume_writing()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if not self.transport.is_closing():
            self.guard.dropped("send_timeout")
            logger.info("dropped a client that read nothing of its answer for %g s", self.guard.body_timeout)
            self.transport.abort()  # a close() would wait for the buffer to flush, i.e. for that client

    def shutdown(self) -> None:
        """Called by uvicorn when the server stops: a request still being sent is answered 503."""
        if self._phase != "idle" and not self.transport.is_closing():
            self._drop("shutdown", 503, "The server is shutting down; retry (on another replica).", "shutting_down")
            return
        super().shutdown()

    def _arm_receive(self, seconds: float, reason: str, what: str) -> None:
        self._cancel("_receive_timer")
        self._receive_timer = self.loop.call_later(seconds, self._receive_timed_out, reason, what, seconds)

    def _receive_timed_out(self, reason: str, what: str, seconds: float) -> None:
        self._receive_timer = None
        if self._phase != "idle":
            self._drop(reason, 408, f"The request's {what} did not arrive within {seconds:g} s.", "request_timeout")

    def _cancel(self, timer: str) -> None:
        """Cancel the timer held in the attribute ``timer`` (``"_receive_timer"``, ...), if one is armed."""
        handle = getattr(self, timer)
        if handle is not None:
            handle.cancel()
            setattr(self, timer, None)

    def _drop(self, reason: str, status: int, message: str, code: str) -> None:
        """Refuse the request being received: answer ``status`` with OpenAI's error object (after the pipelined
        requests before it; not when it has an answer already) and close the connection, lingering."""
        phase, self._phase = self._phase, "idle"
        self._cancel("_receive_timer")
        self._unset_keepalive_if_required()
        if self.transport.is_closing() or self._refused:
            return
        self.guard.dropped(reason)
        linger = reason not in ("too_many_connections", "shutdown")  # neither holds a slot nor the server's stop
        cycle = self.cycle
        if phase == "body" and cycle is not None:  # the refused request's headers were complete: it is self.cycle
            if self.pipeline and self.pipeline[0][0] is cycle:  # queued behind earlier answers: refused in its turn
                self._refused = True
                cycle.keep_alive = False
                self.pipeline[0] = (cycle, _answering(status, message, code))
                return
            if not cycle.response_started:
                self.transport.write(error_response(status, message, code, self.server_state.default_headers))
            # the application sees its client gone and writes nothing more
            cycle.keep_alive = False
            cycle.disconnected = True
            cycle.message_event.set()
        elif cycle is not None and not cycle.response_complete:  # earlier requests still owe their answers
            self._refused = True
            self._deferred = error_response(status, message, code, self.server_state.default_headers)
            return
        else:
            self.transport.write(error_response(status, message, code, self.server_state.default_headers))
        if linger:
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Half-close a refused connection after its answer; close it when the client does, or after LINGER_SECONDS."""
        self._refused = True
        transport = self.transport
        if transport.is_closing():
            return
        try:
            if transport.can_write_eof():
                transport.write_eof()  # the end follows the answer once it is sent
        except (OSError, RuntimeError):  # the client is gone already
            transport.abort()
            return
        transport.resume_reading()  # what the client still sends is dropped, and its end closes the connection
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, transport.abort)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` subclass bound to ``guard``, for ``uvicorn.Config(http=...)``."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard})
