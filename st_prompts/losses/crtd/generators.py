"""Generators for replaced-token corruption: masked LMs whose argmax (never a special token, no gradient) fills the
masked positions. :class:`HubMaskedLMGenerator`: a Hugging Face masked LM sharing the encoder's vocabulary;
:class:`BackboneMLMGenerator`: the offline fallback (frozen backbone, briefly trained head; weaker: report it)."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForMaskedLM, AutoTokenizer

from st_prompts.errors import ConfigurationError, DataNotFoundError, VocabularyMismatchError
from st_prompts.losses.constants import BACKBONE_GENERATOR  # noqa: F401  (the offline fallback's name; re-exported)
from st_prompts.losses.mlm import MLMHead
from st_prompts.modules.checkpoint import backbone_fingerprint, portable_backbone_reference
from st_prompts.utils import resolve_model_name

logger = logging.getLogger(__name__)


def rows_digest(rows: Iterable[Sequence[int]]) -> str:
    """A SHA-256 over token-id rows, in order (identifies the sentences a fallback generator was trained on)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(np.asarray(row, dtype=np.int64).tobytes())
        digest.update(b"|")
    return "sha256:" + digest.hexdigest()


def check_same_vocabulary(generator_tokenizer, encoder_tokenizer, generator_name: str) -> None:
    """Raise :class:`VocabularyMismatchError` for a generator whose tokenizer maps any token otherwise than the
    encoder's."""
    generator_vocab, encoder_vocab = generator_tokenizer.get_vocab(), encoder_tokenizer.get_vocab()
    if generator_vocab == encoder_vocab and generator_tokenizer.mask_token_id == encoder_tokenizer.mask_token_id:
        return
    examples = []
    for token, index in sorted(encoder_vocab.items(), key=lambda item: item[1]):
        other = generator_vocab.get(token)
        if other != index:
            examples.append(f"{token!r}: {index} vs {'missing' if other is None else other}")
        if len(examples) == 3:
            break
    if not examples:
        examples = [f"the generator has {len(generator_vocab) - len(encoder_vocab):+d} tokens the encoder lacks"]
    raise VocabularyMismatchError(
        f"The generator {generator_name!r} does not share the encoder's vocabulary ({len(generator_vocab):,} vs "
        f"{len(encoder_vocab):,} tokens; encoder id vs generator id: {'; '.join(examples)}). Replaced-token detection "
        "compares token ids position by position, so the generator must use the encoder's tokenizer: e.g. "
        "distilbert-base-uncased for BERT-uncased backbones and all-MiniLM-L6-v2, distilroberta-base for RoBERTa, "
        f"or generator={BACKBONE_GENERATOR!r} (the frozen backbone with a briefly trained masked-LM head).")


def _argmax_real_tokens(logits: torch.Tensor, special_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Argmax over the vocabulary with special tokens (and ids beyond the tokenizer) excluded."""
    logits = logits.float().clone()
    logits[:, special_ids.to(logits.device)] = float("-inf")
    if logits.shape[-1] > vocab_size:
        logits[:, vocab_size:] = float("-inf")
    return logits.argmax(-1)


class MaskedLMGenerator:
    """What the corruption needs from a generator (``tokenizer``: the encoder's vocabulary; inputs on ``device``)."""
    name: str = "generator"
    tokenizer: Any = None
    device: torch.device = torch.device("cpu")

    def identity_for(self, rows: Sequence[Sequence[int]]) -> dict[str, Any]:
        """A JSON-able identity: equal identities must give equal corruptions (part of the cache key)."""
        raise NotImplementedError

    def prepare(self, rows: Sequence[Sequence[int]], masking, show_progress: bool = True) -> dict[str, Any]:
        """Called once before corrupting ``rows`` (the fallback trains its head here); returns a report."""
        return {"generator": self.name}

    def predict(self, masked_ids: torch.Tensor, attention_mask: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """The argmax token id (never a special token) at every ``selected`` position, shape ``(selected.sum(),)``."""
        raise NotImplementedError


class HubMaskedLMGenerator(MaskedLMGenerator):
    """A Hugging Face masked LM as generator (DistilBERT-MLM in D2CSE and DiffCSE), on ``device`` (default: CPU);
    ``model`` / ``tokenizer``: already loaded ones (then ``name_or_path`` only names them). Raises
    VocabularyMismatchError (a vocabulary not ``encoder_tokenizer``'s), DataNotFoundError (it cannot be loaded)."""

    def __init__(self, name_or_path: str, encoder_tokenizer=None, device=None, model=None, tokenizer=None,
                 trust_remote_code: bool = False) -> None:
        from st_prompts.loading import require_safe_backbone, safe_loading

        self.name = str(name_or_path)
        if model is None or tokenizer is None:
            require_safe_backbone(self.name, trust_remote_code, what="generator")
        try:
            with safe_loading(trust_remote_code) as safe:
                self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(name_or_path)
                if encoder_tokenizer is not None:
                    check_same_vocabulary(self.tokenizer, encoder_tokenizer, self.name)
                if model is None:
                    model, info = AutoModelForMaskedLM.from_pretrained(name_or_path, output_loading_info=True, **safe)
                    if info.get("missing_keys"):
                        raise ConfigurationError(
                            f"The generator {name_or_path!r} has no trained masked-LM head (missing weights: "
                            f"{', '.join(sorted(info['missing_keys'])[:4])}): its predictions would be random. Use a "
                            f"masked-LM checkpoint, or generator={BACKBONE_GENERATOR!r} to train a head on the frozen "
                            "backbone.")
            self.model = model
        except OSError as exc:
            raise DataNotFoundError(
                f"The generator {name_or_path!r} could not be loaded ({exc}). Offline, pass a local folder with an "
                f"AutoModelForMaskedLM checkpoint and its tokenizer, or use generator={BACKBONE_GENERATOR!r}.") from exc
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.model.to(self.device).eval().requires_grad_(False)
        self.special_ids = torch.tensor(sorted(set(self.tokenizer.all_special_ids)), dtype=torch.long)
        self._identity: dict[str, Any] | None = None

    def identity_for(self, rows) -> dict[str, Any]:
        if self._identity is None:
            self._identity = {"kind": "masked-lm", "name": portable_backbone_reference(self.name),
                              "weights": backbone_fingerprint(self.model)}
        return self._identity

    def prepare(self, rows, masking, show_progress: bool = True) -> dict[str, Any]:
        return {"generator": self.name, "generator_kind": "masked-lm"}

    @torch.no_grad()
    def predict(self, masked_ids, attention_mask, selected) -> torch.Tensor:
        logits = self.model(input_ids=masked_ids.to(self.device), attention_mask=attention_mask.to(self.device)).logits
        return _argmax_real_tokens(logits[selected.to(self.device)], self.special_ids, len(self.tokenizer))


class BackboneMLMGenerator(MaskedLMGenerator):
    """The offline fallback generator: the encoder's frozen backbone (no prompts) and a briefly trained MLM head
    (:class:`~st_prompts.losses.mlm.MLMHead`, its projection the frozen word embeddings), trained with AdamW on the
    training sentences masked as the corruption masks them; ``heldout_share`` of them (at most ``max_heldout``)
    measure it. ``corpus_vocabulary``: predict only the training split's tokens; ``steps``: default ``epochs``
    passes, at most ``max_steps``."""

    def __init__(self, encoder, steps: int | None = None, batch_size: int = 64, learning_rate: float = 3e-3,
                 masking_ratio: float = 0.3, seed: int = 42, heldout_share: float = 0.1, max_heldout: int = 1000,
                 corpus_vocabulary: bool = True, epochs: float = 2.0, max_steps: int = 300) -> None:
        if (steps is not None and steps < 0) or batch_size < 1 or learning_rate <= 0 or epochs <= 0 or max_steps < 0:
            raise ConfigurationError("The fallback generator needs steps >= 0, batch_size >= 1, learning_rate > 0, "
                                     "epochs > 0 and max_steps >= 0.")
        if not 0.0 <= heldout_share < 1.0:
            raise ConfigurationError(f"heldout_share must be in [0, 1), got {heldout_share!r}.")
        self.encoder = encoder
        self.backbone = encoder.auto_model
        self.tokenizer = encoder.tokenizer
        self.name = f"{BACKBONE_GENERATOR} ({encoder.backbone_reference})"
        self.device = self.backbone.get_input_embeddings().weight.device
        self.requested_steps = None if steps is None else int(steps)
        self.epochs, self.max_steps = float(epochs), int(max_steps)
        self.batch_size, self.learning_rate = int(batch_size), float(learning_rate)
        self.masking_ratio, self.seed = float(masking_ratio), int(seed)
        self.heldout_share, self.max_heldout = float(heldout_share), int(max_heldout)
        self.corpus_vocabulary = bool(corpus_vocabulary)
        self.special_ids = torch.tensor(sorted(set(self.tokenizer.all_special_ids)), dtype=torch.long)
        self.head = self._build_head()
        self._identity: dict[str, Any] | None = None
        self._candidates: torch.Tensor | None = None  # token ids the head may predict (None: every real token)

    def _build_head(self) -> nn.Module:
        mlm_logger = logging.getLogger("st_prompts.losses.mlm")
        level = mlm_logger.level
        mlm_logger.setLevel(logging.ERROR)  # its messages speak of the auxiliary MLM loss; we report our own
        try:
            # A fresh head from the seed (the identity must determine the generator); the global RNG is untouched.
            with torch.random.fork_rng():
                torch.manual_seed(self.seed)
                head = MLMHead(self.encoder)
        finally:
            mlm_logger.setLevel(level)
        embeddings = self.backbone.get_input_embeddings().weight
        for parameter in head.parameters():
            if parameter.shape == embeddings.shape:  # the vocabulary projection: tied to the frozen word embeddings
                with torch.no_grad():
                    parameter.copy_(embeddings)
                parameter.requires_grad = False
        # BERT's and RoBERTa's MLM heads end with ``self.decoder(x)``: wrap it to restrict the vocabulary.
        owners = [m for m in head.modules() if isinstance(getattr(m, "decoder", None), nn.Linear)
                  and m.decoder.weight.shape == embeddings.shape]
        if len(owners) != 1:
            raise ConfigurationError(f"Cannot find the vocabulary projection of {type(self.backbone).__name__}'s MLM head.")
        self._decoder = _CandidateDecoder(owners[0].decoder)
        owners[0].decoder = self._decoder
        return head.to(self.device)

    def split(self, rows: Sequence[Sequence[int]]) -> tuple[list, list]:
        """``(training rows, held-out rows)``: a seeded shuffle; no held-out rows below 20 sentences."""
        order = np.random.default_rng(self.seed).permutation(len(rows))
        count = min(int(len(rows) * self.heldout_share), self.max_heldout) if len(rows) >= 20 else 0
        return [rows[i] for i in order[count:]], [rows[i] for i in order[:count]]

    def steps_for(self, train_rows: int) -> int:
        """The head's training steps for a training split of ``train_rows`` sentences."""
        if self.requested_steps is not None:
            return self.requested_steps
        return min(self.max_steps, math.ceil(self.epochs * train_rows / self.batch_size))

    def identity_for(self, rows) -> dict[str, Any]:
        if self._identity is None:
            self._identity = {
                "kind": BACKBONE_GENERATOR, "backbone": backbone_fingerprint(self.backbone),
                "head_from_checkpoint": bool(self.head.from_checkpoint), "training_sentences": rows_digest(rows),
                "steps": self.steps_for(len(self.split(rows)[0])),
                **{key: getattr(self, key) for key in ("batch_size", "learning_rate", "masking_ratio", "seed",
                                                        "heldout_share", "max_heldout", "corpus_vocabulary")}}
        return self._identity

    def _hidden(self, masked_ids, attention_mask, selected) -> torch.Tensor:
        was_training = self.backbone.training
        self.backbone.eval()
        try:
            with torch.no_grad():
                hidden = self.backbone(input_ids=masked_ids.to(self.device),
                                       attention_mask=attention_mask.to(self.device)).last_hidden_state
        finally:
            self.backbone.train(was_training)
        return hidden[selected.to(self.device)]

    def prepare(self, rows, masking, show_progress: bool = True) -> dict[str, Any]:
        """Train the head on the training split of ``rows`` and measure its held-out masked-token accuracy."""
        train_rows, heldout = self.split(rows)
        steps = self.steps_for(len(train_rows))
        if self.corpus_vocabulary:
            present = torch.tensor(sorted({t for row in train_rows for t in row}), dtype=torch.long)
            present = present[~torch.isin(present, self.special_ids)]
            if present.numel():
                self._candidates = present.to(self.device)
                self._decoder.restrict(self._candidates, self.backbone.get_input_embeddings().weight.shape[0])
        parameters = [p for p in self.head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=self.learning_rate, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / max(1, steps)))
        rng = np.random.default_rng(self.seed)
        self.head.train()
        order, cursor, last_loss = rng.permutation(len(train_rows)), 0, None
        bar = tqdm(range(steps), desc="Training the generator's MLM head", unit="step", disable=not show_progress)
        for step in bar:
            if cursor + self.batch_size > len(order):
                order, cursor = rng.permutation(len(train_rows)), 0
            batch = [train_rows[i] for i in order[cursor : cursor + self.batch_size]]
            cursor += self.batch_size
            original, masked, attention, selected = masking.batch(batch, salt=step + 1, device=self.device)
            if not selected.any():
                continue
            logits = self.head(self._hidden(masked, attention, selected))
            loss = nn.functional.cross_entropy(logits.float(), self._decoder.index_of(original[selected]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            last_loss = loss.item()
            if step % 20 == 0:
                bar.set_postfix(loss=f"{last_loss:.3f}")
        bar.close()
        self.head.eval()
        vocabulary = int(self._candidates.numel()) if self._candidates is not None else len(self.tokenizer)
        report = {"generator": self.name, "generator_kind": BACKBONE_GENERATOR,
                  "head_from_checkpoint": bool(self.head.from_checkpoint), "head_training_steps": steps,
                  "head_training_sentences": len(train_rows), "head_vocabulary": vocabulary,
                  "head_final_loss": last_loss, "heldout_sentences": len(heldout)}
        if heldout:
            report["heldout_masked_token_accuracy"] = self.accuracy(heldout, masking)
        logger.info(f"Fallback generator: {self.name}, MLM head "
                    f"{'from the checkpoint' if self.head.from_checkpoint else 'freshly initialised'}, trained {steps} "
                    f"steps on {len(train_rows):,} sentences"
                    + (f"; held-out masked-token accuracy {100 * report['heldout_masked_token_accuracy']:.1f}% "
                       f"({len(heldout):,} sentences)." if heldout else " (too few sentences to hold any out)."))
        return report

    def accuracy(self, rows, masking, batch_size: int = 128) -> float | None:
        """Share of the selected (masked) tokens of ``rows`` whose argmax prediction is the original token."""
        correct = total = 0
        for start in range(0, len(rows), batch_size):
            original, masked, attention, selected = masking.batch(rows[start : start + batch_size], device=self.device)
            if not selected.any():
                continue
            predicted = self.predict(masked, attention, selected)
            correct += int((predicted == original[selected]).sum())
            total += int(selected.sum())
        return correct / total if total else None

    @torch.no_grad()
    def predict(self, masked_ids, attention_mask, selected) -> torch.Tensor:
        logits = self.head(self._hidden(masked_ids, attention_mask, selected))
        if self._candidates is not None:  # special tokens are not candidates
            return self._candidates[logits.argmax(-1)]
        return _argmax_real_tokens(logits, self.special_ids, len(self.tokenizer))


class _CandidateDecoder(nn.Module):
    """A vocabulary projection (``nn.Linear(H, V)``) computed for a subset of the vocabulary only (sharing its
    parameters)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("candidates", None, persistent=False)
        self.register_buffer("positions", None, persistent=False)

    def restrict(self, candidates: torch.Tensor, vocab_size: int) -> None:
        """Compute logits for ``candidates`` only (their order is the output order)."""
        self.candidates = candidates
        self.positions = torch.full((vocab_size,), -100, dtype=torch.long, device=candidates.device)
        self.positions[candidates] = torch.arange(candidates.numel(), device=candidates.device)

    def index_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Targets in the output's index space (-100, ignored by cross-entropy, for non-candidates)."""
        return token_ids if self.candidates is None else self.positions[token_ids]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.candidates is None:
            return self.linear(hidden)
        bias = self.linear.bias[self.candidates] if self.linear.bias is not None else None
        return nn.functional.linear(hidden, self.linear.weight[self.candidates], bias)


def resolve_generator(generator: Any, encoder, masking_ratio: float = 0.3, seed: int = 42,
                      **options: Any) -> MaskedLMGenerator:
    """A :class:`MaskedLMGenerator` from a spec: ``"backbone-mlm"`` (with ``options``: ``steps``, ``batch_size``,
    ``learning_rate``, ...), a Hugging Face masked-LM name or path, or a generator object (its vocabulary is checked)."""
    if isinstance(generator, MaskedLMGenerator):
        if generator.tokenizer is not None:
            check_same_vocabulary(generator.tokenizer, encoder.tokenizer, generator.name)
        return generator
    if not isinstance(generator, str) or not generator:
        raise ConfigurationError(f"generator must be {BACKBONE_GENERATOR!r}, a masked-LM name or path, or a "
                                 f"MaskedLMGenerator; got {generator!r}.")
    if generator == BACKBONE_GENERATOR:
        return BackboneMLMGenerator(encoder, masking_ratio=masking_ratio, seed=seed, **options)

    device = encoder.auto_model.get_input_embeddings().weight.device
    return HubMaskedLMGenerator(resolve_model_name(generator), encoder_tokenizer=encoder.tokenizer, device=device,
                                trust_remote_code=getattr(encoder, "trust_remote_code", False) is True)
