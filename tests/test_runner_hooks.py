"""The runner's Stage.prepare_loss hook: a pre-pass with the stage's loss and training data before it trains."""

from __future__ import annotations

from datasets import Dataset

from st_prompts import methods
from st_prompts.methods.base import Method, Stage
from st_prompts.methods.dcpcse import DCPCSESettings, build_model
from st_prompts.methods._contrastive import contrastive_columns, contrastive_data, contrastive_loss

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
    method = Method(name="hooked", summary="test", settings_class=DCPCSESettings, presets=lambda *a: {},
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
