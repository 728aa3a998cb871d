"""A reparameterised prefix (an embedding table fed through an MLP) is stored as the prefix it computes: full models,
prompts-only checkpoints and a bank's sets reload as plain prefixes that encode the same; checkpoints that stored the
MLP still load; the sizes trained and stored are reported apart."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling

from st_prompts import PromptedTransformer, bank, save_prompts_only
from st_prompts.loading import load_sentence_model
from st_prompts.modules import PROMPTS_FILE
from st_prompts.sizes import prompt_set_size, prompt_sizes

TEXTS = ["the man plays guitar .", "a dog runs in the park with a red car", "the cat", "this is happy music"]


def encode(model, texts=TEXTS, **kwargs) -> torch.Tensor:
    return model.encode(list(texts), convert_to_tensor=True, **kwargs)


def trained_looking(*modules) -> None:
    """Move every prompt parameter (the gate too) far from its initialisation: outputs differ clearly."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in modules:
            for parameter in module.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.3)


def test_a_reparameterised_minilm_set_is_stored_as_its_prefix_under_400_kb(minilm_path, minilm, tmp_path):
    encoder = PromptedTransformer(minilm_path, prefix_length=16, prefix_projection=True)  # P = 512, as DCPCSE
    trained_looking(encoder.prefix_encoder)
    model = SentenceTransformer(modules=[encoder, *list(minilm)[1:]], device="cpu")
    before = encode(model)
    assert not torch.allclose(before, encode(minilm), atol=1e-2)  # the prefix changes the embeddings

    save_prompts_only(model, str(tmp_path / "set"))
    assert sum(f.stat().st_size for f in (tmp_path / "set").rglob("*") if f.is_file()) < 400_000  # 10.3 MB with the MLP
    stored = load_file(tmp_path / "set" / PROMPTS_FILE)
    assert {k: tuple(v.shape) for k, v in stored.items()} == {"prefix_encoder.embedding.weight": (16, 2 * 6 * 384)}
    loaded = load_sentence_model(str(tmp_path / "set"))
    assert not loaded[0].prefix_encoder.projection and not loaded[0].prefix_projection
    torch.testing.assert_close(encode(loaded), before, atol=1e-6, rtol=0)

    # training still runs through the MLP: the module in memory is unchanged, and its sizes say both
    assert encoder.prefix_encoder.projection and encoder.prefix_encoder.transform[0].weight.requires_grad
    size = prompt_sizes(encoder)[""]
    assert size.stored_parameters == 16 * 2 * 6 * 384 == 73_728 and size.stored_bytes == 4 * 73_728
    assert size.trainable_parameters == sum(p.numel() for p in encoder.prefix_encoder.parameters()) > 1_900_000
    assert prompt_sizes(loaded[0])[""].trainable_parameters == 73_728  # reloaded, it trains the prefix itself


def test_full_models_and_bank_sets_store_the_computed_prefix(tiny_bert, tmp_path):
    """Saved, full or prompts-only, a reparameterised prefix is the prefix it computes; checkpoints that stored the
    MLP (``keep_projection=True`` still writes them, for DiffAug's stage 1) still load."""
    encoder = PromptedTransformer(tiny_bert, prefix_length=4, prefix_projection=True, prefix_hidden_size=16,
                                  prefix_gate=True)
    trained_looking(encoder.prefix_encoder)
    model = SentenceTransformer(modules=[encoder, Pooling(32, pooling_mode="mean")], device="cpu")
    before = encode(model)
    model.save(str(tmp_path / "full"))
    stored = load_file(tmp_path / "full" / PROMPTS_FILE)
    assert {k: tuple(v.shape) for k, v in stored.items()} == {"prefix_encoder.embedding.weight": (4, 2 * 2 * 32),
                                                              "prefix_encoder.gate": (2, 4)}
    config = json.loads((tmp_path / "full" / "sentence_bert_config.json").read_text())
    assert config["prefix_projection"] is False and config["prefix_gate"] is True
    assert encoder.get_config_dict()["prefix_projection"] is True  # only what is saved changes
    full = load_sentence_model(str(tmp_path / "full"))
    assert not full[0].prefix_encoder.projection and full[0].prefix_encoder.gated
    torch.testing.assert_close(encode(full), before, atol=1e-6, rtol=0)
    save_prompts_only(model, str(tmp_path / "old"), keep_projection=True)
    assert "prefix_encoder.transform.0.weight" in load_file(tmp_path / "old" / PROMPTS_FILE)
    old = load_sentence_model(str(tmp_path / "old"))
    assert old[0].prefix_encoder.projection
    torch.testing.assert_close(encode(old), before, atol=1e-6, rtol=0)

    # a bank: a reparameterised set beside a plain one, per call and per row
    banked = bank.create_bank(tiny_bert)
    projected = banked[0].new_prompt_set("p", prefix_length=3, prefix_projection=True, prefix_hidden_size=8)
    plain = banked[0].new_prompt_set("q", prefix_length=2)
    trained_looking(projected, plain)
    tasks = ["p", "q", "p", "backbone"]
    expected = {"p": encode(banked, task="p"), "mixed": encode(banked, task=tasks)}
    banked.save(str(tmp_path / "bank"))
    stored = load_file(tmp_path / "bank" / PROMPTS_FILE)
    assert {k: tuple(v.shape) for k, v in stored.items()} == {"prompt_sets.p.embedding.weight": (3, 128),
                                                              "prompt_sets.q.embedding.weight": (2, 128)}
    reloaded = load_sentence_model(str(tmp_path / "bank"))
    assert not reloaded[0].prompt_sets["p"].projection
    assert reloaded[0].prompt_set_options()["p"]["prefix_projection"] is False
    torch.testing.assert_close(encode(reloaded, task="p"), expected["p"], atol=1e-6, rtol=0)
    torch.testing.assert_close(encode(reloaded, task=tasks), expected["mixed"], atol=1e-6, rtol=0)

    # an old bank with a reparameterised set: it loads, and the set joins another bank from its folder
    bank.remove_prompt_set(banked, "q")  # (a bank of one set: a source for bank.add_prompt_set)
    save_prompts_only(banked, str(tmp_path / "old-bank"), keep_projection=True)
    assert "prompt_sets.p.transform.2.bias" in load_file(tmp_path / "old-bank" / PROMPTS_FILE)
    old_bank = load_sentence_model(str(tmp_path / "old-bank"))
    assert old_bank[0].prompt_sets["p"].projection
    torch.testing.assert_close(encode(old_bank, task="p"), expected["p"], atol=1e-6, rtol=0)
    other = bank.create_bank(tiny_bert)
    bank.add_prompt_set(other, "again", str(tmp_path / "old-bank"))
    torch.testing.assert_close(encode(other, task="again"), expected["p"], atol=1e-6, rtol=0)
    # and saved again, it is stored as its prefix
    other.save(str(tmp_path / "new-bank"))
    assert set(load_file(tmp_path / "new-bank" / PROMPTS_FILE)) == {"prompt_sets.again.embedding.weight"}


@pytest.mark.parametrize("projection", [False, True])
def test_sizes_count_what_trains_and_what_is_stored(tiny_bert, projection):
    banked = bank.create_bank(tiny_bert)
    prefix = banked[0].new_prompt_set("s", prefix_length=5, prefix_projection=projection, prefix_hidden_size=8,
                                      prefix_gate=True)
    size = prompt_set_size(prefix)
    stored = prefix.stored_state_dict()
    assert size.stored_parameters == sum(v.numel() for v in stored.values()) == 5 * 2 * 2 * 32 + 2 * 4
    assert size.stored_bytes == sum(v.numel() * v.element_size() for v in stored.values())
    assert size.trainable_parameters == sum(p.numel() for p in prefix.parameters())
    assert (size.trainable_parameters > size.stored_parameters) == projection
    assert size.as_dict() == {"trainable_parameters": size.trainable_parameters,
                              "stored_parameters": size.stored_parameters, "stored_bytes": size.stored_bytes}


def test_bank_list_and_the_card_show_trainable_and_stored_sizes(tiny_bert, tmp_path, capsys):
    from st_prompts import cli

    banked = bank.create_bank(tiny_bert)
    banked[0].new_prompt_set("p", prefix_length=3, prefix_projection=True, prefix_hidden_size=8)
    size = prompt_set_size(banked[0].prompt_sets["p"])
    folder = tmp_path / "bank"
    banked.save(str(folder))
    row = next(line for line in (folder / "README.md").read_text().splitlines() if line.startswith("| `p` |"))
    assert row.startswith(f"| `p` | 3 | {size.trainable_parameters:,} | {size.stored_parameters:,} |")

    assert cli.main(["bank", "list", str(folder), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["sets"]["p"]
    # saved, the set is its prefix: what it trains from now on is what it stores
    assert listed["parameters"] == listed["stored_parameters"] == size.stored_parameters
    assert listed["bytes"] == size.stored_bytes
    # the table, for a set in memory that still has its MLP
    from st_prompts.commands.bank import _summary, format_summary

    table = format_summary(_summary(banked, "in-memory")).splitlines()
    assert table[2].split()[:4] == ["p", "3", f"{size.trainable_parameters:,}", f"{size.stored_parameters:,}"]
