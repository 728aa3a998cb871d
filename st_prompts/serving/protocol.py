"""uvicorn's httptools protocol with timeouts, a connection cap and OpenAI errors for malformed HTTP.

uvicorn times out only idle keep-alive connections: a client that sends part of its headers, or announces a body and
never sends it, or never reads its answer, holds a connection (a file descriptor, and on SIGTERM the drain) for as
long as it likes. :func:`guarded_protocol` returns a subclass of uvicorn's ``HttpToolsProtocol`` (given to
``uvicorn.Config(http=...)``) that bounds every phase of a connection with a timer of the event loop:

==================  =========================================================================================
idle                from the connection's start, and between keep-alive requests: ``idle_timeout`` (closed)
headers             from a request's first byte to its last header: ``header_timeout``, in all (408, closed)
body                from the headers to the body's last byte: ``body_timeout``, in all (408, closed)
answer              while the client does not read its answer (the send buffer stays full): ``body_timeout``
                    without progress (closed at once)
==================  =========================================================================================

A request whose headers are complete and whose body has arrived is the application's: it is not timed here (the
server's drain timeout bounds it on SIGTERM). Beyond ``max_connections`` open connections a new one is answered 503
and closed at once. Bytes that are not HTTP (a garbage request line, ``Content-Length: abc`` or ``-5``, a bad chunk)
are answered 400 in OpenAI's error object instead of uvicorn's plain text. On shutdown a connection still sending its
request is answered 503 and closed (an idle one is closed), so that no client holds the drain. Every connection the
server closes on a client is counted (``ConnectionGuard.on_drop``: ``st_prompts_dropped_connections_total``).
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

from st_prompts.serving.limits import RequestError

logger = logging.getLogger(__name__)

__all__ = ["ConnectionGuard", "guarded_protocol"]


@dataclass
class ConnectionGuard:
    """The bounds of every connection (seconds) and what to call when one is closed on its client.

    Attributes:
        header_timeout: a request's headers must be complete this long after its first byte.
        body_timeout: a request's body must be complete this long after its headers; a client that reads nothing
            of its answer for this long is dropped.
        idle_timeout: a connection without a request (new, or between keep-alive requests) is closed after this.
        max_connections: connections open at once; one more is answered 503 and closed.
        on_drop: ``on_drop(reason)``, called on the event loop for each connection closed on a client.
        on_malformed: called for each request refused as malformed HTTP (it is answered 400).
        on_count: ``on_count(open_connections)`` after each connection opens or closes.
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    max_connections: int = 1000
    on_drop: Callable[[str], None] | None = None
    on_malformed: Callable[[], None] | None = None
    on_count: Callable[[int], None] | None = None

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


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with the bounds of :class:`ConnectionGuard` (see the module docstring); the
    guard is the class attribute ``guard`` (:func:`guarded_protocol` makes the subclass)."""

    guard: ConnectionGuard = ConnectionGuard()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receive_timer = None  # the header or body deadline of the request being received
        self._send_timer = None  # the client does not read its answer
        self._phase = "idle"  # "headers", "body" (a request is being received) or "idle" (none is)

    # ------------------------------------------------------------------ the connection
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        if guard.on_count is not None:
            guard.on_count(len(self.connections))
        if len(self.connections) > guard.max_connections:
            self._drop("too_many_connections", 503, f"The server has {guard.max_connections:,} connections open, "
                       "its limit; retry shortly.", "too_many_connections")
            return
        # uvicorn arms its keep-alive timer only after a first answer: a connection that never sends is timed too
        self.timeout_keep_alive_task = self.loop.call_later(guard.idle_timeout, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_receive_timer()
        self._cancel_send_timer()
        super().connection_lost(exc)
        if self.guard.on_count is not None:
            self.guard.on_count(len(self.connections))

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # closed meanwhile
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:  # callback errors (a URL that is not ASCII, ...) included
            if self.guard.on_malformed is not None:
                self.guard.on_malformed()
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            self._drop("malformed", 400, f"Malformed HTTP request: {reason}.", "invalid_http_request")

    # ------------------------------------------------------------------ request phases (parser callbacks)
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = "headers"
        self._arm_receive(self.guard.header_timeout, "header_timeout", "headers")

    def on_headers_complete(self) -> None:
        self._phase = "body"
        self._arm_receive(self.guard.body_timeout, "body_timeout", "body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = "idle"
        self._cancel_receive_timer()
        super().on_message_complete()

    # ------------------------------------------------------------------ the answer
    def pause_writing(self) -> None:
        super().pause_writing()
        self._cancel_send_timer()
        self._send_timer = self.loop.call_later(self.guard.body_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if not self.transport.is_closing():
            self.guard.dropped("send_timeout")
            logger.info("dropped a client that read nothing of its answer for %g s", self.guard.body_timeout)
            self.transport.abort()  # a close() would wait for the buffer to flush, i.e. for that client

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Called by uvicorn when the server stops: a request still being sent is answered 503 (the server does not
        wait for it), an idle connection is closed, one whose request is answered closes after its answer."""
        if self._phase != "idle" and not self.transport.is_closing():
            self._drop("shutdown", 503, "The server is shutting down; retry (on another replica).", "shutting_down")
            return
        super().shutdown()

    # ------------------------------------------------------------------ helpers
    def _arm_receive(self, seconds: float, reason: str, what: str) -> None:
        self._cancel_receive_timer()
        self._receive_timer = self.loop.call_later(seconds, self._receive_timed_out, reason, what, seconds)

    def _receive_timed_out(self, reason: str, what: str, seconds: float) -> None:
        self._receive_timer = None
        if self._phase != "idle":
            self._drop(reason, 408, f"The request's {what} did not arrive within {seconds:g} s.", "request_timeout")

    def _cancel_receive_timer(self) -> None:
        if self._receive_timer is not None:
            self._receive_timer.cancel()
            self._receive_timer = None

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _drop(self, reason: str, status: int, message: str, code: str) -> None:
        """Answer ``status`` with OpenAI's error object and close the connection; the answer is left out when the
        request being received already has one (an early 413), or when an earlier request's answer is pending."""
        phase, self._phase = self._phase, "idle"
        self._cancel_receive_timer()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        self.guard.dropped(reason)
        pending = self.cycle is not None and not self.cycle.response_complete  # an answer not yet complete
        if (not self.cycle.response_started and not self.pipeline) if phase == "body" else not pending:
            self.transport.write(error_response(status, message, code, self.server_state.default_headers))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` subclass bound to ``guard``, for ``uvicorn.Config(http=...)``."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard})
