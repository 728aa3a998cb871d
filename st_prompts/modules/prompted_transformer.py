"""``PromptedTransformer``: a sentence-transformers input module carrying soft prompts on a (frozen) backbone."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from sentence_transformers.base.modules.transformer import Transformer

from st_prompts import utils
from st_prompts.errors import (BackboneMismatchError, ConfigurationError, DataFormatError, DataNotFoundError,
                               first_line, shorten)
from st_prompts.hub import check_hub_model
from st_prompts.modules import set_checks
from st_prompts.modules.backbones import backbone_dropout, check_checkpointing, check_injection, inspect_backbone
from st_prompts.modules.checkpoint import (PROMPTS_FILE, backbone_fingerprint, backbone_identity, check_backbone_at,
                                           check_fingerprint, dequantized_gguf, portable_backbone_reference,
                                           read_prompts, resolve_quietly, write_prompts)
from st_prompts.modules.checks import check_room_for_text, cls_token_id, validate_prompt_options
from st_prompts.modules.lengths import shipped_max_seq_length
from st_prompts.modules.model_card import PromptsModelCardData
from st_prompts.modules.prompt_sets import (OWN, PromptSelection, PromptSetData, PromptSets, RowTaskEncode,
                                            clean_record, read_prompt_set)
from st_prompts.modules.set_checks import check_prefix_fits
from st_prompts.prompts.features import (CLS_OVERRIDE, DENOISING_POSITIONS, POSITION_IDS, PREFIX_ATTENTION_MASK,
                                         PREFIX_VALUES, PROMPT_TASK, PROMPT_TASKS, SOFT_PROMPT_POSITIONS,
                                         TEMPLATE_DENOISING, TEMPLATE_MASK_INDEX, TEMPLATE_TOKEN_EMBEDDINGS)
from st_prompts.prompts.injection import PREFIX_KWARG, PrefixInjection
from st_prompts.prompts.prefix import PrefixDraw, PrefixEncoder, key_padding, pad_prefix
from st_prompts.prompts.shallow import (ShallowPrompt, parse_template, place_vectors, template_only_features,
                                        tokenize_with_template)
from st_prompts.prompts.spec import PromptSetSpec
from st_prompts.storage import apply_umask
from st_prompts.trust import trusted_in_kwargs

logger = logging.getLogger(__name__)


def check_complete_weights(info: dict[str, Any], where: str) -> None:
    """Refuse a backbone whose checkpoint lacks weights of the model (transformers' ``missing_keys``, the ones of a
    shape that does not fit included) other than its pooler, which sentence embeddings never use."""
    missing = sorted({*info.get("missing_keys", ()), *(k[0] for k in info.get("mismatched_keys", ()))})
    missing = [key for key in missing if "pooler." not in key]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DataFormatError(f"the backbone weights in {str(where)!r} are incomplete: {len(missing)} weight(s) of "
                              f"the model are missing or of another shape ({shown}); transformers would start them "
                              "at random. Save the backbone again (an int8 model cannot be saved).")


class PromptedTransformer(Transformer):
    """A drop-in replacement for sentence-transformers' ``Transformer`` that adds trainable soft prompts.

    Kinds of prompt, usable alone or together, all on one code path:

    * **deep continuous prompts** (DCPCSE, P-tuning v2): ``prefix_length`` trainable key/value vectors prepended in
      every self-attention layer; ``features["prefix_attention_mask"]`` (``(batch, prefix_length)``, 1 = attend)
      lets rows attend to a *view* of the prefix (:func:`~st_prompts.prompts.prefix.prefix_view_mask`);
    * **templates** such as ``This sentence : "[X]" means [MASK] .``, *soft* (trainable token vectors, SCPCSE) or
      *hard* (real tokens, PromptBERT); pool the ``[MASK]`` slot with :class:`~st_prompts.modules.MaskTokenPooling`;
    * a trainable **[CLS] prompt** (``cls_prompt=True``) replacing the input row at position 0, and an external
      ``features["cls_override"]`` (``(batch, hidden)``, not detached) that takes precedence over it;
    * **prompt sets** (``prompt_sets``): named deep prefixes on the same backbone, chosen per call
      (``encode(task=...)``) or per row, in one forward pass (:mod:`~st_prompts.modules.prompt_sets`).

    The prefix reaches every layer through transformers' attention interface (:mod:`~st_prompts.prompts.injection`).
    With ``freeze_backbone=True`` (the default) only the prompts train; the backbone still follows train/eval mode,
    so its dropout makes the two views of a SimCSE pair differ.

    Args:
        model_name_or_path: hub name, local path, packaged alias (``"minilm"``, ``"smollm2"``) or ``.gguf`` file.
        prefix_length: deep-prompt positions per layer (``None``: no deep prompts, e.g. SCPCSE).
        prefix_projection: reparameterise the prefix with an MLP while training; saved as the prefix it computes.
        prefix_hidden_size: hidden size of that MLP (DCPCSE: 512; ``None``: the backbone's hidden size).
        prefix_dropout: dropout on the prefix in training; ``None``: the backbone's hidden dropout.
        prefix_dropout_shared: one prefix dropout mask per pass for the whole batch instead of one per example.
        prefix_init_std: std of the prefix's normal initialisation; ``None``: the backbone's ``initializer_range``.
        template: template with one ``[X]`` and one ``[MASK]`` (``None`` for no template).
        template_mode: ``"soft"`` (trainable template tokens) or ``"hard"`` (real tokens, no parameter).
        cls_prompt: add a trainable [CLS] prompt, initialised from the [CLS] token's input embedding.
        template_denoising: also encode the template alone (same positions, prefix view and draw), for
            :class:`~st_prompts.modules.MaskTokenPooling` to subtract (PromptBERT's template denoising).
        freeze_backbone: keep the backbone's parameters out of training.
        backbone_name_or_path: where the backbone weights come from, recorded in the config and used by prompts-only
            checkpoints (default: ``model_name_or_path``).
        max_seq_length: maximum number of real tokens; capped so that prefix + tokens fit the position embeddings.
        prefix_injection: ``"attention"`` (a folder saved with the removed ``"cache"`` loads on it).
        prefix_gate: reach attention through a zero-initialised gate per layer and head (LLaMA-Adapter): the
            untrained module encodes exactly as its backbone. Default ``False``: the official DCPCSE/DiffAug prefix.
        prompt_sets: named prompt sets, name -> options of :meth:`new_prompt_set`; ``default_task``: the set used
            without ``task`` (``None``: the own prefix, else the plain backbone); ``query_task``/``document_task``:
            the sets of ``encode_query``/``encode_document``.
        prompt_set_info: name -> what the set was trained on and how it scored (informational only).
        **kwargs: passed on to sentence-transformers' ``Transformer``.

    Raises:
        ConfigurationError: invalid options, or prompts leaving fewer than :data:`MIN_TEXT_TOKENS` positions for text.
        DataNotFoundError: for the packaged-MiniLM alias when its package is not installed.
        UnsupportedArchitectureError: for backbones that cannot carry deep prompts.
    """

    config_keys: list[str] = Transformer.config_keys + [
        "prefix_length", "prefix_projection", "prefix_hidden_size", "prefix_dropout", "prefix_dropout_shared",
        "prefix_init_std", "template", "template_mode", "cls_prompt", "template_denoising", "freeze_backbone",
        "backbone_name_or_path", "max_seq_length", "prefix_injection", "prefix_gate", "prompt_sets", "prompt_set_info",
        "default_task", "query_task", "document_task",
    ]

    def __init__(self, model_name_or_path: str, prefix_length: int | None = 16, *, prefix_projection: bool = False,
                 prefix_hidden_size: int | None = 512, prefix_dropout: float | None = None,
                 prefix_dropout_shared: bool = False, prefix_init_std: float | None = None,
                 template: str | None = None, template_mode: str = "soft", cls_prompt: bool = False,
                 template_denoising: bool = False, freeze_backbone: bool = True,
                 backbone_name_or_path: str | None = None, max_seq_length: int | None = None,
                 prefix_injection: str = "attention", prefix_gate: bool = False,
                 prompt_sets: dict[str, dict[str, Any]] | None = None, default_task: str | None = None,
                 query_task: str | None = None, document_task: str | None = None,
                 prompt_set_info: dict[str, dict[str, Any]] | None = None, **kwargs: Any) -> None:
        validate_prompt_options(prefix_length, template, template_mode, cls_prompt, prefix_hidden_size, prefix_dropout,
                                 prefix_init_std, bank=prompt_sets is not None)
        if kwargs.get("backend", "torch") != "torch":
            raise ConfigurationError("PromptedTransformer needs the 'torch' backend (ONNX/OpenVINO cannot take prompts).")
        if kwargs.get("transformer_task", "feature-extraction") != "feature-extraction":
            raise ConfigurationError("PromptedTransformer only supports transformer_task='feature-extraction'.")
        # Prompts need padded batches: never let sentence-transformers flatten (unpad) the inputs.
        kwargs["unpad_inputs"] = False
        # Aliases resolve here (fails fast when the package is missing); a GGUF model is de-quantised from its folder.
        requested = str(model_name_or_path)
        model_name_or_path = utils.resolve_model_name(requested)
        location, gguf_file, _ = utils.resolve_gguf(model_name_or_path)
        # Nothing of the backbone runs or is unpickled unless the user trusts it: its files are checked first.
        from st_prompts.folder_checks import require_safe_backbone, safe_loading

        self.trust_remote_code = trusted_in_kwargs(kwargs)
        require_safe_backbone(requested, self.trust_remote_code)
        if gguf_file:
            for key in ("model_kwargs", "processor_kwargs", "config_kwargs"):
                kwargs[key] = {"gguf_file": gguf_file, **(kwargs.get(key) or {})}
            model_name_or_path = requested
        with safe_loading(self.trust_remote_code) as safe:
            kwargs["model_kwargs"] = {**safe, **(kwargs.get("model_kwargs") or {})}
            super().__init__(location, **kwargs)
        #: The backbone's own length limit (the shipped ``max_seq_length``, else its tokenizer's), or ``None``: what a
        #: trained model encodes up to (:func:`~st_prompts.modules.lengths.backbone_encode_length`).
        self.backbone_max_length: int | None = shipped_max_seq_length(location) or (
            self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1_000_000 else None)
        self.backbone_plan = inspect_backbone(self.auto_model)
        self.prefix_injection = check_injection(prefix_injection)
        if self.backbone_plan.causal and (template is not None or cls_prompt):
            raise ConfigurationError(f"A causal decoder ({self.auto_model.config.model_type}) has no [CLS] and no "
                                     "[MASK] slot that later tokens read: templates and the [CLS] prompt are for "
                                     "encoders; pool a decoder's last token or its mean (pooling 'lasttoken' or 'mean') "
                                     "and let the deep prefix carry the prompt.")
        self.prefix_length = prefix_length
        self.prefix_gate = bool(prefix_gate)
        self.prefix_projection = prefix_projection
        self.prefix_hidden_size = prefix_hidden_size
        self.prefix_dropout = prefix_dropout
        self.prefix_dropout_shared = bool(prefix_dropout_shared)
        self.prefix_init_std = prefix_init_std
        self.template = template
        self.template_mode = template_mode
        self.cls_prompt = bool(cls_prompt)
        if template_denoising and template is None:
            raise ConfigurationError("template_denoising needs a template (it subtracts the template-only representation).")
        self.template_denoising = bool(template_denoising)
        #: Where the backbone loads from here (aliases resolved); saved configs hold :attr:`backbone_reference`.
        self.backbone_name_or_path = (resolve_quietly(str(backbone_name_or_path)) if backbone_name_or_path
                                      else model_name_or_path)
        self._prompts_only_save = False
        # loaded from elsewhere (a full checkpoint) or trained at some point: save_prompts_only then checks the weights
        self._backbone_may_differ = backbone_identity(model_name_or_path) != backbone_identity(self.backbone_name_or_path)
        # RoBERTa-family position ids start at padding_idx + 1; only learned absolute positions are shifted by a prefix
        self._position_offset = self._infer_flatten_position_offset() if self.backbone_plan.absolute_positions else 0

        #: The own prefix (the set ``OWN``) and, in a bank (``prompt_sets`` given, even empty), the named sets.
        self.sets = PromptSets(is_bank=prompt_sets is not None)
        if prefix_length is not None:
            spec = PromptSetSpec(prefix_length, bool(prefix_projection), prefix_hidden_size, prefix_dropout,
                                 self.prefix_gate, prefix_init_std)
            check_prefix_fits(self, prefix_length, self.prefix_gate)  # before anything is allocated
            self.sets.add(OWN, self._build_prefix(spec, shared_dropout=self.prefix_dropout_shared), spec)

        # Input-embedding prompts: one table of trainable vectors (soft template tokens, then the [CLS] prompt).
        self._template = parse_template(template, self.tokenizer) if template is not None else None
        vector_ids: list[int] = []
        if self._template is not None and template_mode == "soft":
            mask_id = self.tokenizer.mask_token_id
            vector_ids = [i for i in self._template.left_ids + self._template.right_ids if i != mask_id]
            if not vector_ids:
                raise ConfigurationError("The template has no token besides [X] and [MASK]: nothing to train (use "
                                         "template_mode='hard').")
        self._cls_slot: int | None = len(vector_ids) if self.cls_prompt else None
        if self.cls_prompt:
            vector_ids.append(cls_token_id(self.tokenizer))
        embeddings = self.auto_model.get_input_embeddings().weight
        self.shallow_prompt = ShallowPrompt.from_token_ids(vector_ids, embeddings) if vector_ids else None

        for name, spec in (set_checks.check_prompt_sets(prompt_sets) or {}).items():
            self.new_prompt_set(name, spec=spec, _room_checked_by_caller=True)
        # banks saved before records were kept load without them
        for name, record in (prompt_set_info if isinstance(prompt_set_info, dict) else {}).items():
            if name in self.sets.names:
                self.sets.info[name] = clean_record(record)
        self.sets.set_roles(default_task, query_task, document_task)
        check_room_for_text(self.max_positions, self._position_offset,
                            self.tokenizer.num_special_tokens_to_add(pair=False), self.template_num_tokens,
                            self.prefix_positions)
        self.freeze_backbone = freeze_backbone
        limit = self.max_position_limit
        if max_seq_length is None or max_seq_length > limit:
            if max_seq_length is not None:
                logger.warning(f"max_seq_length={max_seq_length} does not fit the backbone with {prefix_length} prefix "
                               f"positions; using {limit}.")
            max_seq_length = min(self.tokenizer.model_max_length, limit)
        self.tokenizer.model_max_length = max_seq_length

    @property
    def prefix_encoder(self) -> PrefixEncoder | None:
        """This module's own prefix (the one a method trains), or ``None``."""
        return self.sets.own

    @property
    def prompt_sets(self) -> torch.nn.ModuleDict:
        """Name -> prefix of the named prompt sets, in the order they were added (a view)."""
        return torch.nn.ModuleDict(self.sets.named())

    @property
    def prompt_set_names(self) -> list[str]:
        """The names of the prompt sets, in the order they were added."""
        return self.sets.names

    @property
    def prompt_set_info(self) -> dict[str, dict[str, Any]]:
        """Name -> what the set was trained on and how it scored (see :meth:`record_prompt_set`)."""
        return self.sets.info

    default_task = property(lambda self: self.sets.default, lambda self, value: setattr(self.sets, "default", value),
                            doc="The set used without a task (``None``: the own prefix, else the plain backbone).")
    query_task = property(lambda self: self.sets.query, lambda self, value: setattr(self.sets, "query", value),
                          doc="The set of ``encode_query``.")
    document_task = property(lambda self: self.sets.document,
                             lambda self, value: setattr(self.sets, "document", value),
                             doc="The set of ``encode_document``.")

    def new_prompt_set(self, name: str, prefix_length: int = 16, prefix_projection: bool = False,
                       prefix_hidden_size: int | None = None, prefix_dropout: float | None = None,
                       init_std: float | None = None, prefix_gate: bool = False, *, spec: PromptSetSpec | None = None,
                       internal: bool = False, _room_checked_by_caller: bool = False) -> PrefixEncoder:
        """Add an untrained prompt set ``name`` and return it: a deep prefix of ``prefix_length`` positions, or as
        ``spec`` says. ``prefix_gate=True``: until it trains, the set encodes exactly as the backbone does.
        ``internal``: the name may be a server's ``name@N`` (:func:`~st_prompts.prompts.names.internal_name`)."""
        self.sets.check_new_name(name, internal)
        if spec is None:
            spec = PromptSetSpec(prefix_length, bool(prefix_projection), prefix_hidden_size, prefix_dropout,
                                 bool(prefix_gate), init_std)
        check_prefix_fits(self, spec.prefix_length, spec.prefix_gate, self.template_num_tokens)  # before allocating
        encoder = self._build_prefix(spec)
        if not _room_checked_by_caller:
            self._check_room(encoder.position_length)
        # on the backbone's device and dtype (half precision: precision.apply_dtype)
        weights = next(self.auto_model.parameters())
        return self.sets.add(name, encoder.to(device=weights.device, dtype=weights.dtype), spec)

    def add_prompt_set(self, name: str, source: str | os.PathLike | PromptSetData | Any, *,
                       internal: bool = False) -> PrefixEncoder:
        """Add a trained prompt set under ``name``: the deep prefix of a saved model folder or prompts-only checkpoint
        (read as data, no code runs), a :class:`~st_prompts.modules.prompt_sets.PromptSetData`, or the own prefix of a
        :class:`~st_prompts.PromptedTransformer` / SentenceTransformer.

        Raises:
            BackboneMismatchError: the set was trained on other backbone weights, or for another architecture.
            ConfigurationError: the name is taken or invalid; the source has no deep prefix, or also a template or
                [CLS] prompt (only deep prefixes share a batch).
        """
        self.sets.check_new_name(name, internal)
        if isinstance(source, (str, os.PathLike, PromptSetData)):
            label = "the given data" if isinstance(source, PromptSetData) else repr(str(source))
            data = source if isinstance(source, PromptSetData) else read_prompt_set(str(source))
            spec, state, fingerprint, where = data.spec, data.state, data.fingerprint, f" in {label}"
        else:
            encoder = source if hasattr(source, "prefix_encoder") else source[0]  # a module, or a SentenceTransformer
            if getattr(encoder, "prefix_encoder", None) is None:
                raise ConfigurationError("add_prompt_set needs a model with a deep prefix.")
            if encoder.template is not None or encoder.cls_prompt:
                raise ConfigurationError("Only a deep prefix can join a prompt bank; this model also has a template "
                                         "or a [CLS] prompt.")
            spec, state, label = encoder.own_prefix_spec(), encoder.prefix_encoder.state_dict(), "the given model"
            fingerprint, where = encoder.fingerprint, ""
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise BackboneMismatchError(f"The prompt set{where} was trained on other backbone weights (fingerprint "
                                        f"{fingerprint}, this backbone {self.fingerprint}).")
        # the room first (the clearer refusal), then the shapes on torch's meta device: before anything is allocated
        check_prefix_fits(self, spec.prefix_length, spec.prefix_gate, self.template_num_tokens)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in self._build_prefix(spec).state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if expected != found:
            raise BackboneMismatchError(f"The prompt set in {label} does not fit this backbone's "
                                        f"{self.backbone_plan.layers} layers of {self.backbone_plan.kv_heads} heads of "
                                        f"size {self.backbone_plan.head_dim} ({shorten(found, 160)} against "
                                        f"{shorten(expected, 160)}).")
        for key, tensor in state.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ConfigurationError(f"The prompt set in {label} holds NaN or infinite values ({key!r}).")
        encoder = self.new_prompt_set(name, spec=spec, internal=internal)
        encoder.load_state_dict(state)  # copied onto the set's device and dtype
        return encoder

    def remove_prompt_set(self, name: str) -> None:
        """Remove the prompt set ``name`` (and unset any role it had)."""
        self.sets.remove(name)

    def record_prompt_set(self, name: str, **record: Any) -> None:
        """Record what the set ``name`` was trained on and how it scored (saved with the bank, shown in its card;
        fields: :data:`~st_prompts.modules.prompt_sets.RECORD_FIELDS`). Replaces an earlier record."""
        self.sets.record(name, **record)

    def own_prefix_spec(self) -> PromptSetSpec:
        """The spec of this module's own prefix (as a set of a bank carries it)."""
        if self.sets.own is None:
            raise ConfigurationError("This model has no prefix of its own.")
        return self.sets.specs[OWN]

    def prompt_set_options(self) -> dict[str, dict[str, Any]]:
        """Each named set's options (what the saved config records)."""
        return self.sets.saved_options()

    def inference_cache_bytes(self) -> int:
        """Bytes of the stacked sets' keys/values kept for mixed batches at inference (0 before the first one)."""
        return self.sets.cache_bytes()

    def resolve_task(self, task: str | None) -> PrefixEncoder | None:
        """The prefix a task name selects (see :meth:`~st_prompts.modules.prompt_sets.PromptSets.resolve`)."""
        return self.sets.resolve(task)

    @property
    def fingerprint(self) -> str:
        """The backbone's weight fingerprint (computed once: the backbone of a bank stays frozen)."""
        cached = getattr(self, "_fingerprint", None)
        if cached is None or not self.freeze_backbone:
            cached = self._fingerprint = backbone_fingerprint(self.auto_model)
        return cached

    def _build_prefix(self, spec: PromptSetSpec, shared_dropout: bool = False) -> PrefixEncoder:
        """A deep prefix for ``spec`` shaped for this backbone, initialised as the official code does."""
        plan, config = self.backbone_plan, self.auto_model.config
        return PrefixEncoder(
            spec.prefix_length, plan.layers, plan.kv_heads, plan.head_dim, projection=spec.prefix_projection,
            projection_hidden_size=spec.prefix_hidden_size or config.hidden_size,
            dropout=backbone_dropout(config) if spec.prefix_dropout is None else spec.prefix_dropout,
            shared_dropout=shared_dropout, gate=spec.prefix_gate,
            init_std=self.initial_prefix_std if spec.init_std is None else spec.init_std,
        )

    @property
    def prefix_positions(self) -> int:
        """Positions the prefix takes from the text: the longest ungated prefix with learned absolute positions (the
        text starts after it, as after DCPCSE's key/value cache), 0 with rotary positions."""
        if not self.backbone_plan.absolute_positions:
            return 0
        return max([0, *(encoder.position_length for encoder in self.sets.prefixes.values())])

    def _check_room(self, prefix_length: int) -> None:
        """Make room for a prompt set of ``prefix_length`` positions (a shorter ``max_seq_length`` if need be)."""
        if not self.backbone_plan.absolute_positions:  # the room itself: check_prefix_fits
            return
        limit = self.max_positions - self._position_offset - max(self.prefix_positions, prefix_length)
        if self.tokenizer.model_max_length > limit:
            logger.warning(f"max_seq_length={self.tokenizer.model_max_length} does not fit a prefix of {prefix_length} "
                           f"positions; using {limit}.")
            self.tokenizer.model_max_length = limit

    @property
    def max_positions(self) -> int:
        """The backbone's ``max_position_embeddings`` (a large number when its config has none)."""
        return int(getattr(self.auto_model.config, "max_position_embeddings", None) or 1_000_000)

    @property
    def max_position_limit(self) -> int:
        """The largest ``max_seq_length`` the position embeddings allow once the prefix takes its positions."""
        return self.max_positions - self._position_offset - self.prefix_positions

    @property
    def max_seq_length(self) -> int:
        """Maximum number of real tokens (special tokens and template included); longer texts are truncated."""
        return self.tokenizer.model_max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if value is None or value > self.max_position_limit:
            logger.warning(f"max_seq_length={value} exceeds what the backbone allows with the prefix; capping.")
            value = self.max_position_limit
        self.tokenizer.model_max_length = value

    def position_ids(self, attention_mask: torch.Tensor, prefix_lengths: int | torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The position ids of the real tokens (``attention_mask``: ``(batch, seq)``, without the prefix), after a
        prefix of ``prefix_lengths`` positions (one per pass, or per row; default: the own prefix's).

        Learned absolute positions: what transformers computes after a cache of that length (RoBERTa-style ones start
        at ``padding_idx + 1`` and give padding ``padding_idx``). Rotary positions: ``0, 1, ...`` over the real
        tokens, whichever side the padding is on.
        """
        if not self.backbone_plan.absolute_positions:
            return (torch.cumsum(attention_mask.long(), dim=1) - 1).clamp(min=0)
        if prefix_lengths is None:
            prefix_lengths = self.prefix_encoder.position_length if self.prefix_encoder is not None else 0
        if isinstance(prefix_lengths, torch.Tensor):
            prefix_lengths = prefix_lengths.to(attention_mask.device).view(-1, 1)
        if self._position_offset:  # RoBERTa family
            mask = (attention_mask != 0).long()
            return (torch.cumsum(mask, dim=1) + prefix_lengths) * mask + self._position_offset - 1  # padding_idx
        batch, seq = attention_mask.shape
        return (torch.arange(seq, device=attention_mask.device).unsqueeze(0) + prefix_lengths).expand(batch, seq)

    def _load_model(self, model_name_or_path: str, transformer_task: Any, config: Any, backend: str,
                    is_peft_model: bool, **model_kwargs: Any) -> Any:
        """sentence-transformers' loading, refusing in one line a backbone folder missing weights of the model (e.g.
        saved from an int8 model) instead of loading random layers with a warning."""
        report = logging.getLogger("transformers.modeling_utils")
        level = report.level
        report.setLevel(logging.ERROR)  # its table of missing keys: the one line below says it (a pooler is fine)
        try:
            loaded = super()._load_model(model_name_or_path, transformer_task, config, backend, is_peft_model,
                                         **{**model_kwargs, "output_loading_info": True})
        finally:
            report.setLevel(level)
        model, info = loaded if isinstance(loaded, tuple) else (loaded, {})
        check_complete_weights(info, model_name_or_path)
        return model

    @property
    def freeze_backbone(self) -> bool:
        """Whether the backbone's parameters are frozen (only the soft prompts train). Settable, e.g. for DiffAug."""
        return self._freeze_backbone

    @freeze_backbone.setter
    def freeze_backbone(self, value: bool) -> None:
        self._freeze_backbone = bool(value)
        if not self._freeze_backbone:  # it may then differ from the weights at backbone_name_or_path
            self._backbone_may_differ = True
        for parameter in self.auto_model.parameters():
            parameter.requires_grad = not self._freeze_backbone

    @property
    def initial_prefix_std(self) -> float:
        """The prefix's init std: ``prefix_init_std``, else the backbone's ``initializer_range`` (else 0.02)."""
        if self.prefix_init_std is not None:
            return float(self.prefix_init_std)
        return float(getattr(self.auto_model.config, "initializer_range", None) or 0.02)

    @property
    def parsed_template(self):
        """The template split around its ``[X]`` slot (a ``ParsedTemplate``), or ``None`` without a template."""
        return self._template

    @property
    def cls_prompt_slot(self) -> int | None:
        """Row of the [CLS] prompt in ``shallow_prompt.embeddings``, or ``None`` without a [CLS] prompt."""
        return self._cls_slot

    @property
    def template_num_tokens(self) -> int:
        """Tokens the template adds to every input (0 without a template; special tokens not counted)."""
        return self._template.num_tokens if self._template is not None else 0

    def prompt_parameters(self) -> list[torch.nn.Parameter]:
        """The soft-prompt parameters (deep prefix, soft template tokens, [CLS] prompt), i.e. what prompt tuning trains."""
        return [p for module in (self.prefix_encoder, self.shallow_prompt) if module is not None
                for p in module.parameters()]

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, task: str | None = None,
                   **kwargs) -> dict[str, Any]:
        """Tokenise texts (with a template, into its ``[X]`` slot; only the sentence is truncated). ``task``
        (``encode(task=...)``) chooses the prompt set of every row."""
        if task is not None and not isinstance(task, str):
            raise ConfigurationError("A task per row: call model.encode(texts, task=[...]) on the model itself, or "
                                     "st_prompts.encode_rows(model, texts, tasks).")
        features = self._tokenize(inputs, prompt, **kwargs)
        if task is not None:
            features[PROMPT_TASK] = task
        return features

    def _tokenize(self, inputs: Sequence[Any], prompt: str | None, **kwargs) -> dict[str, Any]:
        if self._template is None:
            return super().preprocess(inputs, prompt=prompt, **kwargs)
        texts = []
        for item in inputs:
            if not isinstance(item, str):
                raise ConfigurationError(f"A PromptedTransformer with a template encodes single texts only, got "
                                         f"{type(item).__name__}.")
            texts.append(prompt + item if prompt else item)
        return tokenize_with_template(self.tokenizer, self._template, self.template_mode == "soft", texts,
                                      self.max_seq_length)

    def template_only_features(self, features: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Features for the template alone (the sentence removed from every row of :meth:`preprocess`'s ``features``),
        each template token keeping its position id (template denoising); the prefix attention mask is kept."""
        if self._template is None:
            raise ConfigurationError("template_only_features needs a PromptedTransformer with a template.")
        positions = features.get(POSITION_IDS)
        if positions is None:
            positions = self.position_ids(features["attention_mask"])
        return template_only_features(self._template, features, positions)

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        """Run the prompted backbone; writes ``features["token_embeddings"]`` (real tokens only, prefix excluded).

        Optional ``features`` keys (:mod:`st_prompts.prompts.features`): ``prefix_attention_mask``, ``cls_override``,
        ``position_ids``, ``prefix_values`` (an earlier pass's prefix draw, to share its dropout; with a prefix this
        pass's draw is written there) and ``template_denoising`` (overrides the module's setting for this call: the
        template alone is then encoded too, into ``template_token_embeddings`` and ``template_mask_index``).
        """
        if "task" in kwargs and PROMPT_TASKS not in features:
            features.setdefault(PROMPT_TASK, kwargs["task"])
        denoise = features.pop(TEMPLATE_DENOISING, None)
        denoise = self.template_denoising if denoise is None else denoise
        positions = denoise if isinstance(denoise, str) else "exact"
        if positions not in DENOISING_POSITIONS:
            raise ConfigurationError(f"features['{TEMPLATE_DENOISING}'] must be a bool or one of "
                                     f"{', '.join(DENOISING_POSITIONS)}, got {denoise!r}.")
        if denoise and self._template is None:
            raise ConfigurationError("template denoising needs a PromptedTransformer with a template.")
        features = self._encode(features)
        if denoise:
            if "prompt_mask_index" not in features:
                raise ConfigurationError("template_denoising needs features from this module's template tokenisation.")
            template_features = self.template_only_features(features)
            if positions == "official":
                self._official_denoising_positions(template_features)  # and no PREFIX_VALUES: a draw of its own
            elif PREFIX_VALUES in features:
                template_features[PREFIX_VALUES] = features[PREFIX_VALUES]
            template_features = self._encode(template_features)
            features[TEMPLATE_TOKEN_EMBEDDINGS] = template_features["token_embeddings"]
            features[TEMPLATE_MASK_INDEX] = template_features["prompt_mask_index"]
        return features

    def _official_denoising_positions(self, template_features: dict[str, Any]) -> None:
        """Move the template tokens after the sentence slot as many positions further as each row attends prefix
        positions (DiffAug's official ``get_delta``), inside the position table."""
        prefix = self.prefix_length or 0
        mask = template_features.get(PREFIX_ATTENTION_MASK)
        positions = template_features[POSITION_IDS]
        attended = (mask.sum(dim=1) if mask is not None else positions.new_full((positions.shape[0],), prefix))
        after_slot = torch.arange(positions.shape[1], device=positions.device) > len(self._template.left_ids)
        shifted = positions + after_slot.unsqueeze(0).long() * attended.to(positions).view(-1, 1)
        template_features[POSITION_IDS] = shifted.clamp(max=self.max_positions - 1)

    def _encode(self, features: dict[str, Any]) -> dict[str, Any]:
        """One pass of the prompted backbone (see :meth:`forward`): input vectors, the rows' prefix, positions, then
        the backbone, whose last hidden states become ``features["token_embeddings"]``."""
        inputs_embeds = self._input_vectors(features)
        selection = self.sets.select(features.get(PROMPT_TASKS), features.get(PROMPT_TASK), inputs_embeds.device)
        model_inputs = self._backbone_inputs(features, inputs_embeds, self._positions(features, selection))
        self._prefix_inputs(model_inputs, features, selection)
        output = self.auto_model(**model_inputs, attention_mask=features["attention_mask"], return_dict=True)
        features["token_embeddings"] = output.last_hidden_state
        return features

    def _input_vectors(self, features: dict[str, Any]) -> torch.Tensor:
        """The input embeddings of the batch, with the trainable vectors (soft template tokens, [CLS] prompt) in their
        slots and ``features["cls_override"]``, if given, at position 0."""
        inputs_embeds = self.auto_model.get_input_embeddings()(features["input_ids"])
        slots = self._vector_slots(features)
        if slots is not None:
            inputs_embeds = self.shallow_prompt(inputs_embeds, slots)
        if features.get(CLS_OVERRIDE) is not None:
            inputs_embeds = place_vectors(inputs_embeds, features[CLS_OVERRIDE], position=0)
        return inputs_embeds

    def _vector_slots(self, features: dict[str, Any]) -> torch.Tensor | None:
        """Which trainable vector goes to each input position (-1: none), or ``None`` when there is none."""
        slots = None
        if self._template is not None and self.template_mode == "soft":
            if SOFT_PROMPT_POSITIONS not in features:
                raise ConfigurationError(f"features lack {SOFT_PROMPT_POSITIONS!r}: tokenise with this module's "
                                         "preprocess() when it has a soft template.")
            slots = features[SOFT_PROMPT_POSITIONS]
        if self._cls_slot is not None:
            input_ids = features["input_ids"]
            slots = input_ids.new_full(input_ids.shape, -1) if slots is None else slots.to(input_ids.device).clone()
            slots[:, 0] = self._cls_slot
        return slots

    def _positions(self, features: dict[str, Any], selection: PromptSelection) -> torch.Tensor:
        """``features["position_ids"]`` (checked), else the positions after each row's prefix."""
        input_ids = features["input_ids"]
        position_ids = features.get(POSITION_IDS)
        if position_ids is None:
            encoder = selection.encoder
            lengths = selection.offsets if selection.mixed else (encoder.position_length if encoder is not None else 0)
            return self.position_ids(features["attention_mask"], lengths)
        if position_ids.shape != input_ids.shape:
            raise ConfigurationError(f"features['position_ids'] must have shape {tuple(input_ids.shape)}, got "
                                     f"{tuple(position_ids.shape)}.")
        return position_ids

    def _backbone_inputs(self, features: dict[str, Any], inputs_embeds: torch.Tensor,
                         position_ids: torch.Tensor) -> dict[str, Any]:
        """The backbone's keyword arguments (the attention mask and the prefix aside)."""
        model_inputs: dict[str, Any] = {"inputs_embeds": inputs_embeds, "position_ids": position_ids}
        accepted = self.backbone_plan.forward_arguments
        if "token_type_ids" in features and "token_type_ids" in accepted:
            model_inputs["token_type_ids"] = features["token_type_ids"]
        if "use_cache" in accepted:
            model_inputs["use_cache"] = False
        return model_inputs

    def _prefix_inputs(self, model_inputs: dict[str, Any], features: dict[str, Any],
                       selection: PromptSelection) -> None:
        """Put the rows' prefix into ``model_inputs``."""
        if selection.mixed:
            if features.get(PREFIX_ATTENTION_MASK) is not None or features.get(PREFIX_VALUES) is not None:
                raise ConfigurationError("prefix views and shared prefix draws need one prompt set for the whole "
                                         "batch.")
            model_inputs[PREFIX_KWARG] = PromptSets.mixed_injection(selection, features["input_ids"].shape[1])
        elif selection.encoder is not None:
            self._one_prefix(model_inputs, features, selection.encoder)
        elif features.get(PREFIX_ATTENTION_MASK) is not None:
            raise ConfigurationError("features['prefix_attention_mask'] was given but this encoder has no prefix.")

    def _one_prefix(self, model_inputs: dict[str, Any], features: dict[str, Any], encoder: PrefixEncoder) -> None:
        """One prefix for every row: its keys/values, the positions each row attends, and masked-out padding keys
        at inference, carried by the attention interface."""
        values = self._prefix_draw(features, encoder, features["attention_mask"].shape[0])
        if isinstance(values, torch.Tensor):
            values = PrefixDraw(values, values.shape[1], gate=encoder.gate_values())
        check_checkpointing(self)
        prefix_mask, given_mask = self._prefix_mask(features, encoder.prefix_length)
        # At inference, pad the keys to a multiple of 16 (see key_padding: the CPU kernel is up to twice as fast);
        # not in training, where attention runs through matrix products and extra keys would only cost.
        padding = 0
        if not self.training and not encoder.gated and values.keep is None:
            padding = key_padding(encoder.prefix_length, features["input_ids"].shape[1])
        if padding:
            values = pad_prefix(values, padding)
            prefix_mask = torch.cat([prefix_mask, prefix_mask.new_zeros(prefix_mask.shape[0], padding)], dim=1)
        model_inputs[PREFIX_KWARG] = PrefixInjection(values, prefix_mask if given_mask or padding else None)

    @staticmethod
    def _prefix_draw(features: dict[str, Any], encoder: PrefixEncoder, batch_size: int) -> PrefixDraw | torch.Tensor:
        """This pass's prefix keys/values (a new dropout draw in training), or those of an earlier pass given in
        ``features["prefix_values"]`` (to share its draw); written back there for a later pass."""
        values = features.get(PREFIX_VALUES)
        if values is None:
            values = encoder.values(batch_size)
        elif values.shape[1] != batch_size:
            raise ConfigurationError(f"features['{PREFIX_VALUES}'] holds a prefix for {values.shape[1]} rows, the "
                                     f"batch has {batch_size}.")
        features[PREFIX_VALUES] = values
        return values

    @staticmethod
    def _prefix_mask(features: dict[str, Any], length: int) -> tuple[torch.Tensor, bool]:
        """The prefix positions each row attends (``features["prefix_attention_mask"]``, checked, else all of them)
        as the attention mask's device and dtype, and whether the caller gave it."""
        attention_mask = features["attention_mask"]
        expected = (attention_mask.shape[0], length)
        prefix_mask = features.get(PREFIX_ATTENTION_MASK)
        if prefix_mask is None:
            return attention_mask.new_ones(expected), False
        if tuple(prefix_mask.shape) != expected:
            raise ConfigurationError(f"features['prefix_attention_mask'] must have shape (batch, prefix_length) = "
                                     f"{expected}, got {tuple(prefix_mask.shape)}.")
        return prefix_mask.to(device=attention_mask.device, dtype=attention_mask.dtype), True

    def prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """The soft prompts' tensors under the keys of ``soft_prompts.safetensors`` (``prefix_encoder.*`` for the own
        prefix, ``prompt_sets.NAME.*`` for a named set, ``shallow_prompt.*``), without any backbone weight."""
        state = self.sets.stored_state(keep_projection=True)
        if self.shallow_prompt is not None:
            state.update({"shallow_prompt." + k: v for k, v in self.shallow_prompt.state_dict().items()})
        return state

    def stored_prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """What a save writes of the prompts: :meth:`prompt_state_dict` with every reparameterised prefix replaced by
        the prefix it computes, exactly (the config then says ``prefix_projection: false``), unless inside
        :meth:`prompts_only` with ``keep_projection=True``."""
        state = self.sets.stored_state(keep_projection=getattr(self, "_keep_projection", False))
        if self.shallow_prompt is not None:
            state.update({"shallow_prompt." + k: v for k, v in self.shallow_prompt.state_dict().items()})
        return state

    @property
    def backbone_reference(self) -> str:
        """The backbone's portable name in saved configs: the packaged alias, a hub id, or an absolute path."""
        return portable_backbone_reference(self.backbone_name_or_path)

    def check_backbone_unchanged(self) -> None:
        """Raise :class:`~st_prompts.errors.BackboneMismatchError` unless the backbone's weights are those at
        :attr:`backbone_name_or_path` (what a prompts-only checkpoint refers to). Free for a backbone loaded from
        there and never trained; otherwise those weights are loaded (failing that, refused) and compared."""
        if self._backbone_may_differ:
            check_backbone_at(self.backbone_name_or_path, self.auto_model)

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        config["backbone_name_or_path"] = self.backbone_reference
        options = self.sets.saved_options()
        config["prompt_sets"] = options if options or self.sets.is_bank else None
        config["prompt_set_info"] = self.sets.saved_info()
        if not config["prompt_set_info"]:
            del config["prompt_set_info"]
        if self._prompts_only_save:
            config["prompts_only"] = True
            config["backbone_fingerprint"] = backbone_fingerprint(self.auto_model)
        if getattr(self, "_saving", False) and not getattr(self, "_keep_projection", False):
            # what stored_prompt_state_dict writes: each reparameterised prefix as the plain prefix it computes
            for name in self.sets.projected():  # (saved_options made the dicts for this config)
                (config if name == OWN else config["prompt_sets"][name])["prefix_projection"] = False
        return config

    @contextmanager
    def prompts_only(self, keep_projection: bool = False):
        """Within this context, :meth:`save` writes only the soft prompts and a reference to the backbone;
        ``keep_projection``: a reparameterised prefix keeps its MLP (see :meth:`stored_prompt_state_dict`)."""
        self._prompts_only_save, self._keep_projection = True, bool(keep_projection)
        try:
            yield self
        finally:
            self._prompts_only_save, self._keep_projection = False, False

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        """Save the module: backbone (always safetensors), tokenizer, config and ``soft_prompts.safetensors``.

        Inside :meth:`prompts_only` only the config (with the backbone reference and fingerprint) and the prompts are
        written; a reference by a local path gets a warning. Prompts are written as :meth:`stored_prompt_state_dict`.
        """
        os.makedirs(output_path, exist_ok=True)
        self._saving = True
        try:
            if self._prompts_only_save:
                reference = self.backbone_reference
                if os.path.isabs(reference):  # a local path: it loads only where that path exists
                    logger.warning(f"The prompts-only checkpoint {output_path!r} refers to its backbone by the local "
                                   f"path {reference!r}: it loads only where that path exists, or with "
                                   "model_kwargs={'backbone_name_or_path': ...} pointing at a copy with the same "
                                   "weights.")
                self.save_config(output_path)
            else:
                with dequantized_gguf(self.auto_model):
                    super().save(output_path, safe_serialization=True)
            write_prompts(self.stored_prompt_state_dict(), output_path)
        finally:
            self._saving = False
        # safetensors writes its files 0600 whatever the umask: give them the permissions of the folder's other files
        for name in os.listdir(output_path):
            if name == PROMPTS_FILE or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", name):
                apply_umask(os.path.join(output_path, name))

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token: bool | str | None = None,
             cache_folder: str | None = None, revision: str | None = None, local_files_only: bool = False,
             trust_remote_code: bool = False, model_kwargs: dict[str, Any] | None = None,
             processor_kwargs: dict[str, Any] | None = None, config_kwargs: dict[str, Any] | None = None,
             backend: str = "torch", init_defaults: dict[str, Any] | None = None, **kwargs):
        """Load a saved module (full or prompts-only).

        A prompts-only checkpoint loads its backbone from the recorded ``backbone_name_or_path``, or from
        ``model_kwargs={"backbone_name_or_path": ...}``; its weights must have the recorded fingerprint, else
        :class:`BackboneMismatchError`.
        """
        hub = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder, "revision": revision,
               "local_files_only": local_files_only}
        model_kwargs = dict(model_kwargs or {})
        backbone_override = model_kwargs.pop("backbone_name_or_path", None)
        config = cls.load_config(model_name_or_path, **hub)
        if config.pop("prompts_only", False):
            expected = config.pop("backbone_fingerprint", None)
            # older checkpoints recorded the packaged MiniLM by its absolute path in another environment
            source = backbone_override or portable_backbone_reference(config["backbone_name_or_path"])
            backbone_hub = {"token": token, "cache_dir": cache_folder, "local_files_only": local_files_only,
                            "trust_remote_code": trust_remote_code}
            init = {k: v for k, v in config.items() if k in cls.config_keys}
            init["backbone_name_or_path"] = source
            # a hub backbone neither cached nor reachable: one line in seconds, not minutes of retries
            check_hub_model(source, what="backbone", needed_by=f"the prompts-only checkpoint {model_name_or_path!r}")
            try:
                module = cls(source, **init, model_kwargs={**backbone_hub, **model_kwargs},
                             processor_kwargs={**backbone_hub, **(processor_kwargs or {})},
                             config_kwargs={**backbone_hub, **(config_kwargs or {})}, backend=backend)
            except OSError as exc:
                raise DataNotFoundError(f"The prompts-only checkpoint {model_name_or_path!r} needs its backbone "
                                        f"{source!r}, which could not be loaded ({first_line(exc)}). Pass "
                                        "model_kwargs={'backbone_name_or_path': '<local copy>'}.") from exc
            check_fingerprint(expected, module.auto_model, model_name_or_path, source)
        else:
            init_kwargs = cls._load_init_kwargs(
                model_name_or_path, trust_remote_code=trust_remote_code, model_kwargs=model_kwargs,
                processor_kwargs=processor_kwargs, config_kwargs=config_kwargs, backend=backend, **hub,
            )
            for key, value in (init_defaults or {}).items():
                init_kwargs.setdefault(key, value)
            module = cls(model_name_or_path=model_name_or_path, **init_kwargs)
        module._load_prompts(model_name_or_path, **hub)
        return module

    def load_prompt_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load soft prompts given under the keys of :meth:`prompt_state_dict` (shapes checked by the callers)."""
        self.sets.load_state(state)
        if self.shallow_prompt is not None:
            self.shallow_prompt.load_state_dict({k[len("shallow_prompt."):]: v for k, v in state.items()
                                                 if k.startswith("shallow_prompt.")})

    def _load_prompts(self, model_name_or_path: str, **hub) -> None:
        expected = {k: tuple(v.shape) for k, v in self.prompt_state_dict().items()}
        path = self.load_file_path(model_name_or_path, PROMPTS_FILE, **hub)
        self.load_prompt_state_dict(read_prompts(path, model_name_or_path, expected))

    def on_model_ready(self, model) -> None:
        """Give the model st_prompts' model card and ``task`` per row in ``model.encode``. A bank inside a
        ``Router`` is refused: both read ``task=``."""
        super().on_model_ready(model)
        if self.sets.is_bank and not any(module is self for module in model):  # in a Router: task= is the Router's
            from st_prompts.folder_checks import ROUTER_UNSUPPORTED

            raise ConfigurationError(ROUTER_UNSUPPORTED + ".")
        if not isinstance(model.__dict__.get("encode"), RowTaskEncode):
            model.encode = RowTaskEncode(model)
        if not isinstance(model.model_card_data, PromptsModelCardData):
            card = PromptsModelCardData.replacing(model.model_card_data)
            model.model_card_data = card
            card.register_model(model)

    def __repr__(self) -> str:
        return (f"PromptedTransformer(backbone={self.auto_model.__class__.__name__}, "
                f"prefix_length={self.prefix_length}, template={self.template!r}, "
                f"template_mode={self.template_mode!r}, cls_prompt={self.cls_prompt}, "
                f"template_denoising={self.template_denoising}, "
                f"freeze_backbone={self.freeze_backbone}, max_seq_length={self.max_seq_length})")
