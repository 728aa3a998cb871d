"""Serving replicas (issue 63, part 4): N ``st-prompts serve`` processes behind a load balancer, checked and changed
as one by ``st-prompts replicas``, ``/health`` as the readiness probe (docs/serving.md: Replicas).

Two replicas of a tiny random bank (an ``st-prompts serve`` process, and the same app on uvicorn in this process)
behind a stand-in load balancer (:class:`Balancer`: round robin over the replicas whose ``/health`` answers 200, the
next one when a connection is refused, as HAProxy's ``option httpchk`` with ``redispatch`` does): requests are spread
over both and every vector equals the bank's ``encode``; an added set reaches every replica before ``replicas add-set``
returns; replicas that differ are named in one line, and the same command run again makes them agree; a refused
change reaches none; an index reloads on both; the process replica's ``/health`` refuses connections while
it loads and first answers 200; a drained replica exits 0 and the balancer's requests are all answered by the other.
In process: ``/live`` answers 200 while ``/health`` answers 503 during a drain, and a set's digest follows its weights
(a set added at run time has the digest of the same set in a bank folder: old and new replicas of a rolling update
agree). Cost: one server start (its imports: ~10 s of CPU), beside this process's replica.
"""

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
from conftest import CLIProcess, make_tiny_backbone, run_cli
from test_serving import get, one_thread, post, prefixed_model, tiny_bank, wait_for

from st_prompts import save_prompts_only
from st_prompts.loading import load_sentence_model
from st_prompts.search import SemanticIndex

TOKEN = "test-admin-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
TEXTS = ["A man is playing a guitar.", "Der Hund schläft.", "a", "The quick brown fox jumps over the lazy dog " * 3]
ARGS = ["--threads", "1", "--drain-timeout", "4"]


class Balancer:
    """A stand-in for HAProxy, nginx or a Kubernetes Service in front of the replicas: each new connection goes to
    the next replica (round robin) among those whose ``GET /health`` answered 200 at the last check (every 0.1 s),
    or to the one after when its connection is refused. ``picked`` counts the connections each replica got."""

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
    """A replica in this process: the same application (:func:`st_prompts.serving.app.create_app` of the bank, its
    index and the admin token) on uvicorn in a thread. A second ``st-prompts serve`` process would cost the test its
    imports (the largest part of a start); replica 0 is one, started, probed and drained for real."""

    def __init__(self, bank: str, index: str) -> None:
        import uvicorn

        from st_prompts.serving.app import ServerContext, create_app
        from st_prompts.serving.indexes import IndexRegistry
        from st_prompts.serving.limits import ServingLimits
        from st_prompts.serving.model import ServedModel

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
    backbone = make_tiny_backbone(root / "tiny-backbone", "bert", max_positions=512)
    bank = tiny_bank(root / "tiny-bank", backbone)
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


def embed(base: str, model: str, texts: list[str] = TEXTS) -> np.ndarray:
    response = post(base, "/v1/embeddings", {"model": model, "input": texts})  # a new connection each time
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]])


def replicas_cli(capsys, monkeypatch, *args: str, urls: list[str]) -> tuple[int, str, str]:
    monkeypatch.setenv("ST_PROMPTS_ADMIN_TOKEN", TOKEN)
    capsys.readouterr()
    code = run_cli(["replicas", *args, *[a for url in urls for a in ("--replica", url)]])
    out, err = capsys.readouterr()
    return code, out, err


def health(url: str) -> dict:
    response = get(url, "/health")
    assert response.status_code == 200, response.text
    return response.json()


def test_requests_through_the_balancer_reach_both_replicas_and_give_what_encode_gives(replicas, capsys,
                                                                                      monkeypatch):
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
    code, out, err = replicas_cli(capsys, monkeypatch, "check", urls=replicas["urls"])
    assert code == 0, err
    fingerprints = {health(url)["fingerprint"] for url in replicas["urls"]}
    assert len(fingerprints) == 1
    assert f"2 replicas ready, serving the same sets (fingerprint {fingerprints.pop()})" in out
    assert set(health(replicas["urls"][0])["sets"]) == {"a", "b", "c"}


def test_an_added_set_reaches_every_replica_and_replicas_that_differ_are_named(replicas, capsys, monkeypatch,
                                                                               tmp_path):
    urls, balancer = replicas["urls"], replicas["balancer"]
    source = prefixed_model(replicas["backbone"], 6, seed=7, dimension=32, normalize=False)
    save_prompts_only(source, str(tmp_path / "prompts"))
    expected = source.encode(TEXTS)
    start = health(urls[0])["fingerprint"]

    # refused by the first replica's checks: one line, no replica changed
    code, _, err = replicas_cli(capsys, monkeypatch, "add-set", "nowhere", str(tmp_path / "missing"), urls=urls)
    assert code == 2 and err.count("\n") == 1 and "refused it (422)" in err and "Nothing was changed" in err
    assert {health(url)["fingerprint"] for url in urls} == {start}

    code, out, err = replicas_cli(capsys, monkeypatch, "add-set", "added", str(tmp_path / "prompts"), urls=urls)
    assert code == 0, err
    assert "2 replicas serve 'added'" in out
    for url in urls:  # each replica, addressed directly, at once
        assert np.abs(embed(url, "added") - expected).max() < 1e-5
    for _ in range(4):
        assert np.abs(embed(balancer.url, "added") - expected).max() < 1e-5
    added = {health(url)["fingerprint"] for url in urls}
    assert len(added) == 1 and added != {start}

    # a set added to one replica only (its own admin route): check names the difference in one line
    other = prefixed_model(replicas["backbone"], 4, seed=9, dimension=32, normalize=False)
    save_prompts_only(other, str(tmp_path / "other"))
    assert post(urls[1], "/admin/prompt-sets", {"name": "one", "source": str(tmp_path / "other")},
                headers=HEADERS).status_code == 201
    code, out, err = replicas_cli(capsys, monkeypatch, "check", urls=urls)
    assert code == 2 and err.count("\n") == 1 and "the replicas serve different sets" in err
    assert urls[0] in err and urls[1] in err
    # the same fan-out completes it: the replica that has it counts as done
    code, out, err = replicas_cli(capsys, monkeypatch, "add-set", "one", str(tmp_path / "other"), urls=urls)
    assert code == 0, err
    assert np.abs(embed(urls[0], "one") - other.encode(TEXTS)).max() < 1e-5

    # the same name with other weights on one replica: the names agree, the fingerprints do not
    code, _, err = replicas_cli(capsys, monkeypatch, "remove-set", "one", urls=urls)
    assert code == 0, err
    assert post(urls[0], "/admin/prompt-sets", {"name": "one", "source": str(tmp_path / "other")},
                headers=HEADERS).status_code == 201
    assert post(urls[1], "/admin/prompt-sets", {"name": "one", "source": str(tmp_path / "prompts")},
                headers=HEADERS).status_code == 201
    sets = [health(url)["sets"] for url in urls]
    assert set(sets[0]) == set(sets[1]) and sets[0]["one"] != sets[1]["one"] and sets[0]["added"] == sets[1]["added"]
    code, _, err = replicas_cli(capsys, monkeypatch, "check", urls=urls)
    assert code == 2 and "different sets" in err

    code, out, err = replicas_cli(capsys, monkeypatch, "remove-set", "one", urls=urls)
    assert code == 0, err
    for url in urls:
        assert "one" not in health(url)["sets"]
        assert post(url, "/v1/embeddings", {"model": "one", "input": ["x"]}).status_code == 404
    assert {health(url)["fingerprint"] for url in urls} == added
    assert replicas_cli(capsys, monkeypatch, "remove-set", "added", urls=urls)[0] == 0
    assert {health(url)["fingerprint"] for url in urls} == {start}  # as they started

    # an index reloaded on every replica; one that no replica serves is refused by the first: nothing changed
    code, out, err = replicas_cli(capsys, monkeypatch, "reload-index", "docs", urls=urls)
    assert code == 0 and "2 replicas reloaded 'docs'" in out, err
    code, _, err = replicas_cli(capsys, monkeypatch, "reload-index", "nothing", urls=urls)
    assert code == 2 and err.count("\n") == 1 and f"{urls[0]} refused it (404)" in err
    hits = post(balancer.url, "/search", {"query": TEXTS[0], "index": "docs", "k": 1}).json()["data"][0]["hits"]
    assert hits[0]["id"] == 0


def test_live_answers_while_health_says_draining(replicas):
    from starlette.testclient import TestClient

    from st_prompts.serving.app import ServerContext, create_app
    from st_prompts.serving.indexes import IndexRegistry
    from st_prompts.serving.limits import ServingLimits
    from st_prompts.serving.model import ServedModel

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
    from st_prompts.serving.model import ServedModel

    served = ServedModel.load(replicas["bank"], device="cpu")
    first, digests = served.fingerprint(), served.set_digests()
    assert set(digests) >= {"a", "b", "c"} and len(set(digests.values())) == len(digests)
    again = ServedModel.load(replicas["bank"], device="cpu")
    assert again.set_digests() == digests and again.fingerprint() == first  # another load, the same weights
    source = prefixed_model(replicas["backbone"], 3, seed=5, dimension=32, normalize=False)
    save_prompts_only(source, str(tmp_path / "x"))
    served.add_prompt_set("x", str(tmp_path / "x"))
    assert served.fingerprint() != first and served.set_digests()["a"] == digests["a"]
    with_x = served.set_digests()["x"]
    served.remove_prompt_set("x")
    assert served.fingerprint() == first
    with torch_no_grad():
        source[0].prefix_encoder.embedding.weight[0, 0] += 1.0  # one value changed
    save_prompts_only(source, str(tmp_path / "x2"))
    served.add_prompt_set("x", str(tmp_path / "x2"))
    assert served.set_digests()["x"] != with_x


def torch_no_grad():
    import torch

    return torch.no_grad()


def test_a_set_added_at_run_time_has_the_digest_of_the_same_set_in_a_bank_folder(replicas, tmp_path):
    """A rolling update (the set added at run time to every replica, then the bank folder changed and the replicas
    restarted on it one at a time) leaves old and new replicas with the same fingerprint."""
    from st_prompts.serving.model import ServedModel

    source = prefixed_model(replicas["backbone"], 5, seed=11, dimension=32, normalize=False)
    save_prompts_only(source, str(tmp_path / "rolled"))
    assert run_cli(["bank", "add", replicas["bank"], "rolled", str(tmp_path / "rolled"), "--output",
                    str(tmp_path / "bank-v2")]) == 0
    running = ServedModel.load(replicas["bank"], device="cpu")
    running.add_prompt_set("rolled", str(tmp_path / "rolled"))
    restarted = ServedModel.load(str(tmp_path / "bank-v2"), device="cpu")  # another folder name, the same sets
    assert restarted.set_digests() == running.set_digests()
    assert restarted.fingerprint() == running.fingerprint() != ServedModel.load(replicas["bank"]).fingerprint()


def test_a_drained_replica_leaves_the_balancer_and_no_request_fails(replicas, capsys, monkeypatch):
    """Last: it stops replica 0 (the other half of a rolling restart, starting a replica, is the fixture's probe)."""
    urls, balancer = replicas["urls"], replicas["balancer"]
    expected = replicas["reference"].encode(TEXTS, task="a")
    old = replicas["probe"].process
    old.send_signal(signal.SIGTERM)
    assert old.wait(30) == 0  # drained, exit status 0
    for _ in range(6):  # refused by replica 0 (until the balancer's next check): sent to replica 1
        assert np.abs(embed(balancer.url, "a") - expected).max() < 1e-5
    assert wait_for(lambda: balancer.ready == {1}, timeout=10)
    code, _, err = replicas_cli(capsys, monkeypatch, "check", urls=urls)
    assert code == 2 and err.count("\n") == 1 and f"{urls[0]}  unreachable" in err
