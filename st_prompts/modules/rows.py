"""One path from text to vector when every row may have its own task (prompt set): :func:`encode_rows`.

``model.encode(texts, task=[one name per text])`` and the server both call it: rows (texts, or token ids made by the
model's tokenizer) are sorted by length and batched, each batch's features carrying every row's task
(``features["prompt_tasks"]``), then run through the model's modules as sentence-transformers' ``encode`` does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from sentence_transformers.util import batch_to_device
from tqdm.autonotebook import tqdm

from st_prompts.errors import ConfigurationError
from st_prompts.numbers import whole
from st_prompts.prompts.features import PROMPT_TASK, PROMPT_TASKS

__all__ = ["encode_rows", "row_tasks"]

#: ``model.encode`` options :func:`encode_rows` takes (the others need one task per call).
ENCODE_OPTIONS = ("prompt_name", "prompt", "batch_size", "show_progress_bar", "output_value", "precision",
                  "convert_to_numpy", "convert_to_tensor", "device", "normalize_embeddings", "truncate_dim")


def row_tasks(count: int, tasks: Sequence[str | None] | str | None) -> list[str | None]:
    """One task per row: ``tasks`` as a list checked against ``count`` rows (a name or ``None`` for every row)."""
    if tasks is None or isinstance(tasks, str):
        return [tasks] * count
    tasks = list(tasks)
    if len(tasks) != count:
        raise ConfigurationError(f"one task per row: got {len(tasks)} tasks for {count} rows.")
    bad = next((t for t in tasks if t is not None and not isinstance(t, str)), None)
    if bad is not None:
        raise ConfigurationError(f"tasks must be names (str) or None, got {type(bad).__name__}.")
    return tasks


def _is_ids(row: Any) -> bool:
    return isinstance(row, (list, tuple, np.ndarray, torch.Tensor)) and not isinstance(row, str)


def encode_rows(model: Any, rows: Sequence[str] | Sequence[Sequence[int]], tasks: Sequence[str | None] | str | None
                = None, *, batch_size: int = 32, show_progress_bar: bool = False, prompt: str | None = None,
                prompt_name: str | None = None, normalize_embeddings: bool = False, truncate_dim: int | None = None,
                convert_to_tensor: bool = False, convert_to_numpy: bool = True, device: Any = None,
                precision: str = "float32", output_value: str = "sentence_embedding",
                prompt_length: int | None = None, prefetch: bool | None = None) -> np.ndarray | torch.Tensor:
    """Sentence embeddings of ``rows``, each encoded with its own task (prompt set) in shared forward passes.

    Args:
        model: a ``SentenceTransformer`` (with prompt sets for tasks other than ``None``).
        rows: texts, or token ids made by the model's tokenizer (special tokens included, already truncated).
        tasks: one task per row (a set's name, ``"backbone"``, or ``None``: the model's default), or one for all.
        output_value: ``"sentence_embedding"`` only; the other options are ``model.encode``'s.
        prompt_length: token ids that already start with a prompt of this many tokens: a pooling that leaves the
            prompt out (``include_prompt=False``) skips them.
        prefetch: keep an accelerator busy (default: on any device but the CPU): the next batch is prepared on a
            second thread and the vectors stay on the device until the end. The vectors are the same either way.

    Returns ``(rows, dim)`` in the order of ``rows``: numpy, or a tensor with ``convert_to_tensor``.
    """
    if output_value != "sentence_embedding":
        raise ConfigurationError(f"a task per row gives sentence embeddings only, not output_value={output_value!r}; "
                                 "encode one task per call for those.")
    if not whole(batch_size, 1):
        raise ConfigurationError(f"batch_size must be a positive integer, got {batch_size!r}.")
    rows = list(rows)
    tasks = row_tasks(len(rows), tasks)
    ids = bool(rows) and _is_ids(rows[0])
    if any(_is_ids(row) != ids or (not ids and not isinstance(row, str)) for row in rows):
        raise ConfigurationError("rows must all be texts (str) or all token ids (lists of integers).")
    # a model without prompt sets (sentence-transformers' Router) routes a whole batch: one task per batch
    per_batch = not hasattr(model[0], "resolve_task")
    if per_batch and ids and any(task is not None for task in tasks):
        raise ConfigurationError(f"token ids with tasks need a model with prompt sets; {type(model[0]).__name__} "
                                 "routes whole calls: give texts.")
    prompt = _prompt(model, prompt, prompt_name)
    if ids and prompt:
        raise ConfigurationError("a prompt goes with texts; token ids already hold what was tokenised.")
    truncate_dim = truncate_dim if truncate_dim is not None else model.truncate_dim
    if device is not None and torch.device(device) != model.device:
        model.to(device)
    device = model.device
    model.eval()
    order = np.argsort([-(len(row)) for row in rows], kind="stable")
    if per_batch:  # group the rows by task (longest first within each) so that no batch mixes two
        first = {task: i for i, task in reversed(list(enumerate(tasks)))}
        order = np.asarray(sorted(order, key=lambda i: first[tasks[i]]), dtype=np.int64)
    prefetch = device.type != "cpu" if prefetch is None else bool(prefetch)
    pinned = prefetch and device.type == "cuda"

    def prepare(batch: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
        """A batch's features (tokenised, padded; pinned for a non-blocking copy) and the Router's routing."""
        batch_tasks = [tasks[i] for i in batch]
        # (token ids reach a Router only without tasks: refused above otherwise)
        routing: dict[str, Any] = {"task": batch_tasks[0]} if per_batch and batch_tasks[0] is not None else {}
        if ids:
            features = _id_features(model, [rows[i] for i in batch])
        else:
            features = model.preprocess([rows[i] for i in batch], prompt=prompt, **routing)
        if prompt_length is not None:
            features["prompt_length"] = int(prompt_length)
        if not per_batch and len(set(batch_tasks)) > 1:
            features[PROMPT_TASKS] = batch_tasks
        elif not per_batch and batch_tasks[0] is not None:
            features[PROMPT_TASK] = batch_tasks[0]
        if pinned:
            features = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in features.items()}
        return features, routing

    batches = _batches(order, tasks, batch_size, per_batch)
    vectors: list[torch.Tensor] = []
    # a second thread prepares batch i + 1 while batch i runs (torch releases the GIL in its kernels)
    pool = ThreadPoolExecutor(1, thread_name_prefix="st-prompts-prefetch") if prefetch and len(batches) > 1 else None
    try:
        upcoming = pool.submit(prepare, batches[0]) if pool is not None else None
        with torch.inference_mode():
            for position, batch in enumerate(tqdm(batches, desc="Batches", disable=not show_progress_bar)):
                if upcoming is not None:
                    features, routing = upcoming.result()
                    upcoming = pool.submit(prepare, batches[position + 1]) if position + 1 < len(batches) else None
                else:
                    features, routing = prepare(batch)
                features = {k: v.to(device, non_blocking=pinned) if isinstance(v, torch.Tensor) else v
                            for k, v in features.items()} if prefetch else batch_to_device(features, device)
                out = model(features, **routing)["sentence_embedding"]
                if truncate_dim is not None:
                    out = out[:, :truncate_dim]
                if normalize_embeddings:
                    out = torch.nn.functional.normalize(out, p=2, dim=1)
                # on an accelerator the vectors stay there until the end: no wait for a copy after each batch
                keep_here = prefetch or (convert_to_tensor and not convert_to_numpy)
                vectors.append(out if keep_here else out.cpu())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if prefetch and (convert_to_numpy or not convert_to_tensor):
        vectors = [torch.cat(vectors).cpu()] if vectors else vectors
    dimension = model.get_embedding_dimension() if not vectors else vectors[0].shape[1]
    stacked = torch.cat(vectors) if vectors else torch.empty(0, dimension or 0)
    result = torch.empty_like(stacked)
    result[torch.as_tensor(order, device=stacked.device)] = stacked
    if precision and precision != "float32":
        from sentence_transformers.quantization import quantize_embeddings

        result = torch.as_tensor(quantize_embeddings(result.cpu(), precision=precision))
    if convert_to_tensor:
        return result
    return result.float().numpy() if result.is_floating_point() else result.numpy()


def _batches(order: np.ndarray, tasks: list[str | None], batch_size: int, per_batch: bool) -> list[np.ndarray]:
    """``order`` cut into batches of ``batch_size`` rows (``per_batch``: also wherever the task changes)."""
    runs = [order]
    if per_batch:  # the runs of one task (the order keeps each task's rows together)
        runs = [np.asarray(list(run)) for _, run in itertools.groupby(order, key=lambda i: tasks[i])]
    return [run[start:start + batch_size] for run in runs for start in range(0, len(run), batch_size)]


def _prompt(model: Any, prompt: str | None, prompt_name: str | None) -> str | None:
    """The prompt text of a call, as ``model.encode`` chooses it (``prompt``, ``prompt_name``, the default)."""
    if prompt is not None:
        return prompt
    prompts = getattr(model, "prompts", None) or {}
    if prompt_name is not None:
        if prompt_name not in prompts:
            raise ConfigurationError(f"prompt_name {prompt_name!r} is not one of the model's prompts "
                                     f"({', '.join(map(repr, prompts)) or 'none'}).")
        return prompts[prompt_name]
    default = getattr(model, "default_prompt_name", None)
    return prompts.get(default) if default is not None else None


def _id_features(model: Any, rows: list[Sequence[int]]) -> dict[str, Any]:
    """A batch's features from token ids: padded as the model's tokenizer pads (its side and pad token)."""
    encoder = model[0]
    template = getattr(encoder, "parsed_template", None)
    if template is not None:
        raise ConfigurationError("token ids need a model without a template (a template is inserted while "
                                 "tokenising texts); give texts.")
    tokenizer = encoder.tokenizer
    ids = [[int(token) for token in row] for row in rows]
    features = dict(tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt"))
    if "token_type_ids" in getattr(tokenizer, "model_input_names", ()) and "token_type_ids" not in features:
        features["token_type_ids"] = torch.zeros_like(features["input_ids"])
    return features
