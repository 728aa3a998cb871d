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
from st_prompts.errors import (
    BackboneMismatchError,
    ConfigurationError,
    DataFormatError,
    DataNotFoundError,
    first_line,
    shorten,
)
from st_prompts.hub import check_hub_model
from st_prompts.modules import set_checks
from st_prompts.modules.backbones import backbone_dropout, check_checkpointing, check_injection, inspect_backbone
from st_prompts.modules.checkpoint import (
    PROMPTS_FILE,
    backbone_fingerprint,
    backbone_identity,
    check_backbone_at,
    check_fingerprint,
    dequantized_gguf,
    is_local_reference,
    portable_backbone_reference,
    read_prompts,
    resolve_quietly,
    write_prompts,
)
from st_prompts.modules.checks import check_room_for_text, cls_token_id, validate_prompt_options
from st_prompts.modules.lengths import shipped_max_seq_length
from st_prompts.modules.model_card import PromptsModelCardData
from st_prompts.modules.prompt_sets import (
    OWN,
    PromptSelection,
    PromptSetData,
    PromptSets,
    RowTaskEncode,
    clean_record,
    read_prompt_set,
)
from st_prompts.modules.set_checks import check_prefix_fits
from st_prompts.prompts.features import (
    CLS_OVERRIDE,
    DENOISING_POSITIONS,
    POSITION_IDS,
    PREFIX_ATTENTION_MASK,
    PREFIX_VALUES,
    PROMPT_TASK,
    PROMPT_TASKS,
    SOFT_PROMPT_POSITIONS,
    TEMPLATE_DENOISING,
    TEMPLATE_MASK_INDEX,
    TEMPLATE_TOKEN_EMBEDDINGS,
)
from st_prompts.prompts.injection import PREFIX_KWARG, PrefixInjection
from st_prompts.prompts.prefix import PrefixDraw, PrefixEncoder, key_padding, pad_prefix
from st_prompts.prompts.shallow import (
    ShallowPrompt,
    parse_template,
    place_vectors,
    template_only_features,
    tokenize_with_template,
)
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

    * **deep continuous prompts** (DCPCSE, P-tuning v2): ``prefix_length`` trainable key/value vectors prepended to
      the keys and values of every self-attention layer. A per-row ``features["prefix_attention_mask"]`` (shape
      ``(batch, prefix_length)``, 1 = attend) lets rows attend to a *view* of the prefix (e.g. one half, see
      :func:`~st_prompts.prompts.prefix.prefix_view_mask`) without shifting any position;
    * **templates**: a ``template`` such as ``This sentence : "[X]" means [MASK] .``, either *soft* (its tokens
      become trainable input vectors initialised from their embeddings, SCPCSE) or *hard* (real, untrained tokens,
      PromptBERT); use :class:`~st_prompts.modules.MaskTokenPooling` to pool the ``[MASK]`` slot;
    * a trainable **[CLS] prompt** (``cls_prompt=True``): a vector initialised from the [CLS] token's input embedding
      that replaces the input row at position 0;
    * an **external [CLS] override**: ``features["cls_override"]`` (shape ``(batch, hidden)``) replaces the input row
      at position 0 for that call, e.g. to condition a second pass of the encoder on a sentence vector; it is not
      detached (gradient flows into it) and takes precedence over the [CLS] prompt.

    * **prompt sets** (``prompt_sets``): named deep prefixes on the same backbone, chosen per call
      (``encode(task=...)``) or per row, in one forward pass (:mod:`~st_prompts.modules.prompt_sets`).

    The prefix reaches every layer through transformers' attention interface (:mod:`~st_prompts.prompts.injection`;
    the supported backbones: :data:`~st_prompts.modules.backbones.SUPPORTED_MODEL_TYPES`). Every forward computes
    explicit ``position_ids`` (:meth:`position_ids`) and feeds the backbone
    ``inputs_embeds``; ``features["position_ids"]`` overrides them (see :meth:`template_only_features`).

    With ``freeze_backbone=True`` (the default) only the prompts receive gradients. The backbone still follows the
    module's train/eval mode, so in training its dropout makes the two views of a SimCSE positive pair differ.

    Example: ``SentenceTransformer(modules=[encoder := PromptedTransformer("bert-base-uncased", prefix_length=16),
    Pooling(encoder.get_embedding_dimension(), pooling_mode="cls")])``.

    Args:
        model_name_or_path: backbone name on the hub, local path, or an alias of the packaged MiniLM (``"minilm"``,
            see :data:`st_prompts.utils.PACKAGED_MINILM_ALIASES`), ``"smollm2"`` or a ``.gguf`` file.
        prefix_length: number of deep-prompt positions per layer (``None`` for no deep prompts, e.g. SCPCSE).
        prefix_projection: reparameterise the prefix with an MLP (``Embedding → Linear → Tanh → Linear``) for
            training; saved, it is the prefix the MLP computes (exactly), and reloads as a plain prefix.
        prefix_hidden_size: hidden size of that MLP (DCPCSE: 512; ``None``: the backbone's hidden size, DiffAug).
        prefix_dropout: dropout on the prefix keys/values in training; ``None`` uses the backbone's hidden dropout.
        prefix_dropout_shared: one prefix dropout mask per forward pass for the whole batch instead of one per example
            (DCPCSE's official code draws one per example); less memory and time, see the benchmarks.
        prefix_init_std: std of the prefix's normal initialisation (biases zero); ``None`` (default): the backbone's
            ``initializer_range``, as the official code's ``init_weights()`` gives it (0.02 for BERT).
        template: template with one ``[X]`` and one ``[MASK]`` (``None`` for no template).
        template_mode: ``"soft"`` (template tokens are trainable vectors) or ``"hard"`` (real tokens, no parameter).
        cls_prompt: add a trainable [CLS] prompt (a vector replacing the input embedding at position 0, initialised
            from the [CLS] token's input embedding, so the output is unchanged before training).
        template_denoising: with a template, also encode the template alone (every template token at the position
            it has in the full input, same prefix view and prefix draw) and write it to
            ``features["template_token_embeddings"]``/``features["template_mask_index"]``;
            :class:`~st_prompts.modules.MaskTokenPooling` then subtracts the template-only ``[MASK]`` state
            (PromptBERT's template denoising, used by DiffAug). Costs a second, short forward pass.
        freeze_backbone: keep the backbone's parameters out of training (``requires_grad=False``).
        backbone_name_or_path: where the backbone weights originally come from; recorded in the config (as the
            packaged alias, a hub id, or an absolute path) and used by prompts-only checkpoints (defaults to
            ``model_name_or_path``).
        max_seq_length: maximum number of real tokens; capped so that prefix + tokens fit the position embeddings.
        prefix_injection: ``"attention"`` (the only path; a folder saved with the removed ``"cache"`` loads on it,
            with the same outputs).
        prefix_gate: reach attention through a zero-initialised gate per layer and key/value head (LLaMA-Adapter's
            zero-initialised attention): the prefix is softmaxed on its own and added through ``tanh(gate)``, takes no
            positions, and the untrained module encodes exactly as its backbone. Default ``False``: the official DCPCSE/DiffAug prefix, part of the text's softmax.
        prompt_sets: named prompt sets, name -> options of :meth:`new_prompt_set` (their weights load with the
            module); ``default_task``: the set used without ``task`` (``None``: the module's own prefix, else the
            plain backbone); ``query_task``/``document_task``: the sets of ``encode_query``/``encode_document``.
        prompt_set_info: name -> what the set was trained on and how it scored (written by
            :func:`st_prompts.bank.train_prompt_set`, shown in the bank's model card; informational only).
        **kwargs: passed on to :class:`sentence_transformers.base.modules.Transformer` (``model_kwargs``,
            ``processor_kwargs``, ``config_kwargs``, ...).

    Raises:
        ConfigurationError: for invalid options (``prefix_length < 1``, no prompt at all, a template without
            ``[X]``/``[MASK]``, a prefix (plus template) leaving fewer than :data:`MIN_TEXT_TOKENS` positions for
            text, a non-torch backend).
        DataNotFoundError: for the packaged-MiniLM alias when its package is not installed.
        UnsupportedArchitectureError: for backbones that cannot carry deep prompts.
    """

    config_keys: list[str] = Transformer.config_keys + [
        "prefix_length",
        "prefix_projection",
        "prefix_hidden_size",
        "prefix_dropout",
        "prefix_dropout_shared",
        "prefix_init_std",
        "template",
        "template_mode",
        "cls_prompt",
        "template_denoising",
        "freeze_backbone",
        "backbone_name_or_path",
        "max_seq_length",
        "prefix_injection",
        "prefix_gate",
        "prompt_sets",
        "prompt_set_info",
        "default_task",
        "query_task",
        "document_task",
    ]

    def __init__(
        self,
        model_name_or_path: str,
        prefix_length: int | None = 16,
        *,
        prefix_projection: bool = False,
        prefix_hidden_size: int | None = 512,
        prefix_dropout: float | None = None,
        prefix_dropout_shared: bool = False,
        prefix_init_std: float | None = None,
        template: str | None = None,
        template_mode: str = "soft",
        cls_prompt: bool = False,
        template_denoising: bool = False,
        freeze_backbone: bool = True,
        backbone_name_or_path: str | None = None,
        max_seq_length: int | None = None,
        prefix_injection: str = "attention",
        prefix_gate: bool = False,
        prompt_sets: dict[str, dict[str, Any]] | None = None,
        default_task: str | None = None,
        query_task: str | None = None,
        document_task: str | None = None,
        prompt_set_info: dict[str, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        validate_prompt_options(prefix_length, template, template_mode, cls_prompt, prefix_hidden_size, prefix_dropout,
                                 prefix_init_std, bank=prompt_sets is not None)
        if kwargs.get("backend", "torch") != "torch":
            raise ConfigurationError("PromptedTransformer needs the 'torch' backend (ONNX/OpenVINO cannot take prompts).")
        if kwargs.get("transformer_task", "feature-extraction") != "feature-extraction":
            raise ConfigurationError("PromptedTransformer only supports transformer_task='feature-extraction'.")
        # Prompts need padded batches: never let sentence-transformers flatten (unpad) the inputs.
        kwargs["unpad_inputs"] = False
        # Aliases of the packaged MiniLM resolve here (fails fast when its package is missing: no hub retries).
        requested = str(model_name_or_path)
        model_name_or_path = utils.resolve_model_name(requested)
        # A GGUF model (the packaged SmolLM2 "smollm2", or a .gguf file): transformers de-quantises it from its folder.
        location, gguf_file, _ = utils.resolve_gguf(model_name_or_path)
        # Nothing of the backbone runs, and nothing is unpickled, unless the user trusts it (--trust-remote-code):
        # its files are checked against st_prompts.trust's allow-list before transformers reads them.
        from st_prompts.folder_checks import require_safe_backbone, safe_loading

        #: Whether the user trusted the backbone's code (``trust_remote_code=True`` reached this module).
        self.trust_remote_code = trusted_in_kwargs(kwargs)
        require_safe_backbone(requested, self.trust_remote_code)
        if gguf_file:
            for key in ("model_kwargs", "processor_kwargs", "config_kwargs"):
                kwargs[key] = {"gguf_file": gguf_file, **(kwargs.get(key) or {})}
            model_name_or_path = requested
        with safe_loading(self.trust_remote_code) as safe:
            kwargs["model_kwargs"] = {**safe, **(kwargs.get("model_kwargs") or {})}
            super().__init__(location, **kwargs)
        config = self.auto_model.config
        #: The backbone's own length limit, before any training length: the ``max_seq_length`` of the
        #: sentence-transformers model saved at ``location`` (256 for all-MiniLM-L6-v2), else its tokenizer's limit
        #: (capped by sentence-transformers at the position table); ``None`` if it has none. The saved model of a
        #: training run encodes up to it (:func:`~st_prompts.modules.lengths.backbone_encode_length`).
        self.backbone_max_length: int | None = shipped_max_seq_length(location) or (
            self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1_000_000 else None)
        #: How this backbone takes the prompts (attention calls, heads, positions): see inspect_backbone.
        self.backbone_plan = inspect_backbone(self.auto_model)
        #: ``"attention"``: the prefix reaches every layer through transformers' attention interface (a saved
        #: ``"cache"``, the removed key/value-cache path, loads as ``"attention"``: the same outputs).
        self.prefix_injection = check_injection(prefix_injection)
        if self.backbone_plan.causal and (template is not None or cls_prompt):
            raise ConfigurationError(
                f"A causal decoder ({config.model_type}) has no [CLS] and no [MASK] slot that later tokens read: "
                "templates and the [CLS] prompt are for encoders; pool a decoder's last token or its mean "
                "(pooling 'lasttoken' or 'mean') and let the deep prefix carry the prompt."
            )
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
        #: Where the backbone can be loaded from here (aliases resolved); saved configs hold
        #: :attr:`backbone_reference` instead.
        self.backbone_name_or_path = (
            resolve_quietly(str(backbone_name_or_path)) if backbone_name_or_path else model_name_or_path
        )
        self._prompts_only_save = False
        # Whether the backbone's weights may differ from those at backbone_name_or_path: loaded from elsewhere (a full
        # checkpoint) or made trainable at some point. save_prompts_only then checks them (see there).
        self._backbone_may_differ = backbone_identity(model_name_or_path) != backbone_identity(self.backbone_name_or_path)
        # RoBERTa-family position ids start at padding_idx + 1 (0 elsewhere); only learned absolute positions are
        # shifted by the prefix (rotary models: the prefix has no position).
        self._position_offset = self._infer_flatten_position_offset() if self.backbone_plan.absolute_positions else 0

        #: The prompt sets (:class:`~st_prompts.modules.prompt_sets.PromptSets`): this module's own prefix (the set
        #: :data:`~st_prompts.modules.prompt_sets.OWN`) and, in a bank (``prompt_sets`` given, even empty), named ones.
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
                raise ConfigurationError(
                    "The template has no token besides [X] and [MASK]: nothing to train (use template_mode='hard')."
                )
        self._cls_slot: int | None = None
        if self.cls_prompt:
            self._cls_slot = len(vector_ids)
            vector_ids.append(cls_token_id(self.tokenizer))
        self.shallow_prompt: ShallowPrompt | None = None
        if vector_ids:
            self.shallow_prompt = ShallowPrompt.from_token_ids(vector_ids, self.auto_model.get_input_embeddings().weight)

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
                logger.warning(
                    f"max_seq_length={max_seq_length} does not fit the backbone with {prefix_length} prefix positions; "
                    f"using {limit}."
                )
            max_seq_length = min(self.tokenizer.model_max_length, limit)
        self.tokenizer.model_max_length = max_seq_length

    # ------------------------------------------------------------------ prompt sets
    @property
    def prefix_encoder(self) -> PrefixEncoder | None:
        """This module's own prefix (the one a method trains), or ``None``."""
        return self.sets.own

    @property
    def prompt_sets(self) -> torch.nn.ModuleDict:
        """Name -> prefix of the named prompt sets, in the order they were added (a view: change the sets with
        :meth:`new_prompt_set`, :meth:`add_prompt_set`, :meth:`remove_prompt_set`)."""
        return torch.nn.ModuleDict(self.sets.named())

    @property
    def prompt_set_names(self) -> list[str]:
        """The names of the prompt sets, in the order they were added."""
        return self.sets.names

    @property
    def prompt_set_info(self) -> dict[str, dict[str, Any]]:
        """Name -> what the set was trained on and how it scored (see :meth:`record_prompt_set`)."""
        return self.sets.info

    @property
    def _is_bank(self) -> bool:
        return self.sets.is_bank

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
        ``spec`` (a :class:`~st_prompts.prompts.spec.PromptSetSpec`, which checks the options) says.

        ``prefix_gate=True``: the set reaches attention through a zero-initialised gate (see
        :class:`~st_prompts.prompts.PrefixEncoder`), so until it trains the bank encodes this task exactly as the
        backbone does. ``internal``: the name may be a server's ``name@N``
        (:func:`~st_prompts.prompts.names.internal_name`)."""
        self.sets.check_new_name(name, internal)
        if spec is None:
            spec = PromptSetSpec(prefix_length, bool(prefix_projection), prefix_hidden_size, prefix_dropout,
                                 bool(prefix_gate), init_std)
        check_prefix_fits(self, spec.prefix_length, spec.prefix_gate, self.template_num_tokens)  # before allocating
        encoder = self._build_prefix(spec)
        if not _room_checked_by_caller:
            self._check_room(encoder.position_length)
        # on the backbone's device, and in its dtype where it was cast to half precision (precision.apply_dtype)
        weights = next(self.auto_model.parameters())
        return self.sets.add(name, encoder.to(device=weights.device, dtype=weights.dtype), spec, internal)

    def add_prompt_set(self, name: str, source: str | os.PathLike | PromptSetData | Any, *,
                       internal: bool = False) -> PrefixEncoder:
        """Add a trained prompt set under ``name``: the deep prefix of a saved model folder or prompts-only checkpoint
        (read as data, no code runs: :func:`~st_prompts.modules.prompt_sets.read_prompt_set`), such data itself
        (:class:`~st_prompts.modules.prompt_sets.PromptSetData`), or the own prefix of a
        :class:`~st_prompts.PromptedTransformer` / SentenceTransformer.

        Raises:
            BackboneMismatchError: the set was trained on other backbone weights (fingerprint), or for another
                architecture (layers, heads, head size).
            ConfigurationError: the name is taken or outside the grammar (``internal``: a server's ``name@N`` may be
                given); the source has no deep prefix, or also a template or [CLS] prompt (only deep prefixes share a
                batch).
        """
        self.sets.check_new_name(name, internal)
        if isinstance(source, (str, os.PathLike, PromptSetData)):
            label = "the given data" if isinstance(source, PromptSetData) else repr(str(source))
            data = source if isinstance(source, PromptSetData) else read_prompt_set(str(source))
            spec, state = data.spec, data.state
            if data.fingerprint is not None and data.fingerprint != self.fingerprint:
                raise BackboneMismatchError(f"The prompt set in {label} was trained on other backbone weights "
                                            f"(fingerprint {data.fingerprint}, this backbone {self.fingerprint}).")
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
            spec, state, label = encoder.own_prefix_spec(), encoder.prefix_encoder.state_dict(), "the given model"
        # the backbone's room first (the clearer refusal of a too-long prefix), then the shapes the spec asks for, on
        # torch's meta device: both before anything is allocated for the set
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
        with torch.no_grad():
            encoder.load_state_dict({k: v.to(next(encoder.parameters()).device) for k, v in state.items()})
        return encoder

    def remove_prompt_set(self, name: str) -> None:
        """Remove the prompt set ``name`` (and unset any role it had)."""
        self.sets.remove(name)

    def record_prompt_set(self, name: str, **record: Any) -> None:
        """Record what the set ``name`` was trained on and how it scored (saved with the bank, shown in its model
        card): ``rows``, ``loss``, ``evaluator``, ``metric``, ``best_score``, ``best_step``, ``start_score`` (step 0),
        ``backbone_score``, ``steps``; ``None`` values are left out. Replaces an earlier record of that set."""
        self.sets.record(name, **record)

    def prompt_set_spec(self, name: str) -> PromptSetSpec:
        """The :class:`~st_prompts.prompts.spec.PromptSetSpec` of the set ``name``."""
        return self.sets.spec(name)

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

    def _known_tasks(self) -> str:
        return self.sets.known()

    @property
    def fingerprint(self) -> str:
        """The backbone's weight fingerprint (computed once: the backbone of a bank stays frozen)."""
        cached = getattr(self, "_fingerprint", None)
        if cached is None or not self.freeze_backbone:
            cached = self._fingerprint = backbone_fingerprint(self.auto_model)
        return cached

    def _build_prefix(self, spec: PromptSetSpec, shared_dropout: bool = False) -> PrefixEncoder:
        """A deep prefix for ``spec`` shaped for this backbone (its prefix layers, key/value heads and head size),
        initialised as the official code does (default std: :attr:`initial_prefix_std`)."""
        plan, config = self.backbone_plan, self.auto_model.config
        return PrefixEncoder(
            prefix_length=spec.prefix_length,
            num_layers=plan.layers,
            num_heads=plan.kv_heads,
            head_dim=plan.head_dim,
            projection=spec.prefix_projection,
            projection_hidden_size=spec.prefix_hidden_size or config.hidden_size,
            dropout=backbone_dropout(config) if spec.prefix_dropout is None else spec.prefix_dropout,
            shared_dropout=shared_dropout,
            init_std=self.initial_prefix_std if spec.init_std is None else spec.init_std,
            gate=spec.prefix_gate,
        )

    # ------------------------------------------------------------------ positions
    @property
    def prefix_positions(self) -> int:
        """Positions the prefix takes from the text: the longest prefix (own or of a prompt set) with learned absolute
        positions (the text starts after the prefix, as after a key/value cache in the official DCPCSE code), 0 with
        rotary positions."""
        if not self.backbone_plan.absolute_positions:
            return 0
        return max([0, *(encoder.position_length for encoder in self.sets.prefixes.values())])

    def _check_room(self, prefix_length: int) -> None:
        """Make room for a prompt set of ``prefix_length`` positions (a shorter ``max_seq_length`` if need be)."""
        if not self.backbone_plan.absolute_positions:
            return
        check_room_for_text(self.max_positions, self._position_offset,
                            self.tokenizer.num_special_tokens_to_add(pair=False), self.template_num_tokens,
                            prefix_length)
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
        # RoBERTa-family position ids start at padding_idx + 1; transformers offsets them by the cache length.
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
        """The position ids of the real tokens, on every path (deep prefix, template, overrides).

        Learned absolute positions: exactly what transformers computes from ``input_ids`` after a cache of
        ``prefix_length`` positions. BERT-style embeddings number the ``seq`` positions ``prefix_length, ...,
        prefix_length + seq - 1``; RoBERTa-style ones (positions from ``padding_idx + 1``) number real tokens
        ``padding_idx + 1 + prefix_length + i`` and give padding ``padding_idx``.

        Args:
            attention_mask: ``(batch, seq)`` mask of the real tokens (without the prefix).
            prefix_lengths: the prefix length of the pass, or of each row (``(batch,)``: rows of several prompt sets);
                default ``prefix_length``.

        Rotary positions: ``0, 1, ...`` over the real tokens, whichever side the padding is on.
        """
        if not self.backbone_plan.absolute_positions:
            # Rotary (or no) positions: the text keeps the positions it has without a prefix, counted over the real
            # tokens so that left and right padding give a row the same positions.
            return (torch.cumsum(attention_mask.long(), dim=1) - 1).clamp(min=0)
        if prefix_lengths is None:
            own = getattr(self, "prefix_encoder", None)
            prefix_lengths = own.position_length if own is not None else 0
        prefix = prefix_lengths
        if isinstance(prefix, torch.Tensor):
            prefix = prefix.to(attention_mask.device).view(-1, 1)
        if self._position_offset:  # RoBERTa family
            padding_idx = self._position_offset - 1
            mask = (attention_mask != 0).long()
            return (torch.cumsum(mask, dim=1) + prefix) * mask + padding_idx
        batch, seq = attention_mask.shape
        return (torch.arange(seq, device=attention_mask.device).unsqueeze(0) + prefix).expand(batch, seq)


    def _load_model(self, model_name_or_path: str, transformer_task: Any, config: Any, backend: str,
                    is_peft_model: bool, **model_kwargs: Any) -> Any:
        """sentence-transformers' loading, with transformers' loading report checked: a backbone folder missing
        weights the model has (e.g. written by ``save_pretrained`` of an int8 model, whose linear weights live
        outside ``state_dict``) is refused in one line instead of loading as random layers with a warning."""
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

    # ------------------------------------------------------------------ options
    @property
    def freeze_backbone(self) -> bool:
        """Whether the backbone's parameters are frozen (only the soft prompts train). Settable, e.g. for DiffAug."""
        return self._freeze_backbone

    @freeze_backbone.setter
    def freeze_backbone(self, value: bool) -> None:
        self._freeze_backbone = bool(value)
        if not self._freeze_backbone:
            # Once trainable, the backbone may differ from the weights at backbone_name_or_path (save_prompts_only).
            self._backbone_may_differ = True
        for parameter in self.auto_model.parameters():
            parameter.requires_grad = not self._freeze_backbone

    @property
    def initial_prefix_std(self) -> float:
        """The std of the prefix's initialisation: ``prefix_init_std``, else the backbone's ``initializer_range``
        (what the official DCPCSE and DiffAug code give it; 0.02 when the config has none)."""
        if self.prefix_init_std is not None:
            return float(self.prefix_init_std)
        return float(getattr(self.auto_model.config, "initializer_range", None) or 0.02)

    @property
    def parsed_template(self):
        """The template split around its ``[X]`` slot (:class:`~st_prompts.prompts.shallow.ParsedTemplate`), or
        ``None`` without a template."""
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
        params = []
        for module in (self.prefix_encoder, self.shallow_prompt):
            if module is not None:
                params.extend(module.parameters())
        return params

    # ------------------------------------------------------------------ preprocessing
    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, task: str | None = None,
                   **kwargs) -> dict[str, Any]:
        """Tokenise texts. With a template, the sentence is put into the template's ``[X]`` slot and only the sentence
        is truncated, so the template (and its ``[MASK]``) always survives. ``task`` (``encode(task=...)``) chooses
        the prompt set of every row (a task per row: :func:`~st_prompts.modules.rows.encode_rows`)."""
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
                raise ConfigurationError(
                    f"A PromptedTransformer with a template encodes single texts only, got {type(item).__name__}."
                )
            texts.append(prompt + item if prompt else item)
        return tokenize_with_template(self.tokenizer, self._template, self.template_mode == "soft", texts,
                                      self.max_seq_length)

    def template_only_features(self, features: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Features for the template alone (the sentence removed from every row), each template token keeping the
        position id it has in ``features``, so that its representation is comparable with the full one (template
        denoising). The per-row prefix attention mask, if any, is kept.

        Args:
            features: features of this module's template tokenisation (:meth:`preprocess`).
        """
        if self._template is None:
            raise ConfigurationError("template_only_features needs a PromptedTransformer with a template.")
        positions = features.get(POSITION_IDS)
        if positions is None:
            positions = self.position_ids(features["attention_mask"])
        return template_only_features(self._template, features, positions)

    # ------------------------------------------------------------------ forward
    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        """Run the prompted backbone; writes ``features["token_embeddings"]`` (real tokens only, prefix excluded).

        Optional ``features`` keys: ``prefix_attention_mask`` (``(batch, prefix_length)``, 1 = attend: a view of the
        prefix per row), ``cls_override`` (``(batch, hidden)``: replaces the input row at position 0, gradient kept),
        ``position_ids`` (``(batch, seq)``: explicit positions, prefix offset included), ``prefix_values`` (the
        prefix keys/values of an earlier pass, to reuse its dropout draw: a :class:`~st_prompts.prompts.PrefixDraw`, or
        a dense ``(2L, batch, heads, l, head_dim)`` tensor).

        With a prefix, ``features["prefix_values"]`` is set to the keys/values this pass used (a
        :class:`~st_prompts.prompts.PrefixDraw` from :meth:`PrefixEncoder.values`), so that a second pass over the same
        rows (e.g. DCPCSE's MLM pass) can share them.

        With ``template_denoising`` (or ``features["template_denoising"] = True``, which a loss sets for its own
        columns: DiffAug denoises in its contrastive loss only), the template alone (:meth:`template_only_features`,
        same positions, same prefix view and prefix draw) is encoded too and written to
        ``features["template_token_embeddings"]`` and ``features["template_mask_index"]``;
        ``features["template_denoising"] = False`` turns it off for that call.
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
        positions: the state DiffAug's official ``get_delta`` subtracts. It indexes its template-alone batch (row
        ``i``: tokens after the slot shifted by ``i``) with ``attention_mask.sum(-1) - template length``, a mask that
        includes the prefix-mask columns (``l`` ones for a view of ``2l`` positions), so the subtracted ``[MASK]``
        state sits ``l`` positions off the sentence's own. Positions stay inside the position table."""
        prefix = self.prefix_length or 0
        mask = template_features.get(PREFIX_ATTENTION_MASK)
        positions = template_features[POSITION_IDS]
        attended = (mask.sum(dim=1) if mask is not None else positions.new_full((positions.shape[0],), prefix))
        after_slot = torch.arange(positions.shape[1], device=positions.device) > len(self._template.left_ids)
        shifted = positions + after_slot.unsqueeze(0).long() * attended.to(positions).view(-1, 1)
        template_features[POSITION_IDS] = shifted.clamp(max=self.max_positions - 1)

    # ------------------------------------------------------------------ one pass
    def _encode(self, features: dict[str, Any]) -> dict[str, Any]:
        """One pass of the prompted backbone, step by step (see :meth:`forward`): the input vectors (soft template
        tokens, [CLS] prompt or a caller's override in their slots), which prefix the rows use (one set, none, or a
        mix: :meth:`~st_prompts.modules.prompt_sets.PromptSets.select`), the positions, what else the backbone
        takes, the prefix, then the backbone, whose last hidden states become ``features["token_embeddings"]``."""
        input_ids = features["input_ids"]
        inputs_embeds = self._input_vectors(features)
        selection = self.sets.select(features.get(PROMPT_TASKS), features.get(PROMPT_TASK), input_ids.device)
        model_inputs = self._backbone_inputs(features, inputs_embeds, self._positions(features, selection))
        attention_mask = self._prefix_inputs(model_inputs, features, selection)
        output = self.auto_model(**model_inputs, attention_mask=attention_mask, return_dict=True)
        features["token_embeddings"] = output.last_hidden_state
        return features

    # ------------------------------------------------------------------ inputs
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
                raise ConfigurationError(
                    f"features lack {SOFT_PROMPT_POSITIONS!r}: tokenise with this module's preprocess() when it has a "
                    "soft template."
                )
            slots = features[SOFT_PROMPT_POSITIONS]
        if self._cls_slot is not None:
            input_ids = features["input_ids"]
            slots = input_ids.new_full(input_ids.shape, -1) if slots is None else slots.to(input_ids.device).clone()
            slots[:, 0] = self._cls_slot
        return slots

    def _positions(self, features: dict[str, Any], selection: PromptSelection) -> torch.Tensor:
        """``features["position_ids"]`` (checked), else the positions after the prefix each row uses (a gated
        prefix, or none, takes no positions)."""
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

    # ------------------------------------------------------------------ the prefix
    def _prefix_inputs(self, model_inputs: dict[str, Any], features: dict[str, Any],
                       selection: PromptSelection) -> torch.Tensor:
        """Put the rows' prefix into ``model_inputs``; returns the attention mask the backbone takes."""
        attention_mask = features["attention_mask"]
        if selection.mixed:
            if features.get(PREFIX_ATTENTION_MASK) is not None or features.get(PREFIX_VALUES) is not None:
                raise ConfigurationError("prefix views and shared prefix draws need one prompt set for the whole "
                                         "batch.")
            model_inputs[PREFIX_KWARG] = PromptSets.mixed_injection(selection, features["input_ids"].shape[1])
        elif selection.encoder is not None:
            attention_mask = self._one_prefix(model_inputs, features, selection.encoder)
        elif features.get(PREFIX_ATTENTION_MASK) is not None:
            raise ConfigurationError("features['prefix_attention_mask'] was given but this encoder has no prefix.")
        return attention_mask

    def _one_prefix(self, model_inputs: dict[str, Any], features: dict[str, Any],
                    encoder: PrefixEncoder) -> torch.Tensor:
        """One prefix for every row: its keys/values (:meth:`_prefix_draw`), the positions each row attends
        (:meth:`_prefix_mask`), masked-out padding keys at inference (see
        :func:`~st_prompts.prompts.prefix.key_padding`), carried by the attention interface. Returns the attention
        mask."""
        attention_mask = features["attention_mask"]
        values = self._prefix_draw(features, encoder, attention_mask.shape[0])
        check_checkpointing(self)
        prefix_mask, given_mask = self._prefix_mask(features, encoder.prefix_length)
        # At inference (no per-example draw), pad the keys to a multiple of 16 with masked-out positions: the CPU
        # attention kernel is up to twice as fast there (see key_padding). Not in training, where attention runs
        # through matrix products (dropout) and extra keys would only cost.
        padding = 0
        if not self.training and not encoder.gated and (isinstance(values, torch.Tensor) or values.keep is None):
            padding = key_padding(encoder.prefix_length, features["input_ids"].shape[1])
        if padding:
            values = pad_prefix(values, padding)
            prefix_mask = torch.cat([prefix_mask, prefix_mask.new_zeros(prefix_mask.shape[0], padding)], dim=1)
        if isinstance(values, torch.Tensor):
            values = PrefixDraw(values, values.shape[1], gate=encoder.gate_values())
        model_inputs[PREFIX_KWARG] = PrefixInjection(values, prefix_mask if given_mask or padding else None)
        return attention_mask

    @staticmethod
    def _prefix_draw(features: dict[str, Any], encoder: PrefixEncoder, batch_size: int) -> PrefixDraw | torch.Tensor:
        """This pass's prefix keys/values (a new dropout draw in training), or those of an earlier pass given in
        ``features["prefix_values"]`` (to share its draw); written back there for a later pass. The prefix is
        broadcast over the batch; views of the prefix are made by the attention mask alone."""
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
        batch_size = attention_mask.shape[0]
        prefix_mask = features.get(PREFIX_ATTENTION_MASK)
        if prefix_mask is None:
            prefix_mask, given = attention_mask.new_ones(batch_size, length), False
        elif tuple(prefix_mask.shape) != (batch_size, length):
            raise ConfigurationError(
                f"features['prefix_attention_mask'] must have shape (batch, prefix_length) = "
                f"{(batch_size, length)}, got {tuple(prefix_mask.shape)}."
            )
        else:
            given = True
        return prefix_mask.to(device=attention_mask.device, dtype=attention_mask.dtype), given

    # ------------------------------------------------------------------ saving and loading
    def prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """The soft prompts' tensors under the keys of ``soft_prompts.safetensors`` (``prefix_encoder.*`` for the own
        prefix, ``prompt_sets.NAME.*`` for a named set, ``shallow_prompt.*``), without any backbone weight."""
        state = self.sets.stored_state(keep_projection=True)
        if self.shallow_prompt is not None:
            state.update({"shallow_prompt." + k: v for k, v in self.shallow_prompt.state_dict().items()})
        return state

    def stored_prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """What a save writes of the prompts: :meth:`prompt_state_dict` with every reparameterised prefix (the own one
        and each set's) replaced by the prefix it computes (:meth:`~st_prompts.prompts.PrefixEncoder.stored_state_dict`),
        exactly; its config then says ``prefix_projection: false``, so the folder reloads as a plain prefix that
        encodes the same. Inside :meth:`prompts_only` with ``keep_projection=True`` (a checkpoint training resumes
        from) the MLP is kept."""
        state = self.sets.stored_state(keep_projection=getattr(self, "_keep_projection", False))
        if self.shallow_prompt is not None:
            state.update({"shallow_prompt." + k: v for k, v in self.shallow_prompt.state_dict().items()})
        return state

    @property
    def backbone_reference(self) -> str:
        """The portable name of the backbone written to saved configs: the packaged alias (``"minilm"``), a hub id,
        or (for other local folders) an absolute path."""
        return portable_backbone_reference(self.backbone_name_or_path)

    def check_backbone_unchanged(self) -> None:
        """Make sure the backbone's weights are those at :attr:`backbone_name_or_path` (what a prompts-only checkpoint
        refers to); raise :class:`~st_prompts.errors.BackboneMismatchError` if they differ.

        Cheap for the usual case: a backbone loaded from ``backbone_name_or_path`` and never made trainable is the
        same by construction. Otherwise (made trainable at some point, or loaded from a full checkpoint) the weights
        at ``backbone_name_or_path`` are loaded and their fingerprints compared; if they cannot be loaded, the
        check refuses too (a prompts-only checkpoint could not be loaded either).
        """
        if self._backbone_may_differ:
            check_backbone_at(self.backbone_name_or_path, self.auto_model)

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        config["backbone_name_or_path"] = self.backbone_reference
        options = self.sets.saved_options()
        config["prompt_sets"] = options if options or self.sets.is_bank else None
        info = self.sets.saved_info()
        if info:
            config["prompt_set_info"] = info
        else:
            config.pop("prompt_set_info", None)
        if self._prompts_only_save:
            config["prompts_only"] = True
            config["backbone_fingerprint"] = backbone_fingerprint(self.auto_model)
        if getattr(self, "_saving", False) and not getattr(self, "_keep_projection", False):
            # what stored_prompt_state_dict writes: each reparameterised prefix as the plain prefix it computes
            for name in self.sets.projected():
                if name == OWN:
                    config["prefix_projection"] = False
                else:
                    config["prompt_sets"] = {**config["prompt_sets"],
                                             name: {**config["prompt_sets"][name], "prefix_projection": False}}
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
        """Save the module: backbone (safetensors), tokenizer, config and ``soft_prompts.safetensors``.

        Inside :meth:`prompts_only` only the config (with the backbone reference and fingerprint) and the prompts are
        written. The reference is portable for the packaged MiniLM (its alias) and hub models (their id); for other
        local folders it is their absolute path, and a warning says so. Weights are always written as safetensors.
        A reparameterised prefix is written as the prefix it computes (:meth:`stored_prompt_state_dict`).
        """
        os.makedirs(output_path, exist_ok=True)
        self._saving = True
        try:
            if self._prompts_only_save:
                reference = self.backbone_reference
                if is_local_reference(reference):
                    logger.warning(
                        f"The prompts-only checkpoint {output_path!r} refers to its backbone by the local path "
                        f"{reference!r}: it loads only where that path exists, or with "
                        "model_kwargs={'backbone_name_or_path': ...} pointing at a copy with the same weights."
                    )
                self.save_config(output_path)
            else:
                with dequantized_gguf(self.auto_model):
                    super().save(output_path, safe_serialization=True)
            write_prompts(self.stored_prompt_state_dict(), output_path)
        finally:
            self._saving = False
        # safetensors writes its files 0600 whatever the umask (a model.save outside st-prompts' atomic folders too):
        # give them the permissions every other file of the folder has
        for name in os.listdir(output_path):
            if name == PROMPTS_FILE or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", name):
                apply_umask(os.path.join(output_path, name))

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        config_kwargs: dict[str, Any] | None = None,
        backend: str = "torch",
        init_defaults: dict[str, Any] | None = None,
        **kwargs,
    ):
        """Load a saved module (full or prompts-only).

        A prompts-only checkpoint loads its backbone from the recorded ``backbone_name_or_path`` (the packaged-MiniLM
        alias resolves to the installed package); pass ``model_kwargs={"backbone_name_or_path": ...}`` to
        ``SentenceTransformer(...)`` to point elsewhere (e.g. a local copy). The backbone's weights must have the
        recorded fingerprint, else :class:`BackboneMismatchError`.
        """
        hub = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder, "revision": revision,
               "local_files_only": local_files_only}
        model_kwargs = dict(model_kwargs or {})
        backbone_override = model_kwargs.pop("backbone_name_or_path", None)
        config = cls.load_config(model_name_or_path, **hub)
        if config.pop("prompts_only", False):
            expected = config.pop("backbone_fingerprint", None)
            # Older checkpoints recorded the packaged MiniLM by its absolute path in another environment.
            source = backbone_override or portable_backbone_reference(config["backbone_name_or_path"])
            backbone_hub = {"token": token, "cache_dir": cache_folder, "local_files_only": local_files_only,
                            "trust_remote_code": trust_remote_code}
            init = {k: v for k, v in config.items() if k in cls.config_keys}
            init["backbone_name_or_path"] = source
            # A hub backbone that is neither cached nor reachable: one line in seconds, not minutes of retries.
            check_hub_model(source, what="backbone", needed_by=f"the prompts-only checkpoint {model_name_or_path!r}")
            try:
                module = cls(
                    source,
                    **init,
                    model_kwargs={**backbone_hub, **model_kwargs},
                    processor_kwargs={**backbone_hub, **(processor_kwargs or {})},
                    config_kwargs={**backbone_hub, **(config_kwargs or {})},
                    backend=backend,
                )
            except OSError as exc:
                raise DataNotFoundError(
                    f"The prompts-only checkpoint {model_name_or_path!r} needs its backbone {source!r}, which could not "
                    f"be loaded ({first_line(exc)}). Pass model_kwargs={{'backbone_name_or_path': '<local copy>'}}."
                ) from exc
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
        """Load soft prompts given under the keys :meth:`prompt_state_dict` uses (those of a saved folder's
        ``soft_prompts.safetensors``); the shapes must be this module's (checked by the callers that read files)."""
        self.sets.load_state(state)
        if self.shallow_prompt is not None:
            self.shallow_prompt.load_state_dict({k[len("shallow_prompt."):]: v for k, v in state.items()
                                                 if k.startswith("shallow_prompt.")})

    def _load_prompts(self, model_name_or_path: str, **hub) -> None:
        expected = {k: tuple(v.shape) for k, v in self.prompt_state_dict().items()}
        path = self.load_file_path(model_name_or_path, PROMPTS_FILE, **hub)
        self.load_prompt_state_dict(read_prompts(path, model_name_or_path, expected))

    def on_model_ready(self, model) -> None:
        """Give the model st_prompts' model card (:class:`~st_prompts.modules.model_card.PromptsModelCardData`): its
        card must say that it needs st_prompts and how to load it), and ``task`` per row in ``model.encode``. A bank
        inside a ``Router`` is refused: both read ``task=``."""
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
        return (
            f"PromptedTransformer(backbone={self.auto_model.__class__.__name__}, prefix_length={self.prefix_length}, "
            f"template={self.template!r}, template_mode={self.template_mode!r}, cls_prompt={self.cls_prompt}, "
            f"template_denoising={self.template_denoising}, "
            f"freeze_backbone={self.freeze_backbone}, max_seq_length={self.max_seq_length})"
        )
