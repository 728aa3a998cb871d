"""Connections spread over forked workers by how many each holds open (``--workers N``): a shared accept spreads a
burst unevenly, so the parent accepts and hands each connection (``SCM_RIGHTS``) to the ready worker holding the
fewest, holds ``--max-connections``, and asks a worker holding two more than another to shed keep-alive clients;
workers publish in shared memory how many they closed and took. Details: ``docs/serving.md`` (Workers)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import RawArray

logger = logging.getLogger(__name__)

__all__ = ["Balancer", "Receiver"]

#: Connections on their way to one worker at most; seconds the parent waits when every hand-off queue is full before
#: closing a connection; seconds between two warnings about those; seconds between two looks at the balance.
HANDOFF_DEPTH = 64
HANDOFF_WAIT = 5.0
WARNING_INTERVAL = 10.0
REBALANCE_INTERVAL = 0.5

_SERVE, _REFUSE = b"c", b"r"  # what a hand-off carries beside the connection: serve it, or answer it 503


class Balancer:
    """The parent's side: accepts on ``listener`` in a thread and hands connections to ready workers (``count``);
    beyond ``max_connections`` open in the whole server, marked to be answered 503. The supervisor calls :meth:`pair`
    before each fork, :meth:`ready`, :meth:`forget`, :meth:`start` and :meth:`stop`."""

    def __init__(self, listener: socket.socket, count: int, max_connections: int = 1000) -> None:
        self.listener = listener
        self.max_connections = max_connections
        # closed, taken (into its event loop), shed_done: written by worker i only; shed_asked, sent: by the parent
        self.closed = RawArray("q", count)
        self.taken = RawArray("q", count)
        self.shed_asked = RawArray("q", count)  # keep-alive connections worker i is to close
        self.shed_done = RawArray("q", count)
        self.sent = [0] * count
        self.unplaced = 0  # connections closed because no worker took them within HANDOFF_WAIT
        self._unplaced_logged = 0
        self._lead: tuple[int, int | None] = (0, None)  # the last look's lead, and which worker had it
        self._warned = -float("inf")
        self._ends: dict[int, socket.socket] = {}
        self._ready: set[int] = set()
        self._lock = threading.Lock()
        #: held from an accept to the close of the parent's copy, and around each fork: a worker forked meanwhile
        #: would inherit that copy and keep the connection open after its own worker closed it
        self.fork_lock = threading.Lock()
        self._wake_read, self._wake_write = socket.socketpair()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def pair(self, index: int) -> socket.socket:
        """A new handoff pair for worker ``index`` (about to be forked): returns the worker's end."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        parent_end.setblocking(False)
        self.forget(index)  # the end of the worker this one replaces
        with self._lock:
            self._ends[index] = parent_end
            for counts in (self.sent, self.closed, self.taken, self.shed_asked, self.shed_done):
                counts[index] = 0
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
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")

    def metrics_text(self) -> bytes:
        """The parent's own samples, in Prometheus' text format (merged into ``/metrics`` with the workers')."""
        return (b"# TYPE st_prompts_dropped_connections_total counter\n"
                b'st_prompts_dropped_connections_total{reason="handoff"} %d\n' % self.unplaced)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        selector.register(self._wake_read, selectors.EVENT_READ)
        rebalanced = time.monotonic()
        try:
            while not self._stopped:
                selector.select(timeout=REBALANCE_INTERVAL)
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
                if time.monotonic() - rebalanced >= REBALANCE_INTERVAL:
                    rebalanced = time.monotonic()
                    self._rebalance()
                self._warn()
        finally:
            selector.close()

    def _hand(self, connection: socket.socket) -> None:
        """Give ``connection`` to the ready worker holding the fewest with fewer than HANDOFF_DEPTH on their way."""
        deadline = None
        while not self._stopped:
            with self._lock:
                order = sorted((self.sent[i] - self.closed[i], i) for i in self._ready
                               if self.sent[i] - self.taken[i] < HANDOFF_DEPTH)
                ends = {i: self._ends[i] for _, i in order}
                held = sum(self.sent[i] - self.closed[i] for i in self._ends)
            mark = _REFUSE if held >= self.max_connections else _SERVE
            for _, index in order:
                try:
                    socket.send_fds(ends[index], [mark], [connection.fileno()])
                except OSError:  # its queue is full (EAGAIN) or it is gone: the next one
                    continue
                with self._lock:
                    if self._ends.get(index) is ends[index]:
                        self.sent[index] += 1
                return
            now = time.monotonic()
            deadline = now + HANDOFF_WAIT if deadline is None else deadline
            if now >= deadline:
                break
            # every worker has its fill on the way: wait until one takes some (a stop wakes the wait)
            select.select([self._wake_read], [], [], min(0.005, deadline - now))
        if not self._stopped:  # (a stopping server closes what it holds anyway)
            self.unplaced += 1

    def _warn(self) -> None:
        """One warning at most every WARNING_INTERVAL seconds for the connections no worker took."""
        if self.unplaced > self._unplaced_logged and time.monotonic() - self._warned >= WARNING_INTERVAL:
            logger.warning("closed %d connection%s that no worker took within %g s (every worker's hand-off queue "
                           "stayed full)", self.unplaced - self._unplaced_logged,
                           "s" * (self.unplaced - self._unplaced_logged != 1), HANDOFF_WAIT)
            self._unplaced_logged = self.unplaced
            self._warned = time.monotonic()

    def _rebalance(self) -> None:
        """Ask the worker holding the most open connections to close half its lead over the one holding the fewest
        after their next answers, when it led at the last look too (brief leads are no reason to move clients)."""
        with self._lock:  # connections open in each worker's event loop (not those on their way)
            held = sorted((self.taken[i] - self.closed[i], i) for i in self._ready)
        lead, index = ((held[-1][0] - held[0][0]) // 2, held[-1][1]) if len(held) >= 2 else (0, None)
        previous, self._lead = self._lead, (lead, index)
        if lead >= 1 and previous[1] == index and previous[0] >= 1:
            self.shed_asked[index] = self.shed_done[index] + min(lead, previous[0])
        elif lead < 1:
            for _, other in held:  # balanced: whatever was asked and not yet done is no longer wanted
                self.shed_asked[other] = self.shed_done[other]


class Receiver:
    """A worker's side: takes the connections the parent hands it into its event loop."""

    def __init__(self, end: socket.socket, index: int, closed, taken, shed_asked, shed_done) -> None:
        self.end = end
        self.index = index
        self.closed = closed
        self.taken = taken
        self.shed_asked = shed_asked
        self.shed_done = shed_done
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

    def shed(self) -> bool:
        """Whether to close this keep-alive connection after its answer: the parent asks for it, and this worker still
        holds at least two connections more than another."""
        index = self.index
        if self.shed_done[index] >= self.shed_asked[index]:
            return False
        held = [self.taken[i] - self.closed[i] for i in range(len(self.closed))]
        mine = held.pop(index)
        if not held or mine - min(held) < 2:
            return False
        self.shed_done[index] += 1
        return True

    def _publish(self) -> None:
        self.closed[self.index] = max(0, self.received - self.pending - self.open)
        self.taken[self.index] = self.received - self.pending

    def _take(self, factory) -> None:
        loop = self._loop
        while loop is not None:
            try:
                mark, fds, _, _ = socket.recv_fds(self.end, 16, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.detach()
                return
            for fd in fds:
                self.received += 1
                self.pending += 1
                loop.create_task(self._connect(loop, factory, socket.socket(fileno=fd), mark == _REFUSE))
            self._publish()

    async def _connect(self, loop: asyncio.AbstractEventLoop, factory, sock: socket.socket, refuse: bool) -> None:
        counted = []  # the connection leaves `pending` once: when the guard counts it, or when it fails

        def made_now(connection_made: Callable, transport) -> None:
            if not counted:
                counted.append(True)
                self.pending -= 1
            connection_made(transport)  # the guard counts it open and publishes (on_count)

        def protocol() -> asyncio.Protocol:
            made = factory()
            made.over_capacity = refuse  # the server holds --max-connections: answered 503 (the guard)
            # leaving `pending` just as the guard counts it open keeps the published count exact (not counted twice)
            made.connection_made = functools.partial(made_now, made.connection_made)
            return made

        try:
            await loop.connect_accepted_socket(protocol, sock)
        except OSError:  # the client went away meanwhile
            sock.close()
            if not counted:
                counted.append(True)
                self.pending -= 1
            self._publish()
