"""The method registry: discovery, presets, the saved MLP head, per-group learning rates, the CLI generated from it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from st_prompts import methods
from st_prompts.errors import ConfigurationError
from st_prompts.methods.base import Method, TrainSettings

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music"]


def test_registry_discovers_the_method_files():
    assert {"dcpcse", "scpcse", "simcse"} <= set(methods.names())
    for name in methods.names():
        method = methods.get(name)
        assert isinstance(method, Method) and method.name == name
        assert issubclass(method.settings_class, TrainSettings)
    with pytest.raises(ConfigurationError, match="Unknown method 'nope'"):
        methods.get("nope")


def test_settings_validate_names_and_choices():
    with pytest.raises(ConfigurationError, match="no option"):
        methods.settings("dcpcse", scale="cpu", mlp=True)  # the old boolean is gone: an error, not a silent no-op
    with pytest.raises(ConfigurationError, match="mlp_head='always'"):
        methods.settings("dcpcse", scale="cpu", mlp_head="always")
    with pytest.raises(ConfigurationError, match="Unknown scale"):
        methods.settings("dcpcse", scale="gpu")
    s = methods.settings("dcpcse", True, "cpu", learning_rate=0.5, prefix_length=None)
    assert s.learning_rate == 0.5 and s.prefix_length == 12  # None means "keep the preset"


def test_supervised_paper_presets_keep_the_mlp_at_inference():
    """Official code: unsupervised runs use the MLP in training only, supervised runs keep it (``--pooler_type cls``)."""
    for name in ("dcpcse", "simcse", "scpcse"):
        assert methods.settings(name, False, "paper").mlp_head == "train_only"
        assert methods.settings(name, True, "paper").mlp_head == "saved"


def test_scpcse_template_constant_matches_the_encoders():
    from st_prompts.methods.scpcse.config import SCPCSE_TEMPLATE as light
    from st_prompts.prompts.shallow import SCPCSE_TEMPLATE

    assert light == SCPCSE_TEMPLATE


@pytest.mark.parametrize("prompts_only", [False, True])
def test_saved_mlp_head_is_applied_saved_and_reloaded(tiny_bert, tmp_path, prompts_only):
    from st_prompts import save_prompts_only
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
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    for mode, owner in (("saved", "dense"), ("train_only", "loss")):
        settings = methods.settings("dcpcse", True, "cpu", backbone=tiny_bert, prefix_length=3, mlp_head=mode,
                                    head_learning_rate=1e-4, learning_rate=1e-2)
        model = methods.get("dcpcse").build_model(settings)
        stage = methods.get("dcpcse").stages(settings)[0]
        loss = stage.build_loss(model, settings)
        args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                                    learning_rate=settings.learning_rate, use_cpu=True,
                                                    learning_rate_mapping=stage.learning_rates(model, settings))
        data = Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES, "negative": SENTENCES[::-1]})
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
        optimizer = trainer.create_optimizer()
        head = model[-1].linear.weight if owner == "dense" else loss.mlp[0].weight
        prefix = model[0].prefix_encoder.embedding.weight
        lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
        assert lr_of[id(head)] == 1e-4 and lr_of[id(prefix)] == 1e-2
        assert not any(id(p) in lr_of for p in model[0].auto_model.parameters())  # frozen backbone not optimised


def test_help_does_not_import_torch():
    code = ("import sys; from st_prompts.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['train', 'dcpcse', '--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'sentence_transformers', 'datasets', 'faiss', 'matplotlib')"
            " if m in sys.modules]\nprint('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    assert "--prefix-length" in out and "--mlp-head" in out  # options generated from the settings class


@pytest.mark.parametrize("method, supervised, gated", [
    ("dcpcse", False, True), ("dcpcse", True, False), ("d2cse", False, False), ("d2cse", True, False),
    ("diffaug", False, True), ("diffaug", True, False), ("skicse", False, False), ("skicse", True, False),
])
def test_cpu_presets_gate_where_three_seeds_moved_the_selection_set_up(method, supervised, gated):
    """Issue 51: the --scale cpu presets gate the prefix where the three-seed STS-B dev mean was higher with the gate
    on the CPU (benchmarks/results/run_all/run_all.md: DCPCSE unsup, DiffAug semi; not D2CSE unsup, -0.53 there
    though +0.46 on an H100); the paper presets never do; the option turns it on and off."""
    assert methods.settings(method, supervised, "cpu").prefix_gate is gated
    assert methods.settings(method, supervised, "cpu", prefix_gate=False).prefix_gate is False
    assert methods.settings(method, supervised, "cpu", prefix_gate=True).prefix_gate is True
    backbone = {"d2cse": "bert-base-uncased", "skicse": "bert-base-uncased"}.get(method)
    if method != "skicse":
        assert methods.settings(method, supervised, "paper", backbone=backbone).prefix_gate is False


def test_no_prefix_gate_on_the_command_line_gives_the_official_prefix():
    from st_prompts.cli import build_parser

    args = build_parser().parse_args(["train", "dcpcse", "--scale", "cpu", "--no-prefix-gate"])
    assert args.prefix_gate is False


def test_every_registered_method_names_its_paper_on_the_model_card():
    """CONTRIBUTING: a new method joins the paper table of the model card (a card without it would cite nothing)."""
    from st_prompts.modules.model_card import PAPERS

    missing = [name for name in methods.names() if name not in PAPERS]
    assert not missing, f"add {missing} to st_prompts.modules.model_card.PAPERS"
    assert all(title and (url is None or url.startswith("https://")) for title, url in PAPERS.values())
