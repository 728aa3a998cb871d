"""DCPCSE's auxiliary masked-language-modelling objective through the prompted encoder: every column is masked and
re-encoded with its contrastive pass's prefix; the checkpoint's MLM head (its decoder a trainable copy of the word
embeddings) trains with the prompts; loss = CL + w(step) · MLM with w(step) = 0.1 · 0.95^(step / 100)."""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForMaskedLM, DataCollatorForLanguageModeling
from transformers.utils import cached_file

from st_prompts.storage import contained_path
from st_prompts.utils import resolve_model_name

logger = logging.getLogger(__name__)


def mlm_weight(step: int, weight: float = 0.1, decay: float = 0.95, decay_steps: int = 100) -> float:
    """DCPCSE's auxiliary MLM weight at optimisation step ``step``: ``weight · decay^(step / decay_steps)``."""
    return weight * decay ** (step / decay_steps)


def _checkpoint_tensors(source: str, prefixes: tuple[str, ...], pickles: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint (folder or hub id) whose names start with one of ``prefixes``, read lazily from
    its safetensors; ``pytorch_model.bin`` only with ``pickles=True`` (a trusted backbone). ``{}`` if none."""

    def find(name: str) -> str | None:
        try:
            return cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except (OSError, ValueError):
            return None

    files: list[str] = []
    if (single := find("model.safetensors")) is not None:
        files = [single]
    elif (index := find("model.safetensors.index.json")) is not None:
        with open(index) as f:
            shards = sorted({shard for key, shard in json.load(f)["weight_map"].items() if key.startswith(prefixes)})
        for shard in shards:  # file names read from a file: they stay in the model's folder
            contained_path(os.path.dirname(index), shard, index)
        files = [p for p in (find(s) for s in shards) if p is not None]
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(prefixes):
                    tensors[key] = handle.get_tensor(key)
    if not files and pickles and (binary := find("pytorch_model.bin")) is not None:
        state = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
        tensors = {k: v.clone() for k, v in state.items() if k.startswith(prefixes)}
    # Old BERT checkpoints name LayerNorm parameters gamma/beta (transformers renames them when it loads a model).
    return {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
            for k, v in tensors.items()}


class MLMHead(nn.Module):
    """The backbone's masked-LM head, trained with the prompts (as the official DCPCSE code): built alone, its weights
    read from the checkpoint by name (else freshly initialised, warned; ``from_checkpoint`` says which), its vocabulary
    projection a trainable *copy* of the word embeddings (the encoder is never changed)."""

    def __init__(self, encoder, source: str | None = None) -> None:
        super().__init__()
        source = resolve_model_name(source or encoder.backbone_name_or_path)
        config = encoder.auto_model.config
        try:
            mlm_config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError):
            mlm_config = config
        with torch.device("meta"):
            skeleton = AutoModelForMaskedLM.from_config(mlm_config)
        base = skeleton.base_model_prefix
        children = [(name, child) for name, child in skeleton.named_children() if name != base]
        self.head_names = tuple(name for name, _ in children)
        self.head = nn.ModuleDict(children)
        self.head.to_empty(device=encoder.auto_model.get_input_embeddings().weight.device)
        tied = dict(getattr(skeleton, "_tied_weights_keys", None) or {})
        decoder_key = next((k for k, v in tied.items() if v.endswith("word_embeddings.weight")), None)
        del skeleton

        state = _checkpoint_tensors(source, tuple(f"{name}." for name in self.head_names),
                                    pickles=getattr(encoder, "trust_remote_code", False) is True)
        expected = set(self.head.state_dict())
        # Tied entries that are absent from a checkpoint (saved once under their twin's name): copy from the twin.
        for key, twin in tied.items():
            if key in expected and key not in state and twin in state:
                state[key] = state[twin]
        self.from_checkpoint = any(k in state for k in expected if k != decoder_key and not k.endswith("bias"))
        self._reset_parameters(config)
        if self.from_checkpoint:
            missing = self.head.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
            still_missing = [k for k in missing.missing_keys if k != decoder_key]
            if still_missing:
                logger.warning(f"MLM head of {source!r}: no weights for {still_missing}; they are freshly initialised.")
        if decoder_key is not None and decoder_key not in state:
            # The decoder of a tied head is the word embedding matrix: start from a copy of it.
            with torch.no_grad():
                self.head.get_parameter(decoder_key).copy_(encoder.auto_model.get_input_embeddings().weight)
        # Ties inside the head (BERT's decoder bias *is* ``predictions.bias``) are restored, so no parameter is idle.
        for key, twin in tied.items():
            if key in expected and twin in expected:
                owner, _, attribute = key.rpartition(".")
                setattr(self.head.get_submodule(owner), attribute, self.head.get_parameter(twin))
        self.head.requires_grad_(True)
        if self.from_checkpoint:
            logger.info(f"Auxiliary MLM uses the masked-LM head of {source!r}, trained with the prompts.")
        else:
            logger.warning(
                f"{source!r} has no masked-LM head weights: the auxiliary MLM loss uses a freshly initialised head "
                "(decoder initialised from the word embeddings), trained together with the prompts.")

    def _reset_parameters(self, config) -> None:
        std = getattr(config, "initializer_range", 0.02)
        for module in self.head.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            else:  # free-standing parameters such as BERT's ``predictions.bias``
                for _, parameter in module.named_parameters(recurse=False):
                    nn.init.zeros_(parameter)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = hidden_states
        for name in self.head_names:
            out = self.head[name](out)
        return out


class TokenMasker:
    """BERT-style masking (15%; 80% mask token, 10% random, 10% unchanged) by transformers' collator; special tokens
    and padding are never masked."""

    def __init__(self, tokenizer, mlm_probability: float = 0.15, seed: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability)
        self.collator.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)))

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = input_ids.device
        ids = input_ids.detach().to("cpu").clone()
        special = torch.isin(ids, self.special_ids) | (attention_mask.to("cpu") == 0)
        masked, labels = self.collator.torch_mask_tokens(ids, special_tokens_mask=special)
        return masked.to(device), labels.to(device)
