"""PromptedTransformer: prefix arithmetic vs PEFT, freezing, architectures, limits, save/load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from conftest import random_prefix, randomise_prompts, st_model
from st_prompts import SCPCSE_TEMPLATE, MaskTokenPooling, PromptedTransformer, save_prompts_only
from st_prompts.errors import ConfigurationError, UnsupportedArchitectureError
from st_prompts.modules import PROMPTS_FILE

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music"]


def test_matches_peft_prefix_tuning(tiny_bert):
    """Same key/value prompts in, same hidden states out as PEFT's PrefixTuningConfig on the same backbone."""
    from peft import PrefixTuningConfig, get_peft_model
    from transformers import AutoModel

    l = 5
    encoder = PromptedTransformer(tiny_bert, prefix_length=l).eval()
    features = encoder.preprocess(SENTENCES)
    ours = encoder(dict(features))["token_embeddings"]

    backbone = AutoModel.from_pretrained(tiny_bert).eval()
    peft_model = get_peft_model(backbone, PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=l)).eval()
    peft_embedding = peft_model.prompt_encoder["default"].embedding
    assert peft_embedding.weight.shape == encoder.prefix_encoder.embedding.weight.shape
    with torch.no_grad():
        peft_embedding.weight.copy_(encoder.prefix_encoder.embedding.weight)
        theirs = peft_model(**{k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids")})
    theirs = theirs.last_hidden_state
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max().item() <= 1e-5


def test_only_prompt_parameters_reach_the_optimizer(tiny_bert, tmp_path):
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    encoder = PromptedTransformer(tiny_bert, prefix_length=4, prefix_projection=True, prefix_hidden_size=8)
    model = st_model(encoder, "cls")
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, loss=MultipleNegativesRankingLoss(model),
                                         train_dataset=Dataset.from_dict({"a": SENTENCES, "b": SENTENCES}))
    optimizer = trainer.create_optimizer()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in encoder.prompt_parameters()}
    # Embedding(l, H) -> Linear(H, 8) -> Tanh -> Linear(8, 2·L·H)
    assert sum(p.numel() for p in encoder.prompt_parameters()) == 4 * 32 + (32 * 8 + 8) + (8 * 2 * 2 * 32 + 2 * 2 * 32)


def test_dropout_makes_views_differ_only_in_training(tiny_bert):
    model = st_model(PromptedTransformer(tiny_bert, prefix_length=4), "cls")
    features = model.preprocess(SENTENCES)
    for training in (True, False):
        a, b = (model.train(training)(dict(features))["sentence_embedding"] for _ in range(2))
        assert (a - b).abs().max() > 1e-4 if training else torch.equal(a, b)


def test_probe_catches_a_backbone_that_ignores_or_drops_the_prompts(tiny_bert, monkeypatch):
    """Attention that drops the prefix, or a layer never handed it, must not pass as a silent no-op."""
    from transformers.models.bert import modeling_bert

    from st_prompts.prompts.injection import PREFIX_KWARG, PrefixInjection

    monkeypatch.setattr(PrefixInjection, "inject", lambda self, module, q, key, value, mask, *a: (key, value, mask))
    with pytest.raises(UnsupportedArchitectureError, match="ignores the deep prompts"):
        PromptedTransformer(tiny_bert, prefix_length=3)
    monkeypatch.undo()
    real = modeling_bert.BertSelfAttention.forward

    def dropping(self, hidden_states, *args, **kwargs):
        if self.layer_idx == 1:
            kwargs.pop(PREFIX_KWARG, None)
        return real(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_bert.BertSelfAttention, "forward", dropping)
    with pytest.raises(UnsupportedArchitectureError, match="1 of 2 calls"):
        PromptedTransformer(tiny_bert, prefix_length=3)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "16"])
def test_invalid_prefix_length(tiny_bert, bad):
    with pytest.raises(ConfigurationError, match="prefix_length must be a whole number from 1 to 16384"):
        PromptedTransformer(tiny_bert, prefix_length=bad)


def test_no_prompt_at_all_or_a_template_without_slots_is_an_error(tiny_bert):
    with pytest.raises(ConfigurationError, match="prefix_length .* template"):
        PromptedTransformer(tiny_bert, prefix_length=None)
    with pytest.raises(ConfigurationError, match=r"\[X\]"):
        PromptedTransformer(tiny_bert, prefix_length=None, template="no slots here [MASK]")


@pytest.mark.parametrize("model_type,offset", [("bert", 0), ("roberta", 1)])
def test_max_seq_length_fits_position_embeddings(tiny_backbones, model_type, offset):
    path = tiny_backbones(model_type, max_positions=40)
    encoder = PromptedTransformer(path, prefix_length=8)
    # RoBERTa positions start at padding_idx + 1 (= 1 here: pad id 0)
    assert encoder.max_seq_length == 40 - offset - 8
    encoder.max_seq_length = 1000
    assert encoder.max_seq_length == 40 - offset - 8
    model = st_model(encoder, "cls")
    long_text = " ".join(["music"] * 500)
    embeddings = model.encode([long_text, "", "a dog"])
    assert embeddings.shape == (3, 32) and np.isfinite(embeddings).all()
    assert model.encode([]).shape[0] == 0


def test_save_load_and_prompts_only_round_trips(tiny_bert, tmp_path):
    encoder = PromptedTransformer(tiny_bert, prefix_length=4, prefix_projection=True, prefix_hidden_size=16)
    randomise_prompts(encoder)
    model = st_model(encoder, "cls")
    expected = model.encode(SENTENCES)

    full = tmp_path / "full"
    model.save(str(full))
    assert (full / PROMPTS_FILE).is_file() and (full / "model.safetensors").is_file()
    assert not list(full.rglob("*.bin"))
    reloaded = SentenceTransformer(str(full), trust_remote_code=True)
    assert isinstance(reloaded[0], PromptedTransformer) and reloaded[0].freeze_backbone
    np.testing.assert_array_equal(reloaded.encode(SENTENCES), expected)

    small = tmp_path / "prompts-only"
    save_prompts_only(model, str(small))
    assert not (small / "model.safetensors").exists()
    size = sum(f.stat().st_size for f in small.rglob("*") if f.is_file())
    assert size < 64 * 1024
    np.testing.assert_array_equal(SentenceTransformer(str(small), trust_remote_code=True).encode(SENTENCES), expected)


def test_shallow_template_prompt(tiny_bert, tmp_path):
    encoder = PromptedTransformer(tiny_bert, prefix_length=None, template=SCPCSE_TEMPLATE, max_seq_length=16)
    tokenizer = encoder.tokenizer
    features = encoder.preprocess(["a dog runs in the park " * 10, "the cat"])
    ids = features["input_ids"]
    assert ids.shape[1] == 16
    for row, mask_pos in zip(ids, features["prompt_mask_index"]):
        assert row[mask_pos] == tokenizer.mask_token_id
        assert row[0] == tokenizer.cls_token_id
    # soft slots: the template tokens but [MASK] (before training, the literal text: test_prompt_mechanisms)
    assert encoder.shallow_prompt.num_soft_tokens == 7  # this sentence : " " means .
    model = SentenceTransformer(modules=[encoder, MaskTokenPooling(encoder.get_embedding_dimension())]).eval()
    model.save(str(tmp_path / "scp"))
    reloaded = SentenceTransformer(str(tmp_path / "scp"), trust_remote_code=True)
    np.testing.assert_array_equal(reloaded.encode(SENTENCES), model.encode(SENTENCES))


def test_prefix_draw_broadcasts_in_eval_and_draws_dropout_per_example_or_shared_in_training(tiny_bert):
    from st_prompts.prompts.prefix import PrefixEncoder, prefix_concat

    encoder = PrefixEncoder(prefix_length=3, num_layers=2, num_heads=2, head_dim=4, dropout=0.5)
    encoder.eval()
    draw = encoder(5)
    assert draw.keep is None and draw.shape == (4, 5, 2, 3, 4)
    keys = draw.dense()[2]  # layer 1 keys = row 2 of the 2L axis
    assert keys.shape == (5, 2, 3, 4) and keys.stride(0) == 0  # one prefix broadcast over the batch, no copy
    expected = encoder.key_values().view(3, 4, 2, 4)[:, 2]
    assert torch.equal(keys[0], expected.permute(1, 0, 2))
    encoder.train()
    draw = encoder(5)
    keys = prefix_concat(draw.prefix[0], draw.keep[0], draw.scale, torch.zeros(5, 2, 1, 4))
    assert keys.shape == (5, 2, 4, 4)
    assert not torch.equal(keys[0, :, :3], keys[1, :, :3])  # independent dropout masks per example
    # a shared mask: one draw per batch, before the broadcast
    encoder = PrefixEncoder(prefix_length=3, num_layers=2, num_heads=2, head_dim=4, dropout=0.5, shared_dropout=True)
    draw = encoder.train().values(5)
    assert draw.keep is None and draw.prefix.shape[1] == 1
    values = draw.dense()
    assert values.stride(1) == 0  # still a view over the batch: one prefix, one mask
    assert torch.equal(values[:, 0], values[:, 4])
    assert (values[:, 0] == 0).any() and not torch.equal(values[:, 0], encoder.eval().values(1).dense()[:, 0])
    prompted = PromptedTransformer(tiny_bert, prefix_length=2, prefix_dropout_shared=True)  # saved in the config
    assert prompted.get_config_dict()["prefix_dropout_shared"] is True and prompted.prefix_encoder.shared_dropout


@pytest.mark.parametrize("shared", [False, True])
def test_prefix_dropout_equals_dropout_then_cat(shared):
    """The fused prefix dropout (a draw applied inside each layer's concatenation) gives what the plain route gives
    from the same random numbers: the broadcast prefix times ``draw_keep_mask``'s draw times ``1 / P(keep)`` (a
    mask per example) or ``nn.Dropout`` on the prefix (a shared mask), then ``torch.cat``."""
    from st_prompts.prompts.prefix import PrefixEncoder, draw_keep_mask, prefix_concat

    batch, layers, heads, length, head_dim, tokens = 6, 3, 2, 4, 8, 5
    encoder = PrefixEncoder(length, layers, heads, head_dim, projection=True, projection_hidden_size=16, dropout=0.3,
                            shared_dropout=shared).train()
    states = [torch.randn(batch, heads, tokens, head_dim, requires_grad=True) for _ in range(2 * layers)]
    weights = [torch.randn(batch, heads, length + tokens, head_dim) for _ in range(2 * layers)]

    def run(fused: bool):
        torch.manual_seed(7)
        encoder.zero_grad()
        for s in states:
            s.grad = None
        if fused:
            draw = encoder(batch)
            outs = [prefix_concat(draw.prefix[i], None if draw.keep is None else draw.keep[i], draw.scale, states[i])
                    for i in range(2 * layers)]
        else:  # the reference: dropout on the dense tensor, then cat
            values = encoder.key_values().permute(1, 2, 0, 3).unsqueeze(1)
            if shared:
                values = encoder.dropout(values).expand(-1, batch, -1, -1, -1)
            else:
                dense = values.expand(-1, batch, -1, -1, -1)
                keep, keep_probability = draw_keep_mask(dense.shape, 0.3)
                values = dense * keep * torch.tensor(1 / keep_probability)
            outs = [torch.cat([v, s], dim=-2) for v, s in zip(values.unbind(0), states)]
        sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        grads = [p.grad.clone() for p in encoder.parameters()] + [s.grad.clone() for s in states]
        return [o.detach() for o in outs], grads, torch.rand(3)

    (fused_out, fused_grads, fused_next), (ref_out, ref_grads, ref_next) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(fused_out, ref_out))
    # the fused backward sums the batch's rows itself, in another order than autograd's expand: equal up to rounding
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(fused_grads, ref_grads))
    assert all(a.abs().sum() > 0 for a in fused_grads)
    assert torch.equal(fused_next, ref_next)  # the same random numbers were drawn
    dropped = (fused_out[0][:, :, :length] == 0).float().mean().item()
    assert 0.1 < dropped < 0.5  # dropout is really on (p = 0.3)
    # per example: rows differ; shared: every row has the same mask
    assert torch.equal(fused_out[0][0, :, :length], fused_out[0][1, :, :length]) is shared


def test_per_example_prefix_dropout_gradient_matches_a_hand_written_sum():
    """The broadcast prefix's gradient is the batch's masked, scaled gradients summed (a per-row prefix: not summed)."""
    from st_prompts.prompts.prefix import _DroppedPrefixCat

    torch.manual_seed(0)
    batch, heads, length, head_dim, tokens = 5, 2, 3, 4, 6
    keep = torch.rand(batch, heads, length, head_dim) > 0.4
    scale = torch.tensor(1 / 0.6)
    upstream = torch.randn(batch, heads, length + tokens, head_dim)
    for rows in (1, batch):
        prefix = torch.randn(rows, heads, length, head_dim, requires_grad=True)
        states = torch.randn(batch, heads, tokens, head_dim, requires_grad=True)
        out = _DroppedPrefixCat.apply(prefix, keep, scale, states)
        assert torch.equal(out[:, :, :length], prefix.detach().expand(batch, -1, -1, -1) * scale * keep)
        assert torch.equal(out[:, :, length:], states.detach())
        (out * upstream).sum().backward()
        expected = upstream[:, :, :length] * keep * scale
        expected = expected.sum(0, keepdim=True) if rows == 1 else expected
        assert prefix.grad.shape == prefix.shape
        assert torch.allclose(prefix.grad, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(states.grad, upstream[:, :, length:])


def test_draw_keep_mask_is_bernoulli_with_the_stated_probability():
    """Every entry is kept with the returned probability (p rounded to 2**-16), independently of its neighbours
    (four entries share one 64-bit random word) and of the lane it came from; seeded draws repeat."""
    from st_prompts.prompts.prefix import draw_keep_mask

    n = 1 << 21
    torch.manual_seed(3)
    keep, keep_probability = draw_keep_mask((n,), 0.3)
    assert keep.dtype == torch.bool and keep.shape == (n,)
    assert keep_probability == 1 - round(0.3 * 2**16) / 2**16 and abs(keep_probability - 0.7) < 2**-16
    drop = 1 - keep_probability
    sigma = (drop * (1 - drop) / n) ** 0.5
    assert abs((~keep).float().mean().item() - drop) < 5 * sigma
    for lane in range(4):  # each 16-bit lane of the 64-bit words
        assert abs((~keep[lane::4]).float().mean().item() - drop) < 5 * 2 * sigma
    both = ((~keep[:-1]) & (~keep[1:])).float().mean().item()  # neighbours (mostly in one word) independent
    assert abs(both - drop * drop) < 5 * (drop * drop * (1 - drop * drop) / n) ** 0.5
    # the kept entries scaled by 1 / P(keep) keep the mean exactly in expectation
    assert abs(keep.float().mean().item() / keep_probability - 1) < 5 * sigma / keep_probability
    torch.manual_seed(3)
    assert torch.equal(draw_keep_mask((n,), 0.3)[0], keep)
    assert not torch.equal(draw_keep_mask((n,), 0.3)[0], keep)
    assert draw_keep_mask((2, 3, 5), 0.1)[0].shape == (2, 3, 5)  # shapes whose size is no multiple of 4
    every, one = draw_keep_mask((7,), 0.0)
    assert one == 1.0 and every.all()
    none, zero = draw_keep_mask((7,), 1.0)
    assert zero == 0.0 and not none.any()
    with pytest.raises(ConfigurationError, match="dropout probability"):
        draw_keep_mask((3,), 1.5)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_inference_pads_the_keys_to_a_multiple_of_16_without_changing_the_output(tiny_backbones, model_type,
                                                                                   monkeypatch):
    """Masked-out zero prefix positions up to a multiple of 16 keys (the CPU's fast case); training never pads."""
    from st_prompts.modules import prompted_transformer as module  # the steps of a pass (PromptedTransformer._encode)
    from st_prompts.prompts.prefix import key_padding

    assert [key_padding(12, t) for t in (32, 4, 20, 37)] == [4, 0, 0, 15]
    encoder = random_prefix(tiny_backbones(model_type), 5).eval()
    features = encoder.tokenize(["a man plays the guitar on a stage", "a dog", "two women are talking quietly"])
    lengths = []
    real_injection = module.PrefixInjection
    monkeypatch.setattr(module, "PrefixInjection",
                        lambda values, mask: lengths.append(values.shape[3]) or real_injection(values, mask))

    def run(pad: bool, **extra):
        if not pad:
            monkeypatch.setattr(module, "key_padding", lambda *a, **k: 0)
        with torch.no_grad():
            out = encoder({**features, **extra})["token_embeddings"]
        monkeypatch.setattr(module, "key_padding", key_padding)
        return out

    tokens = features["input_ids"].shape[1]
    padded, plain = run(True), run(False)
    assert lengths == [5 + key_padding(5, tokens), 5] and (lengths[0] + tokens) % 16 == 0 and lengths[0] > 5
    assert torch.allclose(padded, plain, atol=1e-5) and not torch.allclose(padded, padded.roll(1, 0), atol=1e-3)
    view = {"prefix_attention_mask": torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])}
    assert torch.allclose(run(True, **view), run(False, **view), atol=1e-5)
    lengths.clear()
    encoder.train()
    encoder({**features})
    assert lengths == [5]


@pytest.mark.parametrize("projection", [False, True])
def test_prefix_starts_at_the_backbones_initializer_range_as_in_the_official_code(tiny_backbones, projection):
    """Every Embedding and Linear weight ~ N(0, initializer_range), biases zero (official: before init_weights())."""
    for initializer_range in (0.02, 0.05):
        path = tiny_backbones("bert", max_positions=128)
        encoder = PromptedTransformer(path, prefix_length=64, prefix_projection=projection, prefix_hidden_size=64,
                                      config_kwargs={"initializer_range": initializer_range})
        assert encoder.auto_model.config.initializer_range == initializer_range
        prefix = encoder.prefix_encoder
        weights = [m.weight for m in prefix.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.Linear))]
        assert len(weights) == (3 if projection else 1)
        for weight in weights:
            assert float(weight.std()) == pytest.approx(initializer_range, rel=0.1)
            assert abs(float(weight.mean())) < initializer_range / 10
        assert all(float(m.bias.abs().max()) == 0 for m in prefix.modules() if isinstance(m, torch.nn.Linear))
        if not projection:  # the keys/values are the embedding itself
            assert float(prefix.key_values().std()) == pytest.approx(initializer_range, rel=0.1)
    explicit = PromptedTransformer(tiny_backbones("bert", max_positions=128), prefix_length=64, prefix_init_std=0.5)
    assert float(explicit.prefix_encoder.embedding.weight.std()) == pytest.approx(0.5, rel=0.1)
    with pytest.raises(ConfigurationError, match="prefix_init_std"):
        PromptedTransformer(tiny_backbones("bert"), prefix_length=4, prefix_init_std=0.0)
    from st_prompts.losses import PromptContrastiveLoss

    encoder = PromptedTransformer(tiny_backbones("bert"), prefix_length=2)  # the training-only MLP starts as SimCSE's
    model = st_model(encoder, "cls")
    linear = PromptContrastiveLoss(model, mlp=True).mlp[0]
    assert float(linear.weight.std()) == pytest.approx(encoder.auto_model.config.initializer_range, rel=0.15)
    assert float(linear.bias.abs().max()) == 0
