"""The runner's Stage.prepare_loss hook: a pre-pass with the stage's loss and training data before it trains."""

from __future__ import annotations

from datasets import Dataset

from st_prompts import methods
from st_prompts.methods.base import Method, MethodConfig, Stage
from st_prompts.methods.dcpcse.config import DCPCSESettings
from st_prompts.methods.dcpcse.method import build_model
from st_prompts.methods.stages import contrastive_columns, contrastive_data, contrastive_loss

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music"]


def test_prepare_loss_runs_once_with_the_loss_and_data_before_training(tiny_bert, tmp_path, monkeypatch):
    from st_prompts.training.run import train

    calls = []

    def prepare_loss(loss, dataset, settings):
        calls.append((loss, list(dataset["anchor"]), loss.model.training, settings.method))
        return {"seen": len(dataset)}

    stages = [Stage(name="one", build_loss=contrastive_loss, columns=contrastive_columns, load_data=contrastive_data,
                    prepare_loss=prepare_loss, select_model=False),
              Stage(name="two", build_loss=contrastive_loss, columns=contrastive_columns, load_data=contrastive_data,
                    select_model=False)]
    method = Method(MethodConfig(name="hooked", summary="test", settings_class=DCPCSESettings, presets=lambda *a: {}),
                    build_model=build_model, stages=lambda settings: stages)
    monkeypatch.setattr(methods, "get", lambda name: method)
    settings = DCPCSESettings(method="hooked", backbone=tiny_bert, prefix_length=2, batch_size=2, max_steps=1,
                              output_dir=str(tmp_path))
    data = Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES})
    _, result = train(settings, {"one": data, "two": data}, show_progress_bar=False)
    assert len(calls) == 1  # only the stage that has the hook
    loss, anchors, _, name = calls[0]
    assert anchors == SENTENCES and name == "hooked" and loss.__class__.__name__ == "PromptContrastiveLoss"
    assert result.stage_reports == {"one": {"seen": 4}}


def _train_tiny(tiny_bert, tmp_path, checkpointing: bool):
    from transformers import TrainerCallback

    from st_prompts.training.run import train

    seen = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            backbone = model[0].auto_model
            name = "is_activation_checkpointing" if hasattr(type(backbone), "is_activation_checkpointing") else (
                "is_gradient_checkpointing")
            seen.append(getattr(backbone, name))

    settings = DCPCSESettings(method="dcpcse", backbone=tiny_bert, prefix_length=2, batch_size=2, max_steps=1,
                              output_dir=str(tmp_path), gradient_checkpointing=checkpointing)
    data = Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES})
    train(settings, data, show_progress_bar=False, callbacks=[Probe()])
    return seen


def test_gradient_checkpointing_setting_reaches_the_backbone_without_deprecation_warnings(tiny_bert, tmp_path):
    import warnings

    for checkpointing in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _train_tiny(tiny_bert, tmp_path / str(checkpointing), checkpointing) == [checkpointing]
        if not checkpointing:
            assert not [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    # the training argument's own deprecated name is not used (sentence-transformers' model still warns that it only
    # defines `gradient_checkpointing_enable`; that one is upstream's)
    assert not [str(w.message) for w in caught if str(w.message).startswith("`gradient_checkpointing` is deprecated")]
