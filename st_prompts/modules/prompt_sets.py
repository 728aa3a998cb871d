"""Named prompt sets on one frozen backbone: chosen per call (``encode(task=...)``) and per row (mixed batches).

A :class:`~st_prompts.PromptedTransformer` holds its own deep prefix (``prefix_encoder``, the one the methods train)
and any number of *named* deep prefixes, ``prompt_sets``: a bank of tasks sharing one copy of the backbone, each a few
hundred kilobytes. Every row of a batch may use another set: the sets' keys/values are stacked (padded with masked
positions to the longest set) and each layer gathers its row's prefix, so one forward pass serves any mix of tasks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError, DataNotFoundError, first_line
from st_prompts.modules import set_checks
from st_prompts.modules.backbones import backbone_dropout
from st_prompts.modules.checkpoint import PROMPTS_FILE, backbone_fingerprint
from st_prompts.prompts.features import PREFIX_ATTENTION_MASK, PREFIX_VALUES
from st_prompts.prompts.injection import PREFIX_KWARG, PrefixInjection
from st_prompts.prompts.names import BACKBONE_TASK, check_set_name
from st_prompts.prompts.spec import SAVED_FIELDS, PromptSetSpec
from st_prompts.prompts.prefix import PrefixDraw, PrefixEncoder, key_padding, pad_prefix
from st_prompts.storage import contained_path

#: sentence-transformers' task names of ``encode_query`` / ``encode_document``.
QUERY, DOCUMENT = "query", "document"
#: Options a prompt set is built from (saved in the module config).
SET_OPTIONS = SAVED_FIELDS
#: The fields of a prompt set's record (:meth:`PromptSetsMixin.record_prompt_set`) and their kinds.
RECORD_FIELDS = {"rows": "count", "steps": "count", "best_step": "count", "loss": "text", "evaluator": "text",
                 "metric": "text", "best_score": "score", "start_score": "score", "backbone_score": "score"}


def clean_record(record: Any) -> dict[str, Any]:
    """The known fields of a prompt set's record with values of their kind: counts are non-negative integers, scores
    finite numbers, texts one line of at most 200 characters. Anything else is dropped: a record is read from a
    model folder and ends up in its model card, so a malformed or hostile one must neither fail a save nor reshape
    the card."""
    import math

    clean: dict[str, Any] = {}
    if not isinstance(record, dict):
        return clean
    for key, kind in RECORD_FIELDS.items():
        value = record.get(key)
        if isinstance(value, bool) or value is None:
            continue
        if kind == "count" and isinstance(value, int) and value >= 0:
            clean[key] = value
        elif kind == "score" and isinstance(value, (int, float)) and math.isfinite(value):
            clean[key] = float(value)
        elif kind == "text" and isinstance(value, str):
            text = " ".join(value.split())[:200]
            if text:
                clean[key] = text
    return clean


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
    """``model.encode`` of a model with prompt sets: ``task`` may be one name per input, which goes to
    :func:`~st_prompts.modules.rows.encode_rows` (the server's path too); one task per call (or none) is
    sentence-transformers' own ``encode``. Installed on the model by :meth:`PromptSetsMixin.on_model_ready`; pickles
    with the model."""

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


class PromptSetsMixin:
    """Named prompt sets of :class:`~st_prompts.PromptedTransformer` (see the module docstring)."""

    #: ``encode(task=...)`` reaches this module's forward too (sentence-transformers passes a module the keyword
    #: arguments it declares here).
    forward_kwargs = {"task"}

    def _init_prompt_sets(self, prompt_sets: dict[str, dict[str, Any]] | None, default_task: str | None,
                          query_task: str | None, document_task: str | None,
                          prompt_set_info: dict[str, dict[str, Any]] | None = None) -> None:
        self.prompt_sets = torch.nn.ModuleDict()
        #: a bank (``prompt_sets`` given, even empty) saves its sets' dict, so a bank with no set yet reloads as one
        self._is_bank = prompt_sets is not None
        self._set_specs: dict[str, PromptSetSpec] = {}
        self._stack_cache: tuple[Any, PrefixDraw, torch.Tensor] | None = None
        for name, spec in (set_checks.check_prompt_sets(prompt_sets) or {}).items():
            self.new_prompt_set(name, spec=spec, _room_checked_by_caller=True)
        #: what each set was trained on and how it scored (name -> record; see :meth:`record_prompt_set`); banks saved
        #: before these records load without them
        info = prompt_set_info if isinstance(prompt_set_info, dict) else {}
        self.prompt_set_info: dict[str, dict[str, Any]] = {
            name: clean_record(record) for name, record in info.items() if name in self.prompt_sets}
        self.default_task, self.query_task, self.document_task = default_task, query_task, document_task
        for role in ("default_task", "query_task", "document_task"):
            value = getattr(self, role)
            if value is not None and value != BACKBONE_TASK and value not in self.prompt_sets:
                raise ConfigurationError(f"{role}={value!r} names no prompt set ({self._known_tasks()}).")

    # ------------------------------------------------------------------ the bank
    @property
    def prompt_set_names(self) -> list[str]:
        """The names of the prompt sets, in the order they were added."""
        return list(self.prompt_sets)

    def new_prompt_set(self, name: str, prefix_length: int = 16, prefix_projection: bool = False,
                       prefix_hidden_size: int | None = None, prefix_dropout: float | None = None,
                       init_std: float | None = None, prefix_gate: bool = False, *, spec: PromptSetSpec | None = None,
                       _room_checked_by_caller: bool = False) -> PrefixEncoder:
        """Add an untrained prompt set ``name`` and return it: a deep prefix of ``prefix_length`` positions, or as
        ``spec`` (a :class:`~st_prompts.prompts.spec.PromptSetSpec`, which checks the options) says.

        ``prefix_gate=True``: the set reaches attention through a zero-initialised gate (see
        :class:`~st_prompts.prompts.PrefixEncoder`), so until it trains the bank encodes this task exactly as the
        backbone does."""
        self._check_new_name(name)
        if spec is None:
            spec = PromptSetSpec(prefix_length, bool(prefix_projection), prefix_hidden_size, prefix_dropout,
                                 bool(prefix_gate), init_std)
        set_checks.check_prefix_fits(self, spec.prefix_length, spec.prefix_gate, self.template_num_tokens)  # no alloc
        encoder = self.build_prefix_encoder(spec.prefix_length, spec.prefix_projection, spec.prefix_hidden_size,
                                            spec.prefix_dropout, shared_dropout=False, init_std=spec.init_std,
                                            gate=spec.prefix_gate)
        if not _room_checked_by_caller:
            self._check_room(encoder.position_length)
        device = next(self.auto_model.parameters()).device
        self.prompt_sets[name] = encoder.to(device)
        self._set_specs[name] = spec
        self._stack_cache = None
        return encoder

    def add_prompt_set(self, name: str, source: str | os.PathLike | Any) -> PrefixEncoder:
        """Add a trained prompt set under ``name``: the deep prefix of a saved model folder or prompts-only checkpoint
        (read as data, no code runs), or of a :class:`~st_prompts.PromptedTransformer` / SentenceTransformer.

        Raises:
            BackboneMismatchError: the set was trained on other backbone weights (fingerprint), or for another
                architecture (layers, heads, head size).
            ConfigurationError: the name is taken; the source has no deep prefix, or also a template or [CLS]
                prompt (only deep prefixes share a batch).
        """
        self._check_new_name(name)
        if isinstance(source, (str, os.PathLike)):
            spec, state, fingerprint = read_prompt_set(str(source))
            if fingerprint is not None and fingerprint != self.fingerprint:
                raise BackboneMismatchError(f"The prompt set in {str(source)!r} was trained on other backbone weights "
                                            f"(fingerprint {fingerprint}, this backbone {self.fingerprint}).")
            label = repr(str(source))
        else:
            encoder = source if hasattr(source, "prefix_encoder") else source[0]  # a module, or a SentenceTransformer
            if getattr(encoder, "prefix_encoder", None) is None:
                raise ConfigurationError("add_prompt_set needs a model with a deep prefix.")
            if encoder.template is not None or encoder.cls_prompt:
                raise ConfigurationError("Only a deep prefix can join a prompt bank; this model also has a template "
                                         "or a [CLS] prompt.")
            if encoder.fingerprint != self.fingerprint:
                raise BackboneMismatchError("The prompt set was trained on other backbone weights (fingerprint "
                                            f"{encoder.fingerprint}, this backbone {self.fingerprint}).")
            spec = encoder.own_prefix_spec()
            state = {k[len("prefix_encoder."):]: v for k, v in encoder.prompt_state_dict().items()
                     if k.startswith("prefix_encoder.")}
            label = "the given model"
        encoder = self.new_prompt_set(name, spec=spec)
        expected = {k: tuple(v.shape) for k, v in encoder.state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if expected != found:
            del self.prompt_sets[name], self._set_specs[name]
            raise BackboneMismatchError(f"The prompt set in {label} does not fit this backbone's {self.backbone_plan.layers} "
                                        f"layers of {self.backbone_plan.kv_heads} heads of size "
                                        f"{self.backbone_plan.head_dim} ({found} against {expected}).")
        with torch.no_grad():
            encoder.load_state_dict({k: v.to(next(encoder.parameters()).device) for k, v in state.items()})
        self._stack_cache = None
        return encoder

    def remove_prompt_set(self, name: str) -> None:
        """Remove the prompt set ``name`` (and unset any role it had)."""
        if name not in self.prompt_sets:
            raise ConfigurationError(f"No prompt set {name!r} ({self._known_tasks()}).")
        del self.prompt_sets[name], self._set_specs[name]
        self.prompt_set_info.pop(name, None)
        for role in ("default_task", "query_task", "document_task"):
            if getattr(self, role) == name:
                setattr(self, role, None)
        self._stack_cache = None

    @property
    def fingerprint(self) -> str:
        """The backbone's weight fingerprint (computed once: the backbone of a bank stays frozen)."""
        cached = getattr(self, "_fingerprint", None)
        if cached is None or not self.freeze_backbone:
            cached = self._fingerprint = backbone_fingerprint(self.auto_model)
        return cached

    def record_prompt_set(self, name: str, **record: Any) -> None:
        """Record what the set ``name`` was trained on and how it scored (saved with the bank, shown in its model
        card): ``rows``, ``loss``, ``evaluator``, ``metric``, ``best_score``, ``best_step``, ``start_score`` (step 0),
        ``backbone_score``, ``steps``; ``None`` values are left out. Replaces an earlier record of that set."""
        if name not in self.prompt_sets:
            raise ConfigurationError(f"No prompt set {name!r} ({self._known_tasks()}).")
        self.prompt_set_info[name] = clean_record(record)

    def prompt_set_spec(self, name: str) -> PromptSetSpec:
        """The :class:`~st_prompts.prompts.spec.PromptSetSpec` of the set ``name``."""
        if name not in self._set_specs:
            raise ConfigurationError(f"No prompt set {name!r} ({self._known_tasks()}).")
        return self._set_specs[name]

    def own_prefix_spec(self) -> PromptSetSpec:
        """The spec of this module's own prefix (as a set of a bank would carry it)."""
        if self.prefix_encoder is None:
            raise ConfigurationError("This model has no prefix of its own.")
        return PromptSetSpec(self.prefix_length, bool(self.prefix_projection), self.prefix_hidden_size,
                             self.prefix_dropout, bool(self.prefix_gate))

    def prompt_set_options(self) -> dict[str, dict[str, Any]]:
        """Each set's construction options (what the saved config records)."""
        return {name: spec.saved() for name, spec in self._set_specs.items()}

    def inference_cache_bytes(self) -> int:
        """Bytes of the stacked sets' keys/values kept for mixed batches at inference (0 before the first one)."""
        if self._stack_cache is None:
            return 0
        prefix = self._stack_cache[1].prefix
        return prefix.numel() * prefix.element_size()

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        options = self.prompt_set_options()
        config["prompt_sets"] = options if options or self._is_bank else None
        info = {name: record for name, record in self.prompt_set_info.items() if name in self.prompt_sets and record}
        if info:
            config["prompt_set_info"] = info
        else:
            config.pop("prompt_set_info", None)
        return config

    def _check_new_name(self, name: str) -> None:
        check_set_name(name)
        if name in self.prompt_sets:
            raise ConfigurationError(f"The bank already has a prompt set {name!r}; remove it first.")

    def _known_tasks(self) -> str:
        names = self.prompt_set_names
        return f"prompt sets: {', '.join(names)}" if names else "this model has no prompt sets"

    def build_prefix_encoder(self, prefix_length: int, projection: bool = False, hidden_size: int | None = None,
                             dropout: float | None = None, shared_dropout: bool = False,
                             init_std: float | None = None, gate: bool = False) -> PrefixEncoder:
        """A deep prefix shaped for this backbone (its prefix layers, key/value heads and head size), initialised as
        the official code does (``init_std``: default :attr:`initial_prefix_std`)."""
        plan, config = self.backbone_plan, self.auto_model.config
        return PrefixEncoder(
            prefix_length=prefix_length,
            num_layers=plan.layers,
            num_heads=plan.kv_heads,
            head_dim=plan.head_dim,
            projection=projection,
            projection_hidden_size=hidden_size or config.hidden_size,
            dropout=backbone_dropout(config) if dropout is None else dropout,
            shared_dropout=shared_dropout,
            init_std=self.initial_prefix_std if init_std is None else init_std,
            gate=gate,
        )

    # ------------------------------------------------------------------ choosing
    def resolve_task(self, task: str | None) -> PrefixEncoder | None:
        """The prefix a task name selects: a set, the model's own prefix (no task, no default), or none
        (``"backbone"``, or a default of ``None`` on a model without a prefix). ``"query"``/``"document"`` (from
        ``encode_query``/``encode_document``) select a set of that name, else the bank's query/document set, else the
        default."""
        if task in (QUERY, DOCUMENT) and task not in self.prompt_sets:
            task = self.query_task if task == QUERY else self.document_task
        if task is None:
            task = self.default_task
            if task is None:
                return self.prefix_encoder
        if task == BACKBONE_TASK:
            return None
        encoder = self.prompt_sets[task] if task in self.prompt_sets else None
        if encoder is None:
            raise ConfigurationError(f"Unknown task {task!r} ({self._known_tasks()}; {BACKBONE_TASK!r} is the plain "
                                     "backbone).")
        return encoder

    def select_prompts(self, tasks: list[str | None] | None, task: str | None, batch_size: int,
                       device: torch.device) -> PromptSelection:
        """The prefix of a pass: per row (``tasks``) or for the call (``task``)."""
        if tasks is None:
            return PromptSelection(encoder=self.resolve_task(task))
        encoders = [self.resolve_task(name) for name in tasks]
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
        """The keys/values of ``members`` stacked along the batch dimension, padded to the longest set (inference:
        cached until a parameter changes)."""
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

    def _mixed_prefix(self, model_inputs: dict[str, Any], features: dict[str, Any], selection: PromptSelection,
                      tokens: int) -> None:
        """The prefix of a batch whose rows use several prompt sets: each row gathers its set from the stacked sets
        (inference only); positions past a row's own prefix are masked out."""
        if features.get(PREFIX_ATTENTION_MASK) is not None or features.get(PREFIX_VALUES) is not None:
            raise ConfigurationError("prefix views and shared prefix draws need one prompt set for the whole batch.")
        draw, longest = selection.draw, selection.draw.shape[3]
        prefix_mask = torch.arange(longest, device=selection.lengths.device).unsqueeze(0) < selection.lengths.unsqueeze(1)
        padding = key_padding(longest, tokens)
        if padding:
            draw = pad_prefix(draw, padding)
            prefix_mask = torch.nn.functional.pad(prefix_mask, (0, padding))
        model_inputs[PREFIX_KWARG] = PrefixInjection(draw, prefix_mask, rows=selection.rows)

    def on_model_ready(self, model) -> None:
        """sentence-transformers' hook when the model is assembled: a model with prompt sets takes ``task`` per row."""
        super().on_model_ready(model)
        if self._is_bank and not any(module is self for module in model):  # in a Router: task= is the Router's
            from st_prompts.folder_checks import ROUTER_UNSUPPORTED

            raise ConfigurationError(ROUTER_UNSUPPORTED + ".")
        if not isinstance(model.__dict__.get("encode"), RowTaskEncode):
            model.encode = RowTaskEncode(model)


def read_prompt_set(path: str) -> tuple[PromptSetSpec, dict[str, torch.Tensor], str | None]:
    """``(spec, prefix state dict, backbone fingerprint or None)`` of the deep prefix saved in a model folder or
    prompts-only checkpoint at ``path``: read from its JSON files and ``soft_prompts.safetensors`` only (no module is
    imported, no code runs). A full model folder's fingerprint is that of its saved backbone weights.

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
        state = _load_prompts_file(folder, path)
        prefix = f"prompt_sets.{name}."
        return (spec, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, _fingerprint(config, folder))
    if not config.get("prefix_length"):
        raise ConfigurationError(
            f"{path!r} has no deep prefix to add as a prompt set" + (
                f": it is a bank of {len(sets)} sets ({', '.join(list(sets)[:5])}{', ...' if len(sets) > 5 else ''}); "
                f"export the one you want first (st-prompts bank export {path} SET OUT, or "
                "st_prompts.bank.export_prompt_set) and add OUT." if sets else "."))
    if config.get("template") is not None or config.get("cls_prompt"):
        raise ConfigurationError(f"Only a deep prefix can join a prompt bank; {path!r} also has a template or a [CLS] "
                                 "prompt.")
    state = _load_prompts_file(folder, path)
    state = {k[len("prefix_encoder."):]: v for k, v in state.items() if k.startswith("prefix_encoder.")}
    spec = PromptSetSpec.from_config({k: config.get(k) for k in SAVED_FIELDS}, repr(path))  # before any allocation
    return spec, state, _fingerprint(config, folder)


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
        fingerprint = _file_fingerprint(weights)
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


def _file_fingerprint(path: str) -> str:
    """:func:`backbone_fingerprint` of the weights saved in a safetensors file (same names, dtypes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(path).items()):
        tensor = tensor.contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return "sha256:" + digest.hexdigest()
