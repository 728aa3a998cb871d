"""Integration on the real packaged all-MiniLM-L6-v2: a few DCPCSE steps lower the contrastive loss and change only
the prompts; the trainer path (SentenceTransformerTrainer) and the legacy ``model.fit`` both run the same loss."""

from __future__ import annotations

import torch
from conftest import st_model, through_transformers_cache
from datasets import Dataset

from st_prompts import PromptedTransformer
from st_prompts.losses import PromptContrastiveLoss
from st_prompts.methods import settings as preset
from st_prompts.training.run import train

SENTENCES = ["A man is playing a guitar on stage.", "The cat sleeps on the warm windowsill.",
             "Stock markets fell sharply on Monday.", "She baked a chocolate cake for the party.",
             "The train to Paris was delayed by an hour.", "Children are building a sandcastle at the beach.",
             "The committee approved the new budget.", "A dog chases a ball across the park."]


def make_model(path):
    return st_model(PromptedTransformer(path, prefix_length=8, max_seq_length=32), "cls")


def contrastive_loss(loss, model, seed=0):
    """The training-mode contrastive loss on the fixed batch, with a fixed dropout seed."""
    torch.manual_seed(seed)
    model.train(), loss.train()
    with torch.no_grad():
        return loss([dict(model.preprocess(SENTENCES)), dict(model.preprocess(SENTENCES))], None)["contrastive"].item()


def test_few_steps_lower_the_loss_and_change_only_prompts(minilm_path, tmp_path):
    model = make_model(minilm_path)
    encoder = model[0]
    backbone_before = {k: v.clone() for k, v in encoder.auto_model.state_dict().items()}
    prompts_before = {k: v.clone() for k, v in encoder.prompt_state_dict().items()}
    settings = preset("dcpcse", scale="cpu", batch_size=8, max_steps=8, learning_rate=1e-2, prefix_length=8,
                      output_dir=str(tmp_path), mlp_head="none", logging_steps=1)
    loss_before = contrastive_loss(PromptContrastiveLoss(model), model)

    model, result = train(settings, Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES}), model=model,
                          show_progress_bar=False)
    loss_after = contrastive_loss(PromptContrastiveLoss(model), model)
    assert loss_after < 0.8 * loss_before, (loss_before, loss_after)
    logged = [h["contrastive"] for h in result.log_history if "contrastive" in h]
    assert len(logged) == 8  # the loss part is logged at every step

    for key, value in encoder.auto_model.state_dict().items():
        assert torch.equal(value, backbone_before[key]), f"backbone weight {key} changed"
    changed = [k for k, v in encoder.prompt_state_dict().items() if not torch.equal(v, prompts_before[k])]
    assert changed == ["prefix_encoder.embedding.weight"]
    assert result.trainable_parameters == 8 * 2 * 6 * 384  # l * 2 * L * H
    assert result.trainable_parameters / result.total_parameters < 0.01


def test_legacy_fit_trains_the_prompts(minilm_path, tmp_path):
    from sentence_transformers.readers import InputExample
    from torch.utils.data import DataLoader

    model = make_model(minilm_path)
    before = model[0].prefix_encoder.embedding.weight.detach().clone()
    backbone = model[0].auto_model.embeddings.word_embeddings.weight.detach().clone()
    examples = [InputExample(texts=[s, s]) for s in SENTENCES]
    loss = PromptContrastiveLoss(model, mlm_weight=0.0)
    model.fit(train_objectives=[(DataLoader(examples, batch_size=4, shuffle=True), loss)], epochs=1, warmup_steps=0,
              optimizer_params={"lr": 1e-2}, show_progress_bar=False)
    after = model[0].prefix_encoder.embedding.weight.detach()
    assert not torch.equal(before, after)
    assert torch.equal(backbone, model[0].auto_model.embeddings.word_embeddings.weight)
    assert loss.step == 2  # the loss counted its own optimisation steps (no callback in model.fit)


def test_the_attention_path_gives_transformers_cache_embeddings_on_minilm(minilm_path):
    """Within 1e-5 of transformers' key/value cache (PEFT's mechanism): the official and a 50 times larger prefix."""
    texts = SENTENCES + ["A very long sentence about nothing in particular, " * 4]
    for std in (None, 1.0):
        torch.manual_seed(0)
        encoder = PromptedTransformer(minilm_path, prefix_length=16, prefix_init_std=std).eval()
        features = encoder.tokenize(texts)
        with torch.no_grad():
            ours = encoder(dict(features))["token_embeddings"]
            theirs = through_transformers_cache(encoder, dict(features))
        real = features["attention_mask"].bool()
        assert (ours[real] - theirs[real]).abs().max() < 1e-5, std
