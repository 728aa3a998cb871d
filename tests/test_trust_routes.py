"""No code that ships with a model runs unless the user asked, by any route (a tokenizer ``auto_map``, a ``Dense``
activation, a backbone's modelling ``auto_map``, a Router route) through any command that loads a
model: one line naming the reason and the flag, and the marker its code writes never appears; with the flag it runs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_error, edit_json, save_plain, st_model
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.router import Router
from sentence_transformers.sentence_transformer.modules import Dense, Pooling

from st_prompts import PromptedTransformer, bank, save_prompts_only
from st_prompts.cli import main
from st_prompts.errors import ConfigurationError, UntrustedCodeError
from st_prompts.loading import load_sentence_model, untrusted_reason

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = FIXTURES / "search" / "real_queries.txt"  # 120 distinct sentences
SENTEVAL = FIXTURES / "senteval"


@pytest.fixture(scope="module")
def clean_model(tmp_path_factory, tiny_bert) -> Path:
    """A saved SentenceTransformer of sentence-transformers' own classes (tiny BERT + mean pooling)."""
    return save_plain(tmp_path_factory.mktemp("clean") / "model", tiny_bert)


def _marker_code(marker: Path, body: str) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')\n{body}"


def tokenizer_route(source: Path, tmp_path: Path, name: str = "tok") -> tuple[Path, Path]:
    """A copy of ``source`` whose tokenizer_config.json maps AutoTokenizer to a file beside it."""
    folder = Path(shutil.copytree(source, tmp_path / f"{name}-model"))
    marker = tmp_path / f"{name}-ran"
    module = f"tokenization_{name}"
    edit_json(folder / "tokenizer_config.json",
              lambda config: {**config, "auto_map": {"AutoTokenizer": [f"{module}.EvilTokenizer", None]}})
    (folder / f"{module}.py").write_text(_marker_code(
        marker, "from transformers import BertTokenizerFast\n\n\nclass EvilTokenizer(BertTokenizerFast):\n    pass\n"))
    return folder, marker


def dense_route(source: Path, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A copy of ``source`` with a Dense module whose activation is a class of an importable foreign module."""
    marker = tmp_path / "dense-ran"
    package = tmp_path / "site-dense"
    package.mkdir()
    (package / "evil_activation.py").write_text(_marker_code(
        marker, "import torch\n\n\nclass Act(torch.nn.Tanh):\n    pass\n"))
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.delitem(sys.modules, "evil_activation", raising=False)
    model = SentenceTransformer(str(source), device="cpu")
    model.append(Dense(32, 8))
    folder = tmp_path / "dense-model"
    model.save(str(folder))
    dense_dir = next(p for p in folder.iterdir() if p.name.endswith("Dense"))
    edit_json(dense_dir / "config.json", lambda config: {**config, "activation_function": "evil_activation.Act"})
    return folder, marker


def backbone_route(tiny_bert: str, tmp_path: Path) -> tuple[Path, Path]:
    """A prompts-only checkpoint whose backbone folder maps AutoModel to modelling code beside it."""
    backbone = Path(shutil.copytree(tiny_bert, tmp_path / "backbone"))
    folder = tmp_path / "prompts-only"
    save_prompts_only(st_model(PromptedTransformer(str(backbone), prefix_length=2), "cls"), str(folder))
    marker = tmp_path / "backbone-ran"
    edit_json(backbone / "config.json", lambda config: {**config, "auto_map": {"AutoModel": "modeling_evil.EvilModel"}})
    (backbone / "modeling_evil.py").write_text(_marker_code(
        marker, "from transformers import BertModel\n\n\nclass EvilModel(BertModel):\n    pass\n"))
    return folder, marker


def _commands(model: Path, tmp_path: Path, index: Path) -> dict[str, list[str]]:
    """Every command that loads a model, pointed at ``model`` (``index`` is a clean index of the corpus)."""
    senteval = ["--senteval-dir", str(SENTEVAL), "--no-progress"]
    return {
        "evaluate": ["evaluate", str(model), "--metrics", "sts", "--tasks", "STSBenchmark", *senteval],
        "plot similarity": ["plot", "similarity", str(model), "--out", str(tmp_path / "s.png"), *senteval],
        "plot align-uniform": ["plot", "align-uniform", str(model), "--out", str(tmp_path / "a.png"), *senteval],
        "index build": ["index", "build", str(model), str(CORPUS), str(tmp_path / "new.index"), "--no-progress"],
        "index search --model": ["index", "search", str(index), "cat", "--model", str(model)],
        "index add --model": ["index", "add", str(index), str(CORPUS), "--model", str(model), "--no-progress"],
        "index calibrate --model": ["index", "calibrate", str(index), "--model", str(model)],
    }


@pytest.fixture(scope="module")
def clean_index(tmp_path_factory, clean_model) -> Path:
    out = tmp_path_factory.mktemp("index") / "corpus.index"
    assert main(["index", "build", str(clean_model), str(CORPUS), str(out), "--index-type", "hnsw",
                 "--no-progress"]) == 0
    return out


def _assert_refused(argv: list[str], capsys, marker: Path, words: tuple[str, ...]) -> None:
    err = cli_error(argv, capsys)
    assert "--trust-remote-code" in err and all(word in err for word in words), err
    assert not marker.exists(), f"{argv[0:2]} ran the model's code"


@pytest.mark.parametrize("route", ["tokenizer", "dense", "backbone"])
def test_every_command_refuses_every_route(route, clean_model, clean_index, tiny_bert, tmp_path, capsys,
                                           monkeypatch):
    if route == "tokenizer":
        folder, marker = tokenizer_route(clean_model, tmp_path)
        words = ("tokenizer_config.json", "auto_map")
    elif route == "dense":
        folder, marker = dense_route(clean_model, tmp_path, monkeypatch)
        words = ("evil_activation.Act",)
    else:
        folder, marker = backbone_route(tiny_bert, tmp_path)
        words = ("backbone", "auto_map")
    assert untrusted_reason(str(folder)) is not None
    with pytest.raises(UntrustedCodeError, match="trust_remote_code=True"):
        load_sentence_model(str(folder))
    before = (clean_index / "meta.json").read_text()
    for argv in _commands(folder, tmp_path, clean_index).values():
        _assert_refused(argv, capsys, marker, words)
    assert (clean_index / "meta.json").read_text() == before  # nothing was added or recalibrated
    assert not (tmp_path / "new.index").exists()
    # With the flag, the same model loads: its code runs because the user asked.
    argv = _commands(folder, tmp_path, clean_index)["evaluate"] + ["--trust-remote-code"]
    assert main(argv) == 0
    assert marker.read_text() == "ran"
    assert load_sentence_model(str(folder), trust_remote_code=True).encode(["a cat"]).shape[0] == 1


def router_route(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A Router of two whole models (copies of ``source``); the document route's tokenizer maps AutoTokenizer to a
    file beside it."""
    router = Router.for_query_document(query_modules=[SentenceTransformer(str(source), device="cpu")],
                                       document_modules=[SentenceTransformer(str(source), device="cpu")])
    folder = tmp_path / "router-model"
    SentenceTransformer(modules=[router], device="cpu").save(str(folder))
    nested = next(p for p in folder.iterdir() if p.name.startswith("document_"))
    evil, marker = tokenizer_route(nested, tmp_path, name="routed")
    shutil.rmtree(nested)
    evil.rename(nested)
    return folder, marker


def test_every_command_refuses_a_router_nested_model(clean_model, clean_index, tmp_path, capsys):
    """A Router route that is a whole model is walked like the model itself, through every command."""
    folder, marker = router_route(clean_model, tmp_path)
    assert "tokenizer_config.json" in untrusted_reason(str(folder))
    for argv in _commands(folder, tmp_path, clean_index).values():
        _assert_refused(argv, capsys, marker, ("document_", "tokenizer_config.json", "auto_map"))
    assert not (tmp_path / "new.index").exists()


def test_a_backbone_override_is_checked_too(tiny_bert, tmp_path):
    folder, marker = backbone_route(tiny_bert, tmp_path)
    clean = Path(shutil.copytree(tiny_bert, tmp_path / "clean-backbone"))
    edit_json(folder / "sentence_bert_config.json", lambda config: {**config, "backbone_name_or_path": str(clean)})
    assert untrusted_reason(str(folder)) is None
    evil_backbone = tmp_path / "backbone"
    reason = untrusted_reason(str(folder), model_kwargs={"backbone_name_or_path": str(evil_backbone)})
    assert reason is not None and "auto_map" in reason
    assert not marker.exists()


def test_st_prompts_models_load_without_the_global_flag(tiny_bert, tmp_path):
    """A model with st_prompts modules is assembled from its modules, none loaded with trust_remote_code, and encodes
    exactly as sentence-transformers' own loading with the flag does."""
    encoder = PromptedTransformer(tiny_bert, prefix_length=3)
    model = SentenceTransformer(modules=[encoder, Pooling(32, "cls")], device="cpu",
                                prompts={"query": "the "}, default_prompt_name="query", similarity_fn_name="dot")
    model.save(str(tmp_path / "m"))
    safe = load_sentence_model(str(tmp_path / "m"))
    assert safe.trust_remote_code is False
    assert safe.prompts["query"] == "the " and safe.default_prompt_name == "query"
    assert safe.similarity_fn_name == "dot"
    flagged = SentenceTransformer(str(tmp_path / "m"), trust_remote_code=True, device="cpu")
    sentences = ["a man plays the guitar", "the cat sits on the mat"]
    np.testing.assert_array_equal(safe.encode(sentences), flagged.encode(sentences))


# ---------------------------------------------------------------------------------------------- Router routes (#60.8)
def _router(query_modules, document_modules):
    return SentenceTransformer(modules=[Router.for_query_document(query_modules=query_modules,
                                                                   document_modules=document_modules)], device="cpu")


def test_a_prompted_route_loads_without_trust_and_a_bank_route_is_refused_in_one_line(tiny_bert, clean_model, tmp_path,
                                                                                     capsys):
    """A PromptedTransformer route loads safely, as with trust; a route to a prompt bank is refused in one line, in
    memory, saved, trusted or not, through the command line: the Router and the bank would both read task=."""
    plain = SentenceTransformer(str(clean_model), device="cpu")
    torch.manual_seed(0)
    prompted = PromptedTransformer(tiny_bert, prefix_length=3, prefix_init_std=0.5)
    model = _router([prompted, Pooling(32, "mean")], [plain[0], plain[1]])
    texts = ["a man plays the guitar", "the cat sits on the mat"]
    query, document = model.encode(texts, task="query"), model.encode(texts, task="document")
    assert not np.allclose(query, document, atol=1e-3)
    model.save(str(tmp_path / "routed"))
    for trust in (False, True):
        loaded = load_sentence_model(str(tmp_path / "routed"), trust_remote_code=trust)
        np.testing.assert_allclose(loaded.encode(texts, task="query"), query, atol=1e-6)
        np.testing.assert_allclose(loaded.encode(texts, task="document"), document, atol=1e-6)

    banked = bank.create_bank(tiny_bert)
    banked[0].new_prompt_set("sts", prefix_length=2)
    with pytest.raises(ConfigurationError, match="prompt bank inside a sentence-transformers Router is not supported"):
        _router([banked[0], banked[1]], [plain[0], plain[1]])
    # the same saved by hand (as sentence-transformers' Router.save writes it), and as a whole-model route
    shutil.copytree(tmp_path / "routed", tmp_path / "bank-routed")
    route = next((tmp_path / "bank-routed").glob("query_0_*"))
    edit_json(route / "sentence_bert_config.json", lambda config: {**config, "prompt_sets": {}})
    whole = tmp_path / "whole-routed"
    whole_route = Router({"query": [st_model(PromptedTransformer(tiny_bert, prefix_length=2))], "document": [plain]},
                         default_route="document")
    SentenceTransformer(modules=[whole_route], device="cpu").save(str(whole))
    for folder, match in ((tmp_path / "bank-routed", "prompt bank inside a sentence-transformers Router"),
                          (whole, "route that is a whole st_prompts model cannot be loaded")):
        for trust in (False, True):
            with pytest.raises(ConfigurationError, match=match):
                load_sentence_model(str(folder), trust_remote_code=trust)
        capsys.readouterr()
        assert main(["index", "build", str(folder), str(CORPUS), str(tmp_path / "idx")]) == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and match in err.splitlines()[-1], err
