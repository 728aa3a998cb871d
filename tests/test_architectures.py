"""Deep prompts on every supported architecture (tiny random configs): layers, training, padding, save/load, views,
gradient checkpointing, and the refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DECODERS, one_line_message, random_prefix, st_model, through_transformers_cache
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Transformer

from st_prompts import PromptedTransformer, save_prompts_only
from st_prompts.errors import ConfigurationError, UnsupportedArchitectureError
from st_prompts.modules import PREFIX_ATTENTION_MASK, prefix_view_mask
from st_prompts.modules.backbones import SUPPORTED_MODEL_TYPES
from st_prompts.prompts import injection
from st_prompts.prompts.injection import LAYER_ATTRIBUTE
from st_prompts.prompts.prefix import key_padding

ENCODERS = ("bert", "roberta", "xlm-roberta", "electra", "camembert", "distilbert", "albert", "modernbert")
ARCHITECTURES = ENCODERS + DECODERS
ROTARY = ("modernbert", *DECODERS)
SENTENCES = ["the man plays guitar .", "a dog runs in the park with a red car and a big tree", "the cat",
             "this is happy music"]


def pooling(model_type: str) -> str:
    return "lasttoken" if model_type in DECODERS else "mean"


def encode(model: SentenceTransformer, texts) -> torch.Tensor:
    return model.encode(list(texts), convert_to_tensor=True, batch_size=len(texts))


@contextlib.contextmanager
def layer_outputs(encoder: PromptedTransformer):
    """The output of every attention call, recorded (ALBERT's shared layer once per application)."""
    outputs = []
    handles = [module.register_forward_hook(lambda m, args, out: outputs.append(
        (out[0] if isinstance(out, tuple) else out).detach().clone()))
        for module in encoder.auto_model.modules() if getattr(module, LAYER_ATTRIBUTE, None)]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_prefix_on_every_architecture(tiny_backbones, model_type, tmp_path):
    """The prefix changes every layer; rows attend to their own view in one pass; a row alone equals the row in a
    padded batch; save -> load and prompts-only -> load give identical embeddings; only the prompts get gradient."""
    encoder = random_prefix(tiny_backbones(model_type)).eval()
    features = encoder.preprocess(SENTENCES)
    with torch.no_grad(), layer_outputs(encoder) as on:
        encoder(dict(features))
    with torch.no_grad(), layer_outputs(encoder) as off:
        encoder({**features, PREFIX_ATTENTION_MASK: torch.zeros(len(SENTENCES), 3)})
    assert len(on) == encoder.prefix_encoder.num_layers == len(off)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(on, off))

    views = random_prefix(tiny_backbones(model_type), 4).eval()
    with torch.no_grad():
        mixed = views({**features, PREFIX_ATTENTION_MASK: prefix_view_mask(4, 4, [0, 1, 1, 0])})["token_embeddings"]
        alone = [views({**features, PREFIX_ATTENTION_MASK: prefix_view_mask(4, 4, v)})["token_embeddings"]
                 for v in (0, 1)]
    assert torch.allclose(mixed[[0, 3]], alone[0][[0, 3]], atol=1e-5)
    assert torch.allclose(mixed[[1, 2]], alone[1][[1, 2]], atol=1e-5)
    assert not torch.allclose(mixed[0], alone[1][0], atol=1e-3)

    model = st_model(encoder, pooling(model_type))
    batch = encode(model, SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        assert torch.allclose(encode(model, [sentence])[0], batch[i], atol=1e-5), sentence
    model.save(str(tmp_path / "full"))
    save_prompts_only(model, str(tmp_path / "prompts"))
    for folder in ("full", "prompts"):
        loaded = SentenceTransformer(str(tmp_path / folder), trust_remote_code=True, device="cpu")
        assert torch.equal(encode(loaded, SENTENCES), batch), folder

    encoder.train()(dict(features))["token_embeddings"].pow(2).mean().backward()
    prompts = {id(p) for p in encoder.prompt_parameters()}
    assert all(p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.prompt_parameters())
    assert all(not p.requires_grad and p.grad is None for p in encoder.parameters() if id(p) not in prompts)


@pytest.mark.parametrize("model_type", ROTARY)
def test_a_prefix_no_row_attends_to_changes_nothing_on_rotary_models(tiny_backbones, model_type):
    """The prefix enters after the rotation and the text keeps its positions."""
    path = tiny_backbones(model_type)
    encoder = random_prefix(path).eval()
    with torch.no_grad():
        encoder.prefix_encoder.embedding.weight.zero_()
    plain = Transformer(path).eval()
    features = encoder.preprocess(SENTENCES)
    mask = features["attention_mask"].bool()
    with torch.no_grad():
        ours = encoder({**features, PREFIX_ATTENTION_MASK: torch.zeros(len(SENTENCES), 3)})["token_embeddings"]
        reference = plain(dict(features))["token_embeddings"]
    assert torch.allclose(ours[mask], reference[mask], atol=1e-5)


@pytest.mark.parametrize("model_type", DECODERS)
def test_decoders_give_the_same_embedding_with_left_or_right_padding(tiny_backbones, model_type):
    right = st_model(random_prefix(tiny_backbones(model_type)).eval(), pooling(model_type))
    left_encoder = random_prefix(tiny_backbones(model_type, padding_side="left")).eval()
    assert left_encoder.tokenizer.padding_side == "left"
    left = st_model(left_encoder, pooling(model_type))
    for mode in ("lasttoken", "mean"):
        right[1].__init__(right[1].embedding_dimension, pooling_mode=mode)
        left[1].__init__(left[1].embedding_dimension, pooling_mode=mode)
        assert torch.allclose(encode(right, SENTENCES), encode(left, SENTENCES), atol=1e-5), mode


@pytest.mark.parametrize("model_type", [t for t in ARCHITECTURES if t != "albert"])
def test_gradient_checkpointing_keeps_the_prefix(tiny_backbones, model_type):
    encoder = random_prefix(tiny_backbones(model_type)).train()
    features = encoder.preprocess(SENTENCES)
    for module in encoder.modules():  # no dropout: recomputation must give the same numbers
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

    def step():
        encoder.zero_grad()
        torch.manual_seed(1)
        out = encoder(dict(features))["token_embeddings"]
        out.pow(2).mean().backward()
        return out.detach(), encoder.prefix_encoder.embedding.weight.grad.clone()

    plain_out, plain_grad = step()
    encoder.auto_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert encoder.auto_model.is_gradient_checkpointing
    out, grad = step()
    assert torch.allclose(out, plain_out, atol=1e-5) and torch.allclose(grad, plain_grad, atol=1e-6)
    assert plain_grad.abs().sum() > 0  # the prompts still act


def test_albert_gets_one_prefix_per_application_of_its_shared_layer(tiny_backbones, monkeypatch):
    """ALBERT applies one attention module to every layer: the prefix has a layer per application, read in order."""
    encoder = random_prefix(tiny_backbones("albert"))
    modules = [m for m in encoder.auto_model.modules() if getattr(m, LAYER_ATTRIBUTE, None)]
    config = encoder.auto_model.config
    assert len(modules) == 1 and getattr(modules[0], LAYER_ATTRIBUTE) == tuple(range(config.num_hidden_layers))
    assert encoder.prefix_encoder.num_layers == config.num_hidden_layers and encoder.backbone_plan.shared
    seen = []
    real = injection.PrefixInjection.layer
    monkeypatch.setattr(injection.PrefixInjection, "layer", lambda self, module: seen.append(real(self, module))
                        or seen[-1])
    with torch.no_grad():
        for _ in range(2):
            encoder.eval()(dict(encoder.preprocess(SENTENCES)))
    monkeypatch.undo()
    assert seen == [0, 1, 0, 1]
    # transformers checkpoints no ALBERT layer; were it to, a recomputed shared layer would read the wrong prefix
    assert not encoder.auto_model.supports_gradient_checkpointing
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        monkeypatch.setattr(type(encoder.auto_model), name, property(lambda self: True), raising=False)
    encoder.train()
    with pytest.raises(ConfigurationError, match="shared layer"):
        encoder(dict(encoder.preprocess(SENTENCES)))


def test_grouped_query_decoders_get_a_prefix_of_their_key_value_heads(tiny_backbones):
    encoder = random_prefix(tiny_backbones("qwen3"))
    config = encoder.auto_model.config
    assert encoder.backbone_plan.kv_heads == config.num_key_value_heads < config.num_attention_heads
    assert encoder.prefix_encoder.num_heads == config.num_key_value_heads
    assert encoder.backbone_plan.causal and not encoder.backbone_plan.absolute_positions


def test_local_attention_layers_see_the_whole_prefix(tiny_backbones, monkeypatch):
    """ModernBERT's local layers: every token sees every prefix position; the text part keeps its window."""
    encoder = random_prefix(tiny_backbones("modernbert")).eval()
    masks = []
    real = injection.sdpa_attention_forward

    def spy(module, query, key, value, mask, **kwargs):
        masks.append(mask)
        return real(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(injection, "sdpa_attention_forward", spy)
    features = encoder.preprocess(["a man plays the guitar on a big red car in the park with a dog"])
    with torch.no_grad():
        encoder(dict(features))
    tokens = features["input_ids"].shape[1]
    padding = key_padding(3, tokens)  # inference pads the prefix with masked positions to a multiple of 16 keys
    assert len(masks) == 3 and all(m is not None and m.shape[-1] == 3 + padding + tokens for m in masks)
    assert all(bool(m[..., :3].all()) and not bool(m[..., 3:3 + padding].any()) for m in masks)
    text = [m[..., 3 + padding:] for m in masks]
    assert bool(text[0].all()) and not bool(text[1].all()) and not bool(text[2].all())  # layer 0 global, 1-2 local


@pytest.mark.parametrize("model_type", ENCODERS)
def test_templates_and_the_cls_prompt_work_on_encoders(tiny_backbones, model_type):
    """A soft template and a [CLS] prompt beside the prefix: trainable; a row alone equals the row in a batch."""
    path = tiny_backbones(model_type)
    torch.manual_seed(0)
    encoder = PromptedTransformer(path, prefix_length=2, template='this sentence : "[X]" means [MASK] .',
                                  cls_prompt=True)
    with torch.no_grad():
        encoder.shallow_prompt.embeddings.normal_()
    out = encoder.train()(dict(encoder.preprocess(SENTENCES)))["token_embeddings"]
    out.pow(2).mean().backward()
    assert encoder.shallow_prompt.embeddings.grad.abs().sum() > 0
    encoder.eval()
    with torch.no_grad():
        batch = encoder(dict(encoder.preprocess(SENTENCES)))
        for i, sentence in enumerate(SENTENCES):
            alone = encoder(dict(encoder.preprocess([sentence])))
            mine, theirs = alone["prompt_mask_index"][0], batch["prompt_mask_index"][i]
            assert torch.allclose(alone["token_embeddings"][0, mine], batch["token_embeddings"][i, theirs], atol=1e-5)


def test_decoder_options_and_backbones_computing_attention_themselves_are_refused_in_one_line(tiny_backbones):
    for option in ({"cls_prompt": True}, {"template": 'this sentence : "[X]" means [MASK] .'}):
        with pytest.raises(ConfigurationError, match="causal decoder.*lasttoken") as caught:
            PromptedTransformer(tiny_backbones("llama"), prefix_length=2, **option)
        one_line_message(caught)
    for model_type in ("mpnet", "deberta-v2"):
        with pytest.raises(UnsupportedArchitectureError, match="Supported model types: bert, roberta") as caught:
            PromptedTransformer(tiny_backbones(model_type), prefix_length=3)
        assert all(t in one_line_message(caught) for t in SUPPORTED_MODEL_TYPES)


def test_a_saved_cache_injection_loads_on_the_attention_path(tiny_backbones, caplog):
    """``prefix_injection="cache"`` was removed: a folder saved with it loads, with a warning, on the attention path."""
    encoder = PromptedTransformer(tiny_backbones("distilbert"), prefix_length=3, prefix_injection="cache")
    assert encoder.prefix_injection == "attention" and "was removed" in caplog.text
    with pytest.raises(UnsupportedArchitectureError, match="prefix_injection must be 'attention'"):
        PromptedTransformer(tiny_backbones("bert"), prefix_length=3, prefix_injection="kv")


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta", "electra", "camembert"])
def test_the_attention_path_computes_what_transformers_cache_computes(tiny_backbones, model_type):
    """The same token embeddings and gradients as transformers' own ``DynamicCache`` holding the same prefix draw
    (PEFT's mechanism), in training and at inference, with padding, views, a soft template and a [CLS] prompt."""
    path = tiny_backbones(model_type)
    torch.manual_seed(0)
    encoder = PromptedTransformer(path, prefix_length=4, template='this sentence : "[X]" means [MASK] .',
                                  cls_prompt=True)
    features = encoder.preprocess(SENTENCES)
    views = {PREFIX_ATTENTION_MASK: prefix_view_mask(4, 4, [0, 1, 1, 0])}
    for training in (False, True):
        results = {}
        for kind, run in (("attention", lambda f: encoder(f)["token_embeddings"]),
                          ("cache", lambda f: through_transformers_cache(encoder, f))):
            encoder.train(training).zero_grad()
            torch.manual_seed(3)
            out = run({**features, **views})
            out.pow(2).mean().backward()
            results[kind] = (out.detach(), [p.grad.clone() for p in encoder.prompt_parameters()])
        (a, grads_a), (b, grads_b) = results["attention"], results["cache"]
        assert torch.allclose(a, b, atol=1e-5), training
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(grads_a, grads_b)), training


def test_dcpcse_on_a_decoder_pools_what_the_decoder_has(tiny_backbones):
    from st_prompts import methods

    with pytest.raises(ConfigurationError, match="no \\[CLS\\] to pool.*--pooling lasttoken"):
        methods.build("dcpcse", backbone=tiny_backbones("llama"), scale="cpu")
    model = methods.build("dcpcse", backbone=tiny_backbones("llama"), scale="cpu", pooling="lasttoken")
    assert model[1].pooling_mode == "lasttoken" and model.encode(["the cat"]).shape == (1, 32)
