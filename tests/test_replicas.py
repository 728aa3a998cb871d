"""Serving replicas behind a load balancer, checked and changed as one by ``st-prompts replicas``, ``/health`` as the
readiness probe (docs/serving.md: Replicas). Two replicas of a tiny bank (an ``st-prompts serve`` process and the same
app on uvicorn in this process) behind :class:`Balancer`; in process: ``/live`` during a drain and the sets' digests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from conftest import CLIProcess, run_cli
from test_serving import (TOKEN, add_set, embeddings, get, one_thread, post, saved_prompts, tiny_backbone_and_bank,
                          wait_for)

from st_prompts import save_prompts_only
from st_prompts.loading import load_sentence_model
from st_prompts.search import SemanticIndex
from st_prompts.serving.app import ServerContext, create_app
from st_prompts.serving.indexes import IndexRegistry
from st_prompts.serving.limits import ServingLimits
from st_prompts.serving.model import ServedModel

TEXTS = ["A man is playing a guitar.", "Der Hund schläft.", "a", "The quick brown fox jumps over the lazy dog " * 3]
ARGS = ["--threads", "1", "--drain-timeout", "4"]


class Balancer:
    """A stand-in for HAProxy (``option httpchk``, ``redispatch``): each new connection goes to the next replica (round
    robin) whose ``GET /health`` answered 200 at the last check (every 0.1 s), or to the one after when its connection
    is refused. ``picked`` counts the connections each replica got."""

    def __init__(self, upstreams: list[tuple[str, int]]) -> None:
        self.upstreams = upstreams
        self.ready: set[int] = set()
        self.picked = [0] * len(upstreams)
        self.turn = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _start(self):
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.checker = asyncio.ensure_future(self._check())
        return server

    async def _check(self) -> None:
        while True:
            for index, (host, port) in enumerate(self.upstreams):
                (self.ready.add if await self._healthy(host, port) else self.ready.discard)(index)
            await asyncio.sleep(0.1)

    @staticmethod
    async def _healthy(host: str, port: int) -> bool:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
        except (OSError, asyncio.TimeoutError):
            return False
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: replica\r\nConnection: close\r\n\r\n")
            status = (await asyncio.wait_for(reader.readline(), 2.0)).split()[1:2]
        except (OSError, asyncio.TimeoutError):
            return False
        finally:
            writer.close()
        return status == [b"200"]

    async def _handle(self, reader, writer) -> None:
        count = len(self.upstreams)
        order = [i for i in ((self.turn + k) % count for k in range(count)) if i in self.ready]
        self.turn += 1
        for index in order:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstreams[index])
            except OSError:
                continue  # refused (stopped since the last check): the next one
            self.picked[index] += 1
            break
        else:
            writer.close()
            return
        await asyncio.gather(self._copy(reader, up_writer), self._copy(up_reader, writer))

    @staticmethod
    async def _copy(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.checker.cancel)
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def address(url: str) -> tuple[str, int]:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Probe:
    """A replica started at a known port (``st-prompts serve ... --port PORT``) and its ``/health`` asked from the
    moment it starts, as a readiness probe asks: ``refused`` connections, then the first HTTP status (``status``)."""

    def __init__(self, bank: str, port: int, log, args: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "ST_PROMPTS_ADMIN_TOKEN": TOKEN}
        with open(log, "w") as handle:
            self.process = CLIProcess(["serve", bank, *args, "--port", str(port)], env,
                                      stdout=subprocess.DEVNULL, stderr=handle)
        self.refused, self.status, self.other = 0, None, []
        self.thread = threading.Thread(target=self._probe, daemon=True)
        self.thread.start()

    def _probe(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                self.status = get(self.url, "/health").status_code
                return
            except Exception as exc:  # noqa: BLE001 - httpx's ConnectError: refused while it loads
                if "ConnectError" not in type(exc).__name__:
                    self.other.append(repr(exc))
                self.refused += 1
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)


class InProcess:
    """A replica in this process: the application of the bank, its index and the admin token on uvicorn in a thread
    (a second ``st-prompts serve`` process would cost its imports)."""

    def __init__(self, bank: str, index: str) -> None:
        import uvicorn

        served = ServedModel.load(bank, device="cpu")
        registry = IndexRegistry(served)
        registry.load("docs", index)
        app = create_app(ServerContext(served, registry, ServingLimits(), admin_token=TOKEN))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    backbone, bank = tiny_backbone_and_bank(root)
    reference = load_sentence_model(bank, device="cpu")
    with one_thread():
        SemanticIndex.build(reference, TEXTS, task="a").save(str(root / "docs.index"))
    args = [*ARGS, "--index", f"docs={root / 'docs.index'}"]
    # replica 0 at a known port, its /health asked from the start; replica 1 on a free port (read from its log)
    probe = Probe(bank, free_port(), root / "r0.log", args)
    servers = [probe]
    try:
        with one_thread():  # while replica 0 starts beside it
            servers.append(InProcess(bank, str(root / "docs.index")))
        urls = [probe.url, servers[1].url]
        probe.thread.join(240)
        balancer = Balancer([address(url) for url in urls])
        assert wait_for(lambda: balancer.ready == {0, 1}, timeout=20)
        yield {"root": root, "backbone": backbone, "bank": bank, "servers": servers, "urls": urls,
               "balancer": balancer, "reference": reference, "probe": probe}
        balancer.close()
    finally:
        for server in servers:
            server.stop()


def embed(base: str, model: str) -> np.ndarray:
    return embeddings(post(base, "/v1/embeddings", {"model": model, "input": TEXTS}))  # a new connection each time


@pytest.fixture
def replicas_cli(replicas, capsys, monkeypatch):
    """``st-prompts replicas ARGS --replica URL...`` in process: asserts its exit status; its stdout and stderr."""
    monkeypatch.setenv("ST_PROMPTS_ADMIN_TOKEN", TOKEN)

    def run(*args, status: int = 0) -> tuple[str, str]:
        capsys.readouterr()
        code = run_cli(["replicas", *map(str, args), *[a for url in replicas["urls"] for a in ("--replica", url)]])
        out, err = capsys.readouterr()
        assert code == status, err
        return out, err

    return run


def fingerprints(urls: list[str]) -> set[str]:
    return {health(url)["fingerprint"] for url in urls}


def health(url: str) -> dict:
    response = get(url, "/health")
    assert response.status_code == 200, response.text
    return response.json()


def test_requests_through_the_balancer_reach_both_replicas_and_give_what_encode_gives(replicas, replicas_cli):
    balancer, probe = replicas["balancer"], replicas["probe"]
    # the readiness probe while replica 0 loaded: its connection refused, never answered otherwise, until 200
    assert probe.status == 200 and probe.refused > 0 and probe.other == [], probe.log.read_text()
    pids = {health(url)["pid"] for url in replicas["urls"]}
    assert pids == {probe.process.pid, os.getpid()}
    before = list(balancer.picked)
    for task in ("a", "b", "backbone"):
        expected = replicas["reference"].encode(TEXTS, task=task)
        for _ in range(4):
            assert np.abs(embed(balancer.url, task) - expected).max() < 1e-5, task
    assert [after - b for after, b in zip(balancer.picked, before)] == [6, 6]  # round robin: each took half
    assert {health(balancer.url)["pid"] for _ in range(4)} == pids  # /health says which replica answered
    out, _ = replicas_cli("check")
    (fingerprint,) = fingerprints(replicas["urls"])
    assert f"2 replicas ready, serving the same sets (fingerprint {fingerprint})" in out
    assert set(health(replicas["urls"][0])["sets"]) == {"a", "b", "c"}


def test_an_added_set_reaches_every_replica_and_replicas_that_differ_are_named(replicas, replicas_cli, tmp_path):
    urls, balancer = replicas["urls"], replicas["balancer"]
    expected = saved_prompts(replicas["backbone"], 6, 7, tmp_path / "prompts").encode(TEXTS)
    start = health(urls[0])["fingerprint"]

    # refused by the first replica's checks: one line, no replica changed
    _, err = replicas_cli("add-set", "nowhere", tmp_path / "missing", status=2)
    assert err.count("\n") == 1 and "refused it (422)" in err and "Nothing was changed" in err
    assert fingerprints(urls) == {start}

    assert "2 replicas serve 'added'" in replicas_cli("add-set", "added", tmp_path / "prompts")[0]
    for url in urls:  # each replica, addressed directly, at once
        assert np.abs(embed(url, "added") - expected).max() < 1e-5
    for _ in range(4):
        assert np.abs(embed(balancer.url, "added") - expected).max() < 1e-5
    added = fingerprints(urls)
    assert len(added) == 1 and added != {start}

    # a set added to one replica only (its own admin route): check names the difference in one line
    other = saved_prompts(replicas["backbone"], 4, 9, tmp_path / "other")
    assert add_set(urls[1], "one", tmp_path / "other").status_code == 201
    _, err = replicas_cli("check", status=2)
    assert err.count("\n") == 1 and "the replicas serve different sets" in err and urls[0] in err and urls[1] in err
    replicas_cli("add-set", "one", tmp_path / "other")  # the same fan-out completes it: the replica that has it is done
    assert np.abs(embed(urls[0], "one") - other.encode(TEXTS)).max() < 1e-5

    # the same name with other weights on one replica: the names agree, the fingerprints do not
    replicas_cli("remove-set", "one")
    assert add_set(urls[0], "one", tmp_path / "other").status_code == 201
    assert add_set(urls[1], "one", tmp_path / "prompts").status_code == 201
    sets = [health(url)["sets"] for url in urls]
    assert set(sets[0]) == set(sets[1]) and sets[0]["one"] != sets[1]["one"] and sets[0]["added"] == sets[1]["added"]
    assert "different sets" in replicas_cli("check", status=2)[1]

    replicas_cli("remove-set", "one")
    for url in urls:
        assert "one" not in health(url)["sets"]
        assert post(url, "/v1/embeddings", {"model": "one", "input": ["x"]}).status_code == 404
    assert fingerprints(urls) == added
    replicas_cli("remove-set", "added")
    assert fingerprints(urls) == {start}  # as they started

    # an index reloaded on every replica; one that no replica serves is refused by the first: nothing changed
    assert "2 replicas reloaded 'docs'" in replicas_cli("reload-index", "docs")[0]
    _, err = replicas_cli("reload-index", "nothing", status=2)
    assert err.count("\n") == 1 and f"{urls[0]} refused it (404)" in err
    hits = post(balancer.url, "/search", {"query": TEXTS[0], "index": "docs", "k": 1}).json()["data"][0]["hits"]
    assert hits[0]["id"] == 0


def test_live_answers_while_health_says_draining(replicas):
    from starlette.testclient import TestClient

    served = ServedModel.load(replicas["bank"], device="cpu")
    context = ServerContext(served, IndexRegistry(served), ServingLimits())
    with TestClient(create_app(context)) as client:
        ready = client.get("/health")
        assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["pid"] == os.getpid()
        assert client.get("/live").json() == {"status": "ok", "pid": os.getpid()}
        context.draining = True  # as SIGTERM sets it (tests/test_serving_hardening.py drains real servers)
        draining = client.get("/health")
        assert draining.status_code == 503 and draining.json()["ready"] is False
        live = client.get("/live")
        assert live.status_code == 200 and live.json()["status"] == "draining"
        assert client.post("/v1/embeddings", json={"model": "a", "input": ["x"]}).status_code == 503
        context.draining = False


def test_set_digests_follow_the_weights_not_the_names(replicas, tmp_path):
    served = ServedModel.load(replicas["bank"], device="cpu")
    first, digests = served.fingerprint(), served.set_digests()
    assert set(digests) >= {"a", "b", "c"} and len(set(digests.values())) == len(digests)
    again = ServedModel.load(replicas["bank"], device="cpu")
    assert again.set_digests() == digests and again.fingerprint() == first  # another load, the same weights
    source = saved_prompts(replicas["backbone"], 3, 5, tmp_path / "x")
    served.add_prompt_set("x", str(tmp_path / "x"))
    assert served.fingerprint() != first and served.set_digests()["a"] == digests["a"]
    with_x = served.set_digests()["x"]
    served.remove_prompt_set("x")
    assert served.fingerprint() == first
    with torch.no_grad():
        source[0].prefix_encoder.embedding.weight[0, 0] += 1.0  # one value changed
    save_prompts_only(source, str(tmp_path / "x2"))
    served.add_prompt_set("x", str(tmp_path / "x2"))
    assert served.set_digests()["x"] != with_x


def test_a_set_added_at_run_time_has_the_digest_of_the_same_set_in_a_bank_folder(replicas, tmp_path):
    """A rolling update (a set added at run time, then to the bank folder) leaves old and new replicas alike."""
    saved_prompts(replicas["backbone"], 5, 11, tmp_path / "rolled")
    assert run_cli(["bank", "add", replicas["bank"], "rolled", str(tmp_path / "rolled"), "--output",
                    str(tmp_path / "bank-v2")]) == 0
    running = ServedModel.load(replicas["bank"], device="cpu")
    running.add_prompt_set("rolled", str(tmp_path / "rolled"))
    restarted = ServedModel.load(str(tmp_path / "bank-v2"), device="cpu")  # another folder name, the same sets
    assert restarted.set_digests() == running.set_digests()
    assert restarted.fingerprint() == running.fingerprint() != ServedModel.load(replicas["bank"]).fingerprint()


def test_a_drained_replica_leaves_the_balancer_and_no_request_fails(replicas, replicas_cli):
    """Last: it stops replica 0 (the other half of a rolling restart, starting a replica, is the fixture's probe)."""
    urls, balancer = replicas["urls"], replicas["balancer"]
    expected = replicas["reference"].encode(TEXTS, task="a")
    old = replicas["probe"].process
    old.send_signal(signal.SIGTERM)
    assert old.wait(30) == 0  # drained, exit status 0
    for _ in range(6):  # refused by replica 0 (until the balancer's next check): sent to replica 1
        assert np.abs(embed(balancer.url, "a") - expected).max() < 1e-5
    assert wait_for(lambda: balancer.ready == {1}, timeout=10)
    _, err = replicas_cli("check", status=2)
    assert err.count("\n") == 1 and f"{urls[0]}  unreachable" in err
