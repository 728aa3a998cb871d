"""The batcher alone (no HTTP, no model): routing back, mixed tasks, token budgets, waiting, bounds, cancellation,
failures and draining; and the request checks of :mod:`st_prompts.serving.limits`."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import threading
import time

import numpy as np
import pytest

from st_prompts.serving.batcher import Batcher, BatcherClosed, QueueFull, split_passes
from st_prompts.serving.limits import RequestError, ServingLimits, parse_embedding_request, parse_search_request

DIM = 6


def fake_vector(text: str, task) -> np.ndarray:
    """What a task-aware encoder gives a row: a function of the text and the task only."""
    seed = abs(hash((text, str(task)))) % (2**32)
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)


class FakeEncoder:
    """Records every pass (texts, tasks, thread) and answers with :func:`fake_vector`."""

    def __init__(self, delay: float = 0.0, fail_on: str | None = None) -> None:
        self.passes: list[tuple[list[str], list]] = []
        self.threads: set[str] = set()
        self.delay = delay
        self.fail_on = fail_on

    def __call__(self, texts, tasks):
        self.threads.add(threading.current_thread().name)
        self.passes.append((list(texts), list(tasks)))
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in texts:
            raise RuntimeError("boom in the encoder")
        return np.stack([fake_vector(t, k) for t, k in zip(texts, tasks)])


def with_batcher(encoder, body, **options):
    """``body(batcher)`` (a coroutine function) on a started :class:`Batcher` of ``encoder``, closed after it."""
    async def main():
        batcher = Batcher(encoder, **options)
        await batcher.start()
        result = await body(batcher)
        await batcher.close()
        return result

    return asyncio.run(main())


def tokens_of(texts):
    return [len(t.split()) + 2 for t in texts]


def test_rows_of_many_requests_and_tasks_share_passes_and_come_back_in_order():
    encoder = FakeEncoder(delay=0.002)
    rng = random.Random(0)
    tasks = ["sts", "nli", "para", None]
    requests = []
    for r in range(120):
        texts = [" ".join(["w"] * rng.randint(1, 60)) + f" {r}-{i}" for i in range(rng.randint(1, 12))]
        requests.append((texts, rng.choice(tasks)))

    async def main(batcher):
        return await asyncio.gather(*(batcher.encode(texts, tokens_of(texts), task) for texts, task in requests))

    results = with_batcher(encoder, main, max_wait_ms=5, max_batch_tokens=600, max_batch_rows=40)
    for (texts, task), result in zip(requests, results):
        assert result.shape == (len(texts), DIM)
        assert np.array_equal(result, np.stack([fake_vector(t, task) for t in texts]))
    assert encoder.threads and not any(name == "MainThread" for name in encoder.threads)
    assert len(encoder.passes) < sum(len(t) for t, _ in requests)  # rows were batched
    assert any(len(set(map(str, tasks))) > 1 for _, tasks in encoder.passes)  # and tasks mixed in a pass
    for texts, _ in encoder.passes:
        lengths = tokens_of(texts)
        assert lengths == sorted(lengths)  # a pass comes sorted by length
        assert len(texts) <= 40
        assert len(texts) == 1 or len(texts) * max(lengths) <= 600  # padded tokens within the budget


@pytest.mark.parametrize("overhead", [64.0, 1e6])
def test_sorting_by_length_cuts_padding_and_the_oldest_row_is_never_left_behind(overhead):
    """A long oldest row among short ones: where a pass costs little (a CPU) it runs alone rather than pad short rows
    to its length; where a pass costs much (a GPU) it takes one short row along, which saves a pass."""
    encoder = FakeEncoder()

    async def main(batcher):
        first = asyncio.ensure_future(batcher.encode([" ".join(["w"] * 98)], [100], "a"))
        await asyncio.sleep(0)
        await asyncio.gather(first, batcher.encode([f"s{i}" for i in range(61)], [3] * 61, "b"))  # 3 tokens each

    with_batcher(encoder, main, max_wait_ms=50, max_batch_tokens=400, max_batch_rows=20, pass_overhead_tokens=overhead)
    first_texts, _ = encoder.passes[0]
    assert first_texts[-1].startswith("w w")  # the oldest (long) row is in the first pass
    assert len(encoder.passes) == (5 if overhead < 100 else 4)
    assert len(first_texts) == (1 if overhead < 100 else 2)
    # the short rows left then go together, without the long one's padding
    assert all(len(tokens_of(texts)) * max(tokens_of(texts)) <= 400 for texts, _ in encoder.passes[1:])
    assert sum(len(texts) for texts, _ in encoder.passes) == 62


@pytest.mark.parametrize("overhead, passes", [(20.0, 2), (1e6, 1)])
def test_a_mixed_queue_splits_by_length_when_a_pass_costs_little(overhead, passes):
    """Short and long rows interleaved: a cheap pass splits them by length (no row padded), a costly one does not."""
    encoder = FakeEncoder()

    texts = [f"r{i}" for i in range(40)]
    lengths = [5 if i % 2 else 50 for i in range(40)]
    with_batcher(encoder, lambda batcher: batcher.encode(texts, lengths, ["a", "b"] * 20), max_wait_ms=100,
                 max_batch_tokens=100_000, max_batch_rows=64, pass_overhead_tokens=overhead)
    length_of = dict(zip(texts, lengths))
    assert len(encoder.passes) == passes
    if passes == 2:
        assert [sorted({length_of[t] for t in texts}) for texts, _ in encoder.passes] == [[50], [5]]  # oldest first


def brute_force_split_cost(lengths, max_rows, max_tokens, overhead):
    """The cheapest cost of any split of sorted ``lengths`` into contiguous passes, by trying every split."""
    count = len(lengths)
    best = math.inf
    for mask in range(1 << (count - 1)):  # bit k: a pass ends after row k
        cost, start = 0.0, 0
        for end in range(1, count + 1):
            if end == count or mask >> (end - 1) & 1:
                rows, longest = end - start, lengths[end - 1]
                if rows > max_rows or (rows > 1 and rows * longest > max_tokens):
                    break
                cost += overhead + rows * longest
                start = end
        else:
            best = min(best, cost)
    return best


def test_split_passes_is_the_cheapest_split_against_trying_every_one():
    rng = random.Random(7)
    for _ in range(300):
        count = rng.randint(1, 11)
        lengths = sorted(rng.randint(1, 60) for _ in range(count))
        max_rows, max_tokens = rng.randint(1, 6), rng.choice([40, 100, 10_000])
        overhead = rng.choice([0.0, 5.0, 30.0, 1e6])
        passes = split_passes(lengths, max_rows, max_tokens, overhead)
        assert passes[0][0] == 0 and passes[-1][1] == count  # every row, once, in order
        assert all(a[1] == b[0] for a, b in zip(passes, passes[1:]))
        for low, high in passes:
            assert high - low <= max_rows and (high - low == 1 or (high - low) * lengths[high - 1] <= max_tokens)
        cost = sum(overhead + (high - low) * lengths[high - 1] for low, high in passes)
        assert cost == pytest.approx(brute_force_split_cost(lengths, max_rows, max_tokens, overhead))


def test_pass_overhead_tokens_must_be_a_non_negative_number():
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(ValueError, match="pass_overhead_tokens must be a non-negative number"):
            Batcher(FakeEncoder(), pass_overhead_tokens=bad)
        with pytest.raises(ValueError, match="pass_overhead_tokens must be a non-negative number"):
            ServingLimits(pass_overhead_tokens=bad)
    assert ServingLimits(pass_overhead_tokens=0).pass_overhead_tokens == 0


def test_a_lone_request_waits_at_most_max_wait_and_a_full_pass_does_not_wait():
    encoder = FakeEncoder()

    async def main(batcher):
        start = time.perf_counter()
        await batcher.encode(["one"], [3], "a")
        lone = time.perf_counter() - start
        start = time.perf_counter()
        await batcher.encode([f"t{i}" for i in range(8)], [3] * 8, "a")  # fills max_batch_rows
        return lone, time.perf_counter() - start

    lone, full = with_batcher(encoder, main, max_wait_ms=150, max_batch_tokens=10_000, max_batch_rows=8)
    assert 0.14 <= lone < 1.0
    assert full < 0.1


def test_a_full_queue_refuses_with_a_retry_time_and_a_lone_large_request_is_admitted():
    encoder = FakeEncoder(delay=0.05)

    async def main(batcher):
        big = await batcher.encode([f"x{i}" for i in range(25)], [3] * 25, "a")  # alone: admitted
        first = asyncio.ensure_future(batcher.encode([f"y{i}" for i in range(8)], [3] * 8, "a"))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await batcher.encode([f"z{i}" for i in range(3)], [3] * 3, "a")
        return big, await first, refused.value

    big, ok, refused = with_batcher(encoder, main, max_wait_ms=100, max_queue_rows=10)
    assert big.shape == (25, DIM) and ok.shape == (8, DIM)
    assert refused.retry_after >= 1 and "retry after" in str(refused)


def test_a_cancelled_request_leaves_the_queue_and_its_rows_are_never_encoded():
    encoder = FakeEncoder()

    async def main(batcher):
        gone = asyncio.ensure_future(batcher.encode(["gone-1", "gone-2"], [3, 3], "a"))
        await asyncio.sleep(0.01)
        assert batcher.queued_rows == 2
        gone.cancel()
        await asyncio.sleep(0)
        return batcher.queued_rows, await batcher.encode(["kept"], [3], "a")

    queued_after, kept = with_batcher(encoder, main, max_wait_ms=300)
    assert queued_after == 0
    assert kept.shape == (1, DIM)
    assert all(not t.startswith("gone") for texts, _ in encoder.passes for t in texts)


def test_an_encoder_failure_fails_its_pass_only_and_the_batcher_goes_on():
    encoder = FakeEncoder(fail_on="bad")

    async def main(batcher):
        with pytest.raises(RuntimeError, match="boom"):
            await batcher.encode(["bad", "good"], [3, 3], "a")
        return await batcher.encode(["fine"], [3], "b")

    assert np.array_equal(with_batcher(encoder, main, max_wait_ms=1)[0], fake_vector("fine", "b"))


def test_close_answers_everything_queued_and_refuses_new_requests():
    encoder = FakeEncoder(delay=0.01)

    async def main(batcher):
        pending = [asyncio.ensure_future(batcher.encode([f"r{i}-{j}" for j in range(3)], [3] * 3, i % 2))
                   for i in range(10)]
        await asyncio.sleep(0.01)
        await batcher.close()
        with pytest.raises(BatcherClosed):
            await batcher.encode(["late"], [3], 0)
        return await asyncio.gather(*pending)

    results = with_batcher(encoder, main, max_wait_ms=200, max_batch_rows=4)
    assert all(r.shape == (3, DIM) for r in results)


def test_retry_after_follows_the_measured_drain_rate():
    """3 rows a pass, 0.2 s a pass: the queue drains at about 15 rows/s, and a refused client is told to come back
    when the rows ahead of it are done (not a constant, nor a guess made before any pass)."""
    encoder = FakeEncoder(delay=0.2)

    async def main(batcher):
        assert batcher.drain_rate() is None and batcher.retry_after() == 5  # nothing measured yet
        queued = [asyncio.ensure_future(batcher.encode([f"q{i}-{j}" for j in range(3)], [3] * 3, "a"))
                  for i in range(20)]
        deadline = time.monotonic() + 10
        while len(encoder.passes) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with pytest.raises(QueueFull) as refused:
            await batcher.encode(["late"] * 20, [3] * 20, "a")
        rate, ahead = batcher.drain_rate(), batcher.queued_rows + batcher.running_rows
        await batcher.close(drain=False)
        await asyncio.gather(*queued, return_exceptions=True)
        return rate, ahead, refused.value.retry_after

    rate, ahead, retry_after = with_batcher(encoder, main, max_wait_ms=0, max_batch_rows=3, max_queue_rows=60)
    assert 5 <= rate <= 16, rate  # 15 rows/s, less on a busy machine
    assert retry_after == math.ceil(ahead / rate) or abs(retry_after - ahead / rate) <= 1.5, (retry_after, ahead, rate)
    assert 2 <= retry_after <= 12


def test_close_with_a_timeout_answers_what_is_left_with_batcher_closed():
    encoder = FakeEncoder(delay=0.1)

    async def main(batcher):
        pending = [asyncio.ensure_future(batcher.encode([f"c{i}-{j}" for j in range(2)], [3] * 2, "a"))
                   for i in range(20)]
        await asyncio.sleep(0.05)
        start = time.monotonic()
        await batcher.close(drain=True, timeout=0.25)
        took = time.monotonic() - start
        return took, await asyncio.gather(*pending, return_exceptions=True)

    took, results = with_batcher(encoder, main, max_wait_ms=0, max_batch_rows=2)
    done = [r for r in results if isinstance(r, np.ndarray)]
    closed = [r for r in results if isinstance(r, BatcherClosed)]
    assert len(done) + len(closed) == 20 and 1 <= len(done) < 20 and closed
    assert took < 0.25 + 0.5  # the timeout, and the pass that ran when it passed


def test_a_full_pass_waits_behind_the_running_one_and_starts_without_the_event_loop():
    starts, ends = [], []

    def encode(texts, tasks):
        starts.append(time.monotonic())
        time.sleep(0.2)
        ends.append(time.monotonic())
        return np.stack([fake_vector(t, k) for t, k in zip(texts, tasks)])

    texts = [f"r{i}" for i in range(12)]

    async def main(batcher):
        job = asyncio.ensure_future(batcher.encode(texts, [3] * 12, "a"))
        await asyncio.sleep(0.05)  # the first pass runs, the second (a full one) is queued behind it
        running = batcher.running_rows
        time.sleep(0.5)  # the event loop is held through the first pass and most of the second
        return await job, running, batcher.running_rows

    vectors, running, after = with_batcher(encode, main, max_wait_ms=0, max_batch_rows=4, max_batch_tokens=10_000)
    assert len(starts) == 3 and running == 8 and after == 0
    assert starts[1] - ends[0] < 0.05  # the thread went straight on, the event loop still held
    assert np.array_equal(vectors, np.stack([fake_vector(t, "a") for t in texts]))


def test_a_pass_queued_behind_the_running_one_does_not_start_after_the_drain_timeout():
    encoder = FakeEncoder(delay=0.3)

    async def main(batcher):
        job = asyncio.ensure_future(batcher.encode([f"q{i}" for i in range(6)], [3] * 6, "a"))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        await batcher.close(drain=True, timeout=0.1)
        took = time.monotonic() - start
        return took, await asyncio.gather(job, return_exceptions=True)

    took, (result,) = with_batcher(encoder, main, max_wait_ms=0, max_batch_rows=2)
    assert isinstance(result, BatcherClosed)
    assert len(encoder.passes) == 1  # the queued pass never ran
    assert took < 0.3 + 0.2


# ------------------------------------------------------------------------------------------------ request checks
LIMITS = ServingLimits(max_inputs=5, max_input_chars=20)


@pytest.mark.parametrize("body, status, fragment", [
    ([], 400, "JSON object"),
    ({"model": "sts"}, 422, "'input' is required"),
    ({"input": [], "model": "sts"}, 422, "must not be an empty list"),
    ({"input": ["a", 3], "model": "sts"}, 422, "token ids"),
    ({"input": [[1, 2]], "model": "sts"}, 422, "token ids"),
    ({"input": ["a", None], "model": "sts"}, 422, "input[1] is null"),
    ({"input": ["a", {"x": 1}], "model": "sts"}, 422, "input[1] is an object"),
    ({"input": [""], "model": "sts"}, 422, "empty string"),
    ({"input": ["a"] * 6, "model": "sts"}, 422, "the limit is 5"),
    ({"input": "x" * 21, "model": "sts"}, 422, "21 characters"),
    ({"input": "a", "model": ""}, 422, "'model' must be a name"),
    ({"input": "a"}, 422, "'model' must be a name"),
    ({"input": "a", "model": "sts", "encoding_format": "hex"}, 422, "'float' or 'base64'"),
    ({"input": "a", "model": "sts", "dimensions": 0}, 422, "positive integer"),
])
def test_embedding_requests_are_refused_in_one_line(body, status, fragment):
    with pytest.raises(RequestError) as error:
        parse_embedding_request(body, LIMITS)
    assert error.value.status == status
    assert fragment in error.value.message and "\n" not in error.value.message
    assert set(error.value.payload()["error"]) == {"message", "type", "param", "code"}


def test_good_requests_parse():
    parsed = parse_embedding_request({"input": "a text", "model": "sts", "user": "ignored"}, LIMITS)
    assert parsed.texts == ["a text"] and parsed.encoding_format == "float" and parsed.dimensions is None
    search = parse_search_request({"query": ["q1", "q2"], "index": "docs", "k": 3}, LIMITS)
    assert search.queries == ["q1", "q2"] and search.k == 3
    with pytest.raises(RequestError, match="'k' must be an integer from 1 to 100"):
        parse_search_request({"query": "q", "index": "docs", "k": 0}, LIMITS)
    with pytest.raises(ValueError, match="max_inputs must be a positive integer"):
        ServingLimits(max_inputs=0)


def test_later_rows_cannot_jump_ahead_of_older_ones_beyond_the_window():
    """Passes are chosen among the oldest 4 x max_batch_rows rows: fresh rows of the anchor's length, however well
    they would pad, wait while older rows of another length are within the window."""
    encoder = FakeEncoder()

    async def main(batcher):
        old = asyncio.ensure_future(batcher.encode([f"o{i}" for i in range(8)], [50] + [10] * 7, "a"))
        await asyncio.gather(old, batcher.encode([f"f{i}" for i in range(20)], [50] * 20, "b"))  # queued next

    with_batcher(encoder, main, max_wait_ms=50, max_batch_tokens=10_000, max_batch_rows=2)  # window: 8 rows
    first = encoder.passes[0][0]
    assert "o0" in first and all(t.startswith("o") for t in first)  # not the perfectly fitting fresh "f0"
    last_old = max(i for i, (texts, _) in enumerate(encoder.passes) if any(t.startswith("o") for t in texts))
    assert last_old == 3  # the old request is done in 4 passes of 2


def test_on_idle_runs_once_in_the_worker_thread_after_the_queue_has_been_empty_for_idle_seconds():
    encoder = FakeEncoder(delay=0.01)
    calls: list[tuple[float, str]] = []

    async def main(batcher):
        await asyncio.sleep(0.5)
        assert calls == []  # nothing ran since the start: nothing to give back
        for _ in range(10):  # busy for ~0.5 s: never idle for 0.3 s in between
            await asyncio.gather(*(batcher.encode([f"t{i}"], tokens=[3], tasks="a") for i in range(3)))
            last = time.perf_counter()  # the queue is empty from here
            await asyncio.sleep(0.04)
        assert calls == []
        await asyncio.sleep(0.8)
        assert len(calls) == 1 and calls[0][0] - last >= 0.29
        assert calls[0][1] in encoder.threads  # the worker thread, not the event loop
        await asyncio.sleep(0.5)
        assert len(calls) == 1  # not again while nothing runs
        vectors = await batcher.encode(["again"], tokens=[3], tasks="b")  # work after the call: served at once
        np.testing.assert_array_equal(vectors[0], fake_vector("again", "b"))
        await asyncio.sleep(0.6)
        assert len(calls) == 2

    with_batcher(encoder, main, max_wait_ms=1, idle_seconds=0.3,
                 on_idle=lambda: calls.append((time.perf_counter(), threading.current_thread().name)))


def test_a_failing_on_idle_is_logged_and_the_batcher_goes_on(caplog):
    async def main(batcher):
        await batcher.encode(["x"], tokens=[3], tasks="a")
        await asyncio.sleep(0.3)
        vectors = await batcher.encode(["y"], tokens=[3], tasks="a")
        np.testing.assert_array_equal(vectors[0], fake_vector("y", "a"))

    with caplog.at_level(logging.ERROR, logger="st_prompts.serving.batcher"):
        with_batcher(FakeEncoder(), main, max_wait_ms=1, on_idle=lambda: 1 / 0, idle_seconds=0.05)
    assert "the idle callback failed" in caplog.text


def test_release_free_memory_gives_the_freed_heap_back():
    """glibc keeps freed heap blocks; malloc_trim returns them (the server's idle callback)."""
    from st_prompts.utils import release_free_memory

    def resident_mib() -> float:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(4000):  # 4000 x 64 KiB below the mmap threshold: heap blocks, touched
        block = libc.malloc(65536)
        ctypes.memset(block, 1, 65536)
        blocks.append(block)
    keep = blocks[-1]  # holds the top of the heap: freeing the rest leaves the space inside the heap
    for block in blocks[:-1]:
        libc.free(block)
    before = resident_mib()
    assert release_free_memory() is True
    after = resident_mib()
    libc.free(keep)
    assert before - after > 150, (before, after)  # ~250 MiB were freed inside the heap
