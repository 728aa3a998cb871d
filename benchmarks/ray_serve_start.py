"""How long Ray Serve takes to start two replicas of the st-prompts app on this machine (issue 63, part 4: the
measurement behind docs/serving.md's "Why not Ray Serve"; run by hand).

    pip install "ray[serve]==$(python -c 'import ray; print(ray.__version__)')"   # not in any extra of st-prompts
    python benchmarks/ray_serve_start.py                                           # about a minute

A tiny random bank (tests/conftest.py's, 32 dimensions) is served by Ray Serve exactly as ``st-prompts serve`` serves
it: ``@serve.ingress`` of a function that builds the Starlette app of :mod:`st_prompts.serving.app` (its lifespan
starts the batcher), ``num_replicas=2``, half a CPU each. Timed: importing Ray Serve, ``ray.init`` (a local
cluster), ``serve.run`` until both replicas are ready; then 10 requests through Ray's proxy are checked against the
bank's ``encode``. Results: ``benchmarks/results/ray_serve_start.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from common import run_environment  # noqa: E402


def main() -> None:
    import numpy as np
    from conftest import make_tiny_backbone
    from test_serving import tiny_bank

    from st_prompts.loading import load_sentence_model

    work = Path(tempfile.mkdtemp(prefix="ray-serve-start-"))
    bank = tiny_bank(work / "bank", make_tiny_backbone(work / "backbone", "bert", max_positions=512))
    texts = ["A man is playing a guitar.", "Der Hund schläft."]
    expected = load_sentence_model(bank, device="cpu").encode(texts, task="a")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    load_before = list(os.getloadavg())
    timings = {}
    start = time.perf_counter()
    import ray
    from ray import serve

    timings["import ray, ray.serve"] = time.perf_counter() - start
    start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    timings["ray.init (local cluster)"] = time.perf_counter() - start

    def build():
        from st_prompts.serving.app import ServerContext, create_app
        from st_prompts.serving.indexes import IndexRegistry
        from st_prompts.serving.limits import ServingLimits
        from st_prompts.serving.model import ServedModel

        served = ServedModel.load(bank, device="cpu")
        return create_app(ServerContext(served, IndexRegistry(served), ServingLimits()))

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0.5})
    @serve.ingress(build)
    class Embedder:
        pass

    start = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Embedder.bind(), route_prefix="/")
    timings["serve.run until 2 replicas are ready"] = time.perf_counter() - start
    worst = 0.0
    for _ in range(10):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", method="POST",
                                         data=json.dumps({"model": "a", "input": texts}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            got = np.array([d["embedding"] for d in json.loads(response.read())["data"]])
        worst = max(worst, float(np.abs(got - expected).max()))
    assert worst < 1e-5, worst
    serve.shutdown()
    ray.shutdown()
    total = sum(timings.values())
    out = {"command": "python benchmarks/ray_serve_start.py", "environment": run_environment(),
           "ray": ray.__version__, "load_average_before": load_before, "seconds": timings, "total_seconds": total,
           "requests_checked": 10, "max_abs_diff": worst}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ray_serve_start.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    env = out["environment"]
    lines = [f"# Ray Serve: two replicas of the st-prompts app ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", "`python benchmarks/ray_serve_start.py`", "",
             f"{env['device']}, {env['cpus']} CPUs, Ray {ray.__version__}; load average before "
             f"{load_before[0]:.2f} / {load_before[1]:.2f} (1 / 5 min), after {env['load_average'][0]:.2f}: the "
             "machine was shared with other jobs.", "", "| step | seconds |", "|---|---|"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in timings.items()]
    lines += [f"| total | {total:.1f} |", "", f"10 requests through Ray's proxy, every vector within "
              f"{worst:.1e} of the bank's `encode`."]
    (RESULTS / "ray_serve_start.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
