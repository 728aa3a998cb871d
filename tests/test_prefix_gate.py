"""A gated prefix (zero-initialised attention, LLaMA-Adapter) starts exactly as its backbone, trains (the gate first),
and training a set with an evaluator evaluates step 0, so the kept weights are never below the start."""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from conftest import edit_json, random_prefix, st_model
from sentence_transformers.sentence_transformer.losses import CoSENTLoss
from test_architectures import ARCHITECTURES, SENTENCES, pooling

from st_prompts import PromptedTransformer, bank, save_prompts_only
from st_prompts.loading import load_sentence_model


def plain_and_gated(path: str, model_type: str, length: int = 4):
    """The backbone, and the backbone with an untrained gated prefix that an open gate would let move every output."""
    plain = st_model(path, pooling(model_type), max_seq_length=48)
    encoder = random_prefix(path, length, prefix_gate=True, max_seq_length=48)
    return plain, st_model(encoder, pooling(model_type))


def embed(model, texts=SENTENCES, **kwargs) -> torch.Tensor:
    return model.encode(list(texts), convert_to_tensor=True, batch_size=len(texts), **kwargs)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_an_untrained_gated_prefix_is_the_backbone(tiny_backbones, model_type):
    plain, gated = plain_and_gated(tiny_backbones(model_type), model_type)
    expected = embed(plain)
    torch.testing.assert_close(embed(gated), expected, atol=1e-6, rtol=0)
    with torch.no_grad():  # open the gate: the prefix now reaches every row
        gated[0].prefix_encoder.gate.fill_(0.5)
    assert (embed(gated) - expected).abs().max() > 1e-4


def test_an_untrained_gated_set_is_the_shipped_minilm(minilm, minilm_path):
    model = bank.create_bank(minilm_path)
    model[0].new_prompt_set("sts", prefix_length=16, prefix_gate=True)
    texts = ["A man is playing a guitar.", "A woman slices an onion on a wooden board in the kitchen.", "Hi"]
    shipped = minilm.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(model.encode(texts, task="sts", convert_to_tensor=True), shipped, atol=1e-6, rtol=0)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_gated_and_ungated_sets_mix_per_row(tiny_backbones, model_type, tmp_path):
    """Each row equals its single-task embedding; the bank saves and loads (full and prompts-only) with its gate."""
    path = tiny_backbones(model_type)
    model = bank.create_bank(path, pooling=pooling(model_type))
    encoder = model[0]
    torch.manual_seed(1)
    encoder.new_prompt_set("gated", prefix_length=4, prefix_gate=True)
    encoder.new_prompt_set("plain-set", prefix_length=3)
    with torch.no_grad():
        for module in encoder.prompt_sets.values():
            module.embedding.weight.normal_()
        encoder.prompt_sets["gated"].gate.uniform_(-1, 1)
    tasks = ["gated", "plain-set", "backbone", "gated"]
    alone = torch.stack([embed(model, [text], task=task)[0] for text, task in zip(SENTENCES, tasks)])
    torch.testing.assert_close(embed(model, task=tasks), alone, atol=1e-5, rtol=1e-5)
    assert (alone[0] - embed(model, [SENTENCES[0]], task="backbone")[0]).abs().max() > 1e-4

    model.save(str(tmp_path / "bank"))
    assert json.loads((tmp_path / "bank" / "sentence_bert_config.json").read_text())["prompt_sets"]["gated"][
        "prefix_gate"] is True
    loaded = load_sentence_model(str(tmp_path / "bank"))
    torch.testing.assert_close(embed(loaded, task=tasks), alone, atol=1e-5, rtol=1e-5)

    single = PromptedTransformer(path, prefix_length=4, prefix_gate=True)
    single.prefix_encoder.load_state_dict(encoder.prompt_sets["gated"].state_dict())
    save_prompts_only(st_model(single, pooling(model_type)), str(tmp_path / "gated-prompts"))
    again = load_sentence_model(str(tmp_path / "gated-prompts"))
    torch.testing.assert_close(embed(again, SENTENCES[:1]), alone[:1], atol=1e-5, rtol=1e-5)
    other = bank.create_bank(path, pooling=pooling(model_type))
    bank.add_prompt_set(other, "from-folder", str(tmp_path / "gated-prompts"))
    assert other[0].prompt_sets["from-folder"].gated
    torch.testing.assert_close(embed(other, SENTENCES[:1], task="from-folder"), alone[:1], atol=1e-5, rtol=1e-5)


def test_banks_saved_before_the_gate_load_and_encode_as_before(tiny_bert, tmp_path):
    """A bank whose config has no prefix_gate (saved before this change) loads ungated and encodes as it did."""
    model = bank.create_bank(tiny_bert)
    torch.manual_seed(2)
    model[0].new_prompt_set("sts", prefix_length=3)
    before = embed(model, task="sts")
    model.save(str(tmp_path / "old"))

    def drop_the_gate(config):
        for options in [config, *config["prompt_sets"].values()]:
            options.pop("prefix_gate")

    edit_json(tmp_path / "old" / "sentence_bert_config.json", drop_the_gate)
    loaded = load_sentence_model(str(tmp_path / "old"))
    assert not loaded[0].prompt_sets["sts"].gated
    torch.testing.assert_close(embed(loaded, task="sts"), before, atol=1e-6, rtol=0)


def test_a_gated_prefix_trains_gate_first(tiny_bert):
    """At first only the gate gets gradient (the prefix's output is multiplied by tanh(0) = 0), then the prefix."""
    model = bank.create_bank(tiny_bert)
    data = Dataset.from_dict({"sentence1": SENTENCES[:2], "sentence2": SENTENCES[2:], "score": [0.9, 0.1]})
    with bank.training_prompt_set(model, "sts", prefix_length=3, prefix_gate=True) as trained:
        model.train()
        loss = CoSENTLoss(model)
        features = lambda: [model.preprocess(list(data[c])) for c in ("sentence1", "sentence2")]  # noqa: E731
        loss(features(), torch.tensor(data["score"])).backward()
        assert trained.gate.grad is not None and trained.gate.grad.abs().sum() > 0
        assert trained.embedding.weight.grad.abs().sum() == 0
        with torch.no_grad():
            trained.gate.fill_(0.1)
        trained.zero_grad()
        loss(features(), torch.tensor(data["score"])).backward()
        assert trained.embedding.weight.grad.abs().sum() > 0


class _Counter:
    """An evaluator whose score is highest at the start: the kept weights must be the step-0 ones."""

    primary_metric = "score"
    greater_is_better = True

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model, output_path=None, epoch=-1, steps=-1):
        self.calls += 1
        return {"score": 1.0 / self.calls}


def test_step_zero_is_evaluated_and_kept_when_best(tiny_bert):
    model = bank.create_bank(tiny_bert)
    start = embed(model)
    data = Dataset.from_dict({"sentence1": SENTENCES * 4, "sentence2": SENTENCES[::-1] * 4, "score": [0.5] * 16})
    evaluator = _Counter()
    result = bank.train_prompt_set(model, "sts", data, CoSENTLoss(model), evaluator=evaluator, learning_rate=0.5,
                                   batch_size=4, eval_steps=1, show_progress_bar=False, prefix_length=3,
                                   prefix_gate=True)
    assert result.best_step == 0 and result.best_metric == 1.0 and evaluator.calls >= 3
    torch.testing.assert_close(embed(model, task="sts"), start, atol=1e-6, rtol=0)
    assert math.isclose(float(model[0].prompt_sets["sts"].gate.detach().abs().sum()), 0.0)
