"""D2CSE: replaced-token corruption (masking, generators, cache), the CRTD loss, the method, its CLI (issue 8)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from transformers import BertForMaskedLM, BertTokenizerFast

from conftest import FIXTURES, SPECIAL, WORDS, cli_error, tiny_config
from st_prompts import methods, save_prompts_only
from st_prompts.cli import main
from st_prompts.errors import ConfigurationError, CorruptionCacheError, VocabularyMismatchError
from st_prompts.losses import CRTDLoss
from st_prompts.losses.crtd import BatchNormMLPPooler
from st_prompts.losses.crtd.corruption import (CorruptionCache, ReplacedTokenMasking, crtd_labels, prepare_corruptions,
                                               token_rows)
from st_prompts.losses.crtd.generators import BackboneMLMGenerator, HubMaskedLMGenerator, MaskedLMGenerator

SENTENCES = (FIXTURES / "d2cse" / "train" / "wiki_sentences.txt").read_text().split("\n")[:-1]


class ConstantGenerator(MaskedLMGenerator):
    """A stub generator: predicts one fixed token everywhere (so a selected token equal to it stays original)."""

    def __init__(self, tokenizer, token: str = "the") -> None:
        self.tokenizer = tokenizer
        self.token_id = tokenizer.convert_tokens_to_ids(token)
        self.name = f"constant-{token}"

    def identity_for(self, rows):
        return {"kind": "constant", "token": self.token_id}

    def predict(self, masked_ids, attention_mask, selected):
        return torch.full((int(selected.sum()),), self.token_id, dtype=torch.long)


def build(backbone, **overrides):
    # the official (ungated) prefix: these tests follow its gradients (a zero gate passes none to the prefix at first)
    values = dict(prefix_length=3, cls_prompt=True, prefix_gate=False)
    values.update(overrides)
    return methods.build("d2cse", backbone=backbone, scale="cpu", **values)


def prepared_loss(model, tmp_path, generator=None, **kwargs):
    generator = generator if generator is not None else ConstantGenerator(model[0].tokenizer)
    loss = CRTDLoss(model, generator=generator, cache_dir=str(tmp_path / "cache"), **kwargs)
    loss.prepare(SENTENCES + ["", "[CLS] [SEP]"], show_progress=False)
    return loss


# ---------------------------------------------------------------------------------------------- corruption


def test_masking_selects_about_the_ratio_never_special_tokens_and_is_deterministic(tiny_bert):
    model = build(tiny_bert)
    tokenizer = model[0].tokenizer
    masking = ReplacedTokenMasking(tokenizer, masking_ratio=0.3, seed=1)
    rows = token_rows(model.preprocess, SENTENCES * 20)
    special = set(tokenizer.all_special_ids)
    eligible = selected = changed = 0
    for salt, row in enumerate(rows):
        masked, chosen = masking(row, salt=salt)
        row = np.asarray(row)
        assert not any(chosen[i] for i, t in enumerate(row) if t in special)  # [CLS]/[SEP] never selected
        assert (masked[~chosen] == row[~chosen]).all()  # only selected positions change
        eligible += int(masking.eligible(row).sum())
        selected += int(chosen.sum())
        changed += int((masked != row).sum())
    assert 0.25 < selected / eligible < 0.35
    assert 0.8 < changed / selected < 0.95  # 80% [MASK] + most of the 10% random tokens
    again = ReplacedTokenMasking(tokenizer, masking_ratio=0.3, seed=1)
    for a, b in zip(masking(rows[0]), again(rows[0])):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigurationError, match="masking_ratio"):
        ReplacedTokenMasking(tokenizer, masking_ratio=1.0)


def test_crtd_labels_are_exactly_the_positions_whose_token_differs(tiny_bert, tmp_path, monkeypatch):
    model = build(tiny_bert)
    tokenizer = model[0].tokenizer
    loss = prepared_loss(model, tmp_path)  # the generator predicts "the" at every selected position
    the = tokenizer.convert_tokens_to_ids("the")
    masking = ReplacedTokenMasking(tokenizer, 0.3, seed=loss.seed)
    features = model.preprocess(SENTENCES)
    original, attention = features["input_ids"], features["attention_mask"]
    corrupted = loss.corruptions.corrupt(original, attention)
    labels, detect = crtd_labels(original, corrupted, attention, loss.special_ids)
    kept_the = 0
    for i, (row, new) in enumerate(zip(original, corrupted)):
        n = int(attention[i].sum())
        selected = torch.from_numpy(masking(row[:n].tolist())[1])
        assert torch.equal(new[n:], row[n:]) and not detect[i, n:].any()  # padding: untouched, never detected
        assert torch.equal(new[:n][~selected], row[:n][~selected]) and (new[:n][selected] == the).all()
        kept_the += int((row[:n][selected] == the).sum())
        assert torch.equal(labels[i], (new != row).to(labels.dtype))
        assert not detect[i, 0] and not detect[i, n - 1]  # [CLS] and [SEP]
    assert kept_the > 0  # a "replacement" by the same token happened and counts as original
    assert labels.sum() > 0

    # The loss trains on exactly these labels, over exactly the detectable positions.
    seen = {}
    cross_entropy = torch.nn.functional.cross_entropy
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", lambda logits, targets, *args, **kwargs: seen.update(
        targets=targets.clone()) or cross_entropy(logits, targets, *args, **kwargs))
    model.train()
    batch = [model.preprocess(SENTENCES), model.preprocess(SENTENCES)]
    loss(batch, None)
    expected = labels[detect]
    torch.testing.assert_close(seen["targets"], torch.cat([expected, expected]))


def test_corrupted_pass_gets_the_sentence_vector_in_its_cls_input_row(tiny_bert, tmp_path):
    model = build(tiny_bert)
    encoder = model[0]
    loss = prepared_loss(model, tmp_path)
    inputs_embeds, pooled = [], []
    embeddings = encoder.auto_model.embeddings
    hook = embeddings.register_forward_pre_hook(
        lambda module, args, kwargs: inputs_embeds.append(kwargs["inputs_embeds"].detach().clone()), with_kwargs=True)
    pool_hook = loss.pooler.register_forward_hook(lambda module, args, out: pooled.append(out.detach().clone()))
    model.train()
    batch = [model.preprocess(SENTENCES[:6]), model.preprocess(SENTENCES[6:12])]
    try:
        loss(batch, None)
    finally:
        hook.remove()
        pool_hook.remove()
    assert len(inputs_embeds) == 4  # two original passes, then two corrupted passes
    h = pooled[0].split([6, 6])
    word_embeddings = encoder.auto_model.get_input_embeddings().weight.detach()
    cls_prompt = encoder.shallow_prompt.embeddings.detach()[encoder.cls_prompt_slot]
    for column in range(2):
        original_row0 = inputs_embeds[column][:, 0]
        torch.testing.assert_close(original_row0, cls_prompt.expand_as(original_row0))  # the [CLS] prompt
        corrupted = inputs_embeds[2 + column]
        torch.testing.assert_close(corrupted[:, 0], h[column])  # replaced by h, the pooled sentence vector
        ids = loss.corruptions.corrupt(batch[column]["input_ids"], batch[column]["attention_mask"])
        torch.testing.assert_close(corrupted[:, 1:], word_embeddings[ids[:, 1:]])
        assert not torch.equal(ids, batch[column]["input_ids"])


def test_crtd_gradient_reaches_prompts_cls_prompt_and_original_pass_never_the_backbone(tiny_bert, tmp_path):
    torch.manual_seed(0)
    model = build(tiny_bert)
    encoder = model[0]
    loss = prepared_loss(model, tmp_path)
    model.train()
    batch = [model.preprocess(SENTENCES[:8]), model.preprocess(SENTENCES[:8])]

    original_outputs = []

    def keep(module, args, out):
        if len(original_outputs) < 2:  # the two original passes (the corrupted passes skip pooling)
            out["sentence_embedding"].retain_grad()
            original_outputs.append(out["sentence_embedding"])

    hook = model[1].register_forward_hook(keep)
    try:
        parts = loss(batch, None)
    finally:
        hook.remove()
    parts["crtd"].backward()
    prefix = encoder.prefix_encoder.embedding.weight.grad
    cls_prompt = encoder.shallow_prompt.embeddings.grad
    assert prefix is not None and prefix.abs().sum() > 0
    assert cls_prompt is not None and cls_prompt.abs().sum() > 0
    assert all(o.grad is not None and o.grad.abs().sum() > 0 for o in original_outputs)  # through h
    assert loss.crtd_head.weight.grad.abs().sum() > 0 and loss.pooler.net[0].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in encoder.auto_model.parameters())

    # With h detached, the [CLS] prompt (used only by the original pass) gets no CRTD gradient: it flowed through h.
    model.zero_grad(set_to_none=True)
    crtd_loss = loss.crtd_loss
    loss.crtd_loss = lambda columns, conditions: crtd_loss(columns, [h.detach() for h in conditions])
    loss(batch, None)["crtd"].backward()
    grad = encoder.shallow_prompt.embeddings.grad
    assert grad is None or grad.abs().sum() == 0
    assert encoder.prefix_encoder.embedding.weight.grad.abs().sum() > 0  # the corrupted pass still uses the prefix


@pytest.mark.parametrize("weight", [0.005, 0.5])
def test_crtd_part_is_lambda_times_the_detection_cross_entropy(tiny_backbones, tmp_path, weight):
    """λ times a cross-entropy by hand over every detected position (no dropout, so every pass repeats)."""
    from st_prompts.losses.crtd.corruption import crtd_labels
    from st_prompts.modules import CLS_OVERRIDE

    backbone = tiny_backbones("bert", dropout=0.0)
    torch.manual_seed(0)
    model = build(backbone)
    loss = prepared_loss(model, tmp_path, crtd_weight=weight)
    model.train()
    batch = [model.preprocess(SENTENCES[:6]), model.preprocess(SENTENCES[2:8])]
    parts = loss([dict(f) for f in batch], None)
    with torch.no_grad():
        embeddings = [model(dict(f))["sentence_embedding"] for f in batch]
        pooled = loss.pooler(torch.cat(embeddings)).split([e.shape[0] for e in embeddings])
        log_likelihoods = []
        for features, h in zip(batch, pooled):
            original, attention = features["input_ids"], features["attention_mask"]
            corrupted = loss.corruptions.corrupt(original, attention)
            targets, detect = crtd_labels(original, corrupted, attention, loss.special_ids)
            hidden = model[0]({**features, "input_ids": corrupted, CLS_OVERRIDE: h})["token_embeddings"]
            logits = hidden[detect] @ loss.crtd_head.weight.T + loss.crtd_head.bias
            chosen = logits.gather(1, targets[detect].unsqueeze(1)).squeeze(1)
            log_likelihoods.append(chosen - torch.logsumexp(logits, dim=1))
        cross_entropy = -torch.cat(log_likelihoods).mean()
    assert parts["crtd"].item() == pytest.approx(weight * cross_entropy.item(), rel=1e-5)
    assert set(parts) == {"contrastive", "crtd"}


def test_the_crtd_loss_on_empty_unknown_or_unprepared_sentences_and_out_of_training(tiny_bert, tmp_path):
    model = build(tiny_bert)
    loss = prepared_loss(model, tmp_path)
    model.train()
    mixed = ["", SENTENCES[0], "[CLS] [SEP]", SENTENCES[2]]
    parts = loss([model.preprocess(mixed), model.preprocess(mixed)], None)
    assert all(torch.isfinite(v) for v in parts.values()) and parts["crtd"] > 0
    sum(parts.values()).backward()
    empty = ["", "[CLS] [SEP]"]
    parts = loss([model.preprocess(empty), model.preprocess(empty)], None)
    assert all(torch.isfinite(v) for v in parts.values())
    assert parts["crtd"] == 0  # nothing to detect: masked out of the mean, not NaN
    sum(parts.values()).backward()
    # unprepared or unknown sentences are refused (lambda = 0 needs no corruption)
    batch = [model.preprocess(SENTENCES[:2]), model.preprocess(SENTENCES[:2])]
    with pytest.raises(CorruptionCacheError, match="prepare"):
        CRTDLoss(model)(batch, None)
    other = ["green water and red music", "green water and red music"]
    with pytest.raises(CorruptionCacheError, match="no corrupted copy"):
        loss([model.preprocess(other), model.preprocess(other)], None)
    assert set(CRTDLoss(model, crtd_weight=0.0)(batch, None)) == {"contrastive"}
    # the training-only parts follow the model's mode
    model.eval()
    batch = [model.preprocess(SENTENCES[:4]), model.preprocess(SENTENCES[:4])]
    assert set(loss(batch, None)) == {"contrastive"}
    model.train()
    assert set(loss(batch, None)) == {"contrastive", "crtd"}
    assert not any(isinstance(m, torch.nn.BatchNorm1d) and m.track_running_stats for m in loss.modules())


def test_pooler_is_diffcse_projection_mlp():
    pooler = BatchNormMLPPooler(8)
    shapes = [tuple(p.shape) for p in pooler.parameters()]
    assert shapes == [(16, 8), (16,), (16,), (8, 16)]  # no biases; last BatchNorm without affine parameters
    out = pooler(torch.randn(5, 8))
    torch.testing.assert_close(out.mean(0), torch.zeros(8), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- generators


def _tiny_mlm(path, words) -> str:
    os.makedirs(path, exist_ok=True)
    BertTokenizerFast(vocab={t: i for i, t in enumerate(SPECIAL + list(words))}).save_pretrained(path)
    torch.manual_seed(0)
    BertForMaskedLM(tiny_config("bert", len(SPECIAL) + len(words))).save_pretrained(path)
    return str(path)


def test_generator_with_another_vocabulary_is_refused_here_and_by_the_train_command(tiny_bert, data_dir, tmp_path,
                                                                                   capsys):
    model = build(tiny_bert)
    other = _tiny_mlm(tmp_path / "other", list(reversed(WORDS)))
    with pytest.raises(VocabularyMismatchError, match="does not share the encoder's vocabulary"):
        HubMaskedLMGenerator(other, encoder_tokenizer=model[0].tokenizer)
    loss = CRTDLoss(model, generator=other, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(VocabularyMismatchError, match="backbone-mlm"):
        loss.prepare(SENTENCES)
    with pytest.raises(ConfigurationError, match="no trained masked-LM head"):
        HubMaskedLMGenerator(tiny_bert, encoder_tokenizer=model[0].tokenizer)  # a backbone without MLM head
    argv = ["train", "d2cse", "--backbone", tiny_bert, "--data-dir", str(data_dir), "--max-steps", "1",
            "--batch-size", "4", "--prefix-length", "3", "--generator", other, "--output", str(tmp_path / "m"),
            "--corruption-cache", str(tmp_path / "c"), "--no-progress"]
    assert "does not share the encoder's vocabulary" in cli_error(argv, capsys)


def test_hub_generator_sharing_the_vocabulary_corrupts(tiny_bert, tiny_backbones, tmp_path):
    model = build(tiny_bert)
    generator = tiny_backbones("bert", head=True)  # a masked LM with the test tokenizer
    cache, report = prepare_corruptions(model, SENTENCES, generator=generator, cache_dir=tmp_path, show_progress=False)
    assert report["generator_kind"] == "masked-lm" and report["replaced_tokens"] > 0
    assert report["masked_token_accuracy"] == pytest.approx(1 - report["replaced_tokens"] / report["selected_tokens"])
    special = set(model[0].tokenizer.all_special_ids)
    for original, corrupted in cache.items():
        assert not (set(corrupted[original != corrupted].tolist()) & special)  # never a special token


def test_backbone_fallback_generator_trains_its_head_and_reports_heldout_accuracy(tiny_backbones, tmp_path):
    backbone = tiny_backbones("bert", head=True)
    model = build(backbone)
    encoder = model[0]
    generator = BackboneMLMGenerator(encoder, steps=30, batch_size=8, learning_rate=1e-2, seed=3)
    assert generator.head.from_checkpoint
    trainable = [n for n, p in generator.head.named_parameters() if p.requires_grad]
    assert trainable and not any("decoder" in n for n in trainable)  # projection tied to the frozen embeddings
    before = {n: p.detach().clone() for n, p in generator.head.named_parameters()}
    backbone_before = {n: p.detach().clone() for n, p in encoder.auto_model.named_parameters()}
    cache, report = prepare_corruptions(model, SENTENCES * 2 + [s + " ." for s in SENTENCES], generator=generator,
                                        cache_dir=tmp_path, show_progress=False)
    assert report["heldout_sentences"] == 4 and 0.0 <= report["heldout_masked_token_accuracy"] <= 1.0
    assert 0.0 < report["replaced_share"] < 0.3 + 1e-9
    changed = [n for n, p in generator.head.named_parameters() if not torch.equal(p, before[n])]
    assert set(changed) == set(trainable)
    # It predicts only tokens of its training sentences (the corpus vocabulary), never a special token.
    training_rows, _ = generator.split(list(dict.fromkeys(token_rows(model.preprocess, SENTENCES * 2 + [
        s + " ." for s in SENTENCES]))))
    vocabulary = {t for row in training_rows for t in row} - set(encoder.tokenizer.all_special_ids)
    assert report["head_vocabulary"] == len(vocabulary)
    for original, corrupted in cache.items():
        assert set(corrupted[original != corrupted].tolist()) <= vocabulary
    assert all(torch.equal(p, backbone_before[n]) for n, p in encoder.auto_model.named_parameters())


def test_cache_of_another_generator_or_ratio_is_not_reused(tiny_bert, tiny_backbones, tmp_path, monkeypatch):
    model = build(tiny_bert)
    options = {"steps": 3, "batch_size": 4}
    first, report = prepare_corruptions(model, SENTENCES, cache_dir=tmp_path, generator_options=options,
                                        show_progress=False)
    assert report["reused_sentences"] == 0
    # The same generator and ratio again: everything comes from the cache, the generator is not even trained.
    monkeypatch.setattr(BackboneMLMGenerator, "prepare", lambda *a, **k: pytest.fail("retrained the generator"))
    again, report = prepare_corruptions(model, SENTENCES, cache_dir=tmp_path, generator_options=options,
                                        show_progress=False)
    assert report["reused_sentences"] == len(SENTENCES)
    monkeypatch.undo()
    # Another masking ratio, another generator, another generator recipe: other files, nothing reused.
    variants = [dict(masking_ratio=0.15, generator_options=options),
                dict(generator=tiny_backbones("bert", head=True)),
                dict(generator_options={"steps": 4, "batch_size": 4})]
    paths = {report["cache"]}
    for variant in variants:
        cache, report = prepare_corruptions(model, SENTENCES, cache_dir=tmp_path, show_progress=False, **variant)
        assert report["reused_sentences"] == 0 and report["cache"] not in paths
        assert cache.identity != first.identity
        paths.add(report["cache"])
    assert len(list(tmp_path.glob("corruptions-*.npz"))) == 4
    # A cache file named explicitly but made with another ratio is refused, not mixed in.
    with pytest.raises(CorruptionCacheError, match="masking_ratio"):
        prepare_corruptions(model, SENTENCES, masking_ratio=0.15, generator_options=options, show_progress=False,
                            cache_file=str(CorruptionCache.path_for(tmp_path, first.identity)))


def test_cache_grows_without_changing_what_it_holds(tiny_bert, tmp_path):
    model = build(tiny_bert)
    generator = ConstantGenerator(model[0].tokenizer)
    small, _ = prepare_corruptions(model, SENTENCES[:5], generator=generator, cache_dir=tmp_path, show_progress=False)
    large, report = prepare_corruptions(model, SENTENCES, generator=generator, cache_dir=tmp_path, show_progress=False)
    assert report["reused_sentences"] == 5 and len(large) == len(SENTENCES)
    fresh, _ = prepare_corruptions(model, SENTENCES, generator=generator, cache_dir=tmp_path / "fresh",
                                   show_progress=False)
    for original, corrupted in fresh.items():
        np.testing.assert_array_equal(large.get(original), corrupted)  # a sentence's corruption is a pure function


# ---------------------------------------------------------------------------------------------- method, save, CLI


def _train_tiny(backbone, tmp_path, supervised=False, **overrides):
    from st_prompts.data.training_data import load_training_dataset
    from st_prompts.training.run import train

    settings = methods.settings("d2cse", supervised=supervised, scale="cpu", backbone=backbone, prefix_length=3,
                                batch_size=4, max_steps=2, generator_steps=3, cls_prompt=True,
                                corruption_cache=str(tmp_path / "cache"), output_dir=str(tmp_path / "run"),
                                **overrides)
    dataset = load_training_dataset(supervised, FIXTURES / "d2cse")
    return train(settings, dataset, show_progress_bar=False)


def test_saved_folders_keep_the_cls_prompt_and_hold_no_crtd_head_or_pooler(tiny_bert, tmp_path):
    model, result = _train_tiny(tiny_bert, tmp_path, learning_rate=0.5)
    assert result.stage_reports["train"]["replaced_share"] > 0
    encoder = model[0]
    trained = encoder.shallow_prompt.embeddings.detach()[encoder.cls_prompt_slot].clone()
    cls_id = encoder.tokenizer.cls_token_id
    assert not torch.allclose(trained, encoder.auto_model.get_input_embeddings().weight[cls_id])  # it trained
    allowed = set(encoder.auto_model.state_dict())
    for kind, save in (("full", model.save), ("prompts", lambda p: save_prompts_only(model, p))):
        folder = tmp_path / kind
        save(str(folder))
        names, texts = [], []
        for path in folder.rglob("*"):
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as handle:
                    names.extend(handle.keys())
            elif path.suffix == ".json":  # configs (the model card README names the loss class, as it should)
                texts.append(path.read_text().lower())
        own = set(names) - allowed  # tensors that are not the backbone's own (BERT's backbone has a 'pooler')
        assert own == set(encoder.prompt_state_dict())  # the soft prompts, nothing else
        for forbidden in ("crtd", "pooler", "batchnorm", "running_mean", "running_var", "num_batches", "net."):
            assert not any(forbidden in n.lower() for n in own), forbidden
            assert not any(forbidden in t for t in texts if forbidden != "pooler"), forbidden
        loaded = SentenceTransformer(str(folder), trust_remote_code=True)
        assert [type(m).__name__ for m in loaded] == ["PromptedTransformer", "Pooling"]
        assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in loaded.modules()) and loaded[0].cls_prompt
        torch.testing.assert_close(loaded[0].shallow_prompt.embeddings[loaded[0].cls_prompt_slot], trained, rtol=0,
                                   atol=0)
        np.testing.assert_array_equal(loaded.encode(SENTENCES[:5] + [""]), model.encode(SENTENCES[:5] + [""]))


def test_presets_follow_table_7_and_the_generator_constant_matches():
    def row(supervised, backbone=None):
        s = methods.settings("d2cse", supervised=supervised, scale="paper", backbone=backbone)
        return (s.batch_size, s.learning_rate, s.masking_ratio, s.crtd_weight, s.epochs, s.prefix_length, s.cls_prompt)

    assert row(False) == (144, 0.021, 0.3, 0.005, 2.0, 16, False)
    assert row(False, "bert-large-uncased") == (144, 0.034, 0.3, 0.005, 2.0, 16, False)
    assert row(False, "roberta-base") == (128, 0.044, 0.3, 0.005, 2.0, 16, True)
    assert row(True) == (256, 0.055, 0.3, 0.005, 10.0, 12, True)
    assert row(True, "roberta-base") == (256, 0.024, 0.3, 0.005, 10.0, 12, True)
    assert methods.settings("d2cse", scale="paper").generator == "distilbert-base-uncased"
    assert methods.settings("d2cse", scale="paper", backbone="roberta-base").generator == "distilroberta-base"
    with pytest.raises(ConfigurationError, match="table 7"):
        methods.settings("d2cse", supervised=True, scale="paper", backbone="bert-large-uncased")
    cpu = methods.settings("d2cse", scale="cpu")
    dcpcse = methods.settings("dcpcse", scale="cpu")
    assert (cpu.backbone, cpu.generator, cpu.cls_prompt) == ("minilm", "backbone-mlm", False)
    assert (cpu.batch_size, cpu.epochs, cpu.prefix_length) == (
        dcpcse.batch_size, dcpcse.epochs, dcpcse.prefix_length)  # the same budget
    assert (cpu.learning_rate, dcpcse.learning_rate) == (1e-1, 1e-1)  # both selected on STS-B dev (seed 42)
    supervised = methods.settings("d2cse", supervised=True, scale="cpu")
    # 3e-1 won at seed 42 but collapsed at seed 43: chosen on the three-seed mean (docs/methods/d2cse.md)
    assert (supervised.learning_rate, supervised.cls_prompt) == (1e-1, True)
    with pytest.raises(ConfigurationError, match="masking_ratio"):
        methods.settings("d2cse", scale="cpu", masking_ratio=0.0)
    from st_prompts.losses.crtd.generators import BACKBONE_GENERATOR
    from st_prompts.methods.d2cse.config import BACKBONE_GENERATOR as light

    assert light == BACKBONE_GENERATOR


@pytest.fixture
def data_dir(tmp_path):
    shutil.copytree(FIXTURES / "d2cse" / "train", tmp_path / "data" / "train")
    shutil.copytree(FIXTURES / "senteval", tmp_path / "data" / "senteval")
    return tmp_path / "data"


@pytest.mark.parametrize("supervised", [False, True])
def test_train_command_end_to_end(tiny_bert, data_dir, tmp_path, capsys, supervised):
    out = tmp_path / "model"
    argv = ["train", "d2cse", "--backbone", tiny_bert, "--data-dir", str(data_dir), "--max-steps", "3",
            "--limit", "256", "--batch-size", "4", "--prefix-length", "3", "--eval-steps", "2", "--output", str(out),
            "--prompts-only", "--no-progress", "--generator-steps", "3", "--corruption-cache", str(tmp_path / "c")]
    assert main(argv + (["--supervised"] if supervised else [])) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.rindex("{\n"):])["steps"] == 3
    result = json.loads((out / "train_result.json").read_text())
    report = result["stage_reports"]["train"]
    assert report["generator_kind"] == "backbone-mlm" and report["sentences"] >= 20
    assert result["settings"]["cls_prompt"] is supervised  # table 7's BERT-base column
    full = SentenceTransformer(str(out), trust_remote_code=True)
    small = SentenceTransformer(str(out) + "-prompts", trust_remote_code=True)
    np.testing.assert_array_equal(full.encode(SENTENCES), small.encode(SENTENCES))
