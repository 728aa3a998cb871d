"""Dynamic batching across requests and tasks: one queue of rows, forward passes bounded by a token budget.

The batcher knows nothing of HTTP or of models: it is given an ``encode(texts, tasks) -> array`` function (run in
one worker thread, so the event loop keeps accepting requests while a pass runs) and rows with their token counts::

    batcher = Batcher(encode, max_wait_ms=2, max_batch_tokens=4096)
    await batcher.start()
    vectors = await batcher.encode(["a text", "another"], tokens=[4, 3], tasks="sts")   # rows in request order
    await batcher.close()                                                                # drains what is queued

The oldest row waits at most ``max_wait_ms`` (while a pass runs, the next full one is formed and queued behind it).
The oldest ``4 x max_batch_rows`` rows are sorted by length and split into the passes that cost least in all (padded
tokens plus ``pass_overhead_tokens`` a pass); the pass holding the oldest row runs next, so no row starves, and rows of
any task share a pass. Row ``i`` of a request lands in row ``i`` of its result. A request that would take the queue
past ``max_queue_rows`` raises :class:`QueueFull`; a cancelled request leaves the queue at once; an exception in
``encode`` fails the requests of that pass only. Details and measurements: ``docs/serving.md`` (Batching)."""

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

#: the batcher's pass overhead when none is given or measured: MiniLM on a 2-core CPU measures 90-102 tokens, and a
#: split within 30-180 serves about the same (simulated on the benchmark's Wikipedia lengths)
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
        encode: ``encode(texts, tasks) -> array (rows, dim)``, called in the batcher's own worker thread, one pass at a
            time; ``tasks`` has one task per text (any hashable; ``None`` allowed).
        max_batch_tokens: bound on ``rows x longest row`` (padded tokens) of a pass; a single longer row runs alone.
        pass_overhead_tokens: what one forward pass costs beyond its padded tokens, in tokens: small (tens) on a CPU,
            so passes stay close in length; large on a GPU, so passes fill up
            (:meth:`ServedModel.measure_pass_overhead` measures it).
        max_queue_rows: bound on the queued rows of all requests (:class:`QueueFull` beyond; a request alone in an
            empty queue is always admitted).
        on_batch: called on the event loop after every pass with a :class:`BatchReport` (e.g. metrics).
        on_idle: called in the worker thread once the queue has been empty for ``idle_seconds`` (e.g. to give the
            memory the passes freed back to the system), then not again until new rows have come and gone.
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
        #: rows a pass is chosen from: the oldest ``4 x max_batch_rows`` queued
        self.window_rows = 4 * self.max_batch_rows
        self._on_batch = on_batch
        self._pending: list[_Row] = []
        self._pending_tokens = 0
        self._executor: ThreadPoolExecutor | None = None
        self._worker: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._closing = False
        #: (end time, rows, seconds the worker spent on them: its wait for the batch and the pass) of recent
        #: passes while rows were queued: the measured drain rate that ``Retry-After`` is computed from
        self._drained: deque[tuple[float, int, float]] = deque(maxlen=64)
        self._busy_since: float | None = None  # when the worker, idle, was woken by new rows
        self._pass_end: float | None = None  # when the last pass ended
        #: rows taken into passes that run or are queued behind the running one
        self.running_rows = 0
        self._abandoned = False  # abort_queued was called: passes not yet started fail instead of running

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Start the worker (on the running event loop)."""
        if self._worker is not None:
            return
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="st-prompts-encode")
        self._worker = asyncio.create_task(self._run(), name="st-prompts-batcher")

    async def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new request; with ``drain`` finish every queued row first (for at most ``timeout`` seconds, then
        as without ``drain``), else fail the queued requests with :class:`BatcherClosed`. Returns when the worker has
        stopped (after the pass that runs, which is not interrupted)."""
        self._closing = True
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
        """Fail every queued request with :class:`BatcherClosed` (``message``); rows of the pass that runs are still
        delivered. Returns the number of requests failed."""
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
    def closing(self) -> bool:
        """Whether :meth:`close` was called (new requests are refused)."""
        return self._closing

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a pass (not counting the pass that runs)."""
        return len(self._pending)

    def drain_rate(self, window: float = 30.0) -> float | None:
        """Rows per second the queue drained at over the passes of the last ``window`` seconds (each pass counted
        with the worker's time on it: waiting for its rows and running it), or ``None`` before any was measured."""
        now = time.perf_counter()
        recent = [(rows, seconds) for end, rows, seconds in self._drained if now - end <= window]
        if not recent:
            recent = [(rows, seconds) for _, rows, seconds in list(self._drained)[-4:]]
        rows = sum(r for r, _ in recent)
        seconds = sum(t for _, t in recent)
        return rows / seconds if rows and seconds > 0 else None

    def retry_after(self, extra_rows: int = 0) -> int:
        """Seconds until the rows queued now (and the pass that runs) have drained at the measured drain rate
        (:meth:`drain_rate`), so that the ``extra_rows`` of a refused request are next: at least 1, at most 600; 5
        before any pass was measured."""
        rate = self.drain_rate()
        if rate is None:
            return 5
        ahead = len(self._pending) + self.running_rows  # the whole queue ahead of the client: its turn after them
        return int(min(600, max(1, math.ceil(ahead / rate))))

    # ------------------------------------------------------------------ requests
    async def encode(self, texts: Sequence[str], tokens: Sequence[int], tasks: Any | Sequence[Any]) -> np.ndarray:
        """Encode ``texts`` (one row each, ``tokens`` their lengths) with their ``tasks`` (one for all, or one per
        text); returns the ``(len(texts), dim)`` array in the order of ``texts``.

        Raises:
            QueueFull: the queue has no room for these rows now.
            BatcherClosed: the batcher is closing.
            Exception: what ``encode`` raised for a pass that held rows of this request.
        """
        if self._closing or self._worker is None:
            raise BatcherClosed("The server is shutting down." if self._closing else "The batcher is not started.")
        count = len(texts)
        if len(tokens) != count:
            raise ValueError(f"one token count per text: {len(tokens)} for {count} texts")
        if isinstance(tasks, (list, tuple)):
            if len(tasks) != count:
                raise ValueError(f"one task per text: {len(tasks)} for {count} texts")
            row_tasks = list(tasks)
        else:
            row_tasks = [tasks] * count
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

    # ------------------------------------------------------------------ the worker
    def _full(self) -> bool:
        return self._pending_tokens >= self.max_batch_tokens or len(self._pending) >= self.max_batch_rows

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task] = set()  # passes handed to the worker thread: the one that runs, one queued
        idle_done = True  # no pass has run since the start, or since on_idle was called
        while True:
            if not self._pending or running:
                if not self._pending and not running:
                    if self._closing:
                        return
                    self._wakeup.clear()
                    if not idle_done and self._on_idle is not None:
                        try:
                            await asyncio.wait_for(self._wakeup.wait(), self.idle_seconds)
                        except asyncio.TimeoutError:
                            idle_done = True
                            await loop.run_in_executor(self._executor, self._call_idle)
                            if self._pending:
                                self._busy_since = time.perf_counter()
                            continue
                    else:
                        await self._wakeup.wait()
                    self._busy_since = time.perf_counter()
                    continue
                if self._pending and len(running) < 2 and not self._closing and self._full():
                    # enough rows wait to fill a pass: queue it behind the running one, so that the thread starts it
                    # the moment the other ends (no round trip through the event loop: measured, the thread sat
                    # idle 16 % of the time at concurrency 16); with fewer rows, wait: later arrivals may join it
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
            while self._pending and not self._closing and not self._full():
                delay = deadline - loop.time()
                if delay <= 0:
                    break
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
        """The worker thread's pass; one queued behind a pass that was running when the queue was aborted does not
        start (the drain waits for the running pass only)."""
        if self._abandoned:
            raise BatcherClosed("The server is shutting down: its drain timeout passed before this request's turn.")
        return self._encode(texts, tasks)

    def _take(self) -> list[_Row]:
        """Choose the rows of the next pass (see the module docstring) and remove them from the queue; the rows come
        sorted by length."""
        pool = self._pending
        # candidates: the oldest rows only, so that rows arriving later cannot keep jumping ahead of older ones of
        # another length (the tail latency of requests whose rows spread over passes)
        window = pool[:self.window_rows]
        lengths = [row.tokens for row in window]
        order = sorted(range(len(window)), key=lengths.__getitem__)  # stable: equal lengths stay oldest first
        low, high = pass_of(order.index(0), [lengths[i] for i in order], self.max_batch_rows, self.max_batch_tokens,
                            self.pass_overhead_tokens)
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
            vectors = await loop.run_in_executor(self._executor, self._start_pass, texts, tasks)
            vectors = np.asarray(vectors)
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
            # the worker's time for these rows: since the previous pass ended, or since new rows woke it from idle
            # (an idle server's quiet time is not slow draining), at most its batching wait before the pass
            began = max(t for t in (self._pass_end, self._busy_since, start - self.max_wait) if t is not None)
            self._drained.append((end, len(rows), max(end - began, seconds)))
        self._pass_end = end
        if self._on_batch is not None:
            longest = max(row.tokens for row in rows)
            report = BatchReport(rows=len(rows), tasks=Counter(tasks), tokens=sum(row.tokens for row in rows),
                                 padded_tokens=longest * len(rows), seconds=seconds, queued_rows=len(self._pending),
                                 failed=failed)
            try:
                self._on_batch(report)
            except Exception:  # pragma: no cover - an observer must not stop the batcher
                logger.exception("the batch observer failed")


def split_passes(lengths: Sequence[int], max_rows: int, max_tokens: int, overhead: float) -> list[tuple[int, int]]:
    """The cheapest split of rows sorted by length (``lengths``, ascending) into passes of adjacent rows: a pass
    ``lengths[i:j]`` costs ``overhead + (j - i) * lengths[j - 1]`` (its padded tokens), holds at most ``max_rows``
    rows and ``max_tokens`` padded tokens (a longer row alone). Returns the passes as ``(i, j)`` in order; of equally
    cheap splits, the one with larger passes first.

    Dynamic programming over the end of the last pass: ``cost[j] = min over i of cost[i] + overhead + (j - i) x
    lengths[j - 1]`` (the rows are sorted, so the last is the longest), vectorised over ``i``: ``O(rows x max_rows)``
    for the batcher's window of ``4 x max_rows`` rows, measured 1.5 ms for 128 rows (32 a pass) and 12.6 ms for
    1,024 (256 a pass) on a 2-core CPU, while the previous pass runs. Written here because
    no library at hand partitions batches by padding (sentence-transformers sorts one whole ``encode`` call by
    length and cuts it every ``batch_size`` rows, which is what its in-process ceiling does).
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


def pass_of(position: int, lengths: Sequence[int], max_rows: int, max_tokens: int, overhead: float) -> tuple[int, int]:
    """The pass ``(i, j)`` of :func:`split_passes` that holds row ``position``."""
    for low, high in split_passes(lengths, max_rows, max_tokens, overhead):
        if low <= position < high:
            return low, high
    raise ValueError(f"row {position} is not among {len(lengths)} rows")  # pragma: no cover - positions are rows
