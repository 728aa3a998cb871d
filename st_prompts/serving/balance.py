"""Connections spread over forked workers by how many each holds open (``st-prompts serve --workers N``).

Forked workers that all accept on one shared listening socket do not share the connections evenly: asyncio accepts
every connection waiting when its loop wakes, so a burst of clients lands mostly on whichever worker woke first.
Measured with two workers and 16 keep-alive clients connecting at once, five tries: 8/8, 3/13, 5/11, 8/8, 7/9; a
worker holding 13 of 16 clients is the bottleneck while the other idles (the benchmark's rounds at concurrency 16 were
bimodal: 69-76 against 120-131 sentences/s). The kernel's ``SO_REUSEPORT`` hashing is no better (binomial, blind to
load), and asyncio has no way to accept one connection at a time or to pause accepting.

So with workers the parent accepts (it serves no request) and hands each connection to the ready worker holding the
fewest open connections, over a datagram socket pair per worker (``SCM_RIGHTS``: the worker receives the connection's
file descriptor). The parent counts what it handed to each worker; each worker publishes, in shared memory, how many of
those it has closed, so the parent's count of a worker's open connections includes the ones still on their way. Under
keep-alive clients with one request outstanding each (the usual load), open connections are the work a worker holds.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import RawArray

logger = logging.getLogger(__name__)

__all__ = ["Balancer", "Receiver"]


class Balancer:
    """The parent's side: accepts on ``listener`` in a thread and hands connections to ready workers.

    The supervisor calls :meth:`pair` before each fork (the child's end goes to the worker's :class:`Receiver`),
    :meth:`ready` when a worker says it is ready, :meth:`forget` when it is gone, :meth:`start` once the workers are
    forked and :meth:`stop` when the server stops (the listener itself is closed by the supervisor).
    """

    def __init__(self, listener: socket.socket, count: int) -> None:
        self.listener = listener
        self.closed = RawArray("q", count)  # written by worker i only: connections it was handed and has closed
        self.sent = [0] * count  # written by the parent only
        self._ends: dict[int, socket.socket] = {}
        self._ready: set[int] = set()
        self._lock = threading.Lock()
        #: held from an accept to the close of the parent's copy, and by the supervisor around each fork: a worker
        #: forked meanwhile would inherit the parent's copy of a connection and keep it open after its own worker
        #: closed it (the client would never see it closed)
        self.fork_lock = threading.Lock()
        self._wake_read, self._wake_write = socket.socketpair()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def pair(self, index: int) -> socket.socket:
        """A new handoff pair for worker ``index`` (about to be forked): returns the worker's end."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        parent_end.setblocking(False)
        with self._lock:
            old = self._ends.pop(index, None)
            self._ready.discard(index)
            self._ends[index] = parent_end
            self.sent[index] = 0
            self.closed[index] = 0
        if old is not None:
            old.close()
        return child_end

    def close_in_worker(self) -> None:
        """In a freshly forked worker: close the parent's ends (of every worker), the wake pair and the listener."""
        for end in self._ends.values():
            end.close()
        self._wake_read.close()
        self._wake_write.close()
        self.listener.close()

    def ready(self, index: int) -> None:
        with self._lock:
            if index in self._ends:
                self._ready.add(index)

    def forget(self, index: int) -> None:
        with self._lock:
            self._ready.discard(index)
            end = self._ends.pop(index, None)
        if end is not None:
            end.close()

    def start(self) -> None:
        self.listener.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="st-prompts-balancer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting (safe in a signal handler: it does not wait for the thread)."""
        self._stopped = True
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._stopped:
                selector.select(timeout=0.5)
                if self._stopped:
                    return
                if not self._ready:  # connections wait in the listen queue until a worker is ready
                    time.sleep(0.05)
                    continue
                for _ in range(64):  # then back to the selector: a stop is seen within 64 connections
                    with self.fork_lock:
                        try:
                            connection, _ = self.listener.accept()
                        except (BlockingIOError, InterruptedError):
                            break
                        except OSError:  # the listener was closed: the server stops
                            return
                        try:
                            self._hand(connection)
                        finally:
                            connection.close()  # the worker holds its own copy now
        finally:
            selector.close()

    def _hand(self, connection: socket.socket) -> None:
        with self._lock:
            order = sorted((self.sent[i] - self.closed[i], i) for i in self._ready)
            ends = {i: self._ends[i] for _, i in order}
        for _, index in order:
            try:
                socket.send_fds(ends[index], [b"c"], [connection.fileno()])
            except OSError:  # its queue is full (a stuck worker) or it is gone: the next one
                continue
            with self._lock:
                if self._ends.get(index) is ends[index]:
                    self.sent[index] += 1
            return
        logger.warning("no worker could take a connection: it is closed")


class Receiver:
    """A worker's side: takes the connections the parent hands it into its event loop."""

    def __init__(self, end: socket.socket, closed, index: int) -> None:
        self.end = end
        self.closed = closed
        self.index = index
        self.received = 0
        self.pending = 0  # received, not yet made into a connection
        self.open = 0  # connections open in this worker (the guard's count)
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.Protocol]) -> None:
        """Serve each connection handed over with a protocol from ``factory`` (uvicorn's, as its listener would)."""
        self.end.setblocking(False)
        self._loop = loop
        loop.add_reader(self.end.fileno(), self._take, factory)

    def detach(self) -> None:
        """Take no more connections (the server drains); any still on their way are closed."""
        if self._loop is not None:
            self._loop.remove_reader(self.end.fileno())
            self._loop = None
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(self.end, 16, 1)
            except OSError:
                break
            if not fds:
                break
            for fd in fds:
                socket.socket(fileno=fd).close()
                self.received += 1
        self._publish()

    def on_count(self, open_connections: int) -> None:
        """The guard's count of open connections changed: publish how many handed ones are closed."""
        self.open = open_connections
        self._publish()

    def _publish(self) -> None:
        self.closed[self.index] = max(0, self.received - self.pending - self.open)

    def _take(self, factory) -> None:
        loop = self._loop
        while loop is not None:
            try:
                _, fds, _, _ = socket.recv_fds(self.end, 16, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.detach()
                return
            for fd in fds:
                self.received += 1
                self.pending += 1
                loop.create_task(self._connect(loop, factory, socket.socket(fileno=fd)))

    async def _connect(self, loop: asyncio.AbstractEventLoop, factory, sock: socket.socket) -> None:
        try:
            await loop.connect_accepted_socket(factory, sock)
        except OSError:  # the client went away meanwhile
            sock.close()
        finally:
            self.pending -= 1
            self._publish()
