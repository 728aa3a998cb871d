"""``st-prompts serve --workers N``: forked workers over one loaded model, real server processes on a tiny bank:
answers, admin changes, metrics, replacement of a killed worker, the sharing of connections, the server's bounds,
SIGTERM and orphans."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
from conftest import http_error
from test_serving import (HEADERS, TOKEN, Server, add_set, admin, embeddings, get, metrics, post, saved_prompts,
                          tiny_backbone_and_bank, wait_for)

from st_prompts.loading import load_sentence_model
from st_prompts.serving.workers import merge_metrics

TEXTS = ["A man is playing a guitar.", "Der Hund schläft.", "a", "The quick brown fox jumps over the lazy dog " * 3]


def children(pid: int) -> list[int]:
    return [child.pid for child in psutil.Process(pid).children()]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped by its parent, counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """A tiny backbone and bank for the module's servers."""
    return tiny_backbone_and_bank(tmp_path_factory.mktemp("workers"))


@pytest.fixture(scope="module")
def served(tiny):
    backbone, bank = tiny
    with Server("workers", [bank, "--workers", "2", "--threads", "1", "--drain-timeout", "4", "--header-timeout", "60"],
                env={"ST_PROMPTS_ADMIN_TOKEN": TOKEN}, stderr_apart=True) as server:
        base = server.wait_ready()
        yield {"backbone": backbone, "bank": bank, "server": server, "base": base,
               "reference": load_sentence_model(bank, device="cpu")}


def encode_many(base: str, model: str, texts: list[str], times: int) -> list[np.ndarray]:
    def one(_):  # a new connection per request: the kernel spreads them over the workers
        return embeddings(post(base, "/v1/embeddings", {"model": model, "input": texts}))

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(times)))


def test_two_workers_are_forked_and_answer_what_encode_gives(served):
    pid = served["server"].process.pid
    assert len(children(pid)) == 2
    assert sum("listening on" in line for line in served["server"].lines) == 1  # one line, once all are ready
    for task in ("a", "b", "c", "backbone"):
        expected = served["reference"].encode(TEXTS, task=task)
        for got in encode_many(served["base"], task, TEXTS, 12):
            assert np.abs(got - expected).max() < 1e-5, task


def test_an_added_set_is_served_by_every_worker_after_the_201_and_metrics_sum_the_workers(served, tmp_path):
    base = served["base"]
    before = metrics(base)
    expected = saved_prompts(served["backbone"], 6, 7, tmp_path / "prompts").encode(TEXTS)
    added = add_set(base, "added", tmp_path / "prompts")
    assert added.status_code == 201, added.text
    for got in encode_many(base, "added", TEXTS, 24):  # any worker, at once after the answer
        assert np.abs(got - expected).max() < 1e-5
    # refused by the first worker's checks: no worker has it
    assert "already serves" in http_error(add_set(base, "added", tmp_path / "prompts"), 409)
    http_error(add_set(base, "nowhere", tmp_path / "no"), 422)
    names = [m["id"] for m in get(base, "/v1/models").json()["data"]]
    assert "added" in names and "nowhere" not in names
    after = metrics(base)
    assert after["st_prompts_workers"] == 2
    assert after['st_prompts_requests_total{endpoint=embeddings,status=200}'] - \
        before.get('st_prompts_requests_total{endpoint=embeddings,status=200}', 0) == 24
    assert after["st_prompts_requests_total{endpoint=admin,status=201}"] == 1
    assert {k for k in after if k.startswith("process_resident_memory_bytes")} == \
        {"process_resident_memory_bytes{worker=0}", "process_resident_memory_bytes{worker=1}"}
    removed = post(base, "/admin/prompt-sets/added", None, headers=HEADERS)  # POST is not the removal route
    assert removed.status_code == 405
    assert admin(base, "DELETE", "/admin/prompt-sets/added").status_code == 200
    for _ in range(12):
        http_error(post(base, "/v1/embeddings", {"model": "added", "input": "x"}), 404)


def test_a_killed_worker_is_replaced_and_serves_the_sets_added_before_as_they_were_read(served, tmp_path):
    base, server = served["base"], served["server"]
    expected = saved_prompts(served["backbone"], 5, 9, tmp_path / "kept").encode(TEXTS)
    assert add_set(base, "kept", tmp_path / "kept").status_code == 201
    shutil.rmtree(tmp_path / "kept")  # the replacement adds the set as the first worker read it, not the folder
    pid = server.process.pid
    first = children(pid)
    os.kill(first[0], signal.SIGKILL)
    assert wait_for(lambda: len(children(pid)) == 2 and first[0] not in children(pid)
                    and "starting another" in server.log(), 60), server.log()
    assert wait_for(lambda: sum("added the prompt set 'kept'" in line for line in server.lines) >= 3, 120), \
        server.log()
    for got in encode_many(base, "kept", TEXTS, 24):
        assert np.abs(got - expected).max() < 1e-5


def connections_per_worker(pid: int, port: int, established_only: bool = True) -> list[int]:
    """TCP connections on ``port`` (established ones, or in any state but listening) that each worker of server
    ``pid`` holds."""
    def counted(connection) -> bool:
        if established_only:
            return connection.status == psutil.CONN_ESTABLISHED
        return connection.status != psutil.CONN_LISTEN

    return sorted(sum(c.laddr.port == port and counted(c) for c in child.net_connections("tcp"))
                  for child in psutil.Process(pid).children())


def settled(server: Server) -> tuple[int, int]:
    """The pid and port of ``server`` once its workers hold no connection: a closed connection a worker has not yet
    read counts as open, and would tilt the next ones to the other worker."""
    pid, port = server.process.pid, int(server.url.rsplit(":", 1)[1])
    assert wait_for(lambda: connections_per_worker(pid, port, established_only=False) == [0, 0], 15)
    return pid, port


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_burst_of_connections_is_shared_evenly_by_the_workers_the_replacement_included(served):
    """The parent hands each connection to the worker holding the fewest (not one shared listening socket)."""
    for _ in range(3):
        pid, port = settled(served["server"])
        clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(16)]
        try:
            for client in clients:  # all connected before the first request: a burst
                client.sendall(HEALTH)
            for client in clients:
                assert b" 200 " in client.recv(4096).split(b"\r\n", 1)[0] + b" "
            assert connections_per_worker(pid, port) == [8, 8]
        finally:
            for client in clients:
                client.close()


def test_the_prompt_sets_gauge_is_the_servers_not_the_sum_over_workers(served):
    base = served["base"]
    sets = [card["id"] for card in get(base, "/v1/models").json()["data"] if card["id"] != "backbone"]
    assert len(sets) >= 3 and metrics(base)["st_prompts_prompt_sets"] == len(sets)


def test_a_connection_flood_waits_for_the_workers_instead_of_closing_new_clients(served):
    """While no worker takes connections (both stopped, their hand-off queues full), new clients wait in the listen
    queue: none is closed, nothing is logged per connection."""
    server = served["server"]
    pid, port = settled(server)
    lines = len(server.lines)
    workers = children(pid)
    clients = []
    for worker in workers:
        os.kill(worker, signal.SIGSTOP)
    try:
        for _ in range(600):  # more than the two hand-off queues held (about 270 each)
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        for _ in range(20):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            clients[-1].sendall(HEALTH)
        time.sleep(1.0)  # the parent has found every queue full by now
    finally:
        for worker in workers:
            os.kill(worker, signal.SIGCONT)
    try:
        answers = [client.recv(65536) for client in clients]
    finally:
        for client in clients:
            client.close()
    assert [answer.split(b" ", 2)[1:2] for answer in answers] == [[b"200"]] * 20, answers
    assert metrics(served["base"])["st_prompts_dropped_connections_total{reason=handoff}"] == 0
    assert not [line for line in server.lines[lines:] if "connection" in line], server.lines[lines:]


def test_after_a_worker_is_killed_its_clients_are_shared_again_with_the_replacement(served):
    """The killed worker's clients reconnect to the survivor at once; the parent has it close half its lead
    (``Connection: close``), and those clients reconnect to the replacement."""
    pid, port = settled(served["server"])
    stop = threading.Event()

    def client() -> None:  # a keep-alive client that reconnects when the server closes its connection
        sock = None
        while not stop.is_set():
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.sendall(HEALTH)
                answer = sock.recv(65536)
                if not answer or b"connection: close" in answer.lower():
                    sock.close()
                    sock = None
            except OSError:
                if sock is not None:
                    sock.close()
                sock = None
            time.sleep(0.02)
        if sock is not None:
            sock.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        assert wait_for(lambda: connections_per_worker(pid, port) == [4, 4], 15), connections_per_worker(pid, port)
        first = children(pid)
        os.kill(first[0], signal.SIGKILL)
        assert wait_for(lambda: len(children(pid)) == 2 and first[0] not in children(pid), 60)
        assert wait_for(lambda: connections_per_worker(pid, port) == [4, 4], 30), connections_per_worker(pid, port)
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
    assert metrics(served["base"])["st_prompts_rebalanced_connections_total"] >= 1


@pytest.fixture(scope="module")
def limited(tiny):
    """Two workers, 6 connections and 4 queued rows in all; rows wait 20 s for a pass (they stay queued)."""
    with Server("limited", [tiny[1], "--workers", "2", "--threads", "1", "--max-connections", "6",
                            "--max-queue-rows", "4", "--max-wait-ms", "20000", "--drain-timeout", "3"],
                stderr_apart=True) as server:
        server.wait_ready()
        yield server


def test_max_connections_bounds_the_whole_server_and_the_rest_are_answered_503(limited):
    """Not a cap per worker; the extra connections get an answer, not a TCP reset."""
    pid, port = settled(limited)
    clients = []
    try:
        for _ in range(9):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            clients[-1].sendall(HEALTH)
        answers = [client.recv(65536) for client in clients]  # a reset would raise here
    finally:
        for client in clients:
            client.close()
    assert [int(answer.split(b" ", 2)[1]) for answer in answers] == [200] * 6 + [503] * 3, answers
    for answer in answers[6:]:
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "too_many_connections" and "6 connections" in error["message"]


def test_max_queue_rows_is_shared_by_the_workers(limited):
    """``--max-queue-rows 4`` with two workers: each queues 2 rows at most."""
    base = limited.url
    pid, port = settled(limited)
    results, threads = {}, []

    def start() -> str:
        name = f"queued-{len(threads)}"
        threads.append(threading.Thread(target=lambda: results.update(
            {name: post(base, "/v1/embeddings", {"model": "a", "input": ["one", "two"]})}), daemon=True))
        threads[-1].start()
        return name

    start()
    assert wait_for(lambda: metrics(base)["st_prompts_queue_rows"] == 2, 15)
    for _ in range(4):  # the next goes to the other worker, which holds fewer; one that lands beside it is refused
        assert wait_for(lambda: connections_per_worker(pid, port, established_only=False) == [0, 1], 15)
        name = start()
        assert wait_for(lambda name=name: metrics(base)["st_prompts_queue_rows"] == 4 or name in results, 15)
        if metrics(base)["st_prompts_queue_rows"] == 4:
            break
    assert metrics(base)["st_prompts_queue_rows"] == 4, {name: response.text for name, response in results.items()}
    third = post(base, "/v1/embeddings", {"model": "a", "input": "three"}, timeout=10)  # either worker: 2 + 1 > 2
    assert third.status_code == 503 and third.json()["error"]["code"] == "queue_full", third.text
    assert metrics(base)["st_prompts_queue_rows"] == 4
    limited.process.send_signal(signal.SIGTERM)  # the queued rows cannot be answered within the 3 s drain: 503
    assert limited.process.wait(30) == 0
    for thread in threads:
        thread.join(30)
    assert {response.status_code for response in results.values()} == {503}
    assert "rows queued in each (--max-queue-rows 4 shared)" in limited.log()


def test_sigterm_with_a_stalled_client_stops_every_worker_within_the_drain_timeout(tiny):
    with Server("drain", [tiny[1], "--workers", "2", "--threads", "1", "--drain-timeout", "3",
                          "--header-timeout", "60"], stderr_apart=True) as server:
        base = server.wait_ready()
        host, port = base.removeprefix("http://").rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)))
        stalled.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        workers = children(server.process.pid)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(30)
        took = time.monotonic() - start
        stalled.close()
    assert code == 0, server.log()
    assert took < 3 + 4, took
    assert not any(alive(pid) for pid in workers)
    assert "Traceback" not in server.log()
    assert "SIGTERM: draining 2 workers" in server.log() and "every worker drained" in server.log()


def test_workers_stop_when_their_parent_is_killed(tiny):
    with Server("orphans", [tiny[1], "--workers", "2", "--threads", "1", "--drain-timeout", "3"],
                stderr_apart=True) as server:
        server.wait_ready()
        workers = children(server.process.pid)
        server.process.kill()
        server.process.wait(10)
        assert wait_for(lambda: not any(alive(pid) for pid in workers), 20), server.log()


def test_merge_metrics_sums_counters_and_histograms_and_labels_process_samples():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    texts = []
    for index, (requests, seconds, rss) in enumerate(((3, (0.1, 2.0), 100.0), (5, (0.3,), 250.0))):
        registry = CollectorRegistry()
        Counter("st_prompts_requests", "r", ["endpoint"], registry=registry).labels(endpoint="e").inc(requests)
        Gauge("st_prompts_prompt_sets", "p", registry=registry).set(3 + index)  # a change reaching one worker first
        Gauge("st_prompts_queue_rows", "q", registry=registry).set(10 * (index + 1))
        histogram = Histogram("st_prompts_request_seconds", "s", buckets=(0.2, 1.0), registry=registry)
        for value in seconds:
            histogram.observe(value)
        Gauge("process_resident_memory_bytes", "m", registry=registry).set(rss)
        texts.append((index, generate_latest(registry)))
    parent = (b"# TYPE st_prompts_dropped_connections_total counter\n"
              b'st_prompts_dropped_connections_total{reason="handoff"} 7\n')
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(merge_metrics(texts, parent).decode())
               for s in family.samples}
    assert samples[("st_prompts_requests_total", (("endpoint", "e"),))] == 8
    assert samples[("st_prompts_request_seconds_bucket", (("le", "0.2"),))] == 1
    assert samples[("st_prompts_request_seconds_bucket", (("le", "1.0"),))] == 2
    assert samples[("st_prompts_request_seconds_count", ())] == 3
    assert samples[("st_prompts_request_seconds_sum", ())] == pytest.approx(2.4)
    assert samples[("process_resident_memory_bytes", (("worker", "0"),))] == 100
    assert samples[("process_resident_memory_bytes", (("worker", "1"),))] == 250
    assert samples[("st_prompts_workers", ())] == 2  # the parent's samples are not a worker's
    assert samples[("st_prompts_prompt_sets", ())] == 4  # what every worker serves: the largest, not the sum
    assert samples[("st_prompts_queue_rows", ())] == 30  # what the workers hold apart: the sum
    assert samples[("st_prompts_dropped_connections_total", (("reason", "handoff"),))] == 7


def test_the_journal_keeps_each_served_set_once_and_the_removals_of_sets_the_bank_started_with():
    from st_prompts.serving.workers import Supervisor

    supervisor = Supervisor(2, lambda link, journal: 0)
    for op, args in (("add_set_data", ("a", "/one", "tensors 1")), ("add_set_data", ("b", "/two", "tensors 2")),
                     ("remove_set", ("a",)), ("add_set_data", ("a", "/three", "tensors 3")),
                     ("remove_set", ("sts",)), ("reload_index", ("docs",))):
        supervisor._record(op, args)
    assert supervisor.journal == [("add_set_data", ("b", "/two", "tensors 2")),
                                  ("add_set_data", ("a", "/three", "tensors 3")),
                                  ("remove_set", ("sts",)), ("reload_index", ("docs",))]
