"""One mechanism for every soft prompt: explicit positions, prefix views, input-embedding overrides ([CLS] prompt,
external [CLS] vector), soft and hard templates, template-only features."""

from __future__ import annotations

import contextlib
import shutil

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

from conftest import random_prefix, randomise_prompts, transformers_cache

from st_prompts import MaskTokenPooling, PromptedTransformer, save_prompts_only
from st_prompts.errors import ConfigurationError
from st_prompts.modules import CLS_OVERRIDE, PREFIX_ATTENTION_MASK, prefix_view_mask
from st_prompts.prompts import PROMPTBERT_TEMPLATE, SCPCSE_TEMPLATE

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat", "this is happy music and the dog sits"]
SHORT = ["the cat", "a dog runs in the park"]


def literal(template: str, sentence: str) -> str:
    return template.replace("[X]", sentence)


@contextlib.contextmanager
def capture(encoder: PromptedTransformer):
    """The tensor keyword arguments of each call of the backbone's embeddings module, recorded."""
    calls = []
    handle = encoder.auto_model.embeddings.register_forward_pre_hook(lambda module, args, kwargs: calls.append(
        {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}), with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def run(encoder: PromptedTransformer, features: dict) -> tuple[torch.Tensor, dict]:
    with capture(encoder) as calls, torch.no_grad():
        out = encoder(dict(features))["token_embeddings"]
    return out, calls[-1]


def same_prompts(source: PromptedTransformer, target: PromptedTransformer) -> PromptedTransformer:
    """Copy the deep prefix of ``source`` into ``target`` (both eval)."""
    target.prefix_encoder.load_state_dict(source.prefix_encoder.state_dict())
    return target.eval()


# ---------------------------------------------------------------------------------------------- explicit positions
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_prefix_only_equals_transformers_own_position_computation(tiny_backbones, model_type):
    """Explicit positions + inputs_embeds give exactly what transformers computes from input_ids and the cache."""
    encoder = random_prefix(tiny_backbones(model_type), 5).eval()
    features = encoder.preprocess(SENTENCES)
    ours, seen = run(encoder, features)

    model, l = encoder.auto_model, 5
    mask = torch.cat([torch.ones(len(SENTENCES), l, dtype=torch.long), features["attention_mask"]], dim=1)
    with torch.no_grad():
        theirs = model(
            input_ids=features["input_ids"], attention_mask=mask, token_type_ids=features["token_type_ids"],
            **transformers_cache(model, encoder.prefix_encoder(len(SENTENCES))),
        ).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)

    if model_type == "roberta":  # padding_idx = 0 here: real tokens from 1 + l, padding gets 0
        expected = type(model.embeddings).create_position_ids_from_input_ids(features["input_ids"], 0, l)
    else:
        expected = torch.arange(l, l + features["input_ids"].shape[1]).expand_as(features["input_ids"])
    assert torch.equal(seen["position_ids"], expected)
    assert "input_ids" not in seen and seen["inputs_embeds"].shape[:2] == features["input_ids"].shape


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("prefix", [True, False])
def test_template_keeps_the_positions_and_output_of_the_literal_text(tiny_backbones, model_type, mode, prefix):
    """A template (hard, or soft before training) gives the position ids and hidden states of the literal text."""
    path = tiny_backbones(model_type)
    template = PROMPTBERT_TEMPLATE if mode == "hard" else SCPCSE_TEMPLATE
    if prefix:
        plain = random_prefix(path, 4).eval()
        templated = same_prompts(plain, PromptedTransformer(path, prefix_length=4, template=template, template_mode=mode))
    else:
        plain = Transformer(path).eval()
        templated = PromptedTransformer(path, prefix_length=None, template=template, template_mode=mode).eval()
    texts = [literal(template, s) for s in SHORT]
    ours_features = templated.preprocess(SHORT)
    plain_features = plain.preprocess(texts)
    assert torch.equal(ours_features["input_ids"], plain_features["input_ids"])

    ours, seen = run(templated, ours_features)
    if prefix:
        reference, seen_plain = run(plain, plain_features)
        assert torch.equal(seen["position_ids"], seen_plain["position_ids"])
        assert seen["position_ids"][:, 0].unique().tolist() == [4 + (1 if model_type == "roberta" else 0)]
    else:
        with torch.no_grad():
            reference = plain(dict(plain_features))["token_embeddings"]
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- prefix views
def test_prefix_view_mask_helper():
    assert prefix_view_mask(2, 6, 0).tolist() == [[1, 1, 1, 0, 0, 0]] * 2
    assert prefix_view_mask(2, 6, [1, 0]).tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert prefix_view_mask(1, 5, 1).tolist() == [[0, 0, 0, 1, 1]]
    assert prefix_view_mask(1, 6, 2, num_views=3).tolist() == [[0, 0, 0, 0, 1, 1]]
    assert prefix_view_mask(3, 4, None).tolist() == [[1] * 4] * 3
    assert prefix_view_mask(3, 4, torch.tensor([0, 1, 0])).dtype == torch.long
    for bad in [dict(view=2), dict(view=-1), dict(view=[0, 1, 0]), dict(view=0, num_views=5)]:
        with pytest.raises(ConfigurationError):
            prefix_view_mask(2, 4, **bad)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_a_view_row_gives_the_same_output_alone_or_batched_with_the_other_view(tiny_backbones, model_type):
    encoder = random_prefix(tiny_backbones(model_type), 6).eval()
    features = encoder.preprocess(SENTENCES)
    views = [0, 1, 1, 0]
    batched, seen = run(encoder, {**features, PREFIX_ATTENTION_MASK: prefix_view_mask(4, 6, views)})
    everything, seen_all = run(encoder, features)
    assert torch.equal(seen["position_ids"], seen_all["position_ids"])  # views never shift positions
    for row, view in enumerate(views):
        alone_features = encoder.preprocess([SENTENCES[row]])
        alone, _ = run(encoder, {**alone_features, PREFIX_ATTENTION_MASK: prefix_view_mask(1, 6, view)})
        n = alone.shape[1]
        torch.testing.assert_close(batched[row, :n], alone[0], rtol=0, atol=1e-5)
        other, _ = run(encoder, {**alone_features, PREFIX_ATTENTION_MASK: prefix_view_mask(1, 6, 1 - view)})
        assert (alone - other).abs().max() > 1e-3
        assert (alone[0] - everything[row, :n]).abs().max() > 1e-3

    # the half a row does not attend to has no influence on it
    with torch.no_grad():
        encoder.prefix_encoder.embedding.weight[3:].normal_()
    changed, _ = run(encoder, {**features, PREFIX_ATTENTION_MASK: prefix_view_mask(4, 6, views)})
    for row, view in enumerate(views):
        n = int(features["attention_mask"][row].sum())
        if view == 0:
            torch.testing.assert_close(changed[row, :n], batched[row, :n], rtol=0, atol=1e-6)
        else:
            assert (changed[row, :n] - batched[row, :n]).abs().max() > 1e-3


def test_view_masks_broadcast_the_prefix_and_explicit_positions_are_used_and_bad_ones_refused(tiny_bert, monkeypatch):
    """A per-row prefix mask does not copy the prefix per row (one row, or stride 0); a full one equals none."""
    from st_prompts.modules import prompted_transformer as module  # the steps of a pass (PromptedTransformer._encode)

    encoder = random_prefix(tiny_bert, 4).eval()
    features = encoder.preprocess(SHORT)
    seen = []
    real = module.PrefixInjection
    monkeypatch.setattr(module, "PrefixInjection", lambda values, mask: seen.append(real(values, mask)) or seen[-1])
    run(encoder, {**features, PREFIX_ATTENTION_MASK: prefix_view_mask(2, 4, [0, 1])})
    assert seen[-1].prefix[0].shape[0] == 1 or seen[-1].prefix[0].stride(0) == 0
    full, _ = run(encoder, {**features, PREFIX_ATTENTION_MASK: prefix_view_mask(2, 4, None)})
    assert torch.equal(run(encoder, features)[0], full)
    shifted = encoder.position_ids(features["attention_mask"]) + 1  # explicit position ids are used, if they fit
    _, seen = run(encoder, {**features, "position_ids": shifted})
    assert torch.equal(seen["position_ids"], shifted)
    with pytest.raises(ConfigurationError, match="position_ids"):
        encoder({**features, "position_ids": shifted[:, :2]})
    with pytest.raises(ConfigurationError, match="prefix_attention_mask"):
        encoder({**features, PREFIX_ATTENTION_MASK: torch.ones(2, 3)})
    no_prefix = PromptedTransformer(tiny_bert, prefix_length=None, template=SCPCSE_TEMPLATE)
    with pytest.raises(ConfigurationError, match="no prefix"):
        no_prefix({**no_prefix.preprocess(SHORT), PREFIX_ATTENTION_MASK: torch.ones(2, 4)})


# ---------------------------------------------------------------------------------------------- input overrides
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_cls_override_replaces_the_cls_input_row_and_receives_gradient(tiny_backbones, model_type):
    encoder = random_prefix(tiny_backbones(model_type), 3, cls_prompt=True).train()
    features = encoder.preprocess(SENTENCES)
    override = torch.randn(4, 32, requires_grad=True)
    with capture(encoder) as calls:
        out = encoder({**features, CLS_OVERRIDE: override})["token_embeddings"]
    embeds = calls[-1]["inputs_embeds"]
    assert torch.equal(embeds[:, 0], override)  # wins over the [CLS] prompt
    words = encoder.auto_model.get_input_embeddings()(features["input_ids"])
    assert torch.equal(embeds[:, 1:], words[:, 1:])
    out[:, 0].pow(2).sum().backward()
    assert override.grad is not None and override.grad.abs().sum() > 0
    assert all(p.grad is None for p in encoder.auto_model.parameters())
    with pytest.raises(ConfigurationError, match="override"):
        encoder({**features, CLS_OVERRIDE: torch.zeros(4, 31)})


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_cls_prompt_starts_as_the_cls_embedding_and_trains_alone(tiny_backbones, model_type):
    path = tiny_backbones(model_type)
    plain = random_prefix(path, 3).eval()
    encoder = same_prompts(plain, PromptedTransformer(path, prefix_length=3, cls_prompt=True))
    cls_id = encoder.tokenizer.cls_token_id
    word_embeddings = encoder.auto_model.get_input_embeddings().weight
    assert encoder.shallow_prompt.num_soft_tokens == 1
    assert torch.equal(encoder.shallow_prompt.embeddings[0], word_embeddings[cls_id])
    assert sum(p.numel() for p in encoder.prompt_parameters()) == 3 * 2 * 2 * 32 + 32

    features = encoder.preprocess(SENTENCES)
    before, seen = run(encoder, features)
    assert torch.equal(before, run(plain, features)[0])  # before training: the plain prompted model
    with torch.no_grad():
        encoder.shallow_prompt.embeddings.add_(torch.randn(1, 32))  # (not a constant: LayerNorm would undo it)
    changed, seen = run(encoder, features)
    assert torch.equal(seen["inputs_embeds"][:, 0], encoder.shallow_prompt.embeddings.expand(4, -1))
    assert (changed - before).abs().max() > 1e-3

    encoder.train()
    encoder(dict(features))["token_embeddings"].pow(2).mean().backward()
    assert encoder.shallow_prompt.embeddings.grad.abs().sum() > 0
    assert encoder.prefix_encoder.embedding.weight.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in encoder.auto_model.parameters())


def test_cls_prompt_alone_and_with_a_soft_template(tiny_bert):
    alone = PromptedTransformer(tiny_bert, prefix_length=None, cls_prompt=True).eval()
    plain = Transformer(tiny_bert).eval()
    features = alone.preprocess(SHORT)
    with torch.no_grad():
        torch.testing.assert_close(alone(dict(features))["token_embeddings"], plain(dict(features))["token_embeddings"],
                                   rtol=0, atol=1e-6)
    both = PromptedTransformer(tiny_bert, prefix_length=None, template=SCPCSE_TEMPLATE, cls_prompt=True).eval()
    assert both.shallow_prompt.num_soft_tokens == 7 + 1  # template tokens then the [CLS] prompt
    _, seen = run(both, both.preprocess(SHORT))
    assert torch.equal(seen["inputs_embeds"][:, 0], both.shallow_prompt.embeddings[-1].expand(2, -1))


# ---------------------------------------------------------------------------------------------- hard templates
def test_hard_template_adds_no_parameter(tiny_bert):  # its [MASK] pooling: test_diffaug's mask pooling test
    encoder = PromptedTransformer(tiny_bert, prefix_length=3, template=PROMPTBERT_TEMPLATE, template_mode="hard")
    assert encoder.shallow_prompt is None
    assert [p.shape for p in encoder.prompt_parameters()] == [p.shape for p in encoder.prefix_encoder.parameters()]
    assert "soft_prompt_positions" not in encoder.preprocess(SHORT)
    with pytest.raises(ConfigurationError, match="template_mode"):
        PromptedTransformer(tiny_bert, template=PROMPTBERT_TEMPLATE, template_mode="frozen")
    # a hard template alone is a valid encoder (of a trainable backbone)
    encoder = PromptedTransformer(tiny_bert, prefix_length=None, template=PROMPTBERT_TEMPLATE, template_mode="hard")
    assert encoder.prompt_parameters() == []
    encoder.freeze_backbone = False
    assert all(p.requires_grad for p in encoder.auto_model.parameters())
    with pytest.raises(ConfigurationError, match="nothing to train"):
        PromptedTransformer(tiny_bert, prefix_length=None, template="[X] [MASK]")
    PromptedTransformer(tiny_bert, prefix_length=None, template="[X] [MASK]", template_mode="hard")


# ---------------------------------------------------------------------------------------------- template only
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_template_only_features_keep_the_template_positions(tiny_backbones, model_type, mode):
    path = tiny_backbones(model_type)
    encoder = random_prefix(path, 4, template=PROMPTBERT_TEMPLATE, template_mode=mode).eval()
    features = encoder.preprocess(SHORT)
    full_positions = encoder.position_ids(features["attention_mask"])
    only = encoder.template_only_features({**features, PREFIX_ATTENTION_MASK: prefix_view_mask(2, 4, 1)})
    n = encoder.parsed_template.num_tokens + 2
    assert only["input_ids"].shape == (2, n) and torch.equal(only["input_ids"][0], only["input_ids"][1])
    text = encoder.tokenizer(literal(PROMPTBERT_TEMPLATE, ""))["input_ids"]
    assert only["input_ids"][0].tolist() == text
    for row in range(2):
        kept = [i for i, t in enumerate(features["attention_mask"][row].tolist()) if t]
        sentence = len(kept) - n
        left = 1 + 4  # [CLS] this sentence of "
        assert len(encoder.parsed_template.left_ids) == 4
        template_positions = kept[: left] + kept[left + sentence:]
        assert only["position_ids"][row].tolist() == full_positions[row, template_positions].tolist()
        assert only["input_ids"][row, only["prompt_mask_index"][row]] == encoder.tokenizer.mask_token_id
    assert torch.equal(only[PREFIX_ATTENTION_MASK], prefix_view_mask(2, 4, 1))

    # the encoder uses those positions, and the result is the backbone run on the template tokens at those positions
    out, seen = run(encoder, only)
    assert torch.equal(seen["position_ids"], only["position_ids"])
    if mode == "hard":
        mask = torch.cat([prefix_view_mask(2, 4, 1), only["attention_mask"]], dim=1)
        with torch.no_grad():
            reference = encoder.auto_model(
                input_ids=only["input_ids"], position_ids=only["position_ids"], attention_mask=mask,
                token_type_ids=only["token_type_ids"],
                **transformers_cache(encoder.auto_model, encoder.prefix_encoder(2)),
            ).last_hidden_state
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- save / load
def test_save_load_keeps_the_cls_prompt(tiny_bert, tmp_path):
    encoder = PromptedTransformer(tiny_bert, prefix_length=2, template=PROMPTBERT_TEMPLATE, template_mode="hard",
                                  cls_prompt=True)
    randomise_prompts(encoder)
    model = SentenceTransformer(modules=[encoder, MaskTokenPooling(encoder.get_embedding_dimension())])
    expected = model.encode(SENTENCES)

    model.save(str(tmp_path / "full"))
    save_prompts_only(model, str(tmp_path / "small"))
    for folder in ("full", "small"):
        loaded = SentenceTransformer(str(tmp_path / folder), trust_remote_code=True)
        assert loaded[0].cls_prompt and loaded[0].template_mode == "hard"
        np.testing.assert_array_equal(loaded.encode(SENTENCES), expected)

    # a checkpoint whose prompts do not fit the configuration is refused clearly
    plain = SentenceTransformer(modules=[PromptedTransformer(tiny_bert, prefix_length=2, cls_prompt=False),
                                         Pooling(32, pooling_mode="cls")])
    save_prompts_only(plain, str(tmp_path / "plain"))
    shutil.copy(tmp_path / "small" / "soft_prompts.safetensors", tmp_path / "plain" / "soft_prompts.safetensors")
    with pytest.raises(ConfigurationError, match="expects"):
        SentenceTransformer(str(tmp_path / "plain"), trust_remote_code=True)


def test_freeze_backbone_setter_touches_only_the_backbone(tiny_bert):
    encoder = PromptedTransformer(tiny_bert, prefix_length=2, cls_prompt=True)
    encoder.shallow_prompt.embeddings.requires_grad_(False)  # e.g. a stage that freezes the [CLS] prompt
    encoder.freeze_backbone = False
    assert all(p.requires_grad for p in encoder.auto_model.parameters())
    assert not encoder.shallow_prompt.embeddings.requires_grad
    encoder.freeze_backbone = True
    assert not any(p.requires_grad for p in encoder.auto_model.parameters())
    assert encoder.prefix_encoder.embedding.weight.requires_grad
