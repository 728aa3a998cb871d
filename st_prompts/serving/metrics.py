"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own.

Names (all prefixed ``st_prompts_``): ``queue_rows`` (rows waiting), ``running_rows`` (rows of the pass that runs and of the one
queued behind it),
``batches_total`` and ``mixed_batches_total`` (forward passes, and those whose rows used more than one task),
``batch_rows``, ``batch_tasks``, ``batch_padded_tokens`` and ``batch_seconds`` (histograms per pass),
``rows_total{task}`` (rows encoded per task), ``requests_total{endpoint,status}``, ``request_seconds{endpoint}``
(latency histogram of answered requests), ``cancelled_requests_total`` (clients that went away before their answer),
``prompt_sets`` (sets served), ``dropped_connections_total{reason}`` (connections closed on a client: ``malformed``
HTTP framing, ``header_too_large`` (431), ``url_too_long`` (414), ``header_timeout``, ``body_timeout``,
``send_timeout``, ``too_many_connections``, ``shutdown``; with workers also ``handoff``: no worker took it),
``open_connections`` and ``rebalanced_connections_total`` (with workers: keep-alive connections closed after an answer
so that their client reconnects to a worker holding fewer); and the process collector's
``process_resident_memory_bytes`` and friends. Requests refused before they reach an endpoint (malformed HTTP, a head
or URL too large) count in ``requests_total{endpoint="malformed"}`` with their status.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from st_prompts.serving.batcher import BatchReport

__all__ = ["CONTENT_TYPE_LATEST", "SAME_IN_EVERY_WORKER", "ServerMetrics"]

#: Gauges that say what every worker of a server holds alike (``--workers N``): ``/metrics`` gives their largest value
#: over the workers, not their sum (a bank of 3 sets served by 2 workers serves 3 sets, not 6).
SAME_IN_EVERY_WORKER = frozenset({"st_prompts_prompt_sets"})

_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TASK_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SECOND_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The metrics of one server; ``label(task)`` turns the batcher's task (a route) into a public label."""

    def __init__(self, queued_rows: Callable[[], float], running_rows: Callable[[], float],
                 prompt_sets: Callable[[], float], label: Callable[[object], str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self._label = label
        r = self.registry
        Gauge("st_prompts_queue_rows", "Rows waiting for a forward pass", registry=r).set_function(queued_rows)
        Gauge("st_prompts_running_rows", "Rows of the forward pass that runs and of the one queued behind it", registry=r).set_function(running_rows)
        Gauge("st_prompts_prompt_sets", "Prompt sets served", registry=r).set_function(prompt_sets)
        self.batches = Counter("st_prompts_batches", "Forward passes", registry=r)
        self.mixed = Counter("st_prompts_mixed_batches", "Forward passes whose rows used more than one task",
                             registry=r)
        self.failed = Counter("st_prompts_failed_batches", "Forward passes that raised", registry=r)
        self.batch_rows = Histogram("st_prompts_batch_rows", "Rows per forward pass", buckets=_ROW_BUCKETS,
                                    registry=r)
        self.batch_tasks = Histogram("st_prompts_batch_tasks", "Distinct tasks per forward pass",
                                     buckets=_TASK_BUCKETS, registry=r)
        self.batch_tokens = Histogram("st_prompts_batch_padded_tokens", "Padded tokens (rows x longest) per pass",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_seconds = Histogram("st_prompts_batch_seconds", "Seconds per forward pass",
                                       buckets=_SECOND_BUCKETS, registry=r)
        self.rows = Counter("st_prompts_rows", "Rows encoded, per task", ["task"], registry=r)
        self.requests = Counter("st_prompts_requests", "Requests answered, per endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("st_prompts_request_seconds", "Seconds from a request's arrival to its answer",
                                 ["endpoint"], buckets=_SECOND_BUCKETS, registry=r)
        self.cancelled = Counter("st_prompts_cancelled_requests", "Requests whose client went away before the answer",
                                 registry=r)
        self.dropped = Counter("st_prompts_dropped_connections", "Connections the server closed on a client: "
                               "malformed HTTP, a header, body or send timeout, too many connections, shutdown",
                               ["reason"], registry=r)
        self.connections = Gauge("st_prompts_open_connections", "HTTP connections open", registry=r)
        self.rebalanced = Counter("st_prompts_rebalanced_connections", "Keep-alive connections closed after an answer "
                                  "so that their client reconnects to a worker holding fewer (--workers)", registry=r)

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
