"""Dynamic batching across requests and tasks: one queue of rows; the oldest ``4 x max_batch_rows``, sorted by length,
are split into the passes that cost least (padded tokens plus ``pass_overhead_tokens`` a pass), and the one holding the
oldest row runs next, in one worker thread. Details: ``docs/serving.md``."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from st_prompts.errors import first_line

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PASS_OVERHEAD_TOKENS", "BatchReport", "Batcher", "BatcherClosed", "QueueFull", "split_passes"]

#: the pass overhead when none is given or measured (any within 30-180 serves about the same on a CPU)
DEFAULT_PASS_OVERHEAD_TOKENS = 64.0


class QueueFull(Exception):
    """The queue has no room for the request: try again after ``retry_after`` seconds."""

    def __init__(self, queued_rows: int, requested_rows: int, limit: int, retry_after: int) -> None:
        super().__init__(f"The server is busy: {queued_rows:,} rows are queued and this request adds "
                         f"{requested_rows:,} (the limit is {limit:,}); retry after {retry_after} s.")
        self.retry_after = retry_after


class BatcherClosed(Exception):
    """The batcher is closing (the server drains): it takes no new request."""


@dataclass
class BatchReport:
    """One forward pass, as the batcher reports it to its observer (metrics)."""

    rows: int
    tasks: Counter = field(repr=False)
    tokens: int
    padded_tokens: int
    seconds: float
    queued_rows: int
    failed: bool = False


class _Request:
    __slots__ = ("future", "out", "queued", "remaining", "rows")

    def __init__(self, future: asyncio.Future, rows: int) -> None:
        self.future = future
        self.rows = rows
        self.remaining = rows  # rows not yet delivered
        self.out: np.ndarray | None = None
        self.queued = rows  # rows still in the queue (not yet taken into a pass)


@dataclass(slots=True, eq=False)
class _Row:
    request: _Request
    position: int
    text: str
    task: Hashable
    tokens: int
    arrival: float


class Batcher:
    """Collect rows of many requests and tasks into forward passes (see the module docstring).

    Args:
        encode: ``encode(texts, tasks) -> array (rows, dim)``, called in the worker thread, one pass at a time.
        max_batch_tokens: bound on the padded tokens of a pass; a single longer row runs alone.
        pass_overhead_tokens: what one forward pass costs beyond its padded tokens, in tokens.
        max_queue_rows: bound on the queued rows (:class:`QueueFull` beyond; a request alone is always admitted).
        on_batch: called on the event loop after every pass with a :class:`BatchReport`.
        on_idle: called in the worker thread once the queue has been empty for ``idle_seconds``.
    """

    def __init__(self, encode: Callable[[list[str], list[Any]], Any], *, max_wait_ms: float = 2.0,
                 max_batch_tokens: int = 4096, max_batch_rows: int = 64, max_queue_rows: int = 4096,
                 pass_overhead_tokens: float = DEFAULT_PASS_OVERHEAD_TOKENS,
                 on_batch: Callable[[BatchReport], None] | None = None,
                 on_idle: Callable[[], None] | None = None, idle_seconds: float = 1.0) -> None:
        self._encode = encode
        self._on_idle = on_idle
        self.idle_seconds = float(idle_seconds)
        self.max_wait = max(0.0, float(max_wait_ms)) / 1000.0
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_batch_rows = int(max_batch_rows)
        self.max_queue_rows = int(max_queue_rows)
        overhead = float(pass_overhead_tokens)
        if not math.isfinite(overhead) or overhead < 0:
            raise ValueError(f"pass_overhead_tokens must be a non-negative number, got {pass_overhead_tokens!r}")
        self.pass_overhead_tokens = overhead
        self.window_rows = 4 * self.max_batch_rows
        self._on_batch = on_batch
        self._pending: list[_Row] = []
        self._pending_tokens = 0
        self._executor: ThreadPoolExecutor | None = None
        self._worker: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self.closing = False  # close() was called: new requests are refused
        #: (end time, rows, seconds the worker spent on them) of recent passes: the drain rate of ``Retry-After``
        self._drained: deque[tuple[float, int, float]] = deque(maxlen=64)
        self._busy_since: float | None = None  # when the worker, idle, was woken by new rows
        self._pass_end: float | None = None  # when the last pass ended
        self.running_rows = 0  # rows of the pass that runs and the one queued behind it
        self._abandoned = False  # abort_queued was called: passes not yet started fail instead of running

    async def start(self) -> None:
        """Start the worker (on the running event loop)."""
        if self._worker is not None:
            return
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="st-prompts-encode")
        self._worker = asyncio.create_task(self._run(), name="st-prompts-batcher")

    async def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new request; with ``drain`` finish the queued rows first (for at most ``timeout`` seconds), else
        fail them with :class:`BatcherClosed`. Returns when the worker has stopped."""
        self.closing = True
        if self._worker is None:
            return
        if not drain:
            self.abort_queued()
        self._wakeup.set()
        try:
            if timeout is not None and not self._worker.done():
                await asyncio.wait({self._worker}, timeout=max(0.0, timeout))
                self.abort_queued("The server is shutting down: its drain timeout passed before this request's turn.")
            await self._worker
        finally:
            self._executor.shutdown(wait=True)

    def abort_queued(self, message: str = "The server is shutting down.") -> int:
        """Fail every queued request with :class:`BatcherClosed` (not the pass that runs); returns how many."""
        self._abandoned = True  # a pass queued behind the running one does not start (its requests fail alike)
        requests = {id(r.request): r.request for r in self._pending}.values()
        failed = 0
        for request in requests:
            if not request.future.done():
                request.future.set_exception(BatcherClosed(message))
                failed += 1
            request.queued = 0
        self._pending = []
        self._pending_tokens = 0
        if self._wakeup is not None:
            self._wakeup.set()
        return failed

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a pass (not counting the pass that runs)."""
        return len(self._pending)

    def drain_rate(self, window: float = 30.0) -> float | None:
        """Rows per second the queue drained at over the last ``window`` seconds, or ``None`` before any pass."""
        now = time.perf_counter()
        recent = [entry for entry in self._drained if now - entry[0] <= window] or list(self._drained)[-4:]
        rows, seconds = sum(rows for _, rows, _ in recent), sum(seconds for _, _, seconds in recent)
        return rows / seconds if rows and seconds > 0 else None

    def retry_after(self, extra_rows: int = 0) -> int:
        """Seconds until the rows queued now have drained at :meth:`drain_rate`: 1 to 600; 5 before any pass."""
        rate = self.drain_rate()
        if rate is None:
            return 5
        ahead = len(self._pending) + self.running_rows  # the whole queue ahead of the client: its turn after them
        return int(min(600, max(1, math.ceil(ahead / rate))))

    async def encode(self, texts: Sequence[str], tokens: Sequence[int], tasks: Any | Sequence[Any]) -> np.ndarray:
        """Encode ``texts`` (``tokens``: their lengths) with their ``tasks`` (one for all, or one per text) into a
        ``(len(texts), dim)`` array; raises :class:`QueueFull`, :class:`BatcherClosed`, or what ``encode`` raised."""
        if self.closing or self._worker is None:
            raise BatcherClosed("The server is shutting down." if self.closing else "The batcher is not started.")
        count = len(texts)
        if len(tokens) != count:
            raise ValueError(f"one token count per text: {len(tokens)} for {count} texts")
        row_tasks = list(tasks) if isinstance(tasks, (list, tuple)) else [tasks] * count
        if len(row_tasks) != count:
            raise ValueError(f"one task per text: {len(row_tasks)} for {count} texts")
        if count == 0:
            return np.zeros((0, 0), dtype=np.float32)
        if self._pending and len(self._pending) + count > self.max_queue_rows:
            raise QueueFull(len(self._pending), count, self.max_queue_rows, self.retry_after(count))
        loop = asyncio.get_running_loop()
        request = _Request(loop.create_future(), count)
        now = loop.time()
        rows = [_Row(request, i, text, task, max(1, int(n)), now)
                for i, (text, task, n) in enumerate(zip(texts, row_tasks, tokens))]
        self._pending.extend(rows)
        self._pending_tokens += sum(row.tokens for row in rows)
        self._wakeup.set()
        try:
            return await request.future
        finally:
            if request.queued:  # cancelled (the client went away) or failed: its queued rows leave the queue
                self._discard(request)

    def _discard(self, request: _Request) -> None:
        """Drop the queued rows of a request that will not be answered (cancelled or failed)."""
        if not request.queued:
            return
        kept = [row for row in self._pending if row.request is not request]
        self._pending_tokens -= sum(row.tokens for row in self._pending if row.request is request)
        self._pending = kept
        request.queued = 0

    def _full(self) -> bool:
        return self._pending_tokens >= self.max_batch_tokens or len(self._pending) >= self.max_batch_rows

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task] = set()  # passes handed to the worker thread: the one that runs, one queued
        idle_done = True  # no pass has run since the start, or since on_idle was called
        while True:
            if not self._pending or running:
                if not self._pending and not running:
                    if self.closing:
                        return
                    self._wakeup.clear()
                    idle = not idle_done and self._on_idle is not None
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), self.idle_seconds if idle else None)
                    except asyncio.TimeoutError:
                        idle_done = True
                        await loop.run_in_executor(self._executor, self._call_idle)
                        if not self._pending:
                            continue
                    self._busy_since = time.perf_counter()
                    continue
                if self._pending and len(running) < 2 and not self.closing and self._full():
                    # a full pass waits behind the running one, so the thread starts it without a round trip
                    # through the event loop; with fewer rows, wait: later arrivals may join it
                    running.add(asyncio.create_task(self._run_pass(self._take())))
                    idle_done = False
                    continue
                self._wakeup.clear()
                waiter = asyncio.ensure_future(self._wakeup.wait())
                done, _ = await asyncio.wait(running | {waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():
                    waiter.cancel()
                running -= done
                continue
            deadline = self._pending[0].arrival + self.max_wait
            while self._pending and not self.closing and not self._full() and (delay := deadline - loop.time()) > 0:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), delay)
                except asyncio.TimeoutError:
                    break
            if not self._pending:
                continue
            running.add(asyncio.create_task(self._run_pass(self._take())))
            idle_done = False

    def _call_idle(self) -> None:
        try:
            self._on_idle()
        except Exception:
            logger.exception("the idle callback failed")

    def _start_pass(self, texts: list[str], tasks: list[Any]) -> Any:
        """The worker thread's pass; one queued when the queue was aborted does not start."""
        if self._abandoned:
            raise BatcherClosed("The server is shutting down: its drain timeout passed before this request's turn.")
        return self._encode(texts, tasks)

    def _take(self) -> list[_Row]:
        """Take the rows of the next pass out of the queue, sorted by length."""
        pool = self._pending
        # the oldest rows only, so that later rows cannot keep jumping ahead of older ones of another length
        window = pool[:self.window_rows]
        lengths = [row.tokens for row in window]
        order = sorted(range(len(window)), key=lengths.__getitem__)  # stable: equal lengths stay oldest first
        passes = split_passes([lengths[i] for i in order], self.max_batch_rows, self.max_batch_tokens,
                              self.pass_overhead_tokens)
        oldest = order.index(0)
        low, high = next((low, high) for low, high in passes if low <= oldest < high)
        chosen = [window[i] for i in order[low:high]]
        taken = {id(row) for row in chosen}
        self._pending = [row for row in pool if id(row) not in taken]
        self._pending_tokens -= sum(row.tokens for row in chosen)
        for row in chosen:
            row.request.queued -= 1
        return chosen

    async def _run_pass(self, rows: list[_Row]) -> None:
        loop = asyncio.get_running_loop()
        texts = [row.text for row in rows]
        tasks = [row.task for row in rows]
        start = time.perf_counter()
        self.running_rows += len(rows)
        failed = False
        try:
            vectors = np.asarray(await loop.run_in_executor(self._executor, self._start_pass, texts, tasks))
            if vectors.ndim != 2 or len(vectors) != len(rows):
                raise RuntimeError(f"the encoder returned {vectors.shape} for {len(rows)} rows")
        except Exception as exc:  # noqa: BLE001 - the requests of this pass fail; the server goes on
            failed = True
            if not isinstance(exc, BatcherClosed):
                logger.error("a forward pass of %d rows failed: %s", len(rows), first_line(exc))
            for request in {id(row.request): row.request for row in rows}.values():
                if not request.future.done():
                    request.future.set_exception(exc)
                self._discard(request)
        else:
            for row, vector in zip(rows, vectors):
                request = row.request
                if request.future.done():  # cancelled (client gone) or failed in another pass
                    continue
                if request.out is None:
                    request.out = np.empty((request.rows, vectors.shape[1]), dtype=vectors.dtype)
                request.out[row.position] = vector
                request.remaining -= 1
                if request.remaining == 0:
                    request.future.set_result(request.out)
        finally:
            self.running_rows -= len(rows)
        end = time.perf_counter()
        seconds = end - start
        if not failed:
            # the worker's time since the previous pass or since it was woken (quiet time is not slow draining)
            began = max(t for t in (self._pass_end, self._busy_since, start - self.max_wait) if t is not None)
            self._drained.append((end, len(rows), max(end - began, seconds)))
        self._pass_end = end
        if self._on_batch is not None:
            report = BatchReport(rows=len(rows), tasks=Counter(tasks), tokens=sum(row.tokens for row in rows),
                                 padded_tokens=max(row.tokens for row in rows) * len(rows), seconds=seconds,
                                 queued_rows=len(self._pending), failed=failed)
            try:
                self._on_batch(report)
            except Exception:  # pragma: no cover - an observer must not stop the batcher
                logger.exception("the batch observer failed")


def split_passes(lengths: Sequence[int], max_rows: int, max_tokens: int, overhead: float) -> list[tuple[int, int]]:
    """The cheapest split of rows sorted by length (``lengths``, ascending) into passes ``(i, j)`` of adjacent rows.

    A pass costs ``overhead + (j - i) * lengths[j - 1]`` and holds at most ``max_rows`` rows and ``max_tokens`` padded
    tokens (a longer row alone); of equally cheap splits, larger passes first. Dynamic programming over the end of
    the last pass, vectorised over its start.
    """
    count = len(lengths)
    size = np.asarray(lengths, dtype=np.float64)
    cost = np.full(count + 1, np.inf)
    cost[0] = 0.0
    cut = np.zeros(count + 1, dtype=np.int64)
    starts = np.arange(count + 1, dtype=np.float64)
    for j in range(1, count + 1):
        longest = size[j - 1]
        first = max(0, j - max_rows, j - max(1, int(max_tokens // longest)))
        candidates = cost[first:j] + (j - starts[first:j]) * longest
        best = int(np.argmin(candidates))  # the first of equal costs: the largest pass
        cost[j] = candidates[best] + overhead
        cut[j] = first + best
    passes = []
    j = count
    while j > 0:
        passes.append((int(cut[j]), j))
        j = int(cut[j])
    return passes[::-1]
