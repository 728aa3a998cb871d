"""Half precision at inference (``load_sentence_model(dtype=...)``, ``--dtype``, per-row identity within a stated
tolerance) and int8's input bits by the CPU's flags (:mod:`st_prompts.precision`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import cli_error, cli_out, one_line_message, prompted_model, random_bank

from st_prompts import precision
from st_prompts.errors import ConfigurationError
from st_prompts.loading import load_sentence_model
from st_prompts.quantization import Int8Linear

TEXTS = ["a man plays the guitar", "the dog sleeps", "guitar", "a woman is slicing an onion while the man sings",
         "the cat", "music"] * 2
TASKS = ["a", "b", None, "b", "a", "a", "b", None, "a", "b", "a", "b"]


@pytest.fixture(scope="module")
def bank_path(tmp_path_factory, tiny_bert):
    path = tmp_path_factory.mktemp("precision") / "bank"
    random_bank(tiny_bert, a=4, b={"prefix_length": 7, "prefix_gate": True}).save(str(path))
    return str(path)


@pytest.mark.parametrize("given, expected", [(None, "float32"), ("float32", "float32"), ("bfloat16", "bfloat16"),
                                             ("torch.float16", "float16"), (torch.bfloat16, "bfloat16")])
def test_check_dtype_names_what_it_is_given(given, expected):
    assert precision.check_dtype(given) == expected


@pytest.mark.parametrize("given", ["fp8", "float64", torch.float64, 16, ""])
def test_an_unknown_dtype_is_refused_in_one_line(given):
    with pytest.raises(ConfigurationError, match="unknown dtype") as caught:
        precision.check_dtype(given)
    one_line_message(caught)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_every_module_in_that_dtype_and_rows_keep_their_identity(bank_path, dtype):
    fp32 = load_sentence_model(bank_path, device="cpu")
    half = load_sentence_model(bank_path, device="cpu", dtype=dtype)
    assert precision.dtype_name(half) == dtype and precision.dtype_name(fp32) == "float32"
    floating = [p for p in half.parameters() if p.is_floating_point()]
    assert floating and all(p.dtype == precision.DTYPES[dtype] for p in floating)
    expected = fp32.encode(TEXTS, task=TASKS)
    batch = half.encode(TEXTS, task=TASKS)
    assert batch.dtype == np.float32  # numpy has no bfloat16: sentence-transformers hands float32 back
    norms = np.linalg.norm(batch, axis=1)
    # each row alone against the same row in a mixed, padded batch: within the stated tolerance of its norm
    alone = np.stack([half.encode([text], task=[task])[0] for text, task in zip(TEXTS, TASKS)])
    assert (np.abs(alone - batch).max(axis=1) / norms).max() <= precision.ROW_TOLERANCE[dtype]
    # and close to float32: the same vectors, rounded
    cosines = (batch * expected).sum(1) / norms / np.linalg.norm(expected, axis=1)
    assert cosines.min() > 0.999
    # the rows still differ by task: the sets run in half precision too
    assert np.abs(batch[0] - half.encode([TEXTS[0]], task=["b"])[0]).max() > 1e-2


def test_a_half_model_refuses_to_save_and_a_set_added_to_it_follows_its_dtype(bank_path, tmp_path, tiny_bert):
    half = load_sentence_model(bank_path, device="cpu", dtype="bfloat16")
    with pytest.raises(ConfigurationError, match="loaded in bfloat16"):
        half.save(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    # a set trained on the float32 backbone joins: its fingerprint was taken before the cast
    source = prompted_model(tiny_bert, prefix_length=5, randomise=True)
    half[0].add_prompt_set("c", source)
    assert all(p.dtype == torch.bfloat16 for p in half[0].prompt_sets["c"].parameters())
    got, expected = half.encode(TEXTS[:3], task="c"), source.encode(TEXTS[:3])
    assert np.isfinite(got).all() and np.abs(got - expected).max() < 0.05 * np.abs(expected).max()


def test_int8_with_half_precision_and_a_missing_device_are_refused_in_one_line(bank_path, capsys, tmp_path):
    with pytest.raises(ConfigurationError, match="do not combine"):
        load_sentence_model(bank_path, quantize="int8", dtype="bfloat16")
    # a device this machine lacks: one line before anything loads, not the loader's assertion halfway through
    with pytest.raises(ConfigurationError, match=r"'cuda:99' is not here \(this machine has \d+ cuda device"):
        load_sentence_model(bank_path, device="cuda:99", dtype="bfloat16")
    assert "--dtype" in cli_error(["evaluate", bank_path, "--dtype", "fp8"], capsys)
    (tmp_path / "corpus.txt").write_text("the dog sleeps\n", encoding="utf-8")
    line = cli_error(["index", "build", bank_path, tmp_path / "corpus.txt", tmp_path / "out", "--quantize", "int8",
                      "--dtype", "bfloat16"], capsys)
    assert "do not combine" in line


def test_a_cpu_that_emulates_the_dtype_is_told_in_one_warning(bank_path, monkeypatch, caplog):
    for flags, emulated in (({"avx2", "fma"}, True), ({"avx512f", "avx512_bf16", "avx512_vnni"}, False)):
        caplog.clear()
        monkeypatch.setattr(precision, "cpu_flags", lambda found=frozenset(flags): found)
        with caplog.at_level(logging.WARNING, logger="st_prompts.precision"):
            load_sentence_model(bank_path, device="cpu", dtype="bfloat16")
        lines = [r.getMessage() for r in caplog.records if r.name == "st_prompts.precision"]
        assert (len(lines) == 1 and "emulated" in lines[0] and "\n" not in lines[0]) if emulated else not lines


@pytest.mark.parametrize("flags, bits, summary", [
    ({"avx2", "fma"}, 7, "AVX2, no VNNI, no AVX512-BF16: int8 inputs 7-bit, bf16 emulated"),
    ({"avx2", "avx_vnni"}, 8, "AVX2, VNNI, no AVX512-BF16: int8 inputs 8-bit, bf16 emulated"),
    ({"avx512f", "avx512_vnni", "avx512_bf16"}, 8, "AVX512, VNNI, AVX512-BF16/AMX: int8 inputs 8-bit, bf16 native"),
    ({"avx512f", "amx_int8", "amx_bf16"}, 8, "AVX512, VNNI, AVX512-BF16/AMX: int8 inputs 8-bit, bf16 native"),
])
def test_the_cpu_flags_decide_int8_input_bits_and_are_summarised(flags, bits, summary):
    assert precision.int8_input_bits(frozenset(flags)) == bits
    assert precision.cpu_summary(frozenset(flags)) == summary


def test_int8_inputs_use_the_bits_this_cpu_sums_exactly():
    """At int8's extremes fbgemm's AVX2 kernel saturates its 16-bit pair sums with 8-bit inputs (255 * 127 * 2 >
    32767): without VNNI 7 bits are chosen, with VNNI 8, and exact."""
    linear = torch.nn.Linear(256, 64)
    with torch.no_grad():
        linear.weight.fill_(1.0)
        linear.bias.zero_()
    x = torch.ones(4, 256)
    x[:, 0] = 0.0
    expected = linear(x)
    chosen = Int8Linear.from_linear(linear)
    assert chosen.input_bits == precision.int8_input_bits()
    assert (chosen(x) - expected).abs().max().item() < 1e-3
    if precision.int8_input_bits() == 7:  # this CPU has no VNNI: 8 bits would be wrong, which is why they are not used
        assert (Int8Linear.from_linear(linear, input_bits=8)(x) - expected).abs().max().item() > 1.0


def test_an_index_built_in_bfloat16_records_it_and_encodes_queries_the_same_way(bank_path, tmp_path, capsys):
    """docs/serving.md's ``index build ... --dtype bfloat16`` on a tiny bank, then ``index search``."""
    from st_prompts.search import SemanticIndex

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the dog sleeps\na man plays the guitar\nthe cat sits on the mat\n", encoding="utf-8")
    code, _, err = cli_out(["index", "build", bank_path, corpus, tmp_path / "idx", "--task", "b", "--dtype",
                            "bfloat16", "--no-progress"], capsys)
    assert code == 0, err
    index = SemanticIndex.load(tmp_path / "idx")
    assert index.model_identity.dtype == "bfloat16" and index.model_identity.task == "b"
    code, out, err = cli_out(["index", "search", tmp_path / "idx", "a man plays the guitar", "-k", "1", "--json"],
                             capsys)
    assert code == 0, err
    assert "a man plays the guitar" in out
