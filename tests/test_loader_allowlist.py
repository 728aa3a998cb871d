"""What a model folder may ask of a loader: an allow-list. Hostile folders' code (an ``evil.py``, a code-running
pickle) writes a marker if it runs; without ``--trust-remote-code`` every load is one line or clean, the marker never
written (a property-based test mutates real saved models)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import cli_error, edit_json, prompted_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from st_prompts.cli import main
from st_prompts.errors import StPromptsError, UntrustedCodeError
from st_prompts.loading import backbone_reason, load_sentence_model, untrusted_reason

FIXTURES = Path(__file__).parent / "fixtures"
SENTEVAL = FIXTURES / "senteval"
CORPUS = FIXTURES / "search" / "real_queries.txt"


class _Evil:
    """Unpickling this writes the marker (``__reduce__`` returns a call of ``exec``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def plant(folder: Path, marker: Path, remove_safetensors: bool = True) -> None:
    """Put a malicious pickled weight file and an ``evil.py`` in ``folder`` (the safetensors weights removed)."""
    torch.save({"embeddings.word_embeddings.weight": _Evil(marker)}, folder / "pytorch_model.bin")
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "import torch\n"
        "from transformers import BertConfig, BertModel, BertTokenizerFast\n\n\n"
        "class Evil(torch.nn.Tanh):\n    pass\n\n\n"
        "class EvilModel(BertModel):\n    pass\n\n\n"
        "class EvilConfig(BertConfig):\n    pass\n\n\n"
        "class EvilTokenizer(BertTokenizerFast):\n    pass\n"
    )
    if remove_safetensors:
        for path in folder.glob("*.safetensors"):
            path.unlink()


def planted_copy(source, tmp_path: Path, name: str = "model", remove_safetensors: bool = True) -> tuple[Path, Path]:
    """A copy of ``source`` at ``tmp_path / name`` with :func:`plant`'s files; returns it and the marker."""
    folder = Path(shutil.copytree(source, tmp_path / name))
    plant(folder, tmp_path / "marker", remove_safetensors)
    return folder, tmp_path / "marker"


@pytest.fixture(scope="module")
def st_model(tmp_path_factory, tiny_bert) -> Path:
    """A saved SentenceTransformer of sentence-transformers' own classes: tiny BERT, mean pooling, Dense, Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    path = tmp_path_factory.mktemp("clean") / "model"
    modules = [Transformer(tiny_bert, max_seq_length=32), Pooling(32, "mean"),
               Dense(32, 16, activation_function=torch.nn.Tanh()), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def _one_line_refusal(argv: list[str], capsys, marker: Path, words: tuple[str, ...] = ()) -> str:
    error = cli_error(argv, capsys)
    assert all(word in error for word in words), error
    assert not marker.exists(), f"{argv[:2]} ran the folder's code"
    return error


# ---------------------------------------------------------------------------------------------- the reported case
def minilm_exploit(minilm_path: str, tmp_path: Path, key: str = "model_kwargs") -> tuple[Path, Path]:
    """The reported folder: the packaged MiniLM with a malicious pickle instead of its safetensors,
    ``{key: {"weights_only": false}}`` in sentence_bert_config.json and no dtype in config.json."""
    folder, marker = planted_copy(minilm_path, tmp_path, f"minilm-{key}")
    edit_json(folder / "sentence_bert_config.json", lambda c: {**c, key: {"weights_only": False}})
    edit_json(folder / "config.json", lambda c: {k: v for k, v in c.items() if k not in ("dtype", "torch_dtype")})
    return folder, marker


def test_the_json_rules_look_at_every_depth_and_refuse_what_is_nested_past_it():
    """A key anywhere in a file's JSON, objects and arrays alike, is found; a value nested more than 20 deep is
    refused (not walked further); a tokenizer's vocabulary of 30,000 entries passes."""
    from st_prompts import trust

    def nest(value, depth: int):
        for level in range(depth):
            value = {"x": value} if level % 2 else [value]
        return value

    assert trust.hf_files_reason("config.json", nest({"a": 1}, 19)) is None
    assert "(nested too deep)" in trust.hf_files_reason("config.json", nest({"a": 1}, 21))
    assert "custom code (auto_map)" in trust.hf_files_reason("config.json", nest({"auto_map": {"A": "e.E"}}, 19))
    assert "vocab_file" in trust.hf_files_reason("tokenizer_config.json", nest({"vocab_file": "../v.txt"}, 8))
    assert "kernel" in trust.hf_files_reason("config.json", {"a": [{"b": {"attn_implementation": "org/k"}}]})
    assert trust.hf_files_reason("config.json", {"auto_map": {}, "attn_implementation": "sdpa"}) is None
    vocabulary = {"model": {"vocab": {f"w{i}": i for i in range(30_000)}, "merges": [["a", "b"]] * 1000}}
    assert trust.hf_files_reason("tokenizer.json", vocabulary) is None


@pytest.mark.parametrize("key", ["model_kwargs", "model_args"])
def test_weights_only_in_a_module_config_is_refused_everywhere(minilm_path, tmp_path, capsys, key):
    folder, marker = minilm_exploit(minilm_path, tmp_path, key)
    with pytest.raises(UntrustedCodeError, match=f"sentence_bert_config.json: {key}.weights_only"):
        load_sentence_model(str(folder))
    index = tmp_path / "shared.index"
    assert main(["index", "build", "minilm", str(CORPUS), str(index), "--no-progress"]) == 0
    edit_json(index / "meta.json", lambda m: m["model"].update(name=str(folder), path=str(folder)))
    senteval = ["--senteval-dir", str(SENTEVAL), "--no-progress"]
    commands = [["evaluate", str(folder), "--metrics", "sts", "--tasks", "STSBenchmark", *senteval],
                ["plot", "similarity", str(folder), "--out", str(tmp_path / "s.png"), *senteval],
                ["index", "build", str(folder), str(CORPUS), str(tmp_path / "new.index"), "--no-progress"],
                # an index recording the model: refused before the model loads
                ["index", "search", str(index), "a cat"], ["index", "add", str(index), str(CORPUS), "--no-progress"],
                ["index", "calibrate", str(index)]]
    for argv in commands:
        _one_line_refusal(argv, capsys, marker, ("weights_only", "--trust-remote-code"))
    assert not marker.exists()
    if key == "model_kwargs":  # the control: with trust the same pickle runs (a missing marker above is the loader's)
        with pytest.raises(Exception):  # noqa: B017 - the pickle is not a state dict: loading fails after it ran
            load_sentence_model(str(folder), trust_remote_code=True)
        assert marker.read_text() == "ran"


def test_a_pickle_without_safetensors_is_refused_even_without_options(st_model, tmp_path, capsys):
    folder, marker = planted_copy(st_model, tmp_path, "pickled")
    reason = untrusted_reason(str(folder))
    assert reason is not None and "pytorch_model.bin is a pickled weight file" in reason
    _one_line_refusal(["evaluate", str(folder), "--metrics", "sts", "--tasks", "STSBenchmark", "--senteval-dir",
                       str(SENTEVAL)], capsys, marker, ("pickled weight file",))
    # beside safetensors weights a pickle is ignored: transformers is asked for safetensors only
    clean, marker = planted_copy(st_model, tmp_path, "both", remove_safetensors=False)
    assert untrusted_reason(str(clean)) is None
    assert load_sentence_model(str(clean)).encode(["a cat"]).shape == (1, 16)
    assert not marker.exists()


def test_a_prompted_model_with_model_args_and_only_a_pickle(tiny_bert, tmp_path):
    prompted_model(tiny_bert, "cls", prefix_length=2).save(str(tmp_path / "prompted"))
    folder, marker = planted_copy(tmp_path / "prompted", tmp_path, "planted")
    edit_json(folder / "sentence_bert_config.json", lambda c: {**c, "model_args": {"weights_only": False}})
    with pytest.raises(UntrustedCodeError, match="model_args.weights_only"):
        load_sentence_model(str(folder))
    edit_json(folder / "sentence_bert_config.json", lambda c: {k: v for k, v in c.items() if k != "model_args"})
    with pytest.raises(UntrustedCodeError, match="pickled weight file"):
        load_sentence_model(str(folder))
    assert not marker.exists()


def test_unpickling_is_refused_at_the_last_line_too(st_model, tmp_path, monkeypatch):
    """Should the checks miss a pickle (a hub model whose files cannot be listed), torch.load itself refuses while
    an untrusted model loads."""
    import st_prompts.loading as loading

    folder, marker = planted_copy(st_model, tmp_path)
    monkeypatch.setattr(loading.trust, "pickle_reason", lambda *a, **k: None)  # pretend the check missed it
    monkeypatch.setattr(loading.trust, "SAFE_MODEL_KWARGS", {})  # and transformers were allowed a pickle
    with pytest.raises(StPromptsError) as caught:
        load_sentence_model(str(folder))
    assert "pickled weight file" in str(caught.value) and "\n" not in str(caught.value)
    assert not marker.exists()
    assert torch.load is not loading.trust.refuse_pickle  # restored afterwards


# -------------------------------------------------------------------------- loader options and code, case by case
SBERT = "sentence_bert_config.json"


@pytest.mark.parametrize("where, change, words", [  # change: keys set at the top of the file, or a function
    (SBERT, {"config_kwargs": {"auto_map": {"AutoConfig": "evil.EvilConfig"}}}, ("config_kwargs.auto_map",)),
    (SBERT, {"model_kwargs": {"trust_remote_code": True}}, ("model_kwargs.trust_remote_code",)),
    (SBERT, {"processor_kwargs": {"gguf_file": "/etc/passwd"}}, ("processor_kwargs.gguf_file",)),
    (SBERT, {"tokenizer_name_or_path": "../elsewhere"}, ("tokenizer_name_or_path",)),
    (SBERT, {"model_kwargs": {"attn_implementation": "kernels-community/x"}}, ("attn_implementation",)),
    (SBERT, {"backend": "onnx"}, ("backend",)),
    ("config.json", {"model_type": "evil"}, ("model_type", "evil")),
    ("config.json", {"text_config": {"auto_map": {"AutoModel": "evil.EvilModel"}}}, ("auto_map",)),
    ("config.json", {"quantization_config": {"quant_method": "bitsandbytes"}}, ("quantization_config",)),
    ("tokenizer_config.json", {"tokenizer_class": "evil.EvilTokenizer"}, ("tokenizer_class",)),
    ("tokenizer_config.json", {"tokenizer_file": "/etc/passwd"}, ("tokenizer_file",)),
    ("2_Dense/config.json", {"activation_function": "torch.hub.load"}, ("torch.hub.load",)),
    ("2_Dense/config.json", {"activation_function": "torch.testing._internal.common_utils.TestCase"},
     ("torch.testing",)),
    ("1_Pooling/config.json", {"weights_only": False}, ("weights_only",)),
    ("modules.json", lambda m: [m[0], {**m[1], "path": "../outside"}, *m[2:]], ("outside the model",)),
])
def test_each_loader_option_is_refused_in_one_line(st_model, tmp_path, capsys, where, change, words):
    folder, marker = planted_copy(st_model, tmp_path, remove_safetensors=False)
    sys.path.insert(0, str(folder))
    try:
        edit_json(folder / where, change if callable(change) else lambda config: {**config, **change})
        before = set(sys.modules)
        with pytest.raises(UntrustedCodeError) as caught:
            load_sentence_model(str(folder))
        assert "\n" not in str(caught.value) and all(w in str(caught.value) for w in words), str(caught.value)
        assert not {m for m in set(sys.modules) - before if m.startswith(("torch.testing._internal", "evil"))}
        _one_line_refusal(["plot", "similarity", str(folder), "--out", str(tmp_path / "s.png"), "--senteval-dir",
                           str(SENTEVAL), "--no-progress"], capsys, marker, words)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("evil", None)
    assert not marker.exists()


def test_allowed_options_still_load(st_model, tmp_path):
    """The allow-list's own entries load, and a key no loader reads as an option (a configuration attribute of
    config.json, a pickle beside safetensors weights) does not make a folder unloadable."""
    folder, marker = planted_copy(st_model, tmp_path, remove_safetensors=False)
    edit_json(folder / "config.json", lambda c: {**c, "weights_only": False, "use_safetensors": False})
    edit_json(folder / "sentence_bert_config.json", lambda c: {
        **c, "model_kwargs": {"dtype": "float32", "attn_implementation": "eager"},
        "config_kwargs": {"use_cache": False}, "processor_kwargs": {"model_max_length": 24}})
    model = load_sentence_model(str(folder))
    assert model.encode(["a cat sits on the mat"]).shape == (1, 16)
    assert model[0].model.config._attn_implementation == "eager"
    assert not marker.exists()


def test_a_peft_adapter_s_base_model_is_checked(st_model, tiny_bert, tmp_path):
    folder = Path(shutil.copytree(st_model, tmp_path / "adapter"))
    base, marker = planted_copy(tiny_bert, tmp_path, "base", remove_safetensors=False)
    edit_json(base / "config.json", lambda c: {**c, "auto_map": {"AutoModel": "evil.EvilModel"}})
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(base),
                                                            "r": 8, "target_modules": ["query"]}))
    reason = untrusted_reason(str(folder))
    assert reason is not None and "adapter_config.json: its base model" in reason and "auto_map" in reason
    with pytest.raises(UntrustedCodeError, match="base model"):
        load_sentence_model(str(folder))
    assert not marker.exists()


def test_a_gguf_backbone_is_checked(tmp_path):
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"not a gguf file at all")
    assert "is not a GGUF file" in backbone_reason(str(fake))
    from st_prompts import PromptedTransformer

    with pytest.raises(UntrustedCodeError, match="is not a GGUF file"):
        PromptedTransformer(str(fake), prefix_length=2)
    folder = tmp_path / "gguf-dir"
    folder.mkdir()
    real = folder / "model.gguf"
    real.write_bytes(b"GGUF" + b"\x00" * 16)
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    assert "auto_map" in backbone_reason(str(real))


def test_train_and_bank_refuse_a_hostile_backbone_before_training(tiny_bert, tmp_path, capsys):
    backbone, marker = planted_copy(tiny_bert, tmp_path, "backbone")
    data = tmp_path / "pairs.csv"
    data.write_text("sentence1,sentence2,score\na cat,a dog,0.5\nthe man,a woman,0.2\n")
    for argv in (*(["train", method, "--backbone", str(backbone), "--max-steps", "1", "--output",
                    str(tmp_path / method), "--no-progress"] for method in ("dcpcse", "simcse")),
                 ["bank", "train", str(tmp_path / "bank"), "sts", "--data", str(data), "--backbone", str(backbone),
                  "--no-progress"]):
        _one_line_refusal(argv, capsys, marker, ("pickled weight file", "--trust-remote-code"))
    assert not any((tmp_path / name).exists() for name in ("dcpcse", "simcse", "bank"))


def test_bank_add_reads_a_hostile_source_as_data(tiny_bert, tmp_path, capsys):
    """``bank add`` reads a set's prompts as data: a pickle and an evil.py beside them never run."""
    from st_prompts import bank, save_prompts_only

    bank.create_bank(tiny_bert).save(str(tmp_path / "bank"))
    save_prompts_only(prompted_model(tiny_bert, prefix_length=2), str(tmp_path / "set"))
    marker = tmp_path / "marker"
    plant(tmp_path / "set", marker)
    edit_json(tmp_path / "set" / "sentence_bert_config.json", lambda c: {**c, "model_kwargs": {"weights_only": False}})
    capsys.readouterr()
    code = main(["bank", "add", str(tmp_path / "bank"), "sts", str(tmp_path / "set")])
    assert code in (0, 2) and "Traceback" not in capsys.readouterr().err
    assert not marker.exists()


# -------------------------------------------------------------------------------------------- property-based test
#: Keys a hostile folder may plant, at any level of any of its JSON files.
DANGEROUS_KEYS = ("weights_only", "use_safetensors", "trust_remote_code", "code_revision", "auto_map", "gguf_file",
                  "from_tf", "from_flax", "revision", "subfolder", "tokenizer_class", "activation_function",
                  "model_type", "architectures", "tokenizer_name_or_path", "custom_pipelines", "model_kwargs",
                  "model_args", "config_kwargs", "processor_kwargs", "tokenizer_args", "quantization_config",
                  "backend", "type", "path", "backbone_name_or_path", "tokenizer_file", "attn_implementation",
                  "_attn_implementation", "experts_implementation", "text_config", "types", "weight_map",
                  "use_kernels")
AUTO_MAP = {"AutoModel": "evil.EvilModel", "AutoConfig": "evil.EvilConfig",
            "AutoTokenizer": ["evil.EvilTokenizer", None]}
#: Values that name a hub kernel (transformers would fetch and import it where ``kernels`` is installed).
HUB_KERNELS = ("kernels-community/evil", "someone/evil-kernel@deadbeef", "flash_attention_2",
               {"": "sdpa", "text_config": "someone/evil-kernel"}, "deepgemm")
DANGEROUS_VALUES = (False, True, "evil.Evil", "evil.EvilModel", "evil.EvilTokenizer", AUTO_MAP, ["evil.EvilModel"],
                    "../outside", "/etc/passwd", "model.gguf", "main", "torch.hub.load",
                    "torch.testing._internal.common_utils.TestCase", {"weights_only": False},
                    {"trust_remote_code": True, "auto_map": AUTO_MAP}, "onnx", *HUB_KERNELS,
                    {"attn_implementation": "someone/evil-kernel"}, {"x": "../outside/model.safetensors"},
                    "sentence_transformers.SentenceTransformer")
#: A mutation: (which JSON file of the saved model, by its position in the sorted list of them; key; value; level).
mutation = st.tuples(st.integers(min_value=0, max_value=100), st.sampled_from(DANGEROUS_KEYS),
                     st.sampled_from(DANGEROUS_VALUES), st.integers(min_value=0, max_value=3))
#: Changes to the folder's layout: the model nested as a Router route (a whole model), weights read through a shard
#: index naming a path outside the folder (``..``, absolute, a link), a file or a module folder linked from outside.
HAZARDS = ("shard-dotdot", "shard-absolute", "shard-link", "file-link", "folder-link")
layout = st.tuples(st.booleans(), st.sampled_from((None, *HAZARDS)))
#: Examples per run: small in CI; ``benchmarks/trust_fuzz.py --examples N`` sets more.
EXAMPLES = int(os.environ.get("ST_PROMPTS_FUZZ_EXAMPLES", "40"))


def _containers(data) -> list[dict]:
    """Every dict inside ``data`` (itself included), to place a key at any level."""
    if isinstance(data, dict):
        return [data, *(found for value in data.values() for found in _containers(value))]
    return [found for value in data for found in _containers(value)] if isinstance(data, list) else []


def _apply(folder: Path, which: int, key: str, value, level: int) -> None:
    files = sorted(p for p in folder.rglob("*.json"))  # every JSON file of every module folder, at any depth
    path = files[which % len(files)]
    data = json.loads(path.read_text())
    targets = _containers(data)
    if not targets:
        return
    target = targets[level % len(targets)]
    if level == 3:  # a new nested object under an existing dict
        target = target.setdefault("nested", {}) if isinstance(target.get("nested", {}), dict) else target
    target[key] = value
    path.write_text(json.dumps(data))


def _route(folder: Path) -> Path:
    """Make ``folder`` a Router whose route is the original model, a whole model one level down; its new path."""
    nested = folder / "nested"
    nested.mkdir()
    for item in list(folder.iterdir()):
        if item != nested:
            shutil.move(str(item), str(nested / item.name))
    shutil.copy(nested / "config_sentence_transformers.json", folder / "config_sentence_transformers.json")
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                      "type": "sentence_transformers.base.modules.router.Router"}]))
    (folder / "router_config.json").write_text(json.dumps({
        "types": {"nested": "sentence_transformers.sentence_transformer.model.SentenceTransformer"},
        "structure": {"query": ["nested"], "document": ["nested"]},
        "parameters": {"default_route": "document", "allow_empty_key": True, "route_mappings": {}}}))
    return nested


def _hazard(model: Path, transformer: Path, outside: Path, clean: Path, kind: str) -> None:
    """Plant a path out of the model folder (see :data:`HAZARDS`); ``transformer``: the Transformer module's folder."""
    outside.mkdir(exist_ok=True)
    if kind.startswith("shard"):
        from safetensors import safe_open

        with safe_open(str(clean / "model.safetensors"), "pt") as weights:
            keys = list(weights.keys())
        shutil.copy(clean / "model.safetensors", outside / "model-00001-of-00001.safetensors")
        (transformer / "model.safetensors").unlink(missing_ok=True)
        target = {"shard-dotdot": os.path.relpath(outside, transformer) + "/model-00001-of-00001.safetensors",
                  "shard-absolute": str(outside / "model-00001-of-00001.safetensors"),
                  "shard-link": "model-00001-of-00001.safetensors"}[kind]
        if kind == "shard-link":
            (transformer / target).symlink_to(outside / target)
        (transformer / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {key: target for key in keys}}))
    elif kind == "file-link":
        shutil.move(str(transformer / "tokenizer.json"), str(outside / "tokenizer.json"))
        (transformer / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    else:
        pooling = next(p for p in model.rglob("*_Pooling") if p.is_dir())
        shutil.move(str(pooling), str(outside / "pooling"))
        pooling.symlink_to(outside / "pooling", target_is_directory=True)


def _names_a_hub_kernel(folder: Path) -> bool:
    """Whether a JSON file of ``folder`` holds, under a key transformers reads an implementation from, a value that
    is not one of its local implementations (the test's own oracle, independent of st_prompts.trust)."""
    local = ("sdpa", "eager", "flex_attention", "batched_mm", "grouped_mm")

    def bad(value) -> bool:
        if isinstance(value, dict):
            return any(bad(v) for v in value.values())
        return not (value is None or value is False or (isinstance(value, str) and value in local))

    keys = ("attn_implementation", "_attn_implementation", "experts_implementation", "use_kernels")
    for path in folder.rglob("*.json"):
        for container in _containers(json.loads(path.read_text())):
            if any(key in container and bad(container[key]) for key in keys):
                return True
    return False


def _kernel_requests() -> list[str]:
    """What a stand-in kernels package recorded (``benchmarks/trust_fuzz.py --kernels`` puts one on the path)."""
    log = os.environ.get("KERNELS_LOG")
    if not log or not os.path.exists(log):
        return []
    return [line for line in Path(log).read_text().splitlines()
            if any(word in line for word in ("get_kernel", "kernelize", "LayerRepository", "evil"))]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
@given(mutations=st.lists(mutation, min_size=1, max_size=3), remove_safetensors=st.booleans(), shape=layout)
# found by CI (2026-11-29): the router's own path mutated away, so the hazard planted in the nested model is never
# reached; the folder is refused for the missing module instead (one line, nothing run, nothing outside read)
@example(mutations=[(1, "path", "evil.Evil", 0)], remove_safetensors=False, shape=(True, "shard-dotdot"))
def test_hostile_folders_never_run_code(st_model, capsys, mutations, remove_safetensors, shape):
    routed, hazard = shape
    root = Path(tempfile.mkdtemp(prefix="hostile-"))
    folder = Path(shutil.copytree(st_model, root / "model"))
    transformer = _route(folder) if routed else folder
    marker = root / "marker"
    plant(transformer, marker, remove_safetensors=remove_safetensors)
    for which, key, value, level in mutations:
        _apply(folder, which, key, value, level)
    if hazard:
        _hazard(folder, transformer, root / "outside", st_model, hazard)
    must_refuse = hazard is not None or _names_a_hub_kernel(folder)
    sys.path[:0] = [str(folder), str(transformer)]  # so that any import of "evil.*" would succeed and write the marker
    try:
        try:
            model = load_sentence_model(str(folder))
        except StPromptsError as exc:
            message = str(exc).strip()
            assert "\n" not in message and "pip install" not in message, message
            # a mutated module path can leave the planted hazard unreachable: then the missing module is refused first
            assert not must_refuse or isinstance(exc, UntrustedCodeError) or any(
                key == "path" for _, key, _, _ in mutations), (shape, mutations, message)
            loaded = False
        else:
            loaded = True
            assert not must_refuse, f"loaded a folder with {hazard or 'a hub kernel'}: {mutations}"
            model.encode(["a cat sits on the mat"])
        assert not marker.exists(), f"code ran: {mutations}"
        capsys.readouterr()
        code = main(["plot", "similarity", str(folder), "--out", str(root / "s.png"), "--senteval-dir",
                     str(SENTEVAL), "--no-progress"])
        err = capsys.readouterr().err
        assert code == (0 if loaded else 2), (shape, mutations, err)
        assert "Traceback" not in err and (loaded or len([x for x in err.splitlines() if ": error: " in x]) == 1)
        assert not marker.exists(), f"code ran through the CLI: {mutations}"
        assert _kernel_requests() == [], (shape, mutations, _kernel_requests())
    finally:
        for path in (str(folder), str(transformer)):
            if path in sys.path:
                sys.path.remove(path)
        sys.modules.pop("evil", None)
        shutil.rmtree(root, ignore_errors=True)
