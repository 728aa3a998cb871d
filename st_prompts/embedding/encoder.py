"""Which model embeds a corpus and how one part's texts become its vectors: the same code in this process and in
every Ray actor, so that both engines give the same vectors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from st_prompts.errors import ConfigurationError

#: What a row without a task is encoded as, with a task column (the prompt-set name ``encode_document`` uses).
DOCUMENT_TASK = "document"


@dataclass(frozen=True)
class ModelSpec:
    """A model to load where it is used (every Ray actor loads its own copy from this), through the safe loader."""

    name: str
    trust_remote_code: bool | None = None
    dtype: str = "float32"
    quantize: str = "none"
    device: str | None = None

    def load(self, device: str | None = None) -> Any:
        """The model, loaded by :func:`st_prompts.loading.load_sentence_model` (code in the folder refused unless
        ``trust_remote_code``), its chat templates guarded and its length checked."""
        from st_prompts.loading import load_sentence_model
        from st_prompts.modules.chat_templates import guard_chat_templates
        from st_prompts.search.encoding import check_encode_length

        model = guard_chat_templates(load_sentence_model(
            self.name, self.trust_remote_code, device=device or self.device, quantize=self.quantize, dtype=self.dtype))
        check_encode_length(model, self.name)
        return model


def check_tasks(model: Any, names: Sequence[str | None]) -> None:
    """Refuse, in one line, a prompt set the model does not have (before anything is encoded with it)."""
    wanted = sorted({name for name in names if name is not None})
    if not wanted:
        return
    resolve = getattr(model[0], "resolve_task", None)
    if resolve is None:
        raise ConfigurationError(f"the model has no prompt sets, so it cannot encode with the task "
                                 f"{wanted[0]!r}: give a bank (st-prompts bank) or leave out --task/--task-column")
    for name in wanted:
        resolve(name)  # ConfigurationError("Unknown task ...") naming the sets it has


def encode_part(model: Any, texts: Sequence[str], tasks: Sequence[str | None] | None, task: str | None,
                batch_size: int, progress: bool = False) -> np.ndarray:
    """``(len(texts), dim)`` float32 vectors of one part, not normalised: ``encode_document``, ``encode(task=task)``,
    or with ``tasks`` each row's prompt set (:func:`st_prompts.modules.rows.encode_rows`; none: ``task``, else the
    document side)."""
    from st_prompts.search.encoding import chat_template_errors

    if not texts:
        from st_prompts.search.identity import embedding_dimension

        return np.zeros((0, int(embedding_dimension(model) or 0)), dtype=np.float32)
    options = {"batch_size": batch_size, "show_progress_bar": progress, "convert_to_numpy": True}
    with chat_template_errors():
        if tasks is not None:
            from st_prompts.modules.rows import encode_rows

            default = task if task is not None else DOCUMENT_TASK
            vectors = encode_rows(model, list(texts), [t if t is not None else default for t in tasks], **options)
        elif task is not None:
            vectors = model.encode(list(texts), task=task, **options)
        else:
            vectors = model.encode_document(list(texts), **options)
    return np.ascontiguousarray(vectors, dtype=np.float32)
