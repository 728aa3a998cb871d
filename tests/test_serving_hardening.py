"""``st-prompts serve`` against clients that hold it open or send what is not HTTP (raw sockets, httpx). Servers on a
tiny bank: **S** 2 s timeouts, 40 connections, the default head bounds, admin; **T** long timeouts, a 5 s drain,
``--quantize int8``; **D** a 20 s batching wait and a 3 s drain. T and D are stopped by their tests."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import uvicorn
from conftest import edit_json, http_error
from safetensors.torch import load_file, save_file
from test_serving import (HEADERS, TOKEN, Server, add_set, httpx, metrics, post, saved_prompts, tiny_backbone_and_bank,
                          tiny_bank, wait_for)

from st_prompts.serving.server import _Server
from st_prompts.serving.workers import Supervisor

TIMEOUT = 2.0  # S's header, body and idle timeouts
SLACK = 4.0  # what a busy two-core machine may add to a timer


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    backbone, bank = tiny_backbone_and_bank(tmp_path_factory.mktemp("hardening"))
    quick = ["--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT), "--idle-timeout", str(TIMEOUT)]
    slow = ["--header-timeout", "60", "--body-timeout", "60", "--idle-timeout", "60"]
    # each log stderr alone, each line time-stamped
    started = {name: Server(name, [bank, "--threads", "1", *args], env, stderr_apart=True) for name, args, env in (
        ("S", [*quick, "--max-connections", "40"], {"ST_PROMPTS_ADMIN_TOKEN": TOKEN}),
        ("T", [*slow, "--drain-timeout", "5", "--quantize", "int8"], None),
        ("D", ["--max-wait-ms", "20000", "--drain-timeout", "3"], None))}
    try:
        for server in started.values():
            server.wait_ready()
        yield {"backbone": backbone, **started}
    finally:
        for server in started.values():
            server.stop()


# ---------------------------------------------------------------------------------------------------------- helpers
def connect(server: Server, data: bytes = b"") -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closed ``sock`` (at most ``limit``: then ``math.inf``) and what it sent."""
    start = time.monotonic()
    received = b""
    while time.monotonic() - start < limit:
        sock.settimeout(max(0.05, limit - (time.monotonic() - start)))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return time.monotonic() - start, received
        if not chunk:
            return time.monotonic() - start, received
        received += chunk
    return math.inf, received


def error_of(raw: bytes) -> tuple[int, dict]:
    """The status and OpenAI error object of a raw HTTP answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return status, error


def exchange(server: Server, data: bytes, limit: float = 10) -> tuple[float, bytes]:
    """Send ``data`` on a new connection: :func:`read_until_closed` of it."""
    with connect(server, data) as sock:
        return read_until_closed(sock, limit)


def answer_of(server: Server, data: bytes) -> bytes:
    return exchange(server, data)[1]


def open_fds(server: Server) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


HALF_HEADER = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Ty"
HALF_BODY = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
             b"\r\n{\"model\": ")


# ---------------------------------------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize(("sent", "expected"), [(HALF_HEADER, "headers"), (HALF_BODY, "body"), (b"", None)],
                         ids=["half-header", "half-body", "silent"])
def test_a_stalled_client_is_dropped_within_the_timeout(servers, sent, expected):
    seconds, answer = exchange(servers["S"], sent, TIMEOUT + SLACK)
    assert TIMEOUT - 0.2 <= seconds <= TIMEOUT + SLACK, seconds
    if expected is None:  # nothing asked, nothing answered: the connection is simply closed
        assert answer == b""
    else:
        status, error = error_of(answer)
        assert status == 408 and error["code"] == "request_timeout" and expected in error["message"]


def test_stalled_connections_do_not_pile_up(servers):
    server = servers["S"]
    before = metrics(server.url)
    baseline = open_fds(server)
    sockets = [connect(server, HALF_HEADER[:20 + i % 20]) for i in range(30)]
    try:
        time.sleep(0.5)
        assert open_fds(server) >= baseline + 25  # they are held, for now
        closed_after = [read_until_closed(sock, TIMEOUT + SLACK)[0] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    assert max(closed_after) < TIMEOUT + SLACK
    time.sleep(0.3)
    assert open_fds(server) <= baseline + 2
    after = metrics(server.url)
    key = "st_prompts_dropped_connections_total{reason=header_timeout}"
    assert after[key] - before.get(key, 0) == 30


def test_connections_beyond_the_cap_are_answered_503(servers):
    server = servers["S"]  # at most 40 connections; other tests' connections are closed by now
    held = [connect(server) for _ in range(50)]  # in well under the 2 s idle timeout
    try:
        time.sleep(0.3)
        answers = []
        for sock in held:
            sock.setblocking(False)
            try:
                answers.append(sock.recv(65536))
            except BlockingIOError:  # nothing sent: the connection is held
                answers.append(None)
    finally:
        for sock in held:
            sock.close()
    refused = [answer for answer in answers if answer]
    assert 5 <= len(refused) <= 12 and answers[:35] == [None] * 35, [bool(a) for a in answers]
    for answer in refused:
        status, error = error_of(answer)
        assert status == 503 and error["code"] == "too_many_connections"


# ---------------------------------------------------------------------------------------------------------- framing
@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    b"GARBAGE\r\n\r\n",
    b"GET /h\xffealth HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
], ids=["content-length-abc", "content-length-negative", "garbage-request-line", "bad-path-byte", "bad-chunk"])
def test_malformed_http_gets_an_openai_error_object_and_is_counted(servers, request_bytes):
    server = servers["S"]
    key = "st_prompts_requests_total{endpoint=malformed,status=400}"
    before = metrics(server.url).get(key, 0)
    seconds, answer = exchange(server, request_bytes)
    assert seconds < 10
    status, error = error_of(answer)
    assert status == 400 and error["code"] == "invalid_http_request" and error["message"].startswith("Malformed")
    assert metrics(server.url)[key] == before + 1


# ---------------------------------------------------------------------------------------------------------- the head
HEAD_LIMIT = 64 * 1024  # the defaults of --max-header-bytes, --max-headers and --max-url-bytes (server S)
FIELD_LIMIT = 100
URL_LIMIT = 32 * 1024


def test_an_endless_header_value_is_refused_431_at_the_head_limit(servers):
    """A header streamed in pieces (httptools joins them quadratically) is cut at the head limit."""
    server = servers["S"]
    key = "st_prompts_dropped_connections_total{reason=header_too_large}"
    before = metrics(server.url).get(key, 0)
    sent, chunk = 0, b"v" * 16384
    with connect(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ") as sock:
        sock.settimeout(TIMEOUT + SLACK)
        while sent < 64 * 1024 * 1024:  # bounded: the server closes long before
            try:
                sock.sendall(chunk)
            except OSError:  # closed by the server, with what it had not read
                break
            sent += len(chunk)
        answer = read_until_closed(sock, 10)[1]
    status, error = error_of(answer)
    assert status == 431 and error["code"] == "request_header_fields_too_large", error
    assert f"{HEAD_LIMIT:,} bytes" in error["message"]
    assert metrics(server.url)[key] == before + 1


def test_the_head_is_bounded_in_bytes_and_fields_and_the_url_in_bytes(servers):
    server = servers["S"]
    start = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
    pad = HEAD_LIMIT - len(start) - len(b"\r\n\r\n")
    assert answer_of(server, start + b"p" * pad + b"\r\n\r\n").startswith(b"HTTP/1.1 200 ")  # exactly the limit
    status, error = error_of(answer_of(server, start + b"p" * (pad + 1) + b"\r\n\r\n"))
    assert status == 431 and error["code"] == "request_header_fields_too_large"
    fields = [b"X-F%d: y\r\n" % i for i in range(FIELD_LIMIT - 1)] + [b"Connection: close\r\n"]
    assert answer_of(server, b"GET /health HTTP/1.1\r\n" + b"".join(fields[1:]) + b"Host: x\r\n\r\n").startswith(
        b"HTTP/1.1 200 ")  # exactly the limit
    status, error = error_of(answer_of(server, b"GET /health HTTP/1.1\r\n" + b"".join(fields) + b"Host: x\r\n\r\n"))
    assert status == 431 and f"more than {FIELD_LIMIT} header fields" in error["message"]
    path = b"/" + b"u" * (URL_LIMIT - 1)
    assert answer_of(server, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").startswith(
        b"HTTP/1.1 404 ")  # exactly the limit: no such route
    # 70 KB: beyond httptools' URL parser too
    for size in (URL_LIMIT, 70_000):
        status, error = error_of(answer_of(server, b"GET /" + b"u" * size + b" HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 414 and error["code"] == "url_too_long" and f"{URL_LIMIT:,} bytes" in error["message"]


def test_a_url_the_parser_cannot_read_is_answered_400_without_an_error_in_the_log(servers):
    """The URL parser fails after the headers (the refusal once failed itself: an ``AttributeError``, no answer)."""
    server = servers["S"]
    status, error = error_of(answer_of(server, b"GET http://a:99999999/ HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 400 and error["code"] == "invalid_http_request" and "invalid url" in error["message"]
    time.sleep(0.2)
    assert "AttributeError" not in server.log() and "Fatal error" not in server.log(), server.log()


def split_answers(raw: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of each HTTP/1.1 answer of ``raw`` (each with a Content-Length), in order."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if
                      line.lower().startswith(b"content-length:"))
        out.append((int(head.split(b" ", 2)[1]), rest[:length]))
        raw = rest[length:]
    return out


@pytest.mark.parametrize("refused", [
    b"GARBAGE\r\n\r\n",
    b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
], ids=["garbage-request-line", "bad-chunk-in-a-queued-request"])
def test_pipelined_requests_before_garbage_are_answered_in_order_then_400(servers, refused):
    """Three requests and garbage in one packet lost all three answers (the 400 closed the connection at once)."""
    server = servers["S"]
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = split_answers(answer_of(server, request * 3 + refused))
    assert [status for status, _ in answers] == [200, 200, 200, 400], answers
    assert all(json.loads(body)["status"] == "ok" for _, body in answers[:3])
    assert json.loads(answers[3][1])["error"]["code"] == "invalid_http_request"


def test_int8_is_said_by_the_start_line_health_and_models(servers):
    quantized, plain = servers["T"], servers["S"]
    with httpx.Client(timeout=60) as client:
        for server, expected in ((quantized, "int8"), (plain, "none")):
            assert client.get(server.url + "/health").json()["quantization"] == expected
            cards = client.get(server.url + "/v1/models").json()["data"]
            assert cards and {card["quantization"] for card in cards} == {expected}
            assert client.get(server.url + "/v1/models/a").json()["quantization"] == expected
    loaded = [line for line in quantized.lines if line.startswith("loaded ")]
    assert len(loaded) == 1 and "(int8: its backbone's linear layers)" in loaded[0], quantized.log()
    # the plain server's line names the CPU's int8 input bits (its instructions), never an int8 backbone
    assert not any("(int8: " in line for line in plain.lines if line.startswith("loaded ")), plain.log()


# ---------------------------------------------------------------------------------------------------------- echoes
def test_errors_quote_a_few_hundred_characters_of_the_input(servers):
    base = servers["S"].url
    with httpx.Client(timeout=120) as client:
        huge = client.post(base + "/v1/embeddings", json={"model": "m" * 3_000_000, "input": "hello"})
        assert huge.status_code == 404 and len(huge.content) < 1500
        assert "3,000,000 characters" in http_error(huge)
        odd = client.post(base + "/v1/embeddings", json={"model": "a", "input": "x", "encoding_format": "e" * 100_000})
        assert odd.status_code == 422 and len(http_error(odd)) < 500
        route = client.get(base + "/" + "p" * 20_000)
        assert route.status_code == 404 and len(http_error(route)) < 500


# ---------------------------------------------------------------------------------------------------------- admin
def _edited(source: Path, target: Path, config: dict | None = None, tensors=None) -> str:
    """A copy of the prompts-only folder ``source`` with ``config`` keys set and ``tensors(state) -> state``."""
    shutil.copytree(source, target)
    if config:
        edit_json(target / "sentence_bert_config.json", lambda settings: settings.update(config))
    if tensors is not None:
        weights = str(target / "soft_prompts.safetensors")
        save_file(tensors(load_file(weights)), weights)
    return str(target)


def test_the_admin_endpoint_answers_4xx_never_500(servers, tmp_path):
    base = servers["S"].url
    good = tmp_path / "good"
    saved_prompts(servers["backbone"], 6, 9, good)
    folders = {label: _edited(good, tmp_path / label.replace(" ", "-"), config, tensors)
               for label, config, tensors in (
                   ("huge prefix_length", {"prefix_length": 9_999_999}, None),
                   ("NaN prompts", None, lambda state: {k: torch.full_like(v, float("nan")) for k, v in state.items()}),
                   ("huge hidden size", {"prefix_projection": True, "prefix_hidden_size": 10**9}, None),
                   ("shapes that do not match", {"prefix_length": 7}, None),
                   ("prefix_length as text", {"prefix_length": "6"}, None),
                   ("dropout 5", {"prefix_dropout": 5}, None), ("damaged tensors", None, None))}
    (Path(folders["damaged tensors"]) / "soft_prompts.safetensors").write_bytes(b"\x00" * 64)
    headers = {**HEADERS, "Content-Type": "application/json"}
    bodies = [b"{not json", b"[1, 2]", b"null", json.dumps({"name": 5, "source": str(good)}).encode(),
              json.dumps({"name": "n" * 1_000_000, "source": str(good)}).encode(),
              json.dumps({"name": "ok", "source": "/tmp/\u0000x"}).encode(),
              json.dumps({"name": "ok", "source": "s" * 100_000}).encode(),
              json.dumps({"name": "ok", "source": ["a"]}).encode()]
    bodies += [json.dumps({"name": label.replace(" ", "-"), "source": folder}).encode()
               for label, folder in folders.items()]
    with httpx.Client(timeout=120) as client:
        names = client.get(base + "/v1/models").json()
        for body in bodies:
            message = http_error(client.post(base + "/admin/prompt-sets", content=body, headers=headers))
            assert len(message) < 1000
        for label in ("huge prefix_length", "NaN prompts", "shapes that do not match"):
            response = add_set(base, "x", folders[label])
            assert response.status_code == 422 and http_error(response), label
        assert http_error(client.delete(base + "/admin/prompt-sets/" + "z" * 5000, headers=headers))
        assert client.get(base + "/v1/models").json() == names  # nothing was added
        added = add_set(base, "good", good)
        assert added.status_code == 201, added.text  # the folder the bad ones were made from is fine
        assert client.post(base + "/v1/embeddings", json={"model": "good", "input": "still serving"}).status_code == 200
    assert "Traceback" not in servers["S"].log()


def test_the_admin_endpoint_takes_only_names_of_the_one_grammar(servers, tmp_path):
    """Set names follow st_prompts.prompts.names (a newline split the log lines, ``x@1`` counted as ``x``)."""
    from st_prompts.prompts.names import SET_NAME_RULE

    base = servers["S"].url
    saved_prompts(servers["backbone"], 6, 3, tmp_path / "good")
    with httpx.Client(timeout=120) as client:
        names = client.get(base + "/v1/models").json()
        for name in ("a\nb", "x@1", "backbone", "-x", "caf\u00e9", "t" * 65, "a b", "\x1b[31mred", "x.y"):
            response = add_set(base, name, tmp_path / "good")
            assert SET_NAME_RULE in http_error(response) and response.status_code == 422, (name, response.text)
            assert response.json()["error"]["param"] == "name"
        assert client.get(base + "/v1/models").json() == names
    assert "\x1b" not in servers["S"].log()


def test_a_set_added_again_while_the_old_one_drains_is_labelled_by_its_public_name(servers, tmp_path):
    """The second ``n`` is ``n@2`` inside the model while the first drains: its rows count under ``n``."""
    from st_prompts.serving.app import ServerContext
    from st_prompts.serving.indexes import IndexRegistry
    from st_prompts.serving.limits import ServingLimits
    from st_prompts.serving.model import ServedModel

    bank = tiny_bank(tmp_path / "bank", servers["backbone"])
    saved_prompts(servers["backbone"], 5, 4, tmp_path / "n")
    served = ServedModel.load(bank, device="cpu")
    context = ServerContext(served, IndexRegistry(served), ServingLimits())
    served.add_prompt_set("n", str(tmp_path / "n"))
    pinned = served.acquire("n")  # a request in flight on the first n
    served.remove_prompt_set("n")
    served.add_prompt_set("n", str(tmp_path / "n"))
    again = served.acquire("n")
    assert (pinned, again) == ("n", "n@2")
    assert [context.label(route) for route in (pinned, again, "a", None)] == ["n", "n", "a", served.name]
    served.release(pinned)
    served.release(again)


# ---------------------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_with_stalled_clients_ends_within_the_drain_timeout_without_a_traceback(servers):
    server = servers["T"]  # 60 s timeouts: only the drain can end these connections
    stalled = {"header": connect(server, HALF_HEADER), "body": connect(server, HALF_BODY), "silent": connect(server)}
    try:
        time.sleep(0.5)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        answers = {name: read_until_closed(sock, 5)[1] for name, sock in stalled.items()}
        status = server.process.wait(5 + SLACK)  # the interpreter's exit may take a while on a busy machine
    finally:
        for sock in stalled.values():
            sock.close()
    # nothing was accepted: no reason to wait for the drain timeout
    assert status == 0 and server.when("stopped after SIGTERM") - start < 2.5, server.log()
    assert error_of(answers["body"])[0] == 503 and error_of(answers["header"])[0] == 503
    assert answers["silent"] == b""
    log = server.log()
    assert "Traceback" not in log and "stopped after SIGTERM" in log, log


def test_sigterm_is_bounded_by_the_drain_timeout_and_health_says_draining(servers):
    server = servers["D"]  # rows wait 20 s for a pass; the drain lasts 3 s
    base = server.url
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        queued=post(base, "/v1/embeddings", {"model": "a", "input": ["one", "two"]})), daemon=True)
    thread.start()
    wait_for(lambda: metrics(server.url)["st_prompts_queue_rows"] == 2, 15, 0.05)
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with httpx.Client(timeout=10) as client:
        health = client.get(base + "/health")
        late = client.post(base + "/v1/embeddings", json={"model": "a", "input": "late"})
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    status = server.process.wait(3 + SLACK)
    thread.join(10)
    assert status == 0 and server.when("stopped after SIGTERM") - start < 3 + 0.5, server.log()
    queued = result["queued"]
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "shutting_down", queued.text
    assert "Retry-After" in queued.headers
    assert "Traceback" not in server.log(), server.log()
    assert "SIGTERM: draining (at most 3 s): /health answers 503, new work is refused, 1 requests in flight (2 rows " \
           "queued)" in server.log(), server.log()


def test_the_sigterm_handlers_write_nothing_and_the_loops_log_the_draining_lines(caplog):
    """A SIGTERM that lands inside a log write (the "listening on" line a client has just read) must not write again:
    that write is reentrant, and logging prints a traceback on stderr (seen in a loaded CI run)."""
    context = SimpleNamespace(in_flight=2, draining=False, drain_deadline=None, idle=lambda: False,
                              batcher=SimpleNamespace(queued_rows=3, running_rows=1))
    server, supervisor = _Server(uvicorn.Config(app=None), context, 5), Supervisor(2, None, drain_timeout=5)
    with caplog.at_level(logging.INFO, logger="st_prompts"):
        server.handle_exit(signal.SIGTERM, None)
        supervisor._on_signal(signal.SIGTERM, None)
        assert caplog.records == [] and context.draining and supervisor.stopping == "SIGTERM"
        assert asyncio.run(server.on_tick(1)) is False
        supervisor._loop()  # (no workers: it ends at once, and run() logs what it did not)
        supervisor._log_draining()
    assert [record.getMessage() for record in caplog.records] == [
        "SIGTERM: draining (at most 5 s): /health answers 503, new work is refused, 2 requests in flight (4 rows "
        "queued)", "SIGTERM: draining 0 workers"]
