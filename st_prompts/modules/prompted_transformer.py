"""``PromptedTransformer``: a sentence-transformers input module carrying soft prompts on a (frozen) backbone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from sentence_transformers.base.modules.transformer import Transformer

from st_prompts import utils
from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.modules.backbones import check_injection, inspect_backbone
from st_prompts.modules.checkpoint import (
    PromptsCheckpointMixin,
    backbone_identity,
    resolve_quietly,
)
from st_prompts.modules.checks import check_room_for_text, cls_token_id, validate_prompt_options
from st_prompts.modules.forward_pass import ForwardPassMixin
from st_prompts.modules.lengths import shipped_max_seq_length
from st_prompts.modules.model_card import PromptsModelCardData
from st_prompts.modules.positions import PositionsMixin
from st_prompts.modules.prompt_sets import PromptSetsMixin
from st_prompts.modules.set_checks import check_prefix_fits
from st_prompts.prompts.features import (
    DENOISING_POSITIONS,
    POSITION_IDS,
    PREFIX_ATTENTION_MASK,
    PREFIX_VALUES,
    PROMPT_TASK,
    PROMPT_TASKS,
    TEMPLATE_DENOISING,
    TEMPLATE_MASK_INDEX,
    TEMPLATE_TOKEN_EMBEDDINGS,
)
from st_prompts.prompts.prefix import PrefixEncoder
from st_prompts.trust import trusted_in_kwargs
from st_prompts.prompts.shallow import (
    ShallowPrompt,
    parse_template,
    template_only_features,
    tokenize_with_template,
)

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


class PromptedTransformer(PromptsCheckpointMixin, PositionsMixin, PromptSetsMixin, ForwardPassMixin, Transformer):
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
    explicit ``position_ids`` (:class:`~st_prompts.modules.positions.PositionsMixin`) and feeds the backbone
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

        self.prefix_encoder: PrefixEncoder | None = None
        if prefix_length is not None and check_prefix_fits(self, prefix_length, self.prefix_gate) is None:  # no alloc
            self.prefix_encoder = self.build_prefix_encoder(prefix_length, prefix_projection, prefix_hidden_size,
                                                            prefix_dropout, self.prefix_dropout_shared,
                                                            self.initial_prefix_std, gate=self.prefix_gate)

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

        self._init_prompt_sets(prompt_sets, default_task, query_task, document_task, prompt_set_info)
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

    def on_model_ready(self, model) -> None:
        """Give the model st_prompts' model card (:class:`~st_prompts.modules.model_card.PromptsModelCardData`): its
        card must say that it needs st_prompts and how to load it."""
        super().on_model_ready(model)
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
