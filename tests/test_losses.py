"""PromptContrastiveLoss: InfoNCE against sentence-transformers and a hand-written formula, MLM schedule and masking."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import prompted_model as cls_prompted_model
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_prompts import PromptedTransformer
from st_prompts.errors import ConfigurationError
from st_prompts.losses import MLMHead, PromptContrastiveLoss, TokenMasker, mlm_weight
from st_prompts.training import LossStepCallback

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music"]
NEGATIVES = ["the woman sits", "a red car", "big green tree", "sad water"]


def prompted_model(path):
    return cls_prompted_model(path, "cls", prefix_length=3)


def features(model, texts):
    return dict(model.preprocess(texts))


def test_infonce_equals_sentence_transformers_and_the_formula_and_needs_two_columns(tiny_bert):
    model = prompted_model(tiny_bert).eval()
    loss = PromptContrastiveLoss(model).eval()
    columns = [SENTENCES, SENTENCES[::-1], NEGATIVES]
    with torch.no_grad():
        ours = loss([features(model, c) for c in columns], None)
        reference = MultipleNegativesRankingLoss(model, scale=20.0)([features(model, c) for c in columns], None)
        a, p, n = (torch.nn.functional.normalize(model.encode(c, convert_to_tensor=True), dim=-1) for c in columns)
    assert set(ours) == {"contrastive"}
    assert torch.allclose(ours["contrastive"], reference, atol=1e-6)
    # SimCSE supervised InfoNCE with tau = 0.05: -log exp(s(a_i,p_i)/t) / sum_j [exp(s(a_i,p_j)/t) + exp(s(a_i,n_j)/t)]
    logits = torch.cat([a @ p.T, a @ n.T], dim=1) / 0.05
    by_hand = -(logits.diag() - torch.logsumexp(logits, dim=1)).mean()
    assert torch.allclose(ours["contrastive"], by_hand, atol=1e-4)
    with pytest.raises(ConfigurationError, match="anchor, positive"):
        loss([features(model, SENTENCES)], None)


def no_dropout(model):
    """Training mode (so training-only parts run) with every dropout off (so passes are deterministic)."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def test_mlm_weight_schedule_matches_formula(tiny_backbones):
    for step in (0, 1, 50, 100, 250, 1000):
        assert mlm_weight(step) == pytest.approx(0.1 * 0.95 ** (step / 100))
    assert mlm_weight(100) == pytest.approx(0.095)
    model = prompted_model(tiny_backbones("bert", head=True))
    loss = PromptContrastiveLoss(model, mlm_weight=0.1)
    model.train()
    batch = [features(model, SENTENCES), features(model, SENTENCES)]
    first = loss(batch, None)
    assert set(first) == {"contrastive", "mlm"}
    for _ in range(2):
        loss([features(model, SENTENCES), features(model, SENTENCES)], None)
    assert loss.step == 3 and loss.current_mlm_weight() == pytest.approx(0.1 * 0.95 ** (3 / 100))
    # the trainer's step wins once the callback reports it
    LossStepCallback(loss).on_step_begin(None, type("S", (), {"global_step": 400})(), None)
    assert loss.current_mlm_weight() == pytest.approx(0.1 * 0.95**4)


def test_mlm_masks_every_column_and_equals_a_direct_cross_entropy(tiny_backbones):
    """As in the official code, every column is masked; the logged part is the weighted MLM cross-entropy."""
    model = no_dropout(prompted_model(tiny_backbones("bert", head=True)))
    loss = PromptContrastiveLoss(model, mlm_weight=0.1)
    loss.global_step = 400
    many, other = SENTENCES * 8, NEGATIVES * 8
    loss.masker.collator.generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        weighted = loss([features(model, many), features(model, other)], None)["mlm"]
    loss.masker.collator.generator = torch.Generator().manual_seed(3)
    hidden, labels = [], []
    for texts in (many, other):
        inputs = features(model, texts)
        masked, column_labels = loss.masker(inputs["input_ids"], inputs["attention_mask"])
        assert (column_labels != -100).sum() > 5
        with torch.no_grad():
            out = model[0]({**inputs, "input_ids": masked})["token_embeddings"]
        hidden.append(out[column_labels != -100])
        labels.append(column_labels[column_labels != -100])
    with torch.no_grad():
        direct = torch.nn.functional.cross_entropy(loss.mlm_head(torch.cat(hidden)), torch.cat(labels))
        first_only = torch.nn.functional.cross_entropy(loss.mlm_head(hidden[0]), labels[0])
    assert weighted.item() == pytest.approx(0.1 * 0.95**4 * direct.item(), rel=1e-5)
    assert weighted.item() != pytest.approx(0.1 * 0.95**4 * first_only.item(), rel=1e-3)


def test_training_only_parts_follow_the_models_mode(tiny_backbones):
    """The trainer switches the model's mode, never the loss's: MLP, MLM and the step counter key on the model."""
    model = prompted_model(tiny_backbones("bert", head=True))
    loss = PromptContrastiveLoss(model, mlp=True, mlm_weight=0.1)
    assert isinstance(loss.mlp[0], torch.nn.Linear) and isinstance(loss.mlp[1], torch.nn.Tanh)
    assert not any(p is loss.mlp[0].weight for p in model.parameters())  # never part of the saved model
    loss.train()  # the loss's own flag must not matter
    model.eval()
    with torch.no_grad():
        evaluation = loss([features(model, SENTENCES), features(model, SENTENCES)], None)
        plain = PromptContrastiveLoss(model).eval()([features(model, SENTENCES), features(model, SENTENCES)], None)
    assert set(evaluation) == {"contrastive"} and loss.step == 0
    assert torch.allclose(evaluation["contrastive"], plain["contrastive"])
    loss.eval()
    model.train()
    out = loss([features(model, SENTENCES), features(model, SENTENCES)], None)
    assert set(out) == {"contrastive", "mlm"} and loss.step == 1
    out["contrastive"].backward()
    assert loss.mlp[0].weight.grad is not None and loss.mlp[0].weight.grad.abs().sum() > 0


def test_mlm_weight_does_not_move_during_trainer_evaluation(tiny_backbones, tmp_path):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    model = prompted_model(tiny_backbones("bert", head=True))
    loss = PromptContrastiveLoss(model, mlm_weight=0.1)
    data = Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES})
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                                per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=1,
                                                save_strategy="no", report_to="none", use_cpu=True,
                                                disable_tqdm=True)
    seen = []

    class Record(LossStepCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            seen.append((state.global_step, loss.step, loss.current_mlm_weight()))

    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, loss=loss,
                                         callbacks=[Record(loss)])
    trainer.train()
    # two training steps, two evaluations: the loss counted its two training passes and none of the evaluation ones
    assert [s[0] for s in seen] == [1, 2]
    assert loss.global_step == 1  # the callback's last report (on_step_begin of step 2 is global_step 1)
    assert loss.training_calls == 0  # with the callback, no self-counting at all
    assert [s[2] for s in seen] == [pytest.approx(mlm_weight(s[1])) for s in seen]
    assert any("eval_mlm" in h for h in trainer.state.log_history) is False


def test_mlm_masking_proportions(tiny_bert):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    masker = TokenMasker(tokenizer, seed=0)
    ids = torch.randint(5, len(tokenizer), (400, 50))
    ids[:, 0], ids[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    attention = torch.ones_like(ids)
    attention[:, 40:] = 0
    ids[:, 40:] = tokenizer.pad_token_id
    masked, labels = masker(ids.clone(), attention)
    selected = labels != -100
    real = (attention == 1) & (ids != tokenizer.cls_token_id) & (ids != tokenizer.sep_token_id)
    assert not selected[~real].any()  # special tokens and padding are never masked
    assert selected.sum() / real.sum() == pytest.approx(0.15, abs=0.01)
    to_mask = (masked == tokenizer.mask_token_id) & selected
    unchanged = (masked == ids) & selected
    assert to_mask.sum() / selected.sum() == pytest.approx(0.8, abs=0.03)
    assert unchanged.sum() / selected.sum() == pytest.approx(0.1 + 0.1 / len(tokenizer), abs=0.03)
    assert torch.equal(labels[selected], ids[selected])


def test_mlm_head_from_checkpoint_trains_and_leaves_the_encoder_alone(tiny_backbones, tiny_bert, caplog):
    from transformers import AutoModelForMaskedLM

    with_head = tiny_backbones("bert", head=True)
    reference = AutoModelForMaskedLM.from_pretrained(with_head)
    for freeze in (True, False):
        encoder = PromptedTransformer(with_head, prefix_length=2, freeze_backbone=freeze)
        flags = {name: p.requires_grad for name, p in encoder.named_parameters()}
        head = MLMHead(encoder)
        assert {name: p.requires_grad for name, p in encoder.named_parameters()} == flags  # nothing changed
        assert head.from_checkpoint
        assert all(p.requires_grad for p in head.parameters())  # trained with the prompts, as in the official code
        # only the head was built: its weights are the checkpoint's, the decoder a copy of the word embeddings
        assert sum(p.numel() for p in head.parameters()) == sum(p.numel() for p in reference.cls.parameters())
        embeddings = encoder.auto_model.get_input_embeddings().weight
        assert head.head["cls"].predictions.decoder.weight is not embeddings
        assert torch.equal(head.head["cls"].predictions.decoder.weight, embeddings)
        x = torch.randn(5, reference.config.hidden_size)
        with torch.no_grad():
            assert torch.allclose(head(x), reference.cls(x), atol=1e-6)

    roberta = tiny_backbones("roberta", head=True)
    head = MLMHead(PromptedTransformer(roberta, prefix_length=2))
    reference = AutoModelForMaskedLM.from_pretrained(roberta)
    x = torch.randn(5, reference.config.hidden_size)
    with torch.no_grad():
        assert head.from_checkpoint and torch.allclose(head(x), reference.lm_head(x), atol=1e-6)

    encoder = PromptedTransformer(tiny_bert, prefix_length=2)  # saved as a plain BertModel: no MLM head
    with caplog.at_level(logging.WARNING):
        head = MLMHead(encoder)
    assert not head.from_checkpoint
    assert "has no masked-LM head weights" in caplog.text
    assert all(p.requires_grad for p in head.parameters())
    assert torch.equal(head.head["cls"].predictions.decoder.weight, encoder.auto_model.get_input_embeddings().weight)


def test_mlm_pass_reuses_the_prefix_draw_of_the_contrastive_pass(tiny_backbones):
    """Official DCPCSE: the masked copy runs with the same ``past_key_values`` (same prefix dropout draw)."""
    model = prompted_model(tiny_backbones("bert", head=True)).train()
    encoder = model[0]
    drawn = []
    original = encoder.prefix_encoder.values
    encoder.prefix_encoder.values = lambda batch_size: drawn.append(original(batch_size)) or drawn[-1]
    loss = PromptContrastiveLoss(model, mlm_weight=0.1)
    used = []
    hook = encoder.register_forward_hook(lambda module, args, out: used.append(out["prefix_values"]))
    loss([features(model, SENTENCES), features(model, NEGATIVES)], None)
    hook.remove()
    assert len(drawn) == 2 and len(used) == 4  # one draw per column, used by its contrastive and its MLM pass
    assert used[2] is drawn[0] and used[3] is drawn[1]
    assert not torch.equal(drawn[0].keep, drawn[1].keep)  # dropout is really on: the two columns' draws differ


def test_given_prefix_values_reproduce_a_pass(tiny_bert):
    model = no_dropout(prompted_model(tiny_bert))
    encoder = model[0]
    encoder.prefix_encoder.dropout.p = 0.5  # only the prefix is random
    first = encoder(features(model, SENTENCES))
    again = encoder({**features(model, SENTENCES), "prefix_values": first["prefix_values"]})
    fresh = encoder(features(model, SENTENCES))
    assert torch.equal(first["token_embeddings"], again["token_embeddings"])
    assert not torch.equal(first["token_embeddings"], fresh["token_embeddings"])
