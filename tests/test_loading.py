"""st_prompts.loading: the trust decision of load_sentence_model, and pooling labels."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import cli_out, edit_json, one_error_line, save_plain

from st_prompts.errors import DataNotFoundError, UntrustedCodeError
from st_prompts.loading import load_sentence_model, pooling_label, should_trust_remote_code

SENTEVAL = Path(__file__).parent / "fixtures" / "senteval"
ST_POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory, tiny_bert) -> Path:
    """A saved SentenceTransformer (tiny random BERT + mean pooling): only sentence_transformers classes."""
    return save_plain(tmp_path_factory.mktemp("st-model") / "model", tiny_bert)


def _edit_modules(folder: Path, **types: str) -> None:
    """Replace the ``type`` of the modules whose class name (last component) is a key of ``types``."""
    edit_json(folder / "modules.json", lambda modules: [
        {**module, "type": types.get(module["type"].rsplit(".", 1)[-1], module["type"])} for module in modules])


@pytest.fixture
def evil_folder(st_folder, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A copy of ``st_folder`` whose modules.json names ``evil_pkg.Module``, an importable package that leaves a
    marker file when imported (and is otherwise sentence-transformers' Pooling). Returns (folder, marker)."""
    folder = Path(shutil.copytree(st_folder, tmp_path / "evil-model"))
    _edit_modules(folder, Pooling="evil_pkg.Module")
    marker = tmp_path / "evil-code-ran"
    package = tmp_path / "site" / "evil_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from sentence_transformers.sentence_transformer.modules import Pooling as Module\n"
    )
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "evil_pkg", raising=False)
    yield folder, marker
    sys.modules.pop("evil_pkg", None)


def test_sentence_transformers_classes_load_without_any_trust(st_folder):
    assert should_trust_remote_code(str(st_folder)) is True and should_trust_remote_code("minilm") is True
    model = load_sentence_model(str(st_folder), device="cpu")
    assert model.trust_remote_code is False  # nothing is granted: their classes are sentence-transformers' own
    assert load_sentence_model(str(st_folder), False, device="cpu").trust_remote_code is False


def test_st_prompts_classes_are_trusted_and_code_or_unreadable_files_are_not(st_folder, tiny_bert, tmp_path):
    folder = Path(shutil.copytree(st_folder, tmp_path / "prompted"))
    _edit_modules(folder, Transformer="st_prompts.modules.prompted_transformer.PromptedTransformer")
    assert should_trust_remote_code(str(folder)) is True
    _edit_modules(folder, PromptedTransformer="st_prompts_extra.Module")  # a prefix match is not enough
    assert should_trust_remote_code(str(folder)) is False
    folder = Path(shutil.copytree(st_folder, tmp_path / "auto-map"))  # custom modelling code
    edit_json(folder / "config.json", lambda config: {**config, "auto_map": {"AutoModel": "modeling_evil.EvilModel"}})
    assert should_trust_remote_code(str(folder)) is False
    assert should_trust_remote_code(tiny_bert) is True  # a plain transformers folder without auto_map: no code
    assert should_trust_remote_code(str(tmp_path / "no-such-folder")) is False
    broken = Path(shutil.copytree(st_folder, tmp_path / "broken"))
    (broken / "modules.json").write_text("{not json")
    assert should_trust_remote_code(str(broken)) is False
    (broken / "modules.json").write_text(json.dumps([{"path": "", "type": ST_POOLING, "idx": 0, "name": "0"},
                                                      {"path": "../elsewhere", "type": ST_POOLING}]))
    assert should_trust_remote_code(str(broken)) is False


def test_a_foreign_class_is_refused_without_running_it_unless_trusted(evil_folder, capsys):
    folder, marker = evil_folder
    assert should_trust_remote_code(str(folder)) is False
    for trust in (None, False):
        with pytest.raises(UntrustedCodeError) as caught:
            load_sentence_model(str(folder), trust, device="cpu")
        message = str(caught.value)
        assert "evil_pkg.Module" in message and "--trust-remote-code" in message and "\n" not in message
        assert isinstance(caught.value, ValueError)
    argv = ["evaluate", str(folder), "--senteval-dir", str(SENTEVAL), "--tasks", "stsb", "--no-progress"]
    code, out, err = cli_out(argv, capsys)
    line = one_error_line(err, alone=True)
    assert code == 2 and out == "" and line.startswith("st-prompts evaluate: error: "), line
    assert "evil_pkg.Module" in line and "--trust-remote-code" in line
    assert not marker.exists() and "evil_pkg" not in sys.modules
    code, out, _ = cli_out([*argv, "--trust-remote-code"], capsys)
    assert code == 0 and "STS-B" in out and marker.read_text() == "imported"  # trust was passed on
    model = load_sentence_model(str(folder), True, device="cpu")
    assert model.trust_remote_code is True
    assert model.encode(["a man plays the guitar"]).shape == (1, 32)


def test_hub_ids_are_read_through_hf_hub_download(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    modules = tmp_path / "modules.json"
    modules.write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": ST_POOLING}]))
    asked = []

    def cached(repo_id, filename, **kwargs):
        asked.append((repo_id, filename, kwargs))
        if filename == "modules.json":
            return str(modules)
        raise EntryNotFoundError(f"{filename} not in {repo_id}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cached)
    monkeypatch.setattr("st_prompts.hub.is_cached", lambda repo_id: True)  # as hf_hub_download answers from a cache
    assert should_trust_remote_code("some-org/some-model", revision="v1") is True
    assert asked[0] == ("some-org/some-model", "modules.json", {"revision": "v1"})

    def offline(repo_id, filename, **kwargs):
        raise OSError("no connection")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert should_trust_remote_code("some-org/some-model") is False


def test_missing_model_is_a_data_not_found_error(tmp_path):
    with pytest.raises(DataNotFoundError, match="could not load model"):
        load_sentence_model(str(tmp_path / "missing"))


def test_pooling_labels(st_folder, tiny_bert):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from st_prompts import MaskTokenPooling

    assert pooling_label(load_sentence_model("minilm", device="cpu")) == "mean"
    transformer = Transformer(tiny_bert)
    cls = SentenceTransformer(modules=[transformer, Pooling(32, "cls")], device="cpu")
    assert pooling_label(cls) == "[CLS]"
    both = SentenceTransformer(modules=[transformer, Pooling(32, ["cls", "max"])], device="cpu")
    assert pooling_label(both) == "[CLS]+max"
    mask = SentenceTransformer(modules=[transformer, MaskTokenPooling(32)], device="cpu")
    assert pooling_label(mask) == "[MASK]"
    assert pooling_label(object()) == "unknown"


def test_trusted_but_missing_code_is_a_message_not_a_traceback(st_folder, tmp_path):
    folder = Path(shutil.copytree(st_folder, tmp_path / "missing-code"))
    _edit_modules(folder, Pooling="no_such_package_xyz.Module")
    with pytest.raises(DataNotFoundError, match="cannot be imported"):
        load_sentence_model(str(folder), trust_remote_code=True)
