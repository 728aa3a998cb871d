"""The model a server encodes with: its public task names, the prompt sets behind them, and changes while it serves.

:class:`ServedModel` wraps one ``SentenceTransformer`` loaded with :func:`st_prompts.loading.load_sentence_model` (the
command line's trust rules: no code that ships with a model runs). A prompt bank serves each prompt set under its name
and the plain backbone as ``backbone``; any other model serves itself under one name.

**Hot changes.** Sets are added (:meth:`ServedModel.add_prompt_set`: a saved model folder or prompts-only checkpoint,
checked by the trust rules, read as data by :func:`st_prompts.bank.add_prompt_set`, fingerprint checked) and removed
(:meth:`ServedModel.remove_prompt_set`) while requests are served. A request *pins* the set its task name meant when
it arrived (:meth:`ServedModel.acquire`), so requests in flight finish on the state they started with: a removed set
leaves the public names at once and the model when its last pinned request is done; a name added again while the old
set still drains gets a new set under an internal name (``name@2``). One lock keeps changes out of a running pass.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from st_prompts.errors import StPromptsError, printable
from st_prompts.prompts.names import BACKBONE_TASK, set_name_problem
from st_prompts.serving.limits import RequestError, shorten

logger = logging.getLogger(__name__)

__all__ = ["BACKBONE_TASK", "DOCUMENT_ROLE", "QUERY_ROLE", "ServedModel"]


class _Role:
    """The query or document side of a model (``encode_query`` / ``encode_document``): what an index built without
    a task encodes with. Two instances exist, :data:`QUERY_ROLE` and :data:`DOCUMENT_ROLE`."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<the {self.name} side>"


QUERY_ROLE = _Role("query")
DOCUMENT_ROLE = _Role("document")


class ServedModel:
    """One model and the task names it serves (see the module docstring).

    Args:
        model: a loaded ``SentenceTransformer``.
        name: the public name of a model that is not a prompt bank (default ``"model"``).
        quantization: how its backbone is stored, as ``st-prompts serve --quantize`` says it (``"none"``,
            ``"int8"``): reported by ``/health``, ``/v1/models`` and the start-up line.
    """

    def __init__(self, model: Any, name: str | None = None, quantization: str = "none") -> None:
        from st_prompts.modules import PromptedTransformer

        self.model = model
        first = model[0]
        self.encoder = first if isinstance(first, PromptedTransformer) else None
        self.is_bank = self.encoder is not None and self.encoder.prefix_encoder is None
        self.name = name or "model"
        self.quantization = quantization or "none"
        self.dimension = int(model.get_embedding_dimension())
        self.max_seq_length = getattr(model, "max_seq_length", None)
        self._routes: dict[str, Any] = {}  # public name -> what encode() is given for it
        #: internal set name -> the public name it was added under (``name@2`` -> ``name``): metrics labels
        self._public: dict[str, str] = {}
        if self.encoder is not None:
            if not self.is_bank:
                self._routes[self.name] = None  # the model's own prefix
            for set_name in self.encoder.prompt_set_names:
                self._routes[set_name] = set_name
                self._public[set_name] = set_name
            self._routes[BACKBONE_TASK] = BACKBONE_TASK
        else:
            self._routes[self.name] = None
        self._pins: Counter = Counter()
        self._retired: set[str] = set()  # sets no longer public, removed from the model once unpinned
        self._generation: Counter = Counter()
        self._routes_lock = threading.Lock()  # the routing tables (held for microseconds)
        self._model_lock = threading.RLock()  # the model itself: a pass, an addition, a removal
        self._admin_lock = threading.Lock()  # one change at a time
        self._counter = self._token_counter()
        #: what a forward pass costs beyond its padded tokens, in tokens (:meth:`measure_pass_overhead`), once measured
        self.pass_overhead_tokens: float | None = None
        prompts = getattr(model, "prompts", None) or {}
        #: the model has a real query/document prompt: those rows take ``encode_query``/``encode_document`` apart
        self._role_prompts = {role: bool(prompts.get(role.name)) for role in (QUERY_ROLE, DOCUMENT_ROLE)}

    @classmethod
    def load(cls, name_or_path: str, *, device: str | None = None, name: str | None = None,
             quantize: str | None = None) -> ServedModel:
        """Load ``name_or_path`` with :func:`st_prompts.loading.load_sentence_model` (no code that ships with it
        runs) and serve it; ``name`` defaults to the folder's name (``minilm`` for the packaged model);
        ``quantize="int8"``: its backbone in int8 (:mod:`st_prompts.quantization`)."""
        from st_prompts.loading import load_sentence_model
        from st_prompts.modules.chat_templates import guard_chat_templates

        # an encoder's chat template is dropped, a decoder's bounded in size (docs/trust.md: chat templates)
        model = guard_chat_templates(load_sentence_model(name_or_path, trust_remote_code=False, device=device,
                                                         quantize=quantize))
        model.eval()
        if name is None:
            name = os.path.basename(os.path.normpath(str(name_or_path))) or "model"
        return cls(model, name, quantization=quantize or "none")

    # ------------------------------------------------------------------ names
    def names(self) -> list[str]:
        """The public task names, in the order they were added (``backbone`` last for a prompted model)."""
        with self._routes_lock:
            names = [n for n in self._routes if n != BACKBONE_TASK]
            return names + ([BACKBONE_TASK] if BACKBONE_TASK in self._routes else [])

    def has(self, name: str) -> bool:
        with self._routes_lock:
            return name in self._routes

    def acquire(self, name: str) -> Any:
        """What ``encode`` is to be given for the public task ``name``, pinned until :meth:`release`.

        Raises:
            RequestError: 404, no such task.
        """
        with self._routes_lock:
            if name not in self._routes:
                raise self.unknown(name)
            route = self._routes[name]
            self._pins[route] += 1
            return route

    def unknown(self, name: str) -> RequestError:
        """The 404 of a task name this model does not serve."""
        return RequestError(404, f"The model {shorten(name)} does not exist here; GET /v1/models lists the "
                            f"{len(self._routes)} served ({_some(self._routes)}).", param="model",
                            code="model_not_found")

    def pin(self, route: Any) -> None:
        """Pin a route already held (e.g. an index's) for one more request."""
        with self._routes_lock:
            self._pins[route] += 1

    def release(self, route: Any) -> None:
        """Unpin a route; a retired set whose last pin this was leaves the model at the next pass."""
        with self._routes_lock:
            self._pins[route] -= 1
            if self._pins[route] <= 0:
                del self._pins[route]

    def public_name(self, route: Any) -> str:
        """The public task name of a route (an internal set name such as ``name@2``: the name it was added under;
        ``None``: the model's own name), for a metrics label."""
        if route is None:
            return self.name
        with self._routes_lock:
            return self._public.get(route, str(route))

    def internal_sets(self) -> list[str]:
        """Every prompt set in the model, retired ones still draining included."""
        return list(self.encoder.prompt_set_names) if self.encoder is not None else []

    # ------------------------------------------------------------------ encoding (the batcher's worker thread)
    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens the model reads of each text (special tokens included, truncated at ``max_seq_length``)."""
        if self._counter is not None:
            return [len(encoding.ids) for encoding in self._counter.encode_batch(list(texts))]
        tokenizer = self.model.tokenizer
        with self._model_lock:  # a slow tokenizer's settings are shared with the pass
            ids = tokenizer(list(texts), truncation=self.max_seq_length is not None,
                            max_length=self.max_seq_length)["input_ids"]
        return [len(row) for row in ids]

    def _token_counter(self):
        """A private copy of the fast tokenizer, set up once (calls on the shared one change its settings)."""
        backend = getattr(getattr(self.model, "tokenizer", None), "backend_tokenizer", None)
        if backend is None:
            return None
        from tokenizers import Tokenizer

        counter = Tokenizer.from_str(backend.to_str())
        counter.no_padding()
        if self.max_seq_length:
            counter.enable_truncation(int(self.max_seq_length))
        else:
            counter.no_truncation()
        return counter

    def encode(self, texts: list[str], tasks: list[Any]) -> np.ndarray:
        """One forward pass over rows of any tasks (a prompted model routes each row to its set), as
        ``model.encode(texts, task=...)`` computes it; float32 ``(rows, dim)``."""
        with self._model_lock:
            self._remove_retired()
            tasks = [self._plain(task) for task in tasks]
            mixable = self.encoder is not None
            if len(set(tasks)) == 1 or not mixable or any(isinstance(t, _Role) for t in tasks):
                return self._grouped(texts, tasks)
            return self._encode(texts, list(tasks))

    def _plain(self, task: Any) -> Any:
        """A role row is an ordinary task row unless the model gives that role a prompt of its own."""
        if isinstance(task, _Role) and not self._role_prompts[task] and self.encoder is not None:
            return task.name  # the bank's query/document set, as encode_query/encode_document choose it
        return task

    def _grouped(self, texts: list[str], tasks: list[Any]) -> np.ndarray:
        """One call per distinct task (a model that cannot mix tasks in a pass, or role rows with prompts)."""
        out: np.ndarray | None = None
        for task in dict.fromkeys(tasks):
            positions = [i for i, t in enumerate(tasks) if t == task]
            vectors = self._encode([texts[i] for i in positions], task)
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[positions] = vectors
        return out

    def _encode(self, texts: list[str], task: Any) -> np.ndarray:
        options = {"batch_size": max(1, len(texts)), "convert_to_numpy": True, "show_progress_bar": False}
        if isinstance(task, _Role):
            method = self.model.encode_query if task == QUERY_ROLE else self.model.encode_document
            vectors = method(texts, **options)
        else:
            vectors = self.model.encode(texts, task=task, **options)
        return np.asarray(vectors, dtype=np.float32)

    # ------------------------------------------------------------------ changes (a worker thread, not the loop)
    def add_prompt_set(self, name: Any, source: Any, data: tuple | None = None,
                       with_data: bool = False) -> dict[str, Any] | tuple[dict[str, Any], tuple]:
        """Add the prompt set of the saved model folder or prompts-only checkpoint ``source`` under ``name``.

        The folder is first checked by the command line's trust rules (:func:`st_prompts.loading.untrusted_reason`:
        a folder naming code is refused), its set is read once as data (JSON and safetensors only) and must record
        the backbone fingerprint it was trained on, which must be this backbone's; then the bank takes that data (its
        architecture and pooling checks). ``data``: a set another worker read already (what ``with_data`` returns
        beside the answer: options, tensors as numpy arrays, fingerprint), added as it is, the folder not read again,
        so that every worker of a server holds the same set whatever happens to the folder meanwhile.

        Raises:
            RequestError: 409 (not a prompted model, name taken), 422 (bad name, no such folder, refused folder,
                unknown fingerprint, another backbone, ...).
        """
        from st_prompts import bank
        from st_prompts.loading import untrusted_reason
        from st_prompts.modules.prompt_sets import read_prompt_set

        if self.encoder is None:
            raise RequestError(409, f"{self.name!r} is not a prompted model: prompt sets cannot be added to it.",
                               code="not_a_bank")
        problem = set_name_problem(name)  # the project's one grammar (st_prompts.prompts.names)
        if problem is not None:
            raise RequestError(422, problem[0].upper() + problem[1:] + ".", param="name", code="invalid_name")
        if not isinstance(source, str) or not source:
            raise RequestError(422, "'source' must be the path of a saved model folder or prompts-only checkpoint.",
                               param="source")
        if len(source) > 4096 or "\0" in source:
            raise RequestError(422, f"'source' is not a usable path: {shorten(source)}.", param="source")
        folder = os.path.abspath(os.path.expanduser(source))
        if data is None and not os.path.isdir(folder):
            raise RequestError(422, f"No folder at {source!r} (on the server).", param="source")
        with self._admin_lock:
            if self.has(name):
                raise RequestError(409, f"The model already serves {name!r}; remove it first.", param="name",
                                   code="name_taken")
            if data is None:
                reason = untrusted_reason(folder) or _pickled_weights(folder)
                if reason is not None:
                    raise RequestError(422, f"Refused {source!r}: {reason}. Nothing of it was run.", param="source",
                                       code="untrusted_source")
                try:
                    options, state, fingerprint = read_prompt_set(folder)
                    bank.check_pooling(self.model, folder)
                except StPromptsError as exc:
                    raise RequestError(422, f"Cannot add {source!r}: {_line(exc)}", param="source") from exc
            else:
                import torch

                options, arrays, fingerprint = data
                state = {key: torch.from_numpy(value) for key, value in arrays.items()}
            problem = self._set_problem(options, state)  # before anything is allocated for it
            if problem is not None:
                raise RequestError(422, f"Refused {source!r}: {problem}.", param="source", code="invalid_prompt_set")
            if fingerprint is None:
                raise RequestError(422, f"Refused {source!r}: it records no backbone fingerprint (no "
                                   "model.safetensors, no prompts-only fingerprint), so its backbone cannot be "
                                   "checked.", param="source", code="unknown_fingerprint")
            internal = self._internal_name(name)
            with self._model_lock:
                self._remove_retired()
                try:
                    bank.add_prompt_set(self.model, internal, _SetData(options, state, fingerprint))
                except StPromptsError as exc:
                    raise RequestError(422, f"Cannot add {source!r}: {_line(exc)}", param="source") from exc
            with self._routes_lock:
                self._routes[name] = internal
                self._public[internal] = name
                self._routes[BACKBONE_TASK] = self._routes.pop(BACKBONE_TASK)  # keep the backbone last
        prefix = self.encoder.prompt_sets[internal]
        logger.info("added the prompt set %s from %s", printable(repr(name)), printable(folder))
        info = {"id": name, "prefix_length": int(prefix.prefix_length),
                "parameters": int(sum(p.numel() for p in prefix.parameters()))}
        if with_data:
            return info, (options, {key: value.detach().cpu().numpy() for key, value in state.items()}, fingerprint)
        return info

    def remove_prompt_set(self, name: Any) -> None:
        """Stop serving the prompt set ``name``; it leaves the model once no request in flight uses it.

        Raises:
            RequestError: 404 (no such set), 409 (not a set: the backbone or the model itself).
        """
        with self._admin_lock:
            with self._routes_lock:
                if not isinstance(name, str) or name not in self._routes:
                    raise RequestError(404, f"The model serves no prompt set {shorten(name)}.", code="model_not_found")
                route = self._routes[name]
                if self.encoder is None or not isinstance(route, str) or route == BACKBONE_TASK:
                    raise RequestError(409, f"{name!r} is not a prompt set: it cannot be removed.")
                del self._routes[name]
                self._retired.add(route)
            with self._model_lock:
                self._remove_retired()
        logger.info("removed the prompt set %s", printable(repr(name)))

    def _set_problem(self, options: dict[str, Any], state: dict[str, Any]) -> str | None:
        """Why a prompt set read from a folder (its ``options`` and tensors) cannot join this bank, checked without
        allocating anything for it: option types and ranges, the prefix against the position table, the tensors'
        shapes against those of a set built on torch's ``meta`` device (no memory), NaN or infinite values."""
        import math

        import torch

        length = options.get("prefix_length")
        limit = self.encoder.max_positions
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length < limit:
            return f"prefix_length must be a whole number from 1 to {limit - 1} (the backbone's position table), " \
                   f"got {shorten(length, 40)}"
        hidden = options.get("prefix_hidden_size")
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or not 1 <= hidden <= 65536):
            return f"prefix_hidden_size must be a whole number from 1 to 65536, got {shorten(hidden, 40)}"
        dropout = options.get("prefix_dropout")
        if dropout is not None and (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
                                    or not math.isfinite(dropout) or not 0 <= dropout < 1):
            return f"prefix_dropout must be a number from 0 to below 1, got {shorten(dropout, 40)}"
        for key in ("prefix_projection", "prefix_gate"):
            if options.get(key) not in (None, True, False):
                return f"{key} must be true or false, got {shorten(options.get(key), 40)}"
        try:
            with torch.device("meta"):
                expected = self.encoder.build_prefix_encoder(length, bool(options.get("prefix_projection")), hidden,
                                                             dropout, gate=bool(options.get("prefix_gate")))
        except (StPromptsError, ValueError, TypeError, RuntimeError) as exc:
            return f"its options do not fit this backbone ({_line(exc)})"
        shapes = {k: tuple(v.shape) for k, v in expected.state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if shapes != found:
            return f"its tensors ({shorten(found, 120)}) do not match its options on this backbone " \
                   f"({shorten(shapes, 120)})"
        for key, tensor in state.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"its tensor {key!r} holds NaN or infinite values"
        return None

    def _remove_retired(self) -> None:
        """Take retired sets that no request pins out of the model (holding the model lock)."""
        if not self._retired:
            return
        from st_prompts import bank

        with self._routes_lock:
            free = [route for route in self._retired if not self._pins.get(route)]
            self._retired.difference_update(free)
        for route in free:
            bank.remove_prompt_set(self.model, route)
            with self._routes_lock:
                self._public.pop(route, None)

    def _internal_name(self, name: str) -> str:
        """``name``, or ``name@N`` while a retired set of that name still drains."""
        taken = set(self.internal_sets())
        candidate = name
        while candidate in taken:
            self._generation[name] += 1
            candidate = f"{name}@{self._generation[name] + 1}"
        return candidate

    def warm_up(self) -> None:
        """Encode once per kind of pass (and compute the backbone fingerprint an addition checks against), so that
        the first requests do not pay for it."""
        with self._model_lock:
            self._encode(["warm up"], next(iter(self._routes.values())))
            if self.encoder is not None:
                _ = self.encoder.fingerprint

    def measure_pass_overhead(self, rows: int = 16, repeats: int = 3) -> float:
        """What one forward pass costs beyond its padded tokens, in tokens (the batcher's ``pass_overhead_tokens``),
        stored in :attr:`pass_overhead_tokens` and returned.

        Times passes of one row and of ``rows`` rows of the same 32-token text (the fastest of ``repeats`` each) and
        solves ``seconds = (overhead + padded tokens) x seconds per token``. Measured on a 2-core CPU for a MiniLM
        bank on 2 threads: 90-102 tokens (a pass reads every weight once, whatever its rows); on a GPU a pass of
        many rows costs little more than one, so the overhead is large and passes fill up. Clamped to [0, 1e6].
        """
        route = next(iter(self._routes.values()))
        with self._model_lock:
            text = " ".join(["measure"] * 30)
            tokens = max(1, self.count_tokens([text])[0])

            def fastest(count: int) -> float:
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    self._encode([text] * count, route)
                    best = min(best, time.perf_counter() - start)
                return best

            one, many = fastest(1), fastest(max(2, rows))
        per_token = (many - one) / ((max(2, rows) - 1) * tokens)
        overhead = 1e6 if per_token <= 0 else min(1e6, max(0.0, one / per_token - tokens))
        self.pass_overhead_tokens = overhead
        return overhead


class _SetData:
    """A prompt set read from a folder, in the shape a bank takes a prompted module in (``prefix_encoder``, its
    options, ``prompt_state_dict``, ``fingerprint``), so that the bank's own checks and loading add it: the folder
    is read once, and what was checked is what is added."""

    template = None
    cls_prompt = False
    prefix_encoder = True

    def __init__(self, options: dict[str, Any], state: dict[str, Any], fingerprint: str) -> None:
        from st_prompts.modules.prompt_sets import SET_OPTIONS

        for key in SET_OPTIONS:
            setattr(self, key, options.get(key))
        self._state = state
        self.fingerprint = fingerprint

    def prompt_state_dict(self) -> dict[str, Any]:
        return {f"prefix_encoder.{key}": value for key, value in self._state.items()}


#: Weight files that are Python pickles: a prompt set is read from safetensors only, and a folder that holds one of
#: these is refused rather than left for a later loader to unpickle.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _pickled_weights(folder: str) -> str | None:
    """Why ``folder`` (or a module folder in it) looks like it holds pickled weights, or ``None``."""
    for root, dirs, files in os.walk(folder):
        if os.path.abspath(root) != os.path.abspath(folder):
            dirs[:] = []  # the folder and its module folders only
        for file in sorted(files):
            if file.lower().endswith(PICKLE_SUFFIXES):
                return f"it holds {os.path.relpath(os.path.join(root, file), folder)}, a pickled file (only " \
                       "safetensors are read, nothing is unpickled)"
    return None


def _some(names: dict[str, Any] | list[str], shown: int = 8) -> str:
    names = list(names)
    listed = ", ".join(repr(n) for n in names[:shown])
    return listed + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
