"""``st-prompts serve``: real server processes, real HTTP clients (``openai`` among them), every answer checked against
``model.encode(text, task=...)``. Servers: **A** MiniLM as a bank of three sets with an index and the admin endpoint;
**B** a tiny bank (the load test, no admin token); **C** the tiny bank with a small queue and a 3 s batching wait
(overload, disconnects, removal in flight, SIGTERM last). The other test_serving*.py files share the helpers here."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from conftest import WORDS, CLIProcess, http_error, make_tiny_backbone, random_bank
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

from st_prompts import PromptedTransformer, bank, save_prompts_only
from st_prompts.loading import load_sentence_model
from st_prompts.search import SemanticIndex

try:  # the HTTP client the openai package brings
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases
    import httpx

FIXTURES = Path(__file__).parent / "fixtures"
TOKEN = "test-admin-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
#: Server C's batching wait: rows queue this long before a pass takes them.
C_WAIT_MS = 3000
TEXTS = ["A man is playing a guitar.", "Der Hund schläft.", "a", "The quick brown fox jumps over the lazy dog " * 5]


# ---------------------------------------------------------------------------------------------------- the servers
class Server:
    """``st-prompts serve ... --port 0`` in its own process, forked (:class:`~conftest.CLIProcess`) or, ``fresh``, a
    new interpreter (a test process that has used gRPC, Milvus' client, cannot fork a user of it); the URL is read
    from its log line. ``stderr_apart``: the log is stderr alone (stdout read and dropped), for tests that assert what
    the log holds; each line's ``time.monotonic()`` is kept in :attr:`stamps`."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 stderr_apart: bool = False, fresh: bool = False) -> None:
        self.name = name
        full_env = {k: v for k, v in os.environ.items() if k not in ("ST_PROMPTS_ADMIN_TOKEN", "ST_PROMPTS_TRACEBACK")}
        full_env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        argv, out = ["serve", *args, "--port", "0"], subprocess.PIPE if stderr_apart else subprocess.STDOUT
        self.process = (subprocess.Popen([sys.executable, "-m", "st_prompts.cli", *argv], stdout=subprocess.PIPE,
                                         stderr=out, text=True, env=full_env) if fresh
                        else CLIProcess(argv, full_env, stdout=subprocess.PIPE, stderr=out))
        self.lines: list[str] = []
        self.stamps: list[float] = []
        self.url: str | None = None
        self._ready = threading.Event()
        log = self.process.stderr if stderr_apart else self.process.stdout
        threading.Thread(target=self._read, args=(log,), daemon=True).start()
        if stderr_apart:
            threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def _read(self, log) -> None:
        for line in log:
            self.lines.append(line.rstrip("\n"))
            self.stamps.append(time.monotonic())
            if "listening on http://" in line and self.url is None:
                self.url = line.split("listening on ", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 240) -> str:
        self._ready.wait(timeout)
        assert self.url is not None, f"server {self.name} did not start:\n" + "\n".join(self.lines[-30:])
        return self.url

    def log(self) -> str:
        return "\n".join(self.lines)

    def when(self, text: str) -> float:
        """When the first log line holding ``text`` was read (``math.inf``: none was)."""
        return next((stamp for line, stamp in zip(self.lines, self.stamps) if text in line), math.inf)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def tiny_bank(path: Path, backbone: str) -> str:
    """A bank of three random sets (prefixes of 4, 9, 16) on ``backbone``, reading up to 400 tokens."""
    model = random_bank(backbone, a=4, b=9, c=16)
    model.max_seq_length = 400
    model.save(str(path))
    return str(path)


def tiny_backbone_and_bank(root: Path) -> tuple[str, str]:
    """A tiny random backbone of 512 positions and :func:`tiny_bank` on it, under ``root``."""
    backbone = make_tiny_backbone(root / "tiny-backbone", "bert", max_positions=512)
    return backbone, tiny_bank(root / "tiny-bank", backbone)


def prefixed_model(backbone: str, length: int, seed: int, dimension: int = 32,
                   normalize: bool = False) -> SentenceTransformer:
    torch.manual_seed(seed)
    encoder = PromptedTransformer(backbone, prefix_length=length)
    with torch.no_grad():
        encoder.prefix_encoder.embedding.weight.normal_(0, 0.3)
    modules = [encoder, Pooling(dimension, pooling_mode="mean")] + ([Normalize()] if normalize else [])
    return SentenceTransformer(modules=modules, device="cpu")


def saved_prompts(backbone: str, length: int, seed: int, folder: Path) -> SentenceTransformer:
    """:func:`prefixed_model` (tiny) saved prompts-only to ``folder``; returns the model."""
    model = prefixed_model(backbone, length, seed)
    save_prompts_only(model, str(folder))
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("serving")
    # A: MiniLM as a bank of three sets, an index encoded with "sts"
    model = bank.create_bank("minilm")
    torch.manual_seed(0)
    for name in ("sts", "nli", "para"):
        prefix = model[0].new_prompt_set(name, prefix_length=16)
        with torch.no_grad():
            prefix.embedding.weight.normal_(0, 0.3)
    model.save(str(root / "bank"))
    docs = (FIXTURES / "search" / "real_corpus.txt").read_text(encoding="utf-8").splitlines()[:200]
    with one_thread():
        SemanticIndex.build(model, docs, task="sts").save(str(root / "docs.index"))
    tiny_backbone, tiny = tiny_backbone_and_bank(root)  # B and C
    servers = {
        "A": Server("A", [str(root / "bank"), "--index", f"docs={root / 'docs.index'}"],
                    env={"ST_PROMPTS_ADMIN_TOKEN": TOKEN}),
        "B": Server("B", [tiny, "--threads", "1", "--max-queue-rows", "20000"]),
        "C": Server("C", [tiny, "--threads", "1", "--max-queue-rows", "64", "--max-wait-ms", str(C_WAIT_MS)],
                    env={"ST_PROMPTS_ADMIN_TOKEN": TOKEN}),
    }
    try:
        # the references: each bank loaded again from its folder, while the servers start
        references = {"reference": load_sentence_model(str(root / "bank"), device="cpu"),
                      "tiny_reference": load_sentence_model(tiny, device="cpu")}
        for server in servers.values():
            server.wait_ready()
        yield {"root": root, "servers": servers, "tiny": tiny, "tiny_backbone": tiny_backbone, "minilm": minilm_path,
               **references}
    finally:
        for server in servers.values():
            server.stop()


@contextmanager
def one_thread():
    """Reference encodes on one torch thread: two threads beside three servers on a busy two-core machine crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def url(setup, name: str) -> str:
    return setup["servers"][name].url


def post(base: str, path: str, body, *, headers=None, timeout=60, raw: bytes | None = None):
    headers = {"Content-Type": "application/json", **(headers or {})}
    with httpx.Client(timeout=timeout) as client:
        content = raw if raw is not None else json.dumps(body).encode()
        return client.post(base + path, content=content, headers=headers)


def get(base: str, path: str, **kwargs):
    with httpx.Client(timeout=60) as client:
        return client.get(base + path, **kwargs)


def embeddings(response) -> np.ndarray:
    """The vectors of a 200 answer of ``/v1/embeddings`` (floats)."""
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]])


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics: ``name{label=value,...}`` -> value."""
    out = {}
    for family in text_string_to_metric_families(get(base, "/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_for(condition, timeout: float = 10.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return False


# ---------------------------------------------------------------------------------------------- OpenAI compatibility
def decoded(embedding) -> np.ndarray:
    """What the client hands back: floats, or (asked for base64 explicitly) the base64 string of float32s."""
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_the_openai_client_gets_what_model_encode_gives(setup, encoding_format):
    client = openai.OpenAI(base_url=url(setup, "A") + "/v1", api_key="unused", max_retries=0)
    options = {} if encoding_format is None else {"encoding_format": encoding_format}  # None: the client's base64
    reference = setup["reference"]
    for task in ("sts", "nli", "backbone"):
        response = client.embeddings.create(model=task, input=TEXTS, **options)
        assert response.model == task and [d.index for d in response.data] == list(range(len(TEXTS)))
        got = np.array([decoded(d.embedding) for d in response.data])
        assert got.shape == (len(TEXTS), 384)
        for text, row in zip(TEXTS, got):
            assert np.abs(row - reference.encode(text, task=task)).max() < 1e-5, (task, text)
        tokens = sum(len(reference.tokenizer(t, truncation=True, max_length=256)["input_ids"]) for t in TEXTS)
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    single = client.embeddings.create(model="para", input="A man is playing a guitar.", **options)
    assert np.abs(decoded(single.data[0].embedding) - reference.encode(TEXTS[0], task="para")).max() < 1e-5
    # the sets really differ: routing matters
    assert np.abs(reference.encode(TEXTS[0], task="sts") - reference.encode(TEXTS[0], task="nli")).max() > 1e-2


def test_models_are_the_tasks_and_the_backbone(setup):
    client = openai.OpenAI(base_url=url(setup, "A") + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["sts", "nli", "para", "backbone"]
    assert client.models.retrieve("nli").id == "nli"
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.models.retrieve("nope")
    assert get(url(setup, "A"), "/health").json()["status"] == "ok"


# ------------------------------------------------------------------------------------------------------ bad input
def test_bad_input_gets_one_line_4xx_and_the_server_keeps_serving(setup):
    base = url(setup, "A")
    cases = [  # (the request checks themselves: test_serving_batcher.py)
        ({"model": "sts", "input": ["ok", {"a": 1}]}, 422, "must be a string"),
        ({"model": "sts", "input": ["x"] * 10_000}, 422, "10,000 inputs"),
        ({"model": "sts", "input": "x" * 1_000_000}, (413, 422), "limit"),
        ({"model": "unknown-task", "input": "x"}, 404, "does not exist"),
        ({"model": "sts", "input": "x", "dimensions": 128}, 422, "384-dimensional"),
        (["not", "an", "object"], 400, "JSON object"),
    ]
    for body, status, fragment in cases:
        message = http_error(post(base, "/v1/embeddings", body), status)
        assert fragment in message, (body if len(json.dumps(body)) < 200 else fragment, message)
    assert "not valid JSON" in http_error(post(base, "/v1/embeddings", None, raw=b'{"model": "sts", '), 400)
    wrong_type = post(base, "/v1/embeddings", None, raw=b'{"model":"sts","input":"x"}',
                      headers={"Content-Type": "text/plain"})
    assert "application/json" in http_error(wrong_type, 415)
    too_big = post(base, "/v1/embeddings", None, raw=b"[" + b"1," * 3_000_000 + b"1]")
    assert "limit" in http_error(too_big, 413)
    assert "No route" in http_error(get(base, "/v2/nothing"), 404)
    assert http_error(get(base, "/v1/embeddings"), 405)
    ok = post(base, "/v1/embeddings", {"model": "sts", "input": "still serving", "dimensions": 384})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


# ---------------------------------------------------------------------------------------------------------- search
def test_search_encodes_queries_with_the_index_task_and_finds_what_the_library_finds(setup):
    base = url(setup, "A")
    queries = (FIXTURES / "search" / "real_queries.txt").read_text(encoding="utf-8").splitlines()[:5]
    index = SemanticIndex.load(str(setup["root"] / "docs.index"), model=setup["reference"])
    expected = index.search(queries, k=5)
    response = post(base, "/search", {"query": queries, "index": "docs", "k": 5})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    for hits, want in zip(data, expected):
        assert [h["id"] for h in hits["hits"]] == [w.id for w in want]
        assert np.allclose([h["score"] for h in hits["hits"]], [w.score for w in want], atol=1e-5)
        assert [h["text"] for h in hits["hits"]] == [w.text for w in want]
    one = post(base, "/search", {"query": queries[0], "index": "docs", "k": 100}).json()["data"]
    assert len(one) == 1 and len(one[0]["hits"]) == 100
    assert "from 1 to 100" in http_error(post(base, "/search", {"query": "q", "index": "docs", "k": 101}), 422)
    http_error(post(base, "/search", {"query": "q", "index": "nope"}), 404)


# ----------------------------------------------------------------------------------------------------------- admin
def admin(base: str, method: str, path: str, body=None, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=120) as client:
        if method == "DELETE":
            return client.delete(base + path, headers=headers)
        return client.post(base + path, json=body, headers=headers)


def add_set(base: str, name: str, source, token: str | None = TOKEN):
    """``POST /admin/prompt-sets``: the set ``name`` from the folder ``source``."""
    return admin(base, "POST", "/admin/prompt-sets", {"name": name, "source": str(source)}, token)


class Evil:
    """Unpickling it writes the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def hostile_folders(root: Path, full: Path, prompts: Path, marker: Path) -> dict[str, Path]:
    """Copies of a saved set that would run code if anything loaded them as a model."""
    def linked_copy(label: str, name: str, change: dict) -> Path:
        shutil.copytree(full, root / label, copy_function=os.link)
        data = json.loads((root / label / name).read_text())
        (root / label / name).unlink()  # a hard link: write a new file, leave the original alone
        (root / label / name).write_text(json.dumps({**data, **change}))
        return root / label

    auto_map = {"auto_map": {"AutoModel": "evil.EvilModel", "AutoTokenizer": ["evil.EvilTokenizer", None]}}
    out = {"config-auto-map": linked_copy("config-auto-map", "config.json", auto_map),
           "tokenizer-auto-map": linked_copy("tokenizer-auto-map", "tokenizer_config.json", auto_map),
           "pickled-weights": linked_copy("pickled-weights", "sentence_bert_config.json",
                                          {"model_kwargs": {"weights_only": False}}),
           "prompts-with-pickle": Path(shutil.copytree(prompts, root / "prompts-with-pickle"))}
    for label in ("config-auto-map", "tokenizer-auto-map"):
        (out[label] / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('pwned')\n")
    (out["pickled-weights"] / "model.safetensors").unlink()
    for label in ("pickled-weights", "prompts-with-pickle"):
        (out[label] / "pytorch_model.bin").write_bytes(pickle.dumps(Evil(str(marker))))
    return out


def test_admin_adds_and_removes_sets_from_folders_and_refuses_hostile_ones(setup, tmp_path):
    base = url(setup, "A")
    source = prefixed_model(setup["minilm"], 8, seed=5, dimension=384, normalize=True)
    source.save(str(tmp_path / "full"))
    save_prompts_only(source, str(tmp_path / "prompts"))
    expected = source.encode(TEXTS)

    for token in (None, "wrong"):
        http_error(add_set(base, "x", "y", token), 401)
    for name, folder in (("from-full", tmp_path / "full"), ("from-prompts", tmp_path / "prompts")):
        added = add_set(base, name, folder)
        assert added.status_code == 201, added.text
        assert added.json()["id"] == name and added.json()["prefix_length"] == 8
        got = embeddings(post(base, "/v1/embeddings", {"model": name, "input": TEXTS}))
        assert np.abs(got - expected).max() < 1e-5
    names = [m["id"] for m in get(base, "/v1/models").json()["data"]]
    assert names == ["sts", "nli", "para", "from-full", "from-prompts", "backbone"]
    assert "already serves" in http_error(add_set(base, "sts", tmp_path / "full"), 409)

    marker = tmp_path / "marker"
    for label, folder in hostile_folders(tmp_path, tmp_path / "full", tmp_path / "prompts", marker).items():
        message = http_error(add_set(base, label, folder), 422)
        assert "Refused" in message and not marker.exists(), (label, message)
    prefixed_model(setup["tiny_backbone"], 4, seed=1).save(str(tmp_path / "other-backbone"))
    assert http_error(add_set(base, "other", tmp_path / "other-backbone"), 422)
    assert "No folder" in http_error(add_set(base, "hub", "someone/some-model"), 422)

    assert admin(base, "DELETE", "/admin/prompt-sets/from-full").status_code == 200
    http_error(post(base, "/v1/embeddings", {"model": "from-full", "input": "x"}), 404)
    http_error(admin(base, "DELETE", "/admin/prompt-sets/from-full"), 404)
    http_error(admin(base, "DELETE", "/admin/prompt-sets/backbone"), 409)
    assert not marker.exists()
    still = embeddings(post(base, "/v1/embeddings", {"model": "from-prompts", "input": TEXTS}))
    assert np.abs(still - expected).max() < 1e-5


def test_an_index_reloads_after_index_add(setup):
    base = url(setup, "A")
    folder = str(setup["root"] / "docs.index")
    new = "A violin made of glass floats above the zebra stable."
    before = post(base, "/search", {"query": new, "index": "docs", "k": 1}).json()["data"][0]["hits"][0]
    assert before["text"] != new
    with SemanticIndex.update(folder, model=setup["reference"]) as index:
        (added,) = index.add([new])
    # not reloaded yet: the server answers from the index it loaded
    assert post(base, "/search", {"query": new, "index": "docs", "k": 1}).json()["data"][0]["hits"][0] == before
    reloaded = admin(base, "POST", "/admin/indexes/docs/reload")
    assert reloaded.status_code == 200, reloaded.text
    assert reloaded.json()["documents"] == 201
    hit = post(base, "/search", {"query": new, "index": "docs", "k": 1}).json()["data"][0]["hits"][0]
    assert hit["id"] == added and hit["text"] == new and hit["score"] > 0.99
    http_error(admin(base, "POST", "/admin/indexes/nope/reload"), 404)


def test_without_a_token_the_admin_endpoint_does_not_exist(setup):
    base = url(setup, "B")
    assert get(base, "/health").json()["admin"] is False
    for method, path in (("POST", "/admin/prompt-sets"), ("DELETE", "/admin/prompt-sets/a"),
                         ("POST", "/admin/indexes/docs/reload")):
        http_error(admin(base, method, path, {"name": "x", "source": "y"}), 404)


# ---------------------------------------------------------------------------------------------------- under load
def random_text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS[:-6]) for _ in range(tokens))  # words only: one token each


def test_300_concurrent_requests_of_mixed_tasks_each_get_their_own_task(setup):
    base = url(setup, "B")
    rng = random.Random(7)
    tasks = ["a", "b", "c", "backbone"]
    requests = []
    for _ in range(300):
        count = rng.randint(1, 20)  # about 3,000 rows in all
        # + [CLS] and [SEP]: 3-300 tokens, log-uniform (as many short texts as long ones per doubling)
        texts = [random_text(rng, round(298 ** rng.random())) for _ in range(count)]
        requests.append((rng.choice(tasks), texts))
    words = [len(t.split()) for _, texts in requests for t in texts]
    assert min(words) == 1 and max(words) >= 280
    before = metrics(base)

    async def main():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            calls = [client.post(base + "/v1/embeddings", json={"model": task, "input": texts,
                                                                 "encoding_format": "base64"})
                     for task, texts in requests]
            return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    reference = setup["tiny_reference"]
    expected = {}
    with one_thread():
        for task in tasks:
            texts = sorted({t for k, ts in requests if k == task for t in ts})
            expected.update({(task, t): v for t, v in zip(texts, reference.encode(texts, task=task, batch_size=64))})
    for (task, texts), response in zip(requests, responses):
        assert response.status_code == 200, response.text
        data = response.json()["data"]
        got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
        want = np.stack([expected[(task, t)] for t in texts])
        assert np.abs(got - want).max() < 1e-5, task
    after = metrics(base)

    def grew(key: str) -> float:
        return after[key] - before.get(key, 0)

    assert grew("st_prompts_batches_total") > 0 and grew("st_prompts_mixed_batches_total") > 0
    assert grew("st_prompts_batch_tasks_sum") > grew("st_prompts_batch_tasks_count")  # > 1 task a pass
    assert sum(grew(f"st_prompts_rows_total{{task={t}}}") for t in tasks) == sum(len(texts) for _, texts in requests)
    assert after["st_prompts_queue_rows"] == 0
    assert after["process_resident_memory_bytes"] > 0


# -------------------------------------------------------------------------- overload, disconnects, changes in flight
def test_a_full_queue_answers_503_with_retry_after_and_nothing_hangs(setup):
    base = url(setup, "C")  # 64 queued rows at most, rows wait up to 3 s for a pass

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            calls = [client.post(base + "/v1/embeddings", json={"model": "a", "input": [f"the dog {i}"] * 8})
                     for i in range(40)]
            return await asyncio.wait_for(asyncio.gather(*calls), 60)

    start = time.monotonic()
    responses = asyncio.run(main())
    assert time.monotonic() - start < 30
    codes = [r.status_code for r in responses]
    assert codes.count(200) >= 8 and codes.count(503) >= 1, codes
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["Retry-After"]) >= 1
            assert "busy" in http_error(response, 503)
        else:
            assert len(response.json()["data"]) == 8
    assert post(base, "/v1/embeddings", {"model": "a", "input": "after the storm"}).status_code == 200


def queue_reaches(base: str, rows: int, timeout: float = C_WAIT_MS / 1000 - 0.5) -> bool:
    """Whether server ``base`` queues ``rows`` rows within ``timeout`` seconds (by default, before C's pass)."""
    return wait_for(lambda: metrics(base)["st_prompts_queue_rows"] == rows, timeout)


def _send_raw(base: str, body: dict) -> socket.socket:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_a_client_that_disconnects_frees_its_rows(setup):
    base = url(setup, "C")
    before = metrics(base)
    sent = time.monotonic()
    sock = _send_raw(base, {"model": "c", "input": ["gone"] * 5})
    assert queue_reaches(base, 5)
    sock.close()
    assert queue_reaches(base, 0, C_WAIT_MS / 1000)
    time.sleep(max(0.0, sent + C_WAIT_MS / 1000 + 0.5 - time.monotonic()))  # past the pass that would have run
    after = metrics(base)
    assert after["st_prompts_cancelled_requests_total"] == before.get("st_prompts_cancelled_requests_total", 0) + 1
    assert after.get("st_prompts_rows_total{task=c}", 0) == before.get("st_prompts_rows_total{task=c}", 0)
    assert post(base, "/v1/embeddings", {"model": "c", "input": "still here"}).status_code == 200


def test_requests_in_flight_finish_on_the_set_they_started_with(setup, tmp_path):
    """A request for b is queued; b is removed and another b added; a second request joins the same pass."""
    base = url(setup, "C")
    replacement = prefixed_model(setup["tiny_backbone"], 6, seed=9)
    replacement.save(str(tmp_path / "new-b"))
    texts = ["the man plays guitar", "a red car"]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.ensure_future(client.post(base + "/v1/embeddings", json={"model": "b", "input": texts}))
            await asyncio.to_thread(queue_reaches, base, 2)
            removed = await asyncio.to_thread(admin, base, "DELETE", "/admin/prompt-sets/b")
            gone = await client.post(base + "/v1/embeddings", json={"model": "b", "input": texts})
            added = await asyncio.to_thread(add_set, base, "b", tmp_path / "new-b")
            second = await client.post(base + "/v1/embeddings", json={"model": "b", "input": texts})
            return removed, gone, added, await first, second

    removed, gone, added, first, second = asyncio.run(main())
    assert removed.status_code == 200 and gone.status_code == 404 and added.status_code == 201, added.text
    assert np.abs(embeddings(first) - setup["tiny_reference"].encode(texts, task="b")).max() < 1e-5
    assert np.abs(embeddings(second) - replacement.encode(texts)).max() < 1e-5


def test_sigterm_during_load_answers_every_accepted_request_and_exits(setup):
    server = setup["servers"]["C"]
    base = server.url
    texts = [[f"the cat {i} sits on the mat {j}" for j in range(8)] for i in range(7)]  # 56 rows: less than a pass

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=20)) as client:
            calls = [asyncio.ensure_future(client.post(base + "/v1/embeddings", json={"model": "a", "input": t}))
                     for t in texts]
            queued = await asyncio.to_thread(queue_reaches, base, 56)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:  # a new request after SIGTERM is not accepted (or told to come back)
                late = await client.get(base + "/health", timeout=5)
                late_status = late.status_code
            except httpx.TransportError:
                late_status = None
            return queued, late_status, await asyncio.gather(*calls)

    queued, late_status, responses = asyncio.run(main())
    assert queued
    assert late_status in (None, 503)
    reference = setup["tiny_reference"]
    for batch, response in zip(texts, responses):
        assert np.abs(embeddings(response) - reference.encode(batch, task="a")).max() < 1e-5
    assert server.process.wait(30) == 0
    assert "stopped after SIGTERM" in server.log()


def test_the_pass_overhead_is_measured_at_start_from_pass_timings(setup, tmp_path, monkeypatch):
    """``time = (overhead + tokens) x per-token``: passes of 30 ms + 0.5 ms a padded token cost 60 tokens; the server
    logs what it measured. The passes advance the test's own clock (real sleeps oversleep on a loaded machine)."""
    from types import SimpleNamespace

    from st_prompts.serving import model as model_module
    from st_prompts.serving.model import ServedModel

    served = ServedModel(prefixed_model(setup["tiny_backbone"], 4, seed=0), "tiny")
    tokens = served.count_tokens([" ".join(["measure"] * 30)])[0]
    clock = [0.0]
    monkeypatch.setattr(model_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def timed(texts, route, prompt_length=None):
        clock[0] += 0.030 + 0.0005 * len(texts) * tokens
        return np.zeros((len(texts), 32), dtype=np.float32)

    served._pass = timed
    assert served.measure_pass_overhead(rows=8, repeats=2) == pytest.approx(60, rel=1e-6)
    assert served.pass_overhead_tokens == pytest.approx(60, rel=1e-6)

    def flat(texts, route, prompt_length=None):
        clock[0] += 0.01
        return np.zeros((len(texts), 32), dtype=np.float32)

    served._pass = flat
    assert served.measure_pass_overhead(rows=8, repeats=2) > 300  # a pass of 8 rows costs what one does: fill up
    logged = [line for line in setup["servers"]["A"].log().splitlines() if "a forward pass costs as much as" in line]
    assert len(logged) == 1 and float(logged[0].split("as much as ")[1].split()[0]) >= 0


def test_an_accelerators_pass_size_is_the_fewest_rows_within_a_tenth_of_the_best_rate(setup):
    """``measure_batch_rows`` (at start on a GPU): passes of 10 ms + 1 ms a row flatten out at 128 rows; of 20 ms +
    0.1 ms a row keep rising to 512; a candidate that runs out of device memory ends the search."""
    from st_prompts.serving.model import ServedModel

    served = ServedModel(prefixed_model(setup["tiny_backbone"], 4, seed=0), "tiny")
    assert (served.batch_rows, served.batch_tokens) == (64, 4096)  # a CPU's, unmeasured

    def timed(fixed, per_row, out_of_memory_at=None):
        def run(texts, route, prompt_length=None):
            if out_of_memory_at is not None and len(texts) >= out_of_memory_at:
                raise torch.OutOfMemoryError("CUDA out of memory")
            time.sleep(fixed + per_row * len(texts))
            return np.zeros((len(texts), 32), dtype=np.float32)
        return run

    served._pass = timed(0.010, 0.001)
    assert served.measure_batch_rows(repeats=1) == 128 and served.batch_tokens == 128 * 256
    served._pass = timed(0.020, 0.0001)
    assert served.measure_batch_rows(repeats=1) == 512
    served._pass = timed(0.020, 0.0001, out_of_memory_at=256)
    assert served.measure_batch_rows(repeats=1) == 128
    del served._pass  # the real passes run too, on the CPU
    assert served.measure_batch_rows(candidates=(2, 4), repeats=1) in (2, 4)


def test_the_command_module_imports_no_heavy_library():
    """The serve command imports its server only in its runner (a bare package stands in for ``st_prompts``)."""
    package_dir = str(Path(__file__).resolve().parents[1] / "st_prompts")
    code = ("import sys, types, argparse; package = types.ModuleType('st_prompts'); "
            f"package.__path__ = [{package_dir!r}]; sys.modules['st_prompts'] = package; "
            "import st_prompts.commands.serve as s; "
            "p = argparse.ArgumentParser(); s.add_parser(p.add_subparsers()); "
            "print([m for m in ('torch', 'sentence_transformers', 'starlette', 'uvicorn', 'numpy', 'orjson', "
            "'prometheus_client') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
