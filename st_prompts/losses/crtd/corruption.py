"""Replaced-token corruption for D2CSE's CRTD, computed once before training: tokens masked as DiffCSE does, filled
by a gradient-free masked LM's argmax (the *generator*). Copies are stored by token ids, keyed by the original's ids
(the encoder's tokenizer), in a ``.npz`` file (no pickle) named by a digest of its identity; a file of another
identity raises :class:`~st_prompts.errors.CorruptionCacheError`, a sentence missing from it is an error."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from st_prompts.errors import ConfigurationError, CorruptionCacheError
from st_prompts.losses.crtd.generators import resolve_generator
from st_prompts.storage import write_file_atomic

logger = logging.getLogger(__name__)

#: Version of the masking scheme and file layout (part of every cache identity).
CORRUPTION_FORMAT = 1
#: DiffCSE's treatment of the selected tokens before the generator sees them: [MASK], random token, unchanged.
MASKING_SCHEME = {"mask": 0.8, "random": 0.1, "keep": 0.1}
#: Environment variable naming the cache root (default ``~/.cache/st_prompts``).
CACHE_ENV = "ST_PROMPTS_CACHE"


def default_cache_dir() -> Path:
    """Where corruption caches go by default: ``$ST_PROMPTS_CACHE/corruptions`` or ``~/.cache/st_prompts/corruptions``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "st_prompts")
    return Path(root) / "corruptions"


def tokenizer_fingerprint(tokenizer) -> str:
    """A SHA-256 over the tokenizer's vocabulary (token → id) and its special token ids."""
    payload = {"vocab": sorted(tokenizer.get_vocab().items()),
               "special": sorted(int(i) for i in tokenizer.all_special_ids), "mask": tokenizer.mask_token_id}
    return "sha256:" + hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def identity_digest(identity: dict[str, Any]) -> str:
    """A short stable digest of a JSON-able identity (used in cache file names)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def token_rows(preprocess, sentences: Sequence[str], batch_size: int = 512) -> list[tuple[int, ...]]:
    """The token ids of every sentence as ``preprocess`` produces them (the collator's ids: the cache keys), padding
    removed, in order."""
    rows: list[tuple[int, ...]] = []
    for start in range(0, len(sentences), batch_size):
        features = preprocess(list(sentences[start : start + batch_size]))
        ids, mask = features["input_ids"], features["attention_mask"].bool()
        rows.extend(tuple(int(t) for t in ids[i][mask[i]].tolist()) for i in range(ids.shape[0]))
    return rows


class ReplacedTokenMasking:
    """DiffCSE's masking of a token-id row for the generator, deterministic per (seed, row, salt): each non-special
    token is selected with probability ``masking_ratio`` and becomes the mask token (80%), a random non-special token
    (10%) or stays (10%)."""

    def __init__(self, tokenizer, masking_ratio: float = 0.3, seed: int = 42) -> None:
        if not 0.0 < masking_ratio < 1.0:
            raise ConfigurationError(f"masking_ratio must be in (0, 1), got {masking_ratio!r}.")
        if tokenizer.mask_token_id is None:
            raise ConfigurationError(f"Replaced-token corruption needs a mask token; {type(tokenizer).__name__} has none.")
        self.masking_ratio = float(masking_ratio)
        self.seed = int(seed)
        self.mask_id = int(tokenizer.mask_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.special_ids = np.array(sorted({int(i) for i in tokenizer.all_special_ids}), dtype=np.int64)
        self.random_ids = np.setdiff1d(np.arange(len(tokenizer), dtype=np.int64), self.special_ids)

    def _rng(self, row: np.ndarray, salt: int) -> np.random.Generator:
        digest = hashlib.sha256(np.array([self.seed, salt], dtype=np.int64).tobytes() + row.tobytes()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little"))

    def eligible(self, row: Sequence[int]) -> np.ndarray:
        """Which positions of ``row`` may be masked (not a special token)."""
        return ~np.isin(np.asarray(row, dtype=np.int64), self.special_ids)

    def __call__(self, row: Sequence[int], salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(masked ids, selected positions)`` of one row (no padding); ``salt`` varies the draw (training the
        fallback generator uses a new one per step; the corruption itself uses 0)."""
        row = np.asarray(row, dtype=np.int64)
        rng = self._rng(row, salt)
        draws = rng.random((3, row.shape[0]))
        selected = (draws[0] < self.masking_ratio) & self.eligible(row)
        masked = row.copy()
        to_mask = selected & (draws[1] < MASKING_SCHEME["mask"])
        to_random = selected & ~to_mask & (draws[2] < MASKING_SCHEME["random"] / (1.0 - MASKING_SCHEME["mask"]))
        masked[to_mask] = self.mask_id
        if to_random.any():
            masked[to_random] = rng.choice(self.random_ids, size=int(to_random.sum()))
        return masked, selected

    def batch(self, rows: Sequence[Sequence[int]], salt: int = 0, device=None):
        """Padded tensors ``(original ids, masked ids, attention mask, selected)`` for a batch of rows."""
        length = max((len(r) for r in rows), default=0)
        original = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        masked = original.clone()
        attention = torch.zeros((len(rows), length), dtype=torch.long)
        selected = torch.zeros((len(rows), length), dtype=torch.bool)
        for i, row in enumerate(rows):
            ids, chosen = self(row, salt)
            n = len(row)
            original[i, :n] = torch.as_tensor(np.asarray(row, dtype=np.int64))
            masked[i, :n] = torch.from_numpy(ids)
            attention[i, :n] = 1
            selected[i, :n] = torch.from_numpy(chosen)
        return original.to(device), masked.to(device), attention.to(device), selected.to(device)


def crtd_labels(original_ids: torch.Tensor, corrupted_ids: torch.Tensor, attention_mask: torch.Tensor,
                special_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CRTD targets ``(labels, detect)``, both ``(batch, seq)``: ``labels`` is 1 where the corrupted token differs
    from the original (a token predicted back as itself is original); ``detect`` marks the real, non-special tokens
    the loss averages over."""
    labels = (corrupted_ids != original_ids).long()
    detect = attention_mask.bool() & ~torch.isin(original_ids, special_ids.to(original_ids.device))
    return labels * detect, detect


class CorruptionCache:
    """Corrupted token ids keyed by the original token ids, with the (JSON-able) identity they were made with and
    what is known about the generator (``generator_report``)."""

    def __init__(self, identity: dict[str, Any], generator_report: dict[str, Any] | None = None) -> None:
        self.identity = identity
        self.generator_report = dict(generator_report or {})
        self._rows: dict[bytes, np.ndarray] = {}

    @staticmethod
    def key(row: Sequence[int] | np.ndarray) -> bytes:
        return np.asarray(row, dtype=np.int32).tobytes()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, row) -> bool:
        return self.key(row) in self._rows

    def add(self, original: Sequence[int], corrupted: Sequence[int]) -> None:
        """Store the corrupted copy of one row (same length, special tokens in place)."""
        original = np.asarray(original, dtype=np.int32)
        corrupted = np.asarray(corrupted, dtype=np.int32)
        if original.shape != corrupted.shape:
            raise CorruptionCacheError(f"A corrupted row must have the original's length {original.shape[0]}, got "
                                       f"{corrupted.shape[0]}.")
        self._rows[original.tobytes()] = corrupted

    def get(self, row) -> np.ndarray | None:
        """The corrupted copy of ``row`` (int32 array), or ``None``."""
        return self._rows.get(self.key(row))

    def items(self):
        """``(original ids, corrupted ids)`` pairs as int32 arrays."""
        for key, corrupted in self._rows.items():
            yield np.frombuffer(key, dtype=np.int32), corrupted

    def corrupt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The corrupted copy of a tokenised batch (padding unchanged); :class:`CorruptionCacheError` for a row not
        in the cache."""
        ids_cpu = input_ids.detach().to("cpu")
        mask_cpu = attention_mask.detach().to("cpu").bool()
        out = ids_cpu.clone()
        for i in range(ids_cpu.shape[0]):
            row = ids_cpu[i][mask_cpu[i]]
            corrupted = self._rows.get(row.numpy().astype(np.int32).tobytes())
            if corrupted is None:
                raise CorruptionCacheError(
                    f"A training sentence has no corrupted copy in the replaced-token cache ({len(self):,} sentences; "
                    f"token ids {row.tolist()[:12]}...). Run the corruption pre-pass over the training data first "
                    "(CRTDLoss.prepare(train_dataset)); it must use the model's own tokenizer and max_seq_length.")
            out[i][mask_cpu[i]] = torch.from_numpy(corrupted.astype(np.int64))
        return out.to(input_ids.device)

    @staticmethod
    def path_for(cache_dir: str | Path, identity: dict[str, Any]) -> Path:
        """The file a cache of this identity lives in below ``cache_dir``."""
        return Path(cache_dir) / f"corruptions-{identity_digest(identity)}.npz"

    def save(self, path: str | Path) -> None:
        """Write the cache (atomically: a temporary file renamed into place)."""
        originals = [np.frombuffer(k, dtype=np.int32) for k in self._rows]
        corrupted = list(self._rows.values())
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in originals], dtype=np.int64)])
        meta = json.dumps({"identity": self.identity, "generator_report": self.generator_report})
        empty = np.zeros(0, dtype=np.int32)
        arrays = {"original": np.concatenate(originals) if originals else empty,
                  "corrupted": np.concatenate(corrupted) if corrupted else empty, "offsets": offsets,
                  "meta": np.array(meta)}
        write_file_atomic(path, lambda handle: np.savez(handle, **arrays))

    @classmethod
    def load(cls, path: str | Path, identity: dict[str, Any] | None = None) -> CorruptionCache:
        """Read a cache file; :class:`CorruptionCacheError` if it is none, or (given ``identity``) of another one."""
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                original, corrupted, offsets = data["original"], data["corrupted"], data["offsets"]
        except (OSError, KeyError, ValueError) as exc:
            raise CorruptionCacheError(f"{path} is not a readable corruption cache ({exc}).") from exc
        found = meta.get("identity", {})
        if identity is not None and found != identity:
            differences = sorted(k for k in set(found) | set(identity) if found.get(k) != identity.get(k))
            raise CorruptionCacheError(
                f"The corruption cache {path} was made with another {', '.join(differences)} than this run "
                f"(cache: {_short(found, differences)}; run: {_short(identity, differences)}). Caches of different "
                "generators or masking ratios are never mixed: use another cache file or directory.")
        cache = cls(found, meta.get("generator_report"))
        for i in range(len(offsets) - 1):
            cache._rows[original[offsets[i] : offsets[i + 1]].tobytes()] = corrupted[offsets[i] : offsets[i + 1]].copy()
        return cache


def _short(identity: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(f"{k}={json.dumps(identity.get(k))[:120]}" for k in keys)


def corrupt_rows(generator, masking: ReplacedTokenMasking, rows: Sequence[Sequence[int]], batch_size: int = 64,
                 show_progress: bool = True) -> list[np.ndarray]:
    """Corrupt token-id rows with ``generator``'s argmax at the selected positions (no gradient)."""
    out: list[np.ndarray] = []
    bar = tqdm(total=len(rows), desc="Corrupting sentences", unit="sentence", disable=not show_progress)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        original, masked, attention, selected = masking.batch(chunk, device=generator.device)
        corrupted = original.clone()
        if selected.any():
            with torch.no_grad():
                corrupted[selected] = generator.predict(masked, attention, selected)
        corrupted = corrupted.to("cpu")
        out.extend(corrupted[i, : len(row)].numpy().astype(np.int32) for i, row in enumerate(chunk))
        bar.update(len(chunk))
    bar.close()
    return out


def corruption_statistics(cache: CorruptionCache, masking: ReplacedTokenMasking,
                          rows: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How much the corruption changed ``rows``: eligible, selected and replaced tokens, ``replaced_share`` (replaced
    / eligible) and ``masked_token_accuracy`` (1 − replaced / selected)."""
    eligible = selected = replaced = 0
    for row in rows:
        corrupted = cache.get(row)
        if corrupted is None:
            raise CorruptionCacheError("corruption_statistics: a row is missing from the cache.")
        original = np.asarray(row, dtype=np.int32)
        eligible += int(masking.eligible(row).sum())
        selected += int(masking(row)[1].sum())
        replaced += int((corrupted != original).sum())
    return {"sentences": len(rows), "eligible_tokens": eligible, "selected_tokens": selected,
            "replaced_tokens": replaced, "replaced_share": replaced / eligible if eligible else 0.0,
            "masked_token_accuracy": (selected - replaced) / selected if selected else None}


def prepare_corruptions(model, sentences: Sequence[str], generator: Any = "backbone-mlm", masking_ratio: float = 0.3,
                        seed: int = 42, cache_dir: str | Path | None = None, cache_file: str | Path | None = None,
                        generator_options: dict[str, Any] | None = None,
                        show_progress: bool = True) -> tuple[CorruptionCache, dict[str, Any]]:
    """Corrupt every text the CRTD loss will see once (or reuse a matching cache); returns ``(cache, report)``.
    ``generator``: see :func:`~st_prompts.losses.crtd.generators.resolve_generator`; ``seed``: of the masking and of
    the fallback generator's training, whose options (``steps``, ``batch_size``, ...) are ``generator_options``;
    ``cache_dir``: default :func:`default_cache_dir`; ``cache_file``: an explicit file (refused of another identity).
    """
    encoder = model[0]
    tokenizer = encoder.tokenizer
    unique = list(dict.fromkeys(token_rows(model.preprocess, list(sentences))))
    if not unique:
        raise ConfigurationError("No sentence to corrupt: the training data is empty.")
    masking = ReplacedTokenMasking(tokenizer, masking_ratio, seed)
    gen = resolve_generator(generator, encoder, masking_ratio=masking_ratio, seed=seed, **(generator_options or {}))
    identity = {"format": CORRUPTION_FORMAT, "generator": gen.identity_for(unique),
                "masking_ratio": float(masking_ratio), "masking_scheme": MASKING_SCHEME, "seed": int(seed),
                "tokenizer": tokenizer_fingerprint(tokenizer)}
    path = Path(cache_file) if cache_file is not None else CorruptionCache.path_for(cache_dir or default_cache_dir(), identity)
    cache = CorruptionCache.load(path, identity) if path.exists() else CorruptionCache(identity)
    missing = [row for row in unique if row not in cache]
    if missing:
        if not cache.generator_report:
            cache.generator_report = gen.prepare(unique, masking, show_progress=show_progress)
        logger.info(f"Corrupting {len(missing):,} sentences with {gen.name} (masking ratio {masking_ratio}).")
        for row, corrupted in zip(missing, corrupt_rows(gen, masking, missing, show_progress=show_progress)):
            cache.add(row, corrupted)
        cache.save(path)
    report = {**cache.generator_report, **corruption_statistics(cache, masking, unique), "cache": str(path),
              "reused_sentences": len(unique) - len(missing)}
    accuracy = report.get("heldout_masked_token_accuracy", report["masked_token_accuracy"])
    logger.info(f"Replaced-token corruption: generator {gen.name}, masked-token accuracy "
                f"{'n/a' if accuracy is None else f'{100 * accuracy:.1f}%'}"
                f"{' (held out)' if 'heldout_masked_token_accuracy' in report else ''}, "
                f"{100 * report['replaced_share']:.1f}% of the tokens replaced ({report['sentences']:,} sentences; "
                f"{report['reused_sentences']:,} from the cache {path}).")
    return cache, report
