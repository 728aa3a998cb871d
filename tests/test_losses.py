"""PromptContrastiveLoss: InfoNCE against sentence-transformers and a hand-written formula, MLM schedule and masking."""

from __future__ import annotations

import logging

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Pooling

from st_prompts import PromptedTransformer
from st_prompts.losses import MLMHead, PromptContrastiveLoss, TokenMasker, mlm_weight
from st_prompts.training import LossStepCallback

SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music"]
NEGATIVES = ["the woman sits", "a red car", "big green tree", "sad water"]


def prompted_model(path, **kw):
    encoder = PromptedTransformer(path, prefix_length=3)
    return SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode="cls")])


def features(model, texts):
    return dict(model.preprocess(texts))


def test_infonce_equals_sentence_transformers_and_the_formula(tiny_bert):
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


def test_training_only_mlp(tiny_bert):
    model = prompted_model(tiny_bert)
    loss = PromptContrastiveLoss(model, mlp=True)
    assert isinstance(loss.mlp[0], torch.nn.Linear) and isinstance(loss.mlp[1], torch.nn.Tanh)
    model.eval(), loss.eval()
    with torch.no_grad():
        evaluation = loss([features(model, SENTENCES), features(model, SENTENCES)], None)["contrastive"]
        plain = PromptContrastiveLoss(model, mlp=False).eval()([features(model, SENTENCES), features(model, SENTENCES)], None)
    assert torch.allclose(evaluation, plain["contrastive"])  # MLP unused outside training
    loss.train()
    out = loss([features(model, SENTENCES), features(model, SENTENCES)], None)
    out["contrastive"].backward()
    assert loss.mlp[0].weight.grad is not None and loss.mlp[0].weight.grad.abs().sum() > 0
    # never part of the saved model
    assert not any(p is loss.mlp[0].weight for p in model.parameters())


def test_mlm_weight_schedule_matches_formula(tiny_backbones):
    for step in (0, 1, 50, 100, 250, 1000):
        assert mlm_weight(step) == pytest.approx(0.1 * 0.95 ** (step / 100))
    assert mlm_weight(100) == pytest.approx(0.095)
    model = prompted_model(tiny_backbones("bert", head=True))
    loss = PromptContrastiveLoss(model, mlm_weight=0.1)
    loss.train(), model.train()
    batch = [features(model, SENTENCES), features(model, SENTENCES)]
    first = loss(batch, None)
    assert set(first) == {"contrastive", "mlm"}
    for _ in range(2):
        loss([features(model, SENTENCES), features(model, SENTENCES)], None)
    assert loss.step == 3 and loss.current_mlm_weight() == pytest.approx(0.1 * 0.95 ** (3 / 100))
    # the trainer's step wins once the callback reports it
    LossStepCallback(loss).on_step_begin(None, type("S", (), {"global_step": 400})(), None)
    assert loss.current_mlm_weight() == pytest.approx(0.1 * 0.95**4)
    # the logged part is the weighted MLM loss: undo the weight and compare with a direct cross-entropy
    model.eval()  # the loss stays in training mode (MLM on), the encoder's dropout is off: deterministic
    many = SENTENCES * 8
    loss.masker.collator.generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        weighted = loss([features(model, many), features(model, many)], None)["mlm"]
    loss.masker.collator.generator = torch.Generator().manual_seed(3)
    inputs = features(model, many)
    masked, labels = loss.masker(inputs["input_ids"], inputs["attention_mask"])
    assert (labels != -100).sum() > 5
    with torch.no_grad():
        hidden = model[0]({**inputs, "input_ids": masked})["token_embeddings"]
        direct = torch.nn.functional.cross_entropy(loss.mlm_head(hidden[labels != -100]), labels[labels != -100])
    assert weighted.item() == pytest.approx(0.1 * 0.95**4 * direct.item(), rel=1e-5)


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


def test_mlm_head_from_checkpoint_or_logged_fallback(tiny_backbones, tiny_bert, caplog):
    from transformers import AutoModelForMaskedLM

    with_head = tiny_backbones("bert", head=True)
    encoder = PromptedTransformer(with_head, prefix_length=2)
    head = MLMHead(encoder)
    assert head.from_checkpoint
    reference = AutoModelForMaskedLM.from_pretrained(with_head)
    dense = reference.cls.predictions.transform.dense.weight
    assert torch.equal(head.head[0].predictions.transform.dense.weight, dense)
    assert not any(p.requires_grad for p in head.parameters())
    # the vocabulary projection is the encoder's own embedding matrix, not a copy
    assert reference.get_output_embeddings() is not None
    assert head.head[0].predictions.decoder.weight is encoder.auto_model.get_input_embeddings().weight

    encoder = PromptedTransformer(tiny_bert, prefix_length=2)  # saved as a plain BertModel: no MLM head
    with caplog.at_level(logging.WARNING):
        head = MLMHead(encoder)
    assert not head.from_checkpoint
    assert "has no masked-LM head weights" in caplog.text
    trainable = [n for n, p in head.named_parameters() if p.requires_grad]
    assert trainable and all("decoder.weight" not in n for n in trainable)


def test_loss_needs_two_columns(tiny_bert):
    from st_prompts.errors import ConfigurationError

    model = prompted_model(tiny_bert)
    with pytest.raises(ConfigurationError, match="anchor, positive"):
        PromptContrastiveLoss(model)([features(model, SENTENCES)], None)
