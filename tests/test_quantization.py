"""int8 inference (st_prompts.quantization): close to fp32, per-row identity in mixed batches, prompt sets and gates
untouched, one-line errors, saving refused, and the --quantize options of `index build` and `serve`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli_error, encode, random_bank, st_model
from sentence_transformers import SentenceTransformer

from st_prompts import PromptedTransformer, bank, save_prompts_only
from st_prompts.cli import main
from st_prompts.errors import BackboneMismatchError, ConfigurationError
from st_prompts.loading import load_sentence_model
from st_prompts.prompts.row_exact import ROW_EXACT_ATTRIBUTE
from st_prompts.quantization import Int8Linear, is_quantized, quantization_mode, quantize_model

TEXTS = ["the man plays guitar .", "a dog runs in the park with a red car and a big tree near the water", "the cat",
         "this is happy music", "a woman sits on the mat in the house", "blue", "the big dog and the small cat play"]
TASKS = ["gated", "plain", None, "gated", "plain", "gated", None]
CORPUS_TXT = Path(__file__).parent / "fixtures" / "search" / "corpus.txt"


def two_set_bank(path: str) -> SentenceTransformer:
    """A bank with a gated set (gate opened, with a prefix MLP) and an ungated set, trained-looking weights."""
    return random_bank(path, gated={"prefix_length": 4, "prefix_gate": True, "prefix_projection": True,
                                    "prefix_hidden_size": 16}, plain=6)


def test_int8_minilm_is_close_to_fp32_and_every_backbone_linear_is_int8(minilm_path):
    fp32 = load_sentence_model(minilm_path)
    int8 = load_sentence_model(minilm_path, quantize="int8")
    assert quantization_mode(int8) == "int8" and not is_quantized(fp32)
    linears = [m for m in int8[0].auto_model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert len(linears) == 6 * 6 + 1 and all(isinstance(m, Int8Linear) for m in linears)  # 6 per layer + pooler
    a, b = encode(fp32, TEXTS, normalize_embeddings=True), encode(int8, TEXTS, normalize_embeddings=True)
    cosines = (a * b).sum(dim=1)
    assert cosines.min() > 0.99
    assert not torch.equal(a, b)  # it did quantize


def test_a_row_is_the_same_alone_and_in_a_mixed_batch_with_two_sets(tiny_bert):
    model = two_set_bank(tiny_bert)
    before = encode(model, TEXTS, task=TASKS)
    quantize_model(model, "int8")
    mixed = encode(model, TEXTS, task=TASKS)
    alone = torch.stack([encode(model, [text], task=task)[0] for text, task in zip(TEXTS, TASKS)])
    assert (mixed - alone).abs().max() < 1e-5
    assert not torch.allclose(mixed, before, atol=1e-6)  # int8, not fp32
    assert torch.nn.functional.cosine_similarity(mixed, before).min() > 0.98
    # each set still moves its rows: the prefix reaches attention per row
    backbone = encode(model, TEXTS)
    for row, task in enumerate(TASKS):
        moved = (mixed[row] - backbone[row]).abs().max() > 1e-3
        assert moved == (task is not None), (row, task)


def test_minilm_int8_rows_are_exactly_the_same_alone_and_in_mixed_batches(minilm_path):
    """The real backbone, where padding in a batch flips roundings (1e-2 before attention ran row by row)."""
    texts = (Path(__file__).parent / "fixtures" / "search" / "real_corpus.txt").read_text(
        encoding="utf-8").splitlines()[:24]
    model = bank.create_bank(minilm_path)
    torch.manual_seed(3)
    for name, length in (("short", 4), ("long", 16)):
        with torch.no_grad():
            model[0].new_prompt_set(name, prefix_length=length).embedding.weight.normal_(0, 0.3)
    with torch.no_grad():  # a gated set, its gates opened: the prefix added outside the text's softmax
        for parameter in model[0].new_prompt_set("gated", prefix_length=8, prefix_gate=True).parameters():
            parameter.normal_(0, 0.3)
    quantize_model(model, "int8")
    tasks = [("short", "long", "backbone", "gated")[i % 4] for i in range(len(texts))]
    alone = torch.stack([encode(model, [text], task=task)[0] for text, task in zip(texts, tasks)])
    mixed = encode(model, texts, task=tasks, batch_size=len(texts))
    assert (mixed - alone).abs().max() <= 1e-6
    for module in model[0].auto_model.modules():  # attention over the padded batch: rows move by far more
        setattr(module, ROW_EXACT_ATTRIBUTE, False)
    padded = encode(model, texts, task=tasks, batch_size=len(texts))
    assert (padded - alone).abs().max() > 1e-4


def test_quantize_is_idempotent_none_changes_nothing_and_prompt_sets_and_gates_stay_fp32(tiny_bert):
    model = two_set_bank(tiny_bert)
    encoder = model[0]
    sets = {k: v.clone() for k, v in encoder.prompt_sets.state_dict().items()}
    assert any(k.endswith("gate") for k in sets) and sum(sets[k].abs().sum() for k in sets if "gate" in k) > 0
    assert quantize_model(model, "none") is model and not is_quantized(model)
    quantize_model(model, "int8")
    after = encoder.prompt_sets.state_dict()
    assert sets.keys() == after.keys() and all(torch.equal(sets[k], after[k]) for k in sets)
    assert not any(isinstance(m, Int8Linear) for m in encoder.prompt_sets.modules())
    assert any(isinstance(m, torch.nn.Linear) for m in encoder.prompt_sets.modules())  # the gated set's MLP
    layers = [id(m) for m in model.modules() if isinstance(m, Int8Linear)]
    first = encode(model, TEXTS, task=TASKS)
    assert quantize_model(model, "int8") is model
    assert [id(m) for m in model.modules() if isinstance(m, Int8Linear)] == layers
    assert torch.equal(encode(model, TEXTS, task=TASKS), first)


def test_unknown_modes_and_devices_are_one_line_errors_before_anything_loads(tiny_bert, capsys):
    model = two_set_bank(tiny_bert)
    with pytest.raises(ConfigurationError, match=r"^unknown quantization 'int4': choose one of none, int8$"):
        quantize_model(model, "int4")
    with pytest.raises(ConfigurationError, match="unknown quantization 'int4'"):
        load_sentence_model("/no/such/folder", quantize="int4")  # refused before the missing folder is noticed
    assert "invalid choice: 'int4'" in cli_error(["index", "build", "minilm", CORPUS_TXT, "out", "--quantize", "int4"],
                                                 capsys)
    model[0].auto_model.to("meta")
    with pytest.raises(ConfigurationError, match="int8 inference runs on the CPU; the model is on meta"):
        quantize_model(model, "int8")


def test_a_quantized_model_refuses_to_save_and_an_incomplete_backbone_never_loads(tiny_bert, tmp_path):
    """No save of any part writes anything (the int8 weights live packed outside ``state_dict``: a backbone saved
    without them loaded random layers without an error, and such a folder is refused)."""
    model = quantize_model(two_set_bank(tiny_bert), "int8")
    for save in (model.save, model.save_pretrained, model[0].save, model[0].auto_model.save_pretrained,
                 model[0].auto_model.push_to_hub):
        with pytest.raises(ConfigurationError, match=r"refused: this model's backbone is quantized to int8"):
            save(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigurationError, match="quantized to int8"):  # blames quantization, not training
        save_prompts_only(model, str(tmp_path / "prompts"))
    assert not (tmp_path / "prompts").exists()
    # what such a save wrote (the state dict without the int8 weights) is refused by every st_prompts loader
    from safetensors.torch import save_file

    incomplete = shutil.copytree(tiny_bert, tmp_path / "incomplete", ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: v.contiguous() for k, v in model[0].auto_model.state_dict().items() if v.is_floating_point()}
    assert not any(k.endswith("query.weight") for k in state)
    save_file(state, str(incomplete / "model.safetensors"), metadata={"format": "pt"})
    from st_prompts.errors import DataFormatError

    with pytest.raises(DataFormatError, match=r"backbone weights in .* are incomplete: 12 weight\(s\) .*query.weight"):
        PromptedTransformer(str(incomplete), prefix_length=2)
    with pytest.raises(DataFormatError, match="are incomplete"):
        bank.create_bank(str(incomplete))


def test_a_set_trained_on_the_fp32_backbone_joins_the_quantized_bank(tiny_bert, tmp_path):
    torch.manual_seed(1)
    st_model(PromptedTransformer(tiny_bert, prefix_length=4)).save(str(tmp_path / "one-set"))
    two_set_bank(tiny_bert).save(str(tmp_path / "fp32-bank"))
    model = load_sentence_model(str(tmp_path / "fp32-bank"), quantize="int8")
    bank.add_prompt_set(model, "again", str(tmp_path / "one-set"))  # checked against the fp32 fingerprint
    assert "again" in model[0].prompt_sets and is_quantized(model)
    assert (encode(model, TEXTS[:2], task="again") - encode(model, TEXTS[:2])).abs().max() > 1e-4


def test_index_build_quantize_int8_records_it_and_search_encodes_queries_alike(tmp_path, capsys):
    out = tmp_path / "int8.index"
    assert main(["index", "build", "minilm", str(CORPUS_TXT), str(out), "--no-progress", "--quantize", "int8"]) == 0
    assert "Indexed 15 documents" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert json.dumps(meta).count('"quantize": "int8"') == 1
    assert main(["index", "info", str(out)]) == 0  # issue 60, item 14: index info says so
    assert "documents encoded in int8 (--quantize int8)" in capsys.readouterr().out
    assert main(["index", "search", str(out), "where do cats sleep?", "-k", "3", "--json"]) == 0  # the int8 model
    assert json.loads(capsys.readouterr().out)[0]["hits"][0]["id"] in (1, 2, 16)
    from st_prompts.search import SemanticIndex

    index = SemanticIndex.load(out)
    with pytest.raises(BackboneMismatchError, match="encoded by the int8 model and this one is fp32"):
        index.set_model(load_sentence_model("minilm"))


def test_serve_parses_quantize_and_the_served_model_is_int8(tiny_bert, tmp_path):
    from st_prompts.cli import build_parser
    from st_prompts.serving.model import ServedModel

    parser = build_parser()
    assert parser.parse_args(["serve", "minilm", "--quantize", "int8"]).quantize == "int8"
    assert parser.parse_args(["serve", "minilm"]).quantize == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "minilm", "--quantize", "int4"])
    two_set_bank(tiny_bert).save(str(tmp_path / "bank"))
    served = ServedModel.load(str(tmp_path / "bank"), quantize="int8")
    assert is_quantized(served.model)
    tasks = ["gated" if task is None else task for task in TASKS]
    vectors = served.encode(TEXTS, tasks)
    expected = served.model.encode(TEXTS, task=tasks, convert_to_numpy=True)
    assert abs(vectors - expected).max() < 1e-5


@pytest.mark.parametrize("model_type", ["modernbert", "llama", "camembert"])
def test_int8_rows_are_exact_on_other_architectures(tiny_backbones, model_type):
    """Sliding-window layers, a causal decoder, a RoBERTa-type encoder: each mixed-task row exactly as alone."""
    model = random_bank(tiny_backbones(model_type), "lasttoken" if model_type == "llama" else "mean",
                        gated={"prefix_length": 4, "prefix_gate": True}, plain=6)
    quantize_model(model, "int8")
    texts, tasks = TEXTS * 2, TASKS + TASKS[::-1]
    mixed = encode(model, texts, task=tasks)
    alone = torch.stack([encode(model, [text], task=task)[0] for text, task in zip(texts, tasks)])
    assert torch.equal(mixed, alone)
