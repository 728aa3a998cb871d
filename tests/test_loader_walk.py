"""The check walks what the loader will read: Router routes that are whole models, config.json keys at any depth (no
hub kernel), shard indexes and symlinks (no path out of the folder), malformed module files. Every refusal is one line
(:class:`UntrustedCodeError` in Python, exit 2 from the CLI) and never tells the user to install a package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CLIProcess, cli_error, edit_json, save_plain, st_model

from st_prompts.errors import StPromptsError, UntrustedCodeError
from st_prompts.loading import load_sentence_model, untrusted_reason

SENTEVAL = Path(__file__).parent / "fixtures" / "senteval"
EVIL_KERNEL = "someone-else/evil-kernel@deadbeef"


@pytest.fixture(scope="module")
def routed(tmp_path_factory, tiny_bert) -> Path:
    """A saved model whose only module is a Router of two routes that are whole SentenceTransformers (as
    sentence-transformers' own docs show: one embedder for queries, another for documents)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.router import Router

    path = tmp_path_factory.mktemp("routed") / "model"
    query, document = st_model(tiny_bert, "cls", max_seq_length=32), st_model(tiny_bert, max_seq_length=32)
    router = Router.for_query_document(query_modules=[query], document_modules=[document])
    SentenceTransformer(modules=[router], device="cpu").save(str(path))
    return path


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_bert) -> Path:
    return save_plain(tmp_path_factory.mktemp("plain") / "model", tiny_bert, max_seq_length=32)


def _refused(folder: Path, *words: str) -> str:
    with pytest.raises(UntrustedCodeError) as info:
        load_sentence_model(str(folder))
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message
    assert "install" not in message.replace("--trust-remote-code", ""), message  # never "pip install ..."
    return message


def _evaluate(folder: Path) -> list[str]:
    return ["evaluate", str(folder), "--metrics", "sts", "--tasks", "STSBenchmark", "--senteval-dir",
            str(SENTEVAL), "--no-progress"]


# ------------------------------------------------------------------------------------------------------------ Router
def test_a_router_of_whole_models_loads(routed):
    assert untrusted_reason(str(routed)) is None
    model = load_sentence_model(str(routed))
    assert model.encode_query(["a cat"]).shape == (1, 32) and model.encode_document(["a cat"]).shape == (1, 32)


DOC = "document_0_SentenceTransformer"


@pytest.mark.parametrize("where, change, words", [  # change: keys set at the top of the file, or a function
    (f"{DOC}/sentence_bert_config.json", {"model_kwargs": {"weights_only": False}}, ("weights_only",)),
    (f"{DOC}/sentence_bert_config.json", {"tokenizer_name_or_path": "../../elsewhere"}, ("tokenizer_name_or_path",)),
    (f"{DOC}/config.json", {"attn_implementation": EVIL_KERNEL}, ("attn_implementation", "kernel")),
    (f"{DOC}/modules.json", lambda m: [{**m[0], "type": "evil.EvilModel"}] + m[1:], ("evil.EvilModel",)),
    (f"{DOC}/modules.json", lambda m: [{**m[0], "path": "../../outside"}] + m[1:], ("outside",)),
    (f"{DOC}/1_Pooling/config.json", {"evil_option": 1}, ("evil_option",)),
    ("router_config.json", lambda c: {**c, "types": {**c["types"], "query_0_SentenceTransformer": "evil.Model"}},
     ("evil.Model",)),
    ("router_config.json", {"types": ["not", "an", "object"]}, ("types",)),
])
def test_a_router_nested_model_is_checked_at_every_depth(routed, tmp_path, capsys, where, change, words):
    folder = Path(shutil.copytree(routed, tmp_path / "model"))
    edit_json(folder / where, change if callable(change) else lambda config: {**config, **change})
    _refused(folder, *words)
    assert all(word in cli_error(_evaluate(folder), capsys) for word in words)


def test_a_route_of_a_route_is_walked_too(routed, tmp_path):
    """A Router inside a route's model (two levels down) is checked like the top one."""
    folder = Path(shutil.copytree(routed, tmp_path / "model"))
    inner = folder / DOC
    shutil.rmtree(inner)
    shutil.copytree(routed, inner)  # the document route is itself a routed model
    assert untrusted_reason(str(folder)) is None
    edit_json(inner / "query_0_SentenceTransformer" / "config.json", lambda c: {
        **c, "text_config": {"_attn_implementation": "flash_attention_2"}})
    _refused(folder, "_attn_implementation", "flash_attention_2")


def test_the_legacy_router_config_name_is_checked(routed, tmp_path):
    """Without router_config.json sentence-transformers reads the Router's types from config.json."""
    folder = Path(shutil.copytree(routed, tmp_path / "model"))
    config = json.loads((folder / "router_config.json").read_text())
    (folder / "router_config.json").unlink()
    config["types"]["query_0_SentenceTransformer"] = "evil.Model"
    (folder / "config.json").write_text(json.dumps(config))
    _refused(folder, "config.json", "evil.Model")


def test_a_whole_model_as_a_plain_module_is_refused(plain, tmp_path):
    folder = Path(shutil.copytree(plain, tmp_path / "model"))
    edit_json(folder / "modules.json", lambda m: [m[0], {**m[1], "type": "sentence_transformers.SentenceTransformer"}])
    _refused(folder, "whole model")
    edit_json(folder / "modules.json", lambda m: [m[0], {**m[1], "type": "sentence_transformers.util.misc.fullname"}])
    _refused(folder, "not a sentence-transformers module class")
    edit_json(folder / "modules.json", lambda m: [m[0], {**m[1], "type": "sentence_transformers.nowhere.Evil"}])
    _refused(folder, "sentence_transformers.nowhere.Evil", "not a class of")  # never "install the package ..."


# ------------------------------------------------------------------------------------------------------ hub kernels
@pytest.mark.parametrize("change, words", [
    (lambda c: {**c, "attn_implementation": EVIL_KERNEL}, ("attn_implementation", "evil-kernel")),
    (lambda c: {**c, "_attn_implementation": "flash_attention_2"}, ("flash_attention_2",)),
    (lambda c: {**c, "text_config": {"vision_config": {"attn_implementation": "kernels-community/flash-attn"}}},
     ("kernels-community/flash-attn",)),
    (lambda c: {**c, "attn_implementation": {"": "sdpa", "text_config": EVIL_KERNEL}}, ("evil-kernel",)),
    (lambda c: {**c, "experts_implementation": "deepgemm"}, ("experts_implementation", "deepgemm")),
    (lambda c: {**c, "_experts_implementation_internal": "sonicmoe"}, ("sonicmoe",)),
    (lambda c: {**c, "use_kernels": True}, ("use_kernels",)),
])
def test_config_json_may_not_name_a_hub_kernel(plain, tmp_path, change, words):
    folder = Path(shutil.copytree(plain, tmp_path / "model"))
    edit_json(folder / "config.json", change)
    _refused(folder, "config.json", *words)


def test_local_attention_implementations_still_load(plain, tmp_path):
    folder = Path(shutil.copytree(plain, tmp_path / "model"))
    for value in ("eager", "sdpa", {"": "eager"}):
        edit_json(folder / "config.json", lambda c: {**c, "attn_implementation": value})  # noqa: B023
        assert load_sentence_model(str(folder)).encode(["a cat"]).shape == (1, 32)


# ----------------------------------------------------------------------------------------- shards and symlinks
@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_bert) -> Path:
    """A saved model whose transformer weights are sharded (model.safetensors.index.json and two or more shards)."""
    from transformers import AutoModel

    root = tmp_path_factory.mktemp("sharded")
    path = save_plain(root / "model", tiny_bert, max_seq_length=32)  # (saved whole: sharded again in its folder)
    AutoModel.from_pretrained(str(path)).save_pretrained(str(root / "shards"), max_shard_size="40KB")
    (path / "model.safetensors").unlink()
    for shard in (root / "shards").glob("*safetensors*"):
        shutil.copy(shard, path / shard.name)
    assert (path / "model.safetensors.index.json").exists()
    return path


def _shards(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))


def test_a_sharded_model_loads(sharded):
    assert len(_shards(sharded)) >= 2 and untrusted_reason(str(sharded)) is None
    assert load_sentence_model(str(sharded)).encode(["a cat"]).shape == (1, 32)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "file-link", "folder-link"])
def test_weights_from_outside_the_folder_are_refused(sharded, tmp_path, capsys, kind):
    folder = Path(shutil.copytree(sharded, tmp_path / "model", symlinks=True))
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = _shards(folder)[0]
    shutil.move(str(folder / shard), str(outside / shard))
    if kind in ("dotdot", "absolute"):
        target = f"../outside/{shard}" if kind == "dotdot" else str(outside / shard)
        edit_json(folder / "model.safetensors.index.json", lambda c: {**c, "weight_map": {
            k: (target if v == shard else v) for k, v in c["weight_map"].items()}})
        words = ("model.safetensors.index.json", "outside the model folder")
    elif kind == "file-link":
        (folder / shard).symlink_to(outside / shard)
        words = (shard, "link", "outside the model folder")
    else:
        (folder / "weights").symlink_to(outside, target_is_directory=True)
        edit_json(folder / "model.safetensors.index.json", lambda c: {**c, "weight_map": {
            k: (f"weights/{shard}" if v == shard else v) for k, v in c["weight_map"].items()}})
        words = ("weights", "link", "outside the model folder")
    _refused(folder, *words)
    cli_error(_evaluate(folder), capsys)


def test_a_linked_tokenizer_file_in_a_module_folder_is_refused(plain, tmp_path):
    folder = Path(shutil.copytree(plain, tmp_path / "model"))
    secret = tmp_path / "secret.json"
    shutil.move(str(folder / "tokenizer.json"), str(secret))
    (folder / "tokenizer.json").symlink_to(secret)
    _refused(folder, "tokenizer.json", "link")
    (folder / "tokenizer.json").unlink()
    shutil.copy(secret, folder / "inside.json")
    (folder / "tokenizer.json").symlink_to(folder / "inside.json")  # a link inside the folder is fine
    assert untrusted_reason(str(folder)) is None


def test_a_hub_cache_snapshot_may_link_to_its_blobs(plain, tmp_path):
    """The Hugging Face cache keeps a snapshot's files as links to ../../blobs: a snapshot folder still loads."""
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(plain, snapshot)
    (repo / "blobs").mkdir()
    for path in snapshot.rglob("*"):
        if path.is_file():
            blob = repo / "blobs" / f"{abs(hash(str(path)))}"
            shutil.move(str(path), str(blob))
            path.symlink_to(os.path.relpath(blob, path.parent))
    assert untrusted_reason(str(snapshot)) is None
    assert load_sentence_model(str(snapshot)).encode(["a cat"]).shape == (1, 32)


# -------------------------------------------------------------------------------------- malformed module files
POOLING, TRANSFORMER = ("sentence_transformers.sentence_transformer.modules.Pooling",
                        "sentence_transformers.base.modules.transformer.Transformer")


@pytest.mark.parametrize("modules", [
    {"0": {"type": POOLING}}, [], [POOLING], [{"idx": 0, "path": "", "type": TRANSFORMER}],
    [{"idx": 0, "name": 0, "path": "", "type": TRANSFORMER}], [{"idx": 0, "name": "0", "path": 5, "type": TRANSFORMER}],
    [{"idx": 0, "name": "0", "path": "", "type": None}],
    [{"idx": 0, "name": "0", "path": "", "type": TRANSFORMER, "kwargs": "task"}],
])
def test_a_malformed_modules_json_is_one_line(plain, tmp_path, capsys, modules):
    folder = Path(shutil.copytree(plain, tmp_path / "model"))
    (folder / "modules.json").write_text(json.dumps(modules))
    assert "modules.json" in cli_error(_evaluate(folder), capsys)


@pytest.mark.parametrize("config", [
    ["not", "an", "object"], {"word_embedding_dimension": 32, "pooling_mode": 7},
    {"word_embedding_dimension": 32, "pooling_mode": "no-such-mode"}, {"word_embedding_dimension": None},
    {"word_embedding_dimension": 32, "pooling_mode": {"nested": ["x"]}},
])
def test_a_malformed_pooling_config_is_one_line(plain, tmp_path, capsys, config):
    folder = Path(shutil.copytree(plain, tmp_path / "model"))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    cli_error(_evaluate(folder), capsys)
    with pytest.raises(StPromptsError) as info:
        load_sentence_model(str(folder))
    assert "\n" not in str(info.value)


def test_a_malformed_modules_json_prints_no_traceback_in_its_own_process(plain, tmp_path):
    """The command in a process of its own (what it writes to its real stderr, loggers included)."""
    folder = Path(shutil.copytree(plain, tmp_path / "model"))
    (folder / "modules.json").write_text(json.dumps([{"type": 5}]))
    (folder / "1_Pooling" / "config.json").write_text("[1, 2")
    process = CLIProcess([str(a) for a in _evaluate(folder)], {**os.environ, "HF_HUB_OFFLINE": "1"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = process.stderr.read()
    assert process.wait(300) == 2, stderr
    assert "Traceback" not in stderr and "modules.json" in stderr.strip().splitlines()[-1]
