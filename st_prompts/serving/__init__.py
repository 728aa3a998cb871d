"""Serve many tasks from one process: an OpenAI-compatible embedding server with cross-task batching, and search
(``st-prompts serve``, ``pip install -e ".[serve]"``; docs/serving.md). Nothing is imported here, so that
``import st_prompts.serving.limits`` (or the batcher) needs no web framework."""
