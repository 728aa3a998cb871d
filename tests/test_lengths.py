"""Training length and encoding length are two settings: a model trains on 32-token batches, but the saved model and
every evaluation encode texts whole, up to what the backbone can take (SentEval's protocol)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, SENTENCES, st_model, write_stsb
from scipy.stats import spearmanr
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Transformer

from st_prompts import PromptedTransformer
from st_prompts.errors import ConfigurationError
from st_prompts.evaluation import AlignmentUniformityEvaluator, STSRetrievalEvaluator, STSSuiteEvaluator
from st_prompts.evaluation.sts import stsb_dev_evaluator
from st_prompts.loading import load_sentence_model
from st_prompts.modules.lengths import (FullLengthEvaluator, backbone_encode_length, encode_limit, full_length,
                                       full_length_evaluator, position_capacity)

#: About 150 WordPiece tokens of real English (the MiniLM tokenizer), so that its first 30 tokens are a different text.
LONG_TEXT = " ".join([
    "The committee met on Tuesday to discuss the budget for the coming year, and after a long debate it agreed to",
    "fund the new library, repair the bridge over the river, and hire two more teachers for the primary school.",
    "Several residents spoke against the plan, arguing that taxes were already too high and that the bridge could",
    "wait another year; others pointed out that the library had been closed for three winters because the heating",
    "had failed, and that children had nowhere quiet to study. In the end the vote was seven to four, and the mayor",
    "promised to publish the full accounts online before the next meeting so that everyone could see where the",
    "money would go and how the work would be scheduled across the spring and summer months.",
])


def test_a_trained_model_encodes_long_text_whole(data_dir, tmp_path, minilm_path):
    """One step of DCPCSE on the packaged MiniLM at the training length 32: the saved model encodes up to the shipped
    model's 256 tokens, and a 150-token text is not its first 30 tokens."""
    from st_prompts.training import train_and_save

    out = tmp_path / "dcpcse"
    model, result, _ = train_and_save("dcpcse", scale="cpu", data_dir=str(data_dir), output=str(out), max_steps=1,
                                      batch_size=4, eval_steps=1, show_progress_bar=False)
    assert result.settings["max_seq_length"] == 32  # it trained on 32-token batches
    assert result.encode_length == model.max_seq_length == 256
    shipped = json.loads((Path(minilm_path) / "sentence_bert_config.json").read_text())["max_seq_length"]
    saved = json.loads((out / "sentence_bert_config.json").read_text())
    assert saved["max_seq_length"] == shipped == 256
    card = (out / "README.md").read_text()
    assert "Maximum Sequence Length:** 256 tokens" in card and "**Encodes:** up to 256 tokens per text" in card

    loaded = load_sentence_model(str(out))
    assert loaded.max_seq_length == 256
    tokens = loaded.tokenizer(LONG_TEXT, add_special_tokens=False)["input_ids"]
    assert 140 <= len(tokens) <= 200
    head = loaded.tokenizer.decode(tokens[:30])
    whole, first = loaded.encode([LONG_TEXT, head], convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(whole, first, dim=0) < 0.99
    # what truncation at the training length gives instead: the first 30 tokens only
    loaded.max_seq_length = 32
    truncated = loaded.encode(LONG_TEXT, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(truncated, first, dim=0) > 0.97


def test_max_encode_length_is_a_setting(tiny_bert, data_dir, tmp_path):
    from st_prompts.training import train_and_save

    model, result, out = train_and_save("dcpcse", backbone=tiny_bert, data_dir=str(data_dir),
                                        output=str(tmp_path / "m"), max_steps=1, batch_size=4, eval_steps=1,
                                        max_encode_length=20, show_progress_bar=False)
    assert model.max_seq_length == result.encode_length == 20
    assert json.loads(Path(out, "sentence_bert_config.json").read_text())["max_seq_length"] == 20
    with pytest.raises(ConfigurationError, match="max_encode_length=500 exceeds"):
        train_and_save("dcpcse", backbone=tiny_bert, data_dir=str(data_dir), output=str(tmp_path / "n"), max_steps=1,
                       batch_size=4, eval_steps=1, max_encode_length=500, show_progress_bar=False)


def test_default_encode_length_is_the_backbone_limit_and_full_length_restores_the_training_length(tiny_bert,
                                                                                                   minilm_path):
    """The shipped sentence-transformers model's own length if any, else the position table less the prefix."""
    prompted = PromptedTransformer(tiny_bert, prefix_length=16, max_seq_length=8)
    assert prompted.max_seq_length == 8
    assert position_capacity(prompted) == 64 - 16
    assert backbone_encode_length(prompted, tiny_bert) == 48
    minilm = PromptedTransformer(minilm_path, prefix_length=16, max_seq_length=32)
    assert minilm.backbone_max_length == 256
    assert backbone_encode_length(minilm, minilm_path) == 256
    plain = Transformer(tiny_bert, max_seq_length=8)
    assert position_capacity(plain) == 64 and backbone_encode_length(plain, tiny_bert) == 64
    # full_length: the encode limit inside, the training length restored after (on errors too)
    model = st_model(PromptedTransformer(tiny_bert, prefix_length=4, max_seq_length=8), "cls")
    assert encode_limit(model) == 60
    with full_length(model) as length:
        assert length == model.max_seq_length == 60
    assert model.max_seq_length == 8
    with pytest.raises(RuntimeError), full_length(model):
        raise RuntimeError("boom")
    assert model.max_seq_length == 8


def test_the_sts_suite_encodes_a_long_pair_whole(tiny_bert, tmp_path):
    """Pairs that share their first 10 words and differ only after: truncated at a 6-token training length every
    pair's cosine is 1; the suite, as SentEval, reads the tails and its score follows them."""
    stem = "the man plays guitar and the dog runs in the park"
    tails = ["and this is happy music", "the cat sits on the mat", "a woman plays piano", "the big red car",
             "green tree and blue water", "the sad dog sits"]
    pairs = [(f"{stem} {tails[0]}", f"{stem} {tail}", float(5 - i)) for i, tail in enumerate(tails)]
    root = Path(shutil.copytree(FIXTURES / "senteval", tmp_path / "senteval"))
    write_stsb(root, [(score, a, b) for a, b, score in pairs])
    model = st_model(tiny_bert, max_seq_length=6)
    suite = STSSuiteEvaluator(str(root), tasks=["STSBenchmark"])
    result = suite(model)
    assert suite.max_length == 64 and model.max_seq_length == 6  # full length inside, the training length after
    a, b = (model.encode([p[i] for p in pairs]) for i in (0, 1))  # truncated at 6: the tails are cut
    np.testing.assert_allclose(np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1), 1, atol=1e-6)
    model.max_seq_length = 64
    a, b = (model.encode([p[i] for p in pairs]) for i in (0, 1))
    cosine = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cosine.min() < 0.999
    expected = spearmanr(cosine, [p[2] for p in pairs]).statistic
    assert result["sts_stsbenchmark_spearman"] == pytest.approx(expected)
    assert suite.get_config_dict()["max_length"] == 64


def test_every_evaluator_and_selection_encode_at_full_length(tiny_bert, tmp_path):
    """STS-B dev selection, recall@K and alignment/uniformity; any evaluator handed to training is wrapped once."""
    model = st_model(tiny_bert, max_seq_length=6)
    seen = []
    original = model.encode
    model.encode = lambda *args, **kwargs: seen.append(model.max_seq_length) or original(*args, **kwargs)
    senteval = str(FIXTURES / "senteval")
    dev = stsb_dev_evaluator(senteval)
    dev(model)
    STSRetrievalEvaluator.from_senteval(senteval, split="dev", write_csv=False)(model)
    AlignmentUniformityEvaluator.from_senteval(senteval, split="dev", write_csv=False)(model)
    assert seen and set(seen) == {64} and model.max_seq_length == 6
    assert dev.max_length == 64 and full_length_evaluator(dev) is dev
    wrapped = full_length_evaluator(_PlainEvaluator())
    assert isinstance(wrapped, FullLengthEvaluator) and full_length_evaluator(wrapped) is wrapped
    assert wrapped.primary_metric == "plain_length" and wrapped.greater_is_better
    assert wrapped(model) == {"plain_length": 64} and wrapped.max_length == 64 and model.max_seq_length == 6


class _PlainEvaluator:
    """A user's evaluator that knows nothing of lengths: it reports the length the model encodes at."""

    primary_metric = "plain_length"
    greater_is_better = True

    def __call__(self, model, output_path=None, epoch=-1, steps=-1):
        return {"plain_length": model.max_seq_length}


def test_an_index_records_its_length_and_reports_cut_documents(minilm_path, tmp_path, capsys):
    """``index build`` records the limit and counts the cut documents; a model now at another length is told so."""
    from st_prompts.cli import main
    from st_prompts.search import SemanticIndex

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([LONG_TEXT, *SENTENCES]) + "\n")
    model = SentenceTransformer(minilm_path, device="cpu")
    model.max_seq_length = 64
    saved = tmp_path / "model"
    model.save(str(saved))
    out = tmp_path / "corpus.index"
    assert main(["index", "build", str(saved), str(corpus), str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "1 of 9 documents are longer than the model encodes (64 tokens)" in err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model"]["max_seq_length"] == 64 and meta["documents_over_length"] == 1

    longer = SentenceTransformer(str(saved), device="cpu")
    longer.max_seq_length = 256
    with pytest.warns(UserWarning, match="encoded at up to 64 tokens each, but model .* now encodes up to 256"):
        SemanticIndex.load(str(out), model=longer)
