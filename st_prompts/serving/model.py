"""The model a server encodes with: its public task names (a bank: each prompt set, and ``backbone``; another model:
one name), the prompt sets behind them, and changes while it serves. A request pins the set its task name meant when
it arrived, so a removed set leaves the model when its last request is done (a re-added name: ``name@2``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from st_prompts.errors import StPromptsError, first_line, printable, shorten
from st_prompts.precision import dtype_name
from st_prompts.prompts.names import BACKBONE_TASK, internal_name, set_name_problem
from st_prompts.serving.limits import RequestError

if TYPE_CHECKING:
    from st_prompts.modules.prompt_sets import PromptSetData

logger = logging.getLogger(__name__)

__all__ = ["BACKBONE_TASK", "DOCUMENT_ROLE", "QUERY_ROLE", "Role", "ServedModel", "choose_batch_rows"]

#: A CPU's rows and padded tokens a pass; the rows an accelerator tries, the padded tokens a row, the share of the best
#: rate the fewest rows must reach (:meth:`ServedModel.measure_batch_rows`).
CPU_BATCH_ROWS, CPU_BATCH_TOKENS = 64, 4096
BATCH_ROW_CANDIDATES = (32, 64, 128, 256, 512)
BATCH_TOKENS_PER_ROW = 256
BATCH_RATE_SHARE = 0.9


class Role:
    """The query or document side of a model (``encode_query`` / ``encode_document``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<the {self.name} side>"


QUERY_ROLE = Role("query")
DOCUMENT_ROLE = Role("document")


class ServedModel:
    """One model and the task names it serves (``name``: a plain model's; ``quantization``: as reported)."""

    def __init__(self, model: Any, name: str | None = None, quantization: str = "none") -> None:
        from sentence_transformers.base.modules.router import Router

        from st_prompts.modules import PromptedTransformer

        self.model = model
        first = model[0]
        self.encoder = first if isinstance(first, PromptedTransformer) else None
        self.is_bank = self.encoder is not None and self.encoder.prefix_encoder is None
        self.name = name or "model"
        self.quantization = quantization or "none"
        self.dtype = dtype_name(model)
        self.device = str(getattr(model, "device", "cpu"))
        #: rows and padded tokens of a pass: a CPU's defaults; an accelerator's are measured at start
        self.batch_rows, self.batch_tokens = CPU_BATCH_ROWS, CPU_BATCH_TOKENS
        self.dimension = int(model.get_embedding_dimension())
        self.max_seq_length = getattr(model, "max_seq_length", None)
        # public name -> what encode() is given for it (None: the model's own prefix); backbone last
        self._routes: dict[str, Any] = {} if self.is_bank else {self.name: None}
        sets = list(self.encoder.prompt_set_names) if self.encoder is not None else []
        self._routes.update(zip(sets, sets))
        self._public: dict[str, str] = dict(zip(sets, sets))  # internal set name -> public name (name@2 -> name)
        if self.encoder is not None:
            self._routes[BACKBONE_TASK] = BACKBONE_TASK
        self._pins: Counter = Counter()
        self._retired: set[str] = set()  # sets no longer public, removed from the model once unpinned
        self._generation: Counter = Counter()
        self._routes_lock = threading.Lock()  # the routing tables (held for microseconds)
        self._model_lock = threading.RLock()  # the model itself: a pass, an addition, a removal
        self._admin_lock = threading.Lock()  # one change at a time
        self._counter = self._token_counter()
        self.pass_overhead_tokens: float | None = None
        prompts = getattr(model, "prompts", None) or {}
        self._prompts = {role.name: prompts[role.name] for role in (QUERY_ROLE, DOCUMENT_ROLE) if prompts.get(role.name)}
        self._prompt_lengths = self._excluded_prompt_lengths()
        self._routed = isinstance(first, Router)  # sentence-transformers' Router: a side is a route
        self._ids_rows = self._ids_agree()
        self._digests: dict[str, str] = {}  # internal set name -> its digest (computed once; dropped on removal)

    @classmethod
    def load(cls, name_or_path: str, *, device: str | None = None, name: str | None = None,
             quantize: str | None = None, dtype: str | None = None) -> ServedModel:
        """Load ``name_or_path`` (no code that ships with it runs) and serve it; ``name``: the folder's by default."""
        from st_prompts.loading import load_sentence_model
        from st_prompts.modules.chat_templates import guard_chat_templates

        # an encoder's chat template is dropped, a decoder's bounded in size (docs/trust.md: chat templates)
        model = guard_chat_templates(load_sentence_model(name_or_path, trust_remote_code=False, device=device,
                                                         quantize=quantize, dtype=dtype))
        model.eval()
        if name is None:
            name = os.path.basename(os.path.normpath(str(name_or_path))) or "model"
        return cls(model, name, quantization=quantize or "none")

    def names(self) -> list[str]:
        """The public task names, in the order they were added (``backbone`` last for a prompted model)."""
        with self._routes_lock:
            return list(self._routes)  # add_prompt_set keeps the backbone last

    def has(self, name: str) -> bool:
        with self._routes_lock:
            return name in self._routes

    def acquire(self, name: str) -> Any:
        """What ``encode`` is to be given for the public task ``name``, pinned until :meth:`release` (404: none)."""
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
        """The public task name of a route (``name@2``: ``name``; ``None``: the model's own), for a metrics label."""
        if route is None:
            return self.name
        with self._routes_lock:
            return self._public.get(route, str(route))

    def internal_sets(self) -> list[str]:
        """Every prompt set in the model, retired ones still draining included."""
        return list(self.encoder.prompt_set_names) if self.encoder is not None else []

    def set_digests(self) -> dict[str, str]:
        """Public task name -> the digest of the prompt set it encodes with (not the backbone)."""
        from st_prompts.serving.fingerprint import set_digest

        if self.encoder is None:
            return {}
        with self._routes_lock:
            routes = [(name, route) for name, route in self._routes.items() if route != BACKBONE_TASK]
        out = {}
        for name, route in routes:
            key = "\0own" if route is None else route  # the own prefix: a key no set name can be
            if key not in self._digests:
                module = self.encoder.prefix_encoder if route is None else self.encoder.sets.named().get(route)
                if module is None:  # removed since the snapshot above: no longer served
                    continue
                self._digests[key] = set_digest(module)
            out[name] = self._digests[key]
        return out

    def fingerprint(self, digests: dict[str, str] | None = None) -> str:
        """One digest of what this server serves (task names, backbone, dtype, quantization, :meth:`set_digests`);
        equal on every replica that serves the same sets with the same weights."""
        from st_prompts.serving.fingerprint import served_fingerprint

        # not the folder's name: a bank rolled out as a new folder serves the same (a plain model's name is a task)
        if "\0backbone" not in self._digests:  # once: a model whose backbone is not frozen would hash it per call
            self._digests["\0backbone"] = self.encoder.fingerprint if self.encoder is not None else ""
        identity = {"dtype": self.dtype, "quantization": self.quantization,
                    "backbone": self._digests["\0backbone"] or None, "tasks": sorted(self.names())}
        return served_fingerprint(identity, self.set_digests() if digests is None else digests)

    def tokenize(self, texts: Sequence[str], route: Any) -> tuple[list[Any], list[int]]:
        """The rows of ``texts`` for :meth:`encode` under ``route`` (token ids, or texts where the model tokenises
        otherwise: a template, a slow tokenizer, a Router) and the tokens the model reads of each."""
        prompt = self._prompts.get(route.name, "") if isinstance(route, Role) else ""  # a query/document side's prompt
        if prompt:
            texts = [prompt + text for text in texts]
        if self._counter is not None:
            ids = [encoding.ids for encoding in self._counter.encode_batch(list(texts))]
            return (ids if self._ids_rows else list(texts)), [len(row) for row in ids]
        tokenizer = self.model.tokenizer
        with self._model_lock:  # a slow tokenizer's settings are shared with the pass
            ids = tokenizer(list(texts), truncation=self.max_seq_length is not None,
                            max_length=self.max_seq_length)["input_ids"]
        return list(texts), [len(row) for row in ids]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens the model reads of each text (special tokens included, truncated at ``max_seq_length``)."""
        return self.tokenize(texts, None)[1]

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

    def _ids_agree(self) -> bool:
        """Whether the rows can be token ids: the private tokenizer gives exactly the first module's ids."""
        from sentence_transformers.base.modules.transformer import Transformer

        first = self.model[0]
        if self._counter is None or not isinstance(first, Transformer) or getattr(first, "parsed_template", None):
            return False
        probes = ["warm up", "  Ångström façade, naïve — 42 %!", " ".join(["long"] * 2 * int(self.max_seq_length or 64))]
        try:
            with self._model_lock:
                made = first.preprocess(probes)
            ids, mask = made["input_ids"].tolist(), made["attention_mask"].tolist()
        except Exception:  # noqa: BLE001 - a module that cannot tokenise alone: texts are kept, nothing is lost
            return False
        theirs = [[int(t) for t, m in zip(row, keep) if m] for row, keep in zip(ids, mask)]
        return theirs == [encoding.ids for encoding in self._counter.encode_batch(probes)]

    def _excluded_prompt_lengths(self) -> dict[Role, int]:
        """For each side with a prompt, its length in tokens if a pooling of the model leaves prompts out."""
        measure = getattr(self.model[0], "_get_prompt_length", None)  # sentence-transformers' own measure
        if measure is None or not any(getattr(module, "include_prompt", True) is False for module in self.model):
            return {}
        lengths = {role: measure(self._prompts[role.name]) for role in (QUERY_ROLE, DOCUMENT_ROLE)
                   if role.name in self._prompts}
        return {role: int(length) for role, length in lengths.items() if length is not None}

    def _task(self, route: Any) -> str | None:
        """What :func:`~st_prompts.modules.rows.encode_rows` is given for a route (``None``: the model's own)."""
        if isinstance(route, Role):
            return route.name if self.encoder is not None or self._routed else None
        return route

    def encode(self, rows: list[Any], routes: list[Any]) -> np.ndarray:
        """One forward pass over rows of any routes (what :meth:`tokenize` made, or texts), as ``model.encode``
        computes them; float32 ``(rows, dim)``."""
        if rows and isinstance(rows[0], str):  # texts: tokenised once per route, as a request's are
            made: list[Any] = list(rows)
            for route in dict.fromkeys(routes):
                positions = [i for i, r in enumerate(routes) if r == route]
                for i, row in zip(positions, self.tokenize([rows[i] for i in positions], route)[0]):
                    made[i] = row
            rows = made
        tasks = [self._task(route) for route in routes]
        groups: dict[int | None, list[int]] = {}
        for i, route in enumerate(routes):  # rows whose ids start with a prompt a pooling may leave out
            groups.setdefault(self._prompt_lengths.get(route), []).append(i)
        with self._model_lock:
            self._remove_retired()
            out = np.empty((len(rows), self.dimension), dtype=np.float32)
            for length, positions in groups.items():
                out[positions] = self._pass([rows[i] for i in positions], [tasks[i] for i in positions], length)
            return out

    def _pass(self, rows: list[Any], tasks: list[str | None], prompt_length: int | None = None) -> np.ndarray:
        from st_prompts.modules.rows import encode_rows

        vectors = encode_rows(self.model, rows, tasks, batch_size=max(1, len(rows)), prompt_length=prompt_length)
        return np.asarray(vectors, dtype=np.float32)

    def add_prompt_set(self, name: Any, source: Any, data: tuple | None = None,
                       with_data: bool = False) -> dict[str, Any] | tuple[dict[str, Any], tuple]:
        """Add the prompt set of the saved model folder or prompts-only checkpoint ``source`` under ``name``.

        The folder is checked by the trust rules and read as data; it must record its backbone fingerprint.
        ``data``: a set another worker read already (what ``with_data`` returns), added without reading the folder.
        Raises :class:`RequestError` 409 (not a prompted model, name taken) or 422 (anything wrong with the source).
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
            raise RequestError(422, f"No folder at {shorten(source)} (on the server).", param="source")
        with self._admin_lock:
            if self.has(name):
                raise RequestError(409, f"The model already serves {name!r}; remove it first.", param="name",
                                   code="name_taken")
            try:
                if data is None:
                    reason = untrusted_reason(folder) or _pickled_weights(folder)
                    if reason is not None:
                        raise RequestError(422, f"Refused {shorten(source)}: {reason}. Nothing of it was run.",
                                           param="source", code="untrusted_source")
                    data = read_prompt_set(folder)
                    bank.check_pooling(self.model, folder)
                else:
                    data = _from_plain(data)
            except StPromptsError as exc:
                raise RequestError(422, f"Cannot add {shorten(source)}: {first_line(exc)}", param="source") from exc
            if data.fingerprint is None:
                raise RequestError(422, f"Refused {shorten(source)}: it records no backbone fingerprint (no "
                                   "model.safetensors, no prompts-only fingerprint), so its backbone cannot be "
                                   "checked.", param="source", code="unknown_fingerprint")
            internal = self._internal_name(name)
            with self._model_lock:
                self._remove_retired()
                try:
                    bank.add_prompt_set(self.model, internal, data, internal=True)
                except StPromptsError as exc:
                    raise RequestError(422, f"Cannot add {shorten(source)}: {first_line(exc)}", param="source",
                                       code="invalid_prompt_set") from exc
            with self._routes_lock:
                self._routes[name] = internal
                self._public[internal] = name
                self._routes[BACKBONE_TASK] = self._routes.pop(BACKBONE_TASK)  # keep the backbone last
        prefix = self.encoder.prompt_sets[internal]
        logger.info("added the prompt set %s from %s", printable(repr(name)), printable(folder))
        info = {"id": name, "prefix_length": int(prefix.prefix_length),
                "parameters": int(sum(p.numel() for p in prefix.parameters()))}
        return (info, _to_plain(data)) if with_data else info

    def remove_prompt_set(self, name: Any) -> None:
        """Stop serving the prompt set ``name`` (404, 409); it leaves the model once no request uses it."""
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
            self._digests.pop(route, None)  # a set added later under this internal name is another set

    def _internal_name(self, name: str) -> str:
        """``name``, or ``name@N`` while a retired set of that name still drains."""
        taken = set(self.internal_sets())
        candidate = name
        while candidate in taken:
            self._generation[name] += 1
            candidate = internal_name(name, self._generation[name] + 1)
        return candidate

    def warm_up(self) -> None:
        """Encode once (and compute the backbone fingerprint), so that the first requests do not pay for it."""
        with self._model_lock:
            route = next(iter(self._routes.values()))
            self.encode(self.tokenize(["warm up"], route)[0], [route])
            if self.encoder is not None:
                _ = self.encoder.fingerprint

    def measure_batch_rows(self, candidates: Sequence[int] = BATCH_ROW_CANDIDATES, repeats: int = 3) -> int:
        """Rows a pass for an accelerator: times passes of each of ``candidates`` rows (the fastest of ``repeats``) and
        keeps the fewest within 10 % of the best rate, until one runs out of memory; :attr:`batch_tokens` becomes 256
        a row. Stored in :attr:`batch_rows` and returned."""
        import torch

        rates: dict[int, float] = {}
        with self._model_lock:
            for rows in candidates:
                try:
                    rates[rows] = rows / self._fastest_pass(rows, repeats)[0]
                except torch.OutOfMemoryError:
                    break
        self.batch_rows = choose_batch_rows(rates) if rates else CPU_BATCH_ROWS
        self.batch_tokens = BATCH_TOKENS_PER_ROW * self.batch_rows
        return self.batch_rows

    def _fastest_pass(self, rows: int, repeats: int) -> tuple[float, int]:
        """The fastest of ``repeats`` passes of ``rows`` copies of a 32-token text, in seconds, and its tokens."""
        route = next(iter(self._routes.values()))
        made, counts = self.tokenize([" ".join(["measure"] * 30)], route)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self._pass(made * rows, [self._task(route)] * rows)
            best = min(best, time.perf_counter() - start)
        return best, max(1, counts[0])

    def measure_pass_overhead(self, rows: int = 16, repeats: int = 3) -> float:
        """What a forward pass costs beyond its padded tokens, in tokens (:attr:`pass_overhead_tokens`): times passes of
        1 and ``rows`` rows, solves ``seconds = (overhead + padded tokens) x seconds per token``, clamps to [0, 1e6]."""
        with self._model_lock:
            one, tokens = self._fastest_pass(1, repeats)
            many, _ = self._fastest_pass(max(2, rows), repeats)
        per_token = (many - one) / ((max(2, rows) - 1) * tokens)
        overhead = 1e6 if per_token <= 0 else min(1e6, max(0.0, one / per_token - tokens))
        self.pass_overhead_tokens = overhead
        return overhead


def choose_batch_rows(rates: dict[int, float], share: float = BATCH_RATE_SHARE) -> int:
    """The fewest rows a pass whose rate (``rates``: rows -> rows/s) is within ``share`` of the best."""
    best = max(rates.values())
    return min(rows for rows, rate in rates.items() if rate >= share * best)


def _to_plain(data: PromptSetData) -> tuple[dict[str, Any], dict[str, np.ndarray], str | None]:
    """A set as plain data (options, numpy arrays, fingerprint), which a parent passes on without importing torch."""
    from dataclasses import asdict

    return asdict(data.spec), {key: value.detach().cpu().numpy() for key, value in data.state.items()}, data.fingerprint


def _from_plain(plain: tuple) -> PromptSetData:
    """The set of :func:`_to_plain`'s data, its options checked again as a spec."""
    import torch

    from st_prompts.modules.prompt_sets import PromptSetData
    from st_prompts.prompts.spec import PromptSetSpec

    options, arrays, fingerprint = plain
    return PromptSetData(PromptSetSpec.from_config(options, "the prompt set"),
                         {key: torch.from_numpy(value) for key, value in arrays.items()}, fingerprint)


#: Pickled weight files: a folder that holds one is refused rather than left for a later loader to unpickle.
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
