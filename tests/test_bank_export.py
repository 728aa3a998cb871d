"""One set of a bank as a prompts-only checkpoint (``bank.export_prompt_set``, ``st-prompts bank export``): it loads
alone, encodes as the bank with that task, and joins another bank; every new set starts as the backbone."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_error, random_bank

from st_prompts import bank, cli
from st_prompts.errors import ConfigurationError
from st_prompts.loading import load_sentence_model
from st_prompts.storage import MANIFEST_FILE

TEXTS = ["the man plays guitar .", "a dog runs in the park with a red car", "the cat", "this is happy music"]


def encode(model, texts=TEXTS, **kwargs) -> torch.Tensor:
    return model.encode(list(texts), convert_to_tensor=True, **kwargs)


def saved_bank(backbone: str, folder) -> dict[str, torch.Tensor]:
    """A bank with a gated reparameterised set and a plain one, trained-looking, saved at ``folder``; returns what
    each set encodes."""
    model = random_bank(backbone, p=dict(prefix_length=3, prefix_projection=True, prefix_hidden_size=8,
                                         prefix_gate=True), q=2)
    model.save(str(folder))
    return {"p": encode(model, task="p"), "q": encode(model, task="q"), "backbone": encode(model, task="backbone")}


def test_an_exported_set_loads_alone_and_joins_another_bank(tiny_bert, tmp_path, capsys):
    expected = saved_bank(tiny_bert, tmp_path / "bank")
    assert not torch.allclose(expected["p"], expected["backbone"], atol=1e-3)
    out = bank.export_prompt_set(str(tmp_path / "bank"), "p", tmp_path / "p")
    assert out == tmp_path / "p" and (out / MANIFEST_FILE).is_file() and not (out / "model.safetensors").exists()
    config = json.loads((out / "sentence_bert_config.json").read_text())
    assert config["prompts_only"] and config["prefix_length"] == 3 and config["prefix_gate"] is True
    assert config["prefix_projection"] is False and config.get("prompt_sets") is None
    alone = load_sentence_model(str(out))
    torch.testing.assert_close(encode(alone), expected["p"], atol=1e-6, rtol=0)

    other = bank.create_bank(tiny_bert)
    bank.add_prompt_set(other, "from-p", str(out))
    torch.testing.assert_close(encode(other, task="from-p"), expected["p"], atol=1e-6, rtol=0)

    # from a bank in memory too
    loaded = load_sentence_model(str(tmp_path / "bank"))
    bank.export_prompt_set(loaded, "q", tmp_path / "q")
    torch.testing.assert_close(encode(load_sentence_model(str(tmp_path / "q"))), expected["q"], atol=1e-6, rtol=0)
    with pytest.raises(ConfigurationError, match="No prompt set 'nope'"):
        bank.export_prompt_set(loaded, "nope", tmp_path / "nope")
    assert not (tmp_path / "nope").exists()

    # through the command line
    bank_folder, out = str(tmp_path / "bank"), str(tmp_path / "out")
    assert cli.main(["bank", "export", bank_folder, "q", out]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == out
    torch.testing.assert_close(encode(load_sentence_model(out)), expected["q"], atol=1e-6, rtol=0)

    def one_line_error(args: list[str], match: str) -> None:
        line = cli_error(args, capsys)  # (after any loading progress bar)
        assert line.startswith("st-prompts bank: error:") and match in line, line

    one_line_error(["bank", "export", bank_folder, "p", out], "--overwrite")  # exists: never replaced silently
    torch.testing.assert_close(encode(load_sentence_model(out)), expected["q"], atol=1e-6, rtol=0)
    one_line_error(["bank", "export", bank_folder, "nope", str(tmp_path / "x")], "No prompt set 'nope'")
    assert not (tmp_path / "x").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    one_line_error(["bank", "export", bank_folder, "p", str(mine), "--overwrite"], "refusing to replace")
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]

    assert cli.main(["bank", "export", bank_folder, "p", out, "--overwrite"]) == 0
    torch.testing.assert_close(encode(load_sentence_model(out)), expected["p"], atol=1e-6, rtol=0)
    # it adds to another bank with bank add
    assert cli.main(["bank", "create", str(tmp_path / "other"), "--backbone", tiny_bert]) == 0
    assert cli.main(["bank", "add", str(tmp_path / "other"), "sts", out]) == 0
    other = load_sentence_model(str(tmp_path / "other"))
    torch.testing.assert_close(encode(other, task="sts"), expected["p"], atol=1e-6, rtol=0)


def test_a_set_made_by_training_prompt_set_starts_as_the_backbone(minilm_path, minilm):
    """Every kept set starts as the backbone: ``training_prompt_set`` gates a new set by default."""
    model = bank.create_bank(minilm_path)
    shipped = encode(minilm)
    with bank.training_prompt_set(model, "new", prefix_length=8) as trained:
        assert trained.gated
        model.eval()
        torch.testing.assert_close(encode(model, task="new"), shipped, atol=1e-6, rtol=0)
    with bank.training_prompt_set(model, "ungated", prefix_length=8, prefix_gate=False):  # asked for: not the backbone
        model.eval()
        assert not torch.allclose(encode(model, task="ungated"), shipped, atol=1e-4)
