"""Serve many tasks from one process: an OpenAI-compatible embedding server with cross-task batching, and search.

``st-prompts serve MODEL_OR_BANK`` (``pip install -e ".[serve]"``; docs/serving.md). The parts:

* :mod:`~st_prompts.serving.batcher`: dynamic batching across requests and tasks (no HTTP, no model: testable and
  benchmarkable alone);
* :mod:`~st_prompts.serving.limits`: what a request and the server may ask for, and the one-line errors;
* :mod:`~st_prompts.serving.model`: the served model, its task names and hot changes of prompt sets;
* :mod:`~st_prompts.serving.indexes`: the FAISS indexes searched;
* :mod:`~st_prompts.serving.metrics`: Prometheus metrics;
* :mod:`~st_prompts.serving.protocol`: uvicorn's HTTP protocol with header, body and idle timeouts, a connection cap
  and OpenAI errors for malformed HTTP;
* :mod:`~st_prompts.serving.app`: the Starlette application; :mod:`~st_prompts.serving.server`: uvicorn, signals,
  draining.

Nothing is imported here, so that ``import st_prompts.serving.limits`` (or the batcher) needs no web framework.
"""
