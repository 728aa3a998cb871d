"""Many tasks on one frozen backbone: prompt sets chosen per call and per row, trained one at a time, saved,
searched."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import encode, make_tiny_backbone, prompted_model, random_bank
from datasets import Dataset
from sentence_transformers import SentenceTransformer
from sentence_transformers.losses import CoSENTLoss, MultipleNegativesRankingLoss

from st_prompts import bank, save_prompts_only
from st_prompts.errors import BackboneMismatchError, ConfigurationError, DataFormatError

TEXTS = ["the man plays guitar .", "a dog runs in the park with a red car and a big tree near the water", "the cat",
         "this is happy music", "a woman sits on the mat in the house", "blue", "the big dog and the small cat play"]


@pytest.mark.parametrize("model_type", ["bert", "roberta", "modernbert", "llama"])
def test_each_row_gets_its_own_set_through_length_sorting(tiny_backbones, model_type):
    """One encode call, rows of several lengths and tasks (sets of 3 and 9 positions, the plain backbone, the
    default), batches smaller than the input: every row equals its single-task embedding."""
    pooling = "lasttoken" if model_type == "llama" else "mean"
    model = random_bank(tiny_backbones(model_type), pooling, short=3, long=9)
    tasks = ["short", "long", "backbone", None, "long", "short", "long"]
    mixed = encode(model, TEXTS, task=tasks, batch_size=3)
    assert not torch.allclose(encode(model, TEXTS[:1], task="short")[0], encode(model, TEXTS[:1], task="long")[0],
                              atol=1e-3)
    for text, task, row in zip(TEXTS, tasks, mixed):
        alone = encode(model, [text], task=task)[0]
        assert torch.allclose(alone, row, atol=1e-5), (text, task)
        grouped = encode(model, [t for t, k in zip(TEXTS, tasks) if k == task], task=task, batch_size=7)
        assert any(torch.allclose(g, row, atol=1e-5) for g in grouped)
    # the same through encode_rows (the server's path: token ids made once), and one task for the whole call
    from st_prompts import encode_rows

    assert torch.allclose(encode_rows(model, TEXTS, tasks, batch_size=3, convert_to_tensor=True), mixed, atol=1e-6)
    ids = model.tokenizer(TEXTS, truncation=True, max_length=model.max_seq_length)["input_ids"]
    assert torch.allclose(encode_rows(model, ids, tasks, batch_size=3, convert_to_tensor=True), mixed, atol=1e-5)
    assert torch.allclose(encode(model, TEXTS, task="long"), encode(model, TEXTS, task=["long"] * len(TEXTS)),
                          atol=1e-5)


def test_no_task_is_the_plain_backbone_of_a_bank_and_the_shipped_model_for_minilm(minilm):
    model = bank.create_bank("minilm")
    assert [type(m).__name__ for m in model] == ["PromptedTransformer", "Pooling", "Normalize"]
    texts = ["A man is playing a guitar.", "The cat sleeps on the warm windowsill all afternoon, as cats do. " * 8]
    assert model[0].max_seq_length == minilm.max_seq_length == 256
    assert torch.allclose(encode(model, texts), encode(minilm, texts), atol=1e-6)


def test_save_load_and_prompts_only_give_identical_embeddings(tiny_bert, tmp_path):
    model = random_bank(tiny_bert, short=3, long=9)
    model[0].query_task, model[0].document_task = "short", "long"
    tasks = ["short", "long", "backbone", "long", "short", None, "long"]
    expected = encode(model, TEXTS, task=tasks)
    model.save(str(tmp_path / "full"))
    save_prompts_only(model, str(tmp_path / "prompts"))
    for folder in ("full", "prompts"):
        loaded = SentenceTransformer(str(tmp_path / folder), trust_remote_code=True, device="cpu")
        assert loaded[0].prompt_set_names == ["short", "long"] and loaded[0].query_task == "short"
        assert torch.equal(encode(loaded, TEXTS, task=tasks), expected), folder
    # a bank without any set yet (``st-prompts bank create``) reloads as a bank that sets can join
    model = random_bank(tiny_bert)
    expected = encode(model, TEXTS)
    model.save(str(tmp_path / "empty"))
    loaded = SentenceTransformer(str(tmp_path / "empty"), trust_remote_code=True, device="cpu")
    assert loaded[0].prompt_set_names == [] and torch.equal(encode(loaded, TEXTS), expected)
    loaded[0].new_prompt_set("later", prefix_length=4)
    assert encode(loaded, TEXTS, task="later").shape == expected.shape


def test_encode_query_and_encode_document_use_their_sets(tiny_bert):
    model = random_bank(tiny_bert, q=3, d=5)
    plain = encode(model, TEXTS)
    assert torch.allclose(model.encode_query(TEXTS, convert_to_tensor=True), plain)  # no roles: the default
    model[0].query_task, model[0].document_task = "q", "d"
    assert torch.allclose(model.encode_query(TEXTS, convert_to_tensor=True), encode(model, TEXTS, task="q"))
    assert torch.allclose(model.encode_document(TEXTS, convert_to_tensor=True), encode(model, TEXTS, task="d"))
    model[0].default_task = "d"
    assert torch.allclose(encode(model, TEXTS), encode(model, TEXTS, task="d"))


def test_a_set_trained_while_others_exist_leaves_them_and_the_backbone_bit_identical(tiny_bert):
    model = random_bank(tiny_bert, kept=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = Dataset.from_dict({"sentence1": TEXTS[:4] * 4, "sentence2": TEXTS[3:7] * 4,
                              "score": [0.9, 0.1, 0.5, 0.3] * 4})
    result = bank.train_prompt_set(model, "new", data, CoSENTLoss(model), batch_size=4, max_steps=3,
                                   learning_rate=5e-2, show_progress_bar=False, prefix_length=6)
    new = dict(model[0].prompt_sets["new"].named_parameters())
    assert set(new) == {"embedding.weight", "gate"}  # a new set is gated by default (the multitask study)
    assert result.steps == 3 and result.trainable_parameters == sum(p.numel() for p in new.values())
    after = model.state_dict()
    changed = {k for k in after if k not in before or not torch.equal(after[k], before[k])}
    assert changed == {"0.sets.prefixes.new.embedding.weight", "0.sets.prefixes.new.gate"}
    assert model[0].default_task is None and all(p.requires_grad for p in model[0].prompt_sets["kept"].parameters())
    # the trained set is what the loss saw: default task inside the context only
    with bank.training_prompt_set(model, "new"):
        assert model[0].default_task == "new"
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [
            "0.sets.prefixes.new.gate", "0.sets.prefixes.new.embedding.weight"]


def test_any_sentence_transformers_loss_trains_a_set(tiny_bert):
    model = random_bank(tiny_bert)
    triplets = Dataset.from_dict({"anchor": TEXTS[:4], "positive": TEXTS[1:5], "negative": TEXTS[3:7]})
    start = encode(model, TEXTS, task="backbone")
    bank.train_prompt_set(model, "nli", triplets, MultipleNegativesRankingLoss(model), batch_size=4, max_steps=2,
                          show_progress_bar=False)
    assert not torch.allclose(encode(model, TEXTS, task="nli"), start, atol=1e-4)
    assert torch.equal(encode(model, TEXTS, task="backbone"), start)


def test_a_set_for_other_weights_or_another_shape_is_refused(tiny_bert, tiny_backbones, tmp_path):
    other = prompted_model(make_tiny_backbone(tmp_path / "other", "bert", seed=1), prefix_length=4)  # other weights
    save_prompts_only(other, str(tmp_path / "other-prompts"))
    model = random_bank(tiny_bert)
    for source in (str(tmp_path / "other-prompts"), other):
        with pytest.raises(BackboneMismatchError, match="other backbone weights"):
            bank.add_prompt_set(model, "x", source)
    prompted_model(tiny_backbones("distilbert"), prefix_length=4).save(str(tmp_path / "foreign"))  # another shape
    with pytest.raises(BackboneMismatchError):
        bank.add_prompt_set(model, "x", str(tmp_path / "foreign"))
    assert model[0].prompt_set_names == []


def test_a_set_from_a_folder_of_the_same_backbone_joins_and_encodes_as_it_did(tiny_bert, tmp_path):
    source = prompted_model(tiny_bert, prefix_length=5, randomise=True)
    expected = encode(source, TEXTS)
    save_prompts_only(source, str(tmp_path / "prompts"))
    source.save(str(tmp_path / "full"))
    model = random_bank(tiny_bert, other=3)
    bank.add_prompt_set(model, "from-prompts", str(tmp_path / "prompts"))
    bank.add_prompt_set(model, "from-full", str(tmp_path / "full"))
    bank.add_prompt_set(model, "from-model", source)
    for name in ("from-prompts", "from-full", "from-model"):
        assert torch.allclose(encode(model, TEXTS, task=name), expected, atol=1e-6)
    with pytest.raises(ConfigurationError, match="already has a prompt set"):
        bank.add_prompt_set(model, "other", source)
    prompted_model(tiny_bert, "cls", prefix_length=5).save(str(tmp_path / "cls"))
    with pytest.raises(ConfigurationError, match="pools 'cls' but this bank pools 'mean'"):
        bank.add_prompt_set(model, "cls", str(tmp_path / "cls"))
    bank.remove_prompt_set(model, "from-full")
    assert model[0].prompt_set_names == ["other", "from-prompts", "from-model"]


def test_clear_one_line_errors(tiny_bert):
    model = random_bank(tiny_bert, a=3)
    with pytest.raises(ConfigurationError, match="Unknown task 'b'.*prompt sets: a"):
        encode(model, TEXTS, task="b")
    with pytest.raises(ConfigurationError, match="one task per row"):
        encode(model, TEXTS, task=["a"])
    with pytest.raises(ConfigurationError, match="A task per row"):
        model[0].preprocess(TEXTS, task=["a"] * len(TEXTS))
    model.train()
    features = {**model.preprocess(TEXTS[:2]), "prompt_tasks": ["a", "backbone"]}
    with pytest.raises(ConfigurationError, match="train one prompt set at a time"):
        model(features)
    with pytest.raises(ConfigurationError, match="name"):
        model[0].new_prompt_set("backbone")


def test_training_files_of_every_shape_and_their_errors(tmp_path):
    from st_prompts.data.task_data import read_task_file

    (tmp_path / "scored.csv").write_text("s1,s2,score\na,b,4.5\nc,d,1\n")
    (tmp_path / "triplets.jsonl").write_text('{"q": "a", "p": "b", "n": "c"}\n{"q": "d", "p": "e", "n": "f"}\n')
    (tmp_path / "pairs.tsv").write_text("x\ty\na\tb\n")
    (tmp_path / "sentences.csv").write_text("text\na dog\na cat\n")
    kinds = {name: read_task_file(tmp_path / name) for name in
             ("scored.csv", "triplets.jsonl", "pairs.tsv", "sentences.csv")}
    assert {k: v.kind for k, v in kinds.items()} == {"scored.csv": "scored-pairs", "triplets.jsonl": "triplets",
                                                     "pairs.tsv": "pairs", "sentences.csv": "sentences"}
    assert kinds["scored.csv"].dataset.column_names == ["sentence1", "sentence2", "score"]
    assert kinds["triplets.jsonl"].dataset[1] == {"anchor": "d", "positive": "e", "negative": "f"}
    (tmp_path / "bad.csv").write_text("s1,s2,score\na,b,high\n")
    with pytest.raises(DataFormatError, match="row 2: score 'high' is not a number"):
        read_task_file(tmp_path / "bad.csv")
    (tmp_path / "ragged.csv").write_text("a,b\nx,y\nz\n")
    with pytest.raises(DataFormatError, match="line 3: 1 fields"):
        read_task_file(tmp_path / "ragged.csv")


def test_the_command_line_trains_adds_lists_and_searches_per_task(tiny_bert, tmp_path, capsys):
    from st_prompts import cli

    data = tmp_path / "scored.csv"
    data.write_text("s1,s2,score\n" + "".join(f"{a},{b},{s}\n" for a, b, s in
                                               zip(TEXTS, TEXTS[1:], [4.5, 1, 3, 0.5, 2, 5])))
    triplets = tmp_path / "triplets.csv"
    triplets.write_text("a,p,n\n" + "".join(f"{a},{b},{c}\n" for a, b, c in zip(TEXTS, TEXTS[1:], TEXTS[2:])))
    folder = str(tmp_path / "bank")
    common = ["--batch-size", "2", "--max-steps", "2", "--no-progress"]
    assert cli.main(["bank", "train", folder, "sts", "--data", str(data), "--backbone", tiny_bert, *common]) == 0
    assert cli.main(["bank", "train", folder, "nli", "--data", str(triplets), "--prefix-length", "5", *common]) == 0
    assert cli.main(["bank", "train", folder, "sts", "--data", str(data), *common]) == 2  # exists: --replace
    assert cli.main(["bank", "train", folder, "x", "--data", str(triplets), "--loss", "cosent", *common]) == 2
    assert cli.main(["bank", "roles", folder, "--default", "sts"]) == 0
    capsys.readouterr()
    assert cli.main(["bank", "list", folder, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["default"] == "sts" and {k: v["prefix_length"] for k, v in listed["sets"].items()} == {
        "sts": 16, "nli": 5}
    assert listed["sets"]["nli"]["trained"]["rows"] == 5 and listed["sets"]["nli"]["trained"]["steps"] == 2
    assert cli.main(["bank", "list", folder]) == 0  # a table by default
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"{folder}: 2 prompt set(s) on {tiny_bert}"
    assert table[1].split() == ["set", "prefix", "trainable", "stored", "size", "roles", "trained", "on",
                                "selection", "score", "(step)"]
    sts_row, nli_row = table[2].split(), table[3].split()
    assert sts_row[:2] == ["sts", "16"] and "default," not in sts_row and "default" in sts_row
    assert sts_row[2] == f"{listed['sets']['sts']['parameters']:,}" and "CoSENTLoss" in sts_row
    assert nli_row[:2] == ["nli", "5"] and "MultipleNegativesRankingLoss" in nli_row and "default" not in nli_row
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    index = str(tmp_path / "index")
    assert cli.main(["index", "build", folder, str(corpus), index, "--task", "nli", "--no-progress"]) == 0
    assert json.loads((tmp_path / "index" / "meta.json").read_text())["model"]["task"] == "nli"
    capsys.readouterr()
    assert cli.main(["index", "search", index, "a dog in the park", "-k", "1", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)[0]["hits"]
    model = SentenceTransformer(folder, trust_remote_code=True, device="cpu")
    query = model.encode(["a dog in the park"], task="nli", normalize_embeddings=True)[0]
    documents = model.encode(TEXTS, task="nli", normalize_embeddings=True)
    assert hits[0]["text"] == TEXTS[int((documents @ query).argmax())]
    assert cli.main(["index", "search", index, "a dog", "--task", "sts"]) == 2
    assert cli.main(["bank", "remove", folder, "nli"]) == 0
    assert SentenceTransformer(folder, trust_remote_code=True)[0].prompt_set_names == ["sts"]
