"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own: the queue, the forward passes
(rows, tasks, padded tokens, seconds), rows per task, requests per endpoint and status (refused before an endpoint:
``endpoint="malformed"``), their latency, connections open, dropped (per reason) and rebalanced, and the process's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

from st_prompts.serving.batcher import BatchReport

__all__ = ["CONTENT_TYPE_LATEST", "SAME_IN_EVERY_WORKER", "ServerMetrics"]

#: Gauges of what every worker holds alike: ``/metrics`` gives their largest value over the workers, not their sum.
SAME_IN_EVERY_WORKER = frozenset({"st_prompts_prompt_sets"})

_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TASK_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SECOND_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The metrics of one server; ``label(task)`` turns the batcher's task (a route) into a public label."""

    def __init__(self, queued_rows: Callable[[], float], running_rows: Callable[[], float],
                 prompt_sets: Callable[[], float], label: Callable[[object], str]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        self._label = label
        gauge, counter, histogram = (partial(kind, registry=r) for kind in (Gauge, Counter, Histogram))
        gauge("st_prompts_queue_rows", "Rows waiting for a forward pass").set_function(queued_rows)
        gauge("st_prompts_running_rows", "Rows of the forward pass that runs and of the one queued behind it"
              ).set_function(running_rows)
        gauge("st_prompts_prompt_sets", "Prompt sets served").set_function(prompt_sets)
        self.batches = counter("st_prompts_batches", "Forward passes")
        self.mixed = counter("st_prompts_mixed_batches", "Forward passes whose rows used more than one task")
        self.failed = counter("st_prompts_failed_batches", "Forward passes that raised")
        self.batch_rows = histogram("st_prompts_batch_rows", "Rows per forward pass", buckets=_ROW_BUCKETS)
        self.batch_tasks = histogram("st_prompts_batch_tasks", "Distinct tasks per forward pass", buckets=_TASK_BUCKETS)
        self.batch_tokens = histogram("st_prompts_batch_padded_tokens", "Padded tokens (rows x longest) per pass",
                                      buckets=_TOKEN_BUCKETS)
        self.batch_seconds = histogram("st_prompts_batch_seconds", "Seconds per forward pass", buckets=_SECOND_BUCKETS)
        self.rows = counter("st_prompts_rows", "Rows encoded, per task", ["task"])
        self.requests = counter("st_prompts_requests", "Requests answered, per endpoint and status",
                                ["endpoint", "status"])
        self.latency = histogram("st_prompts_request_seconds", "Seconds from a request's arrival to its answer",
                                 ["endpoint"], buckets=_SECOND_BUCKETS)
        self.cancelled = counter("st_prompts_cancelled_requests", "Requests whose client went away before the answer")
        self.dropped = counter("st_prompts_dropped_connections", "Connections the server closed on a client: malformed "
                               "HTTP, a header, body or send timeout, too many connections, shutdown", ["reason"])
        self.connections = gauge("st_prompts_open_connections", "HTTP connections open")
        self.rebalanced = counter("st_prompts_rebalanced_connections", "Keep-alive connections closed after an answer "
                                  "so that their client reconnects to a worker holding fewer (--workers)")

    def observe_batch(self, report: BatchReport) -> None:
        """The batcher's observer: one forward pass."""
        if report.failed:
            self.failed.inc()
            return
        self.batches.inc()
        if len(report.tasks) > 1:
            self.mixed.inc()
        self.batch_rows.observe(report.rows)
        self.batch_tasks.observe(len(report.tasks))
        self.batch_tokens.observe(report.padded_tokens)
        self.batch_seconds.observe(report.seconds)
        for task, count in report.tasks.items():
            self.rows.labels(task=self._label(task)).inc(count)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if status < 400:
            self.latency.labels(endpoint=endpoint).observe(seconds)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
