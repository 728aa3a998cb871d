"""DiffAug's stage-1 curves: δ and κ against the step, read from a run's ``train_result.json``
(``st-prompts plot diffaug-stage1``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from st_prompts.errors import DataFormatError, DataNotFoundError
from st_prompts.plots import add_note, save_png


def read_diffaug_stage1(run_dir: Path) -> list[dict[str, float]]:
    """The ``{"step", "diffaug_delta", "diffaug_kappa"}`` entries of a DiffAug run's ``train_result.json``.

    Raises:
        DataNotFoundError: without ``RUN_DIR/train_result.json``.
        DataFormatError: if the run logged no stage-1 diagnostics (not a DiffAug run, or stage 1 was skipped).
    """
    path = Path(run_dir) / "train_result.json"
    if not path.is_file():
        raise DataNotFoundError(f"{str(path)!r} does not exist: RUN_DIR must be the output folder of a training run.")
    history = json.loads(path.read_text()).get("log_history", [])
    rows = [e for e in history if "diffaug_delta" in e and "diffaug_kappa" in e]
    if not rows:
        raise DataFormatError(f"{str(path)!r} holds no stage-1 diagnostics (diffaug_delta/diffaug_kappa): not a "
                              "DiffAug run, or one that skipped stage 1.")
    return rows


def plot_diffaug_stage1(rows: Sequence[Mapping[str, float]], out_path: str | os.PathLike,
                        title: str | None = None) -> Path:
    """DiffAug's stage-1 diagnostics (``rows`` as :func:`read_diffaug_stage1` returns them) against the step: δ (left
    axis) and κ (right axis), the end of stage 1 and the largest δ marked, as the PNG ``out_path``."""
    if not rows:
        raise DataFormatError("No stage-1 diagnostics to draw.")
    steps = [r["step"] for r in rows]
    delta = [r["diffaug_delta"] for r in rows]
    kappa = [r["diffaug_kappa"] for r in rows]
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, delta, marker="o", markersize=3, color="tab:blue", label="δ representation divergence")
    ax.set_xlabel("stage-1 step")
    ax.set_ylabel("δ = E‖f(x;θ1) − f(x⁺;θ2)‖₂", color="tab:blue")
    right = ax.twinx()
    right.plot(steps, kappa, marker="s", markersize=3, color="tab:red", label="κ weight convergence")
    right.set_ylabel("κ (ℓ2,1 gap, backbone − prefix)", color="tab:red")
    peak = steps[int(np.argmax(delta))]
    ax.axvline(peak, color="tab:blue", linestyle=":", linewidth=1)
    ax.axvline(steps[-1], color="0.3", linestyle="--", linewidth=1)
    handles = ax.get_lines()[:1] + right.get_lines()[:1]
    ax.legend(handles, [h.get_label() for h in handles], loc="best", fontsize=8)
    fig.suptitle(title or "DiffAug stage 1: representation divergence and weight convergence")
    add_note(fig, f"Dotted: largest δ (step {peak}); dashed: end of stage 1 (step {steps[-1]}).")
    return save_png(fig, out_path)
