"""The method registry: discovery, presets, the saved MLP head, per-group learning rates, the CLI generated from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer

from st_prompts import methods, save_prompts_only
from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import Method, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music"]


def test_registry_discovers_the_method_files():
    assert {"dcpcse", "scpcse", "simcse"} <= set(methods.names())
    for name in methods.names():
        method = methods.get(name)
        assert isinstance(method, Method) and method.name == name
        assert issubclass(method.settings_class, TrainSettings)
    with pytest.raises(ConfigurationError, match="Unknown method 'nope'"):
        methods.get("nope")


def test_settings_validate_names_and_choices_and_keep_the_official_presets():
    # mlp: the old boolean is gone (an error, not a silent no-op)
    for bad, match in ((dict(mlp=True), "no option"), (dict(mlp_head="always"), "mlp_head='always'"),
                       (dict(scale="gpu"), "Unknown scale")):
        with pytest.raises(ConfigurationError, match=match):
            methods.settings("dcpcse", **{"scale": "cpu", **bad})
    s = methods.settings("dcpcse", True, "cpu", learning_rate=0.5, prefix_length=None)
    assert s.learning_rate == 0.5 and s.prefix_length == 12  # None means "keep the preset"
    # the official code: unsupervised runs use the MLP in training only, supervised runs keep it
    for name in ("dcpcse", "simcse", "scpcse"):
        assert methods.settings(name, False, "paper").mlp_head == "train_only"
        assert methods.settings(name, True, "paper").mlp_head == "saved"
    from st_prompts.cli import build_parser
    from st_prompts.methods.scpcse.config import SCPCSE_TEMPLATE as light
    from st_prompts.prompts.shallow import SCPCSE_TEMPLATE

    assert light == SCPCSE_TEMPLATE
    args = build_parser().parse_args(["train", "dcpcse", "--scale", "cpu", "--no-prefix-gate"])
    assert args.prefix_gate is False  # the official prefix


@pytest.mark.parametrize("prompts_only", [False, True])
def test_saved_mlp_head_is_applied_saved_and_reloaded(tiny_bert, tmp_path, prompts_only):
    from st_prompts.training.run import count_parameters

    model = methods.build("dcpcse", backbone=tiny_bert, supervised=True, scale="cpu", prefix_length=3,
                          mlp_head="saved")
    dense = model[-1]
    assert type(dense).__name__ == "Dense" and len(model) == 3
    model.eval()
    with torch.no_grad():
        features = model.preprocess(SENTENCES)
        cls = model[1](model[0](dict(features)))["sentence_embedding"]
        expected = torch.tanh(cls @ dense.linear.weight.T + dense.linear.bias)
        got = model.encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(got, expected)
    trainable, _ = count_parameters(model)
    prefix = sum(p.numel() for p in model[0].prompt_parameters())
    assert trainable == prefix + 32 * 32 + 32  # the head counts in the trainable share

    path = str(tmp_path / "model")
    save_prompts_only(model, path) if prompts_only else model.save(path)
    loaded = SentenceTransformer(path, trust_remote_code=True)
    assert type(loaded[-1]).__name__ == "Dense"
    np.testing.assert_array_equal(loaded.encode(SENTENCES), model.encode(SENTENCES))


def test_head_learning_rate_gets_its_own_optimizer_group(tiny_bert, tmp_path):
    from st_prompts.training.run import stage_trainer

    for mode, owner in (("saved", "dense"), ("train_only", "loss")):
        settings = methods.settings("dcpcse", True, "cpu", backbone=tiny_bert, prefix_length=3, mlp_head=mode,
                                    head_learning_rate=1e-4, learning_rate=1e-2, max_steps=1)
        model = methods.get("dcpcse").build_model(settings)
        data = Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES, "negative": SENTENCES[::-1]})
        trainer, _, _ = stage_trainer(settings, methods.get("dcpcse").stages(settings)[0], data, model,
                                      show_progress_bar=False, trainer_dir=str(tmp_path))
        optimizer = trainer.create_optimizer()
        head = model[-1].linear.weight if owner == "dense" else trainer.loss.mlp[0].weight
        prefix = model[0].prefix_encoder.embedding.weight
        lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
        assert lr_of[id(head)] == 1e-4 and lr_of[id(prefix)] == 1e-2
        assert not any(id(p) in lr_of for p in model[0].auto_model.parameters())  # frozen backbone not optimised


def test_help_does_not_import_torch():
    """Nor do a method's generated options for its recipe script (``method_parser``)."""
    code = ("import sys; from st_prompts.cli import main; from st_prompts.commands.train import method_parser\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['train', 'dcpcse', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(method_parser('d2cse', 'D2CSE').format_help())\n"
            "heavy = [m for m in ('torch', 'transformers', 'sentence_transformers', 'datasets', 'faiss', 'matplotlib')"
            " if m in sys.modules]\nprint('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    for flag in ("--prefix-length", "--mlp-head", "--cls-prompt", "--crtd-weight", "--masking-ratio", "--generator",
                 "--corruption-cache"):  # options generated from the settings classes
        assert flag in out, flag


@pytest.mark.parametrize("method, supervised, gated", [
    ("dcpcse", False, True), ("dcpcse", True, False), ("d2cse", False, False), ("d2cse", True, False),
    ("diffaug", False, True), ("diffaug", True, False), ("skicse", False, False), ("skicse", True, False),
])
def test_cpu_presets_gate_where_three_seeds_moved_the_selection_set_up(method, supervised, gated):
    """Gated where the three-seed STS-B dev mean was higher (benchmarks/results/run_all); paper presets never."""
    assert methods.settings(method, supervised, "cpu").prefix_gate is gated
    assert methods.settings(method, supervised, "cpu", prefix_gate=False).prefix_gate is False
    assert methods.settings(method, supervised, "cpu", prefix_gate=True).prefix_gate is True
    backbone = {"d2cse": "bert-base-uncased", "skicse": "bert-base-uncased"}.get(method)
    if method != "skicse":
        assert methods.settings(method, supervised, "paper", backbone=backbone).prefix_gate is False


def test_every_method_folder_is_registered_described_and_listed_in_the_docs():
    """A method is its folder (found by its config.py, naming the paper), a recipe, a test and a docs page
    (CONTRIBUTING.md); README.md's and docs/index.md's tables are the registry's."""
    from st_prompts.methods import catalog

    package = Path(methods.__file__).parent
    assert methods.names() == sorted(p.name for p in package.iterdir() if (p / "config.py").is_file())
    for name in methods.names():
        config = methods.config(name)
        assert config.title and config.citation and config.paper and config.description, name
        assert config.paper_url is None or config.paper_url.startswith("https://"), name
        assert (ROOT / "docs" / "methods" / f"{name}.md").is_file(), name
        assert list((ROOT / "recipes").glob(f"{name}*.py")), name
    assert catalog.stale(ROOT) == [], "run python -m st_prompts.methods.catalog"


def test_a_method_card_cites_its_paper(tiny_bert):
    model = methods.build("diffaug", backbone=tiny_bert, scale="cpu")
    card = model.model_card_data
    assert (card.method_title, card.paper_url) == ("DiffAug", "https://arxiv.org/abs/2210.16536")
    assert card.get_model_specific_metadata()["st_prompts"]["paper"].startswith("Differentiable Data Augmentation")
    assert card.get_default_model_name().startswith("DiffAug on ")


def test_contributing_walks_a_seventh_method_end_to_end(tiny_bert, data_dir, tmp_path, monkeypatch):
    """CONTRIBUTING.md's code blocks, each headed by its path, are a whole method: built into a package here,
    registered, its test block run (two training steps, save, reload), its recipe compiled."""
    import re

    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    blocks = {match.group(1): match.group(2) for match in
              re.finditer(r"```python\n# ([\w/]+\.py)\n(.*?)```", text, flags=re.S)}
    folder = "st_prompts/methods/anglecse/"
    assert sorted(blocks) == sorted([folder + "__init__.py", folder + "config.py", folder + "method.py",
                                     "recipes/anglecse.py", "tests/test_anglecse.py"])
    package = tmp_path / "walkthrough" / "anglecse"
    package.mkdir(parents=True)
    for name in ("__init__.py", "config.py", "method.py"):
        (package / name).write_text(blocks[folder + name], encoding="utf-8")
    compile(blocks["recipes/anglecse.py"], "recipes/anglecse.py", "exec")
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(package.parent)])
    monkeypatch.setitem(methods._REGISTRY, "anglecse", "st_prompts.methods.anglecse")
    for module in [m for m in sys.modules if m.startswith("st_prompts.methods.anglecse")]:
        monkeypatch.delitem(sys.modules, module)
    assert "anglecse" in methods.names() and methods.config("anglecse").title == "AnglE-prefix"
    with pytest.raises(ConfigurationError, match="angle-scale"):
        methods.settings("anglecse", supervised=True, scale="cpu", angle_scale=0.0)
    namespace: dict = {}
    exec(compile(blocks["tests/test_anglecse.py"], "tests/test_anglecse.py", "exec"), namespace)
    namespace["test_only_the_prefix_trains_and_the_saved_model_encodes_the_same"](tiny_bert, data_dir, tmp_path)
    for module in [m for m in sys.modules if m.startswith("st_prompts.methods.anglecse")]:
        monkeypatch.delitem(sys.modules, module)
