"""The prompt sets a :class:`~st_prompts.PromptedTransformer` holds (:class:`PromptSets`), and which prefix each row of
a pass uses: a model's own prefix (the set :data:`OWN`) and a bank's named sets are the same thing here. Rows of
several sets share a pass: the sets are stacked (padded with masked positions) and each layer gathers its row's."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, first_line
from st_prompts.modules import set_checks
from st_prompts.modules.checkpoint import PROMPTS_FILE, tensors_fingerprint
from st_prompts.numbers import real, whole
from st_prompts.prompts.injection import PrefixInjection
from st_prompts.prompts.names import BACKBONE_TASK, check_set_name, is_internal_name
from st_prompts.prompts.prefix import PrefixDraw, PrefixEncoder, key_padding, pad_prefix
from st_prompts.prompts.spec import SAVED_FIELDS, PromptSetSpec
from st_prompts.storage import contained_path

#: sentence-transformers' task names of ``encode_query`` / ``encode_document``.
QUERY, DOCUMENT = "query", "document"
#: The internal name of a model's own prefix (outside the set-name grammar: no user's set can take it).
OWN = "@own"
#: The fields of a prompt set's record (:meth:`PromptSets.record`) and their kinds.
RECORD_FIELDS = {"rows": "count", "steps": "count", "best_step": "count", "loss": "text", "evaluator": "text",
                 "metric": "text", "best_score": "score", "start_score": "score", "backbone_score": "score"}


def clean_record(record: Any) -> dict[str, Any]:
    """The known fields of a prompt set's record with values of their kind (counts non-negative integers, scores finite
    numbers, texts one line of at most 200 characters); anything else is dropped, as it would end up in a model card."""
    clean: dict[str, Any] = {}
    if not isinstance(record, dict):
        return clean
    for key, kind in RECORD_FIELDS.items():
        value = record.get(key)
        if kind == "count" and whole(value, 0):  # never a bool (``True == 1``), as below
            clean[key] = value
        elif kind == "score" and real(value):
            clean[key] = float(value)
        elif kind == "text" and isinstance(value, str):
            text = " ".join(value.split())[:200]
            if text:
                clean[key] = text
    return clean


@dataclass(frozen=True)
class PromptSetData:
    """A prompt set read as data: its spec, its prefix's state dict, its backbone's fingerprint (``None``: unknown)."""

    spec: PromptSetSpec
    state: dict[str, torch.Tensor]
    fingerprint: str | None


@dataclass
class PromptSelection:
    """The prefix of one pass: one set for every row (``encoder``), none (plain backbone), or a mix.

    Attributes:
        encoder: the set every row uses (``None``: no prefix, or a mix).
        draw: with a mix, the stacked sets' keys/values ``(2L, sets, heads, longest, head_dim)``.
        rows: with a mix, the index of each row's set in ``draw`` (``(batch,)``).
        lengths: with a mix, each row's prefix length (``(batch,)``; 0 for the plain backbone).
        offsets: with a mix, the positions each row's prefix takes from its text (its length, 0 when gated).
    """

    encoder: PrefixEncoder | None = None
    draw: PrefixDraw | None = None
    rows: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    offsets: torch.Tensor | None = None

    @property
    def mixed(self) -> bool:
        return self.draw is not None


class RowTaskEncode:
    """``model.encode`` of a model with prompt sets: one task per input goes to
    :func:`~st_prompts.modules.rows.encode_rows`; one per call (or none) is sentence-transformers' own ``encode``."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, *args, task=None, **kwargs):
        if task is None or isinstance(task, str):
            return type(self.model).encode(self.model, *args, task=task, **kwargs)
        from st_prompts.modules.rows import ENCODE_OPTIONS, encode_rows

        args = list(args)
        inputs = args.pop(0) if args else kwargs.pop("inputs", kwargs.pop("sentences", None))
        names = ("prompt_name", "prompt", "batch_size", "show_progress_bar")  # encode's positional order
        kwargs.update(zip(names, args))
        unknown = sorted(set(kwargs) - set(ENCODE_OPTIONS))
        if unknown:
            raise ConfigurationError(f"encode with a task per row does not take {', '.join(unknown)}; encode one "
                                     "task per call for those.")
        singular = isinstance(inputs, str)
        texts = [inputs] if singular else list(inputs)
        result = encode_rows(self.model, texts, list(task), **kwargs)
        return result[0] if singular else result


class PromptSets(torch.nn.Module):
    """The prompt sets of one backbone: their prefixes (a ``ModuleDict``), specs and records, the roles (default, query
    and document sets) and the choice of each row's prefix (:meth:`select`). The owner builds each prefix for its
    backbone. ``is_bank``: the owner saves its named sets' dict even when empty, and loads as a bank."""

    def __init__(self, is_bank: bool = False) -> None:
        super().__init__()
        self.prefixes = torch.nn.ModuleDict()
        self.specs: dict[str, PromptSetSpec] = {}
        #: what each named set was trained on and how it scored (name -> record; see :meth:`record`)
        self.info: dict[str, dict[str, Any]] = {}
        self.is_bank = is_bank
        self.default: str | None = None
        self.query: str | None = None
        self.document: str | None = None
        self._stack_cache: tuple[Any, PrefixDraw, dict[int, int]] | None = None

    @property
    def own(self) -> PrefixEncoder | None:
        """The owner's own prefix (``None`` without one)."""
        return self.prefixes[OWN] if OWN in self.prefixes else None

    @property
    def names(self) -> list[str]:
        """The named sets, in the order they were added (the own prefix is not one)."""
        return [name for name in self.prefixes if name != OWN]

    def named(self) -> dict[str, PrefixEncoder]:
        """Name -> prefix of every named set."""
        return {name: encoder for name, encoder in self.prefixes.items() if name != OWN}

    def add(self, name: str, encoder: PrefixEncoder, spec: PromptSetSpec) -> PrefixEncoder:
        """Hold ``encoder`` (built for ``spec``) as the set ``name`` (checked by the caller: :meth:`check_new_name`)."""
        self.prefixes[name] = encoder
        self.specs[name] = spec
        self._stack_cache = None
        return encoder

    def _check_named(self, name: str) -> str:
        if name not in self.prefixes or name == OWN:
            raise ConfigurationError(f"No prompt set {name!r} ({self.known()}).")
        return name

    def remove(self, name: str) -> None:
        """Drop the set ``name`` (and any role it had)."""
        self._check_named(name)
        del self.prefixes[name], self.specs[name]
        self.info.pop(name, None)
        for role in ("default", "query", "document"):
            if getattr(self, role) == name:
                setattr(self, role, None)
        self._stack_cache = None

    def record(self, name: str, **record: Any) -> None:
        """Record what the set ``name`` was trained on and how it scored (see :data:`RECORD_FIELDS`)."""
        self.info[self._check_named(name)] = clean_record(record)

    def set_roles(self, default: str | None, query: str | None, document: str | None) -> None:
        """Set the default, query and document sets, each a named set (or ``"backbone"`` / ``None``)."""
        for role, value in (("default_task", default), ("query_task", query), ("document_task", document)):
            if value is not None and value != BACKBONE_TASK and value not in self.names:
                raise ConfigurationError(f"{role}={value!r} names no prompt set ({self.known()}).")
        self.default, self.query, self.document = default, query, document

    def check_new_name(self, name: str, internal: bool = False) -> None:
        """Refuse a name outside the one grammar (``internal``: or a server's ``name@N``), or taken."""
        if not (internal and is_internal_name(name)):
            check_set_name(name)
        if name in self.prefixes:
            raise ConfigurationError(f"The bank already has a prompt set {name!r}; remove it first.")

    def known(self) -> str:
        """The named sets, for a message."""
        names = self.names
        return f"prompt sets: {', '.join(names)}" if names else "this model has no prompt sets"

    def saved_options(self) -> dict[str, dict[str, Any]]:
        """What a saved config records of each named set (:meth:`PromptSetSpec.saved`)."""
        return {name: self.specs[name].saved() for name in self.names}

    def saved_info(self) -> dict[str, dict[str, Any]]:
        """The non-empty records of the named sets."""
        return {name: record for name, record in self.info.items() if name in self.prefixes and record}

    @staticmethod
    def file_prefix(name: str) -> str:
        """The key prefix of a set's tensors in ``soft_prompts.safetensors``."""
        return "prefix_encoder." if name == OWN else f"prompt_sets.{name}."

    def stored_state(self, keep_projection: bool = False) -> dict[str, torch.Tensor]:
        """Every set's tensors under their file keys (a reparameterised prefix as the prefix it computes)."""
        state = {}
        for name, encoder in self.prefixes.items():
            tensors = encoder.state_dict() if keep_projection else encoder.stored_state_dict()
            state.update({self.file_prefix(name) + key: value for key, value in tensors.items()})
        return state

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load tensors read from a saved folder (file keys) into the sets."""
        for name, encoder in self.prefixes.items():
            prefix = self.file_prefix(name)
            encoder.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self._stack_cache = None

    def projected(self) -> list[str]:
        """The sets whose prefix is reparameterised by an MLP (saved as the prefix it computes)."""
        return [name for name, encoder in self.prefixes.items() if encoder.projection]

    def resolve(self, task: str | None) -> PrefixEncoder | None:
        """The prefix a task name selects: a named set, the own prefix (no task and no default), or none
        (``"backbone"``, or nothing to choose). ``"query"``/``"document"`` select a set of that name, else the
        query/document set, else the default."""
        if task in (QUERY, DOCUMENT) and task not in self.prefixes:
            task = self.query if task == QUERY else self.document
        if task is None:
            task = self.default
            if task is None:
                return self.own
        if task == BACKBONE_TASK:
            return None
        if task == OWN or task not in self.prefixes:
            raise ConfigurationError(f"Unknown task {task!r} ({self.known()}; {BACKBONE_TASK!r} is the plain "
                                     "backbone).")
        return self.prefixes[task]

    def select(self, tasks: list[str | None] | None, task: str | None, device: torch.device) -> PromptSelection:
        """The prefix of a pass: per row (``tasks``) or for the call (``task``)."""
        if tasks is None:
            return PromptSelection(encoder=self.resolve(task))
        encoders = [self.resolve(name) for name in tasks]
        distinct = {id(e): e for e in encoders}
        if len(distinct) == 1:
            return PromptSelection(encoder=encoders[0])
        if self.training:
            raise ConfigurationError("Rows of several tasks in one batch are for inference: train one prompt set at a "
                                     "time (the others stay frozen).")
        members = [e for e in distinct.values() if e is not None]
        draw, index = self._stacked(members, device)
        rows = torch.tensor([index[id(e)] if e is not None else 0 for e in encoders], device=device)
        lengths = torch.tensor([e.prefix_length if e is not None else 0 for e in encoders], device=device)
        offsets = torch.tensor([e.position_length if e is not None else 0 for e in encoders], device=device)
        return PromptSelection(draw=draw, rows=rows, lengths=lengths, offsets=offsets)

    def _stacked(self, members: list[PrefixEncoder], device) -> tuple[PrefixDraw, dict[int, int]]:
        """The keys/values of ``members`` stacked along the batch dimension, padded to the longest (cached)."""
        params = [p for m in members for p in m.parameters()]
        # parameters change in place (optimizer steps, load_state_dict): their version counters say so
        key = (tuple(id(m) for m in members), tuple(p._version for p in params), device)
        if self._stack_cache is not None and self._stack_cache[0] == key:
            return self._stack_cache[1], self._stack_cache[2]
        longest = max(m.prefix_length for m in members)
        gate = gated = None
        with torch.no_grad():
            values = [torch.nn.functional.pad(m.values(1).prefix, (0, 0, 0, longest - m.prefix_length))
                      for m in members]
            stacked = torch.cat(values, dim=1).to(device)  # (2L, sets, heads, longest, hd)
            if any(m.gated for m in members):  # (L, sets, heads); an ungated set's rows never read theirs
                gate = torch.cat([m.gate_values() if m.gated else values[0].new_zeros(stacked.shape[0] // 2, 1,
                                                                                       stacked.shape[2])
                                  for m in members], dim=1).to(device)
                gated = torch.tensor([m.gated for m in members], device=device)
        draw = PrefixDraw(stacked, len(members), gate=gate, gated=gated)
        index = {id(m): i for i, m in enumerate(members)}
        self._stack_cache = (key, draw, index)
        return draw, index

    def cache_bytes(self) -> int:
        """Bytes of the stacked sets' keys/values kept for mixed batches at inference (0 before the first one)."""
        if self._stack_cache is None:
            return 0
        prefix = self._stack_cache[1].prefix
        return prefix.numel() * prefix.element_size()

    @staticmethod
    def mixed_injection(selection: PromptSelection, tokens: int) -> PrefixInjection:
        """The prefix of a batch whose rows use several sets: each row gathers its set from the stacked sets;
        positions past a row's own prefix are masked out (and the keys padded as :func:`key_padding` says)."""
        draw, longest = selection.draw, selection.draw.shape[3]
        prefix_mask = torch.arange(longest, device=selection.lengths.device).unsqueeze(0) < selection.lengths.unsqueeze(1)
        padding = key_padding(longest, tokens)
        if padding:
            draw = pad_prefix(draw, padding)
            prefix_mask = torch.nn.functional.pad(prefix_mask, (0, padding))
        return PrefixInjection(draw, prefix_mask, rows=selection.rows)


def read_prompt_set(path: str) -> PromptSetData:
    """The deep prefix saved in a model folder or prompts-only checkpoint at ``path``, read from its JSON and
    safetensors files only (no code runs). A full folder's fingerprint is that of its saved backbone weights.

    Raises:
        DataNotFoundError, DataFormatError, ConfigurationError: no such folder, damaged files, or no deep prefix.
    """
    folder = _prompted_module_folder(path)
    try:
        with open(os.path.join(folder, "sentence_bert_config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise DataFormatError(f"Cannot read the prompted encoder's configuration in {path!r}: {exc}") from exc
    sets = set_checks.config_prompt_sets(config, path)
    if not config.get("prefix_length") and len(sets) == 1:  # a bank of one set: that set
        (name, spec), = sets.items()
    elif not config.get("prefix_length"):
        raise ConfigurationError(
            f"{path!r} has no deep prefix to add as a prompt set" + (
                f": it is a bank of {len(sets)} sets ({', '.join(list(sets)[:5])}{', ...' if len(sets) > 5 else ''}); "
                f"export the one you want first (st-prompts bank export {path} SET OUT, or "
                "st_prompts.bank.export_prompt_set) and add OUT." if sets else "."))
    elif config.get("template") is not None or config.get("cls_prompt"):
        raise ConfigurationError(f"Only a deep prefix can join a prompt bank; {path!r} also has a template or a [CLS] "
                                 "prompt.")
    else:
        name, spec = OWN, None
    prefix = PromptSets.file_prefix(name)
    state = {k[len(prefix):]: v for k, v in _load_prompts_file(folder, path).items() if k.startswith(prefix)}
    if spec is None:  # checked before any allocation
        spec = PromptSetSpec.from_config({k: config.get(k) for k in SAVED_FIELDS}, repr(path))
    return PromptSetData(spec, state, _fingerprint(config, folder))


def _load_prompts_file(folder: str, path: str) -> dict[str, torch.Tensor]:
    try:
        state = load_file(os.path.join(folder, PROMPTS_FILE))
    except Exception as exc:  # safetensors' SafetensorError, OSError
        raise DataFormatError(f"{PROMPTS_FILE} in {path!r} is damaged or missing ({first_line(exc)}).") from exc
    return set_checks.check_finite_prompts(state, repr(path))  # NaN prompts never join a bank


def _fingerprint(config: dict[str, Any], folder: str) -> str | None:
    """The backbone fingerprint a prompts-only checkpoint records, or that of a full folder's saved weights."""
    fingerprint = config.get("backbone_fingerprint")
    weights = os.path.join(folder, "model.safetensors")
    if fingerprint is None and os.path.isfile(weights):
        fingerprint = tensors_fingerprint(load_file(weights))  # as backbone_fingerprint of the loaded model
    return fingerprint


def _prompted_module_folder(path: str) -> str:
    if not os.path.isdir(path):
        raise DataNotFoundError(f"No model folder at {path!r}.")
    modules = os.path.join(path, "modules.json")
    if not os.path.isfile(modules):
        return path
    try:
        entries = json.loads(open(modules, encoding="utf-8").read())
    except ValueError as exc:
        raise DataFormatError(f"{modules} is damaged: {exc}") from exc
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith("PromptedTransformer"):
            return str(contained_path(path, entry["path"], modules)) if entry.get("path") else path
    raise ConfigurationError(f"{path!r} holds no PromptedTransformer: nothing to add as a prompt set.")
