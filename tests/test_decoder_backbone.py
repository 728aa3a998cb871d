"""A real decoder backbone, SmolLM2-135M-Instruct (Llama, grouped-query attention, GGUF): deep prompts reach it, a
row's embedding does not depend on its batch, and full and prompts-only checkpoints reload identically."""

from __future__ import annotations

import pytest
import torch
from conftest import st_model
from sentence_transformers import SentenceTransformer

from st_prompts import PromptedTransformer, save_prompts_only
from st_prompts.modules import PREFIX_ATTENTION_MASK

SENTENCES = ["A man is playing a guitar.", "The cat sleeps on the warm windowsill all afternoon.", "Rain."]


@pytest.fixture(scope="module")
def smollm2(cached_gguf):
    torch.manual_seed(0)
    return st_model(PromptedTransformer("smollm2", prefix_length=4, max_seq_length=32, prefix_init_std=0.5),
                    "lasttoken")


def encode(model, texts):
    return model.encode(list(texts), convert_to_tensor=True, batch_size=len(texts))


def test_the_decoder_is_inspected_as_a_grouped_query_causal_model(smollm2):
    encoder = smollm2[0]
    config = encoder.auto_model.config
    plan = encoder.backbone_plan
    assert (plan.layers, plan.kv_heads, plan.head_dim) == (30, 3, 64) and plan.causal and not plan.absolute_positions
    assert config.num_attention_heads == 9
    trainable = sum(p.numel() for p in encoder.prompt_parameters())
    assert trainable == 2 * 30 * 3 * 64 * 4 and encoder.backbone_reference == "smollm2"
    assert encoder.max_seq_length == 32
    features = encoder.preprocess(SENTENCES)
    mask = features["attention_mask"].bool()
    with torch.no_grad():  # the prompts reach the decoder: masking them out moves every token
        masked = encoder.eval()({**features, PREFIX_ATTENTION_MASK: torch.zeros(len(SENTENCES), 4)})["token_embeddings"]
        prompted = encoder(dict(features))["token_embeddings"]
    assert (prompted[mask] - masked[mask]).abs().max() > 1e-2


def test_a_row_alone_equals_the_row_in_a_padded_batch_with_either_padding_side(smollm2):
    batch = encode(smollm2, SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        assert torch.allclose(encode(smollm2, [sentence])[0], batch[i], atol=1e-4)
    tokenizer = smollm2[0].tokenizer
    tokenizer.padding_side = "left"
    try:
        assert torch.allclose(encode(smollm2, SENTENCES), batch, atol=1e-4)
    finally:
        tokenizer.padding_side = "right"


def test_full_and_prompts_only_checkpoints_reload_identically(smollm2, cached_gguf, tmp_path):
    expected = encode(smollm2, SENTENCES)
    smollm2.save(str(tmp_path / "full"))  # the de-quantised GGUF weights as an ordinary checkpoint
    save_prompts_only(smollm2, str(tmp_path / "prompts"))
    assert not (tmp_path / "prompts" / "model.safetensors").exists()
    for folder in ("full", "prompts"):
        loaded = SentenceTransformer(str(tmp_path / folder), trust_remote_code=True, device="cpu")
        assert torch.equal(encode(loaded, SENTENCES), expected), folder
