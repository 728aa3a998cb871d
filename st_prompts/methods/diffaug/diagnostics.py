"""DiffAug's stage-1 diagnostics (paper §3.2) and a trainer callback that logs them and can end stage 1 by them.

* δ (eq. 6) = E ||f(x; θ1) − f(x⁺; θ2)||₂ over probe pairs, in eval mode: what the two prefix views make differ.
* κ (eqs. 7–8) = 1/(2M) Σ_m (κ_k^m + κ_v^m), κ_k^m = mean ℓ2 norm of layer m's backbone key rows (real tokens of the
  probe sentences, prompted pass) minus that of its prefix key rows (every position, both views); likewise values.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch
from transformers import TrainerCallback

from st_prompts.errors import ConfigurationError
from st_prompts.prompts.prefix import prefix_view_mask

logger = logging.getLogger(__name__)

#: Names of the backbone's key and value projections (BERT, RoBERTa, XLM-R, ELECTRA, CamemBERT).
_KEY_VALUE = re.compile(r"layer\.(\d+)\.attention\.self\.(key|value)$")
#: ``log_history`` keys written by :class:`PrefixDiagnosticsCallback`.
DELTA_KEY, KAPPA_KEY = "diffaug_delta", "diffaug_kappa"


def _features(model, texts: Sequence[str], view: int | None, num_views: int) -> dict:
    features = model.preprocess(list(texts))
    device = model.device
    features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
    encoder = model[0]
    if view is not None:
        features["prefix_attention_mask"] = prefix_view_mask(len(texts), encoder.prefix_length, view, num_views,
                                                             device=device)
    return features


def embed_with_view(model, texts: Sequence[str], view: int | None, num_views: int = 2,
                    batch_size: int = 64) -> torch.Tensor:
    """Sentence embeddings of ``texts`` with every row attending to prefix view ``view`` (``None``: whole prefix),
    in the model's current mode, without gradient."""
    out = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            features = _features(model, texts[start : start + batch_size], view, num_views)
            out.append(model(features)["sentence_embedding"])
    return torch.cat(out)


def representation_divergence(model, firsts: Sequence[str], seconds: Sequence[str], views: tuple[int | None, int | None]
                              = (0, 1), num_views: int = 2, batch_size: int = 64) -> float:
    """δ: the mean Euclidean distance between ``f(firsts[i]; view 0)`` and ``f(seconds[i]; view 1)`` (eval mode)."""
    if len(firsts) != len(seconds) or not firsts:
        raise ConfigurationError("representation_divergence needs two equally long, non-empty lists of texts.")
    was_training = model.training
    model.eval()
    try:
        a = embed_with_view(model, firsts, views[0], num_views, batch_size)
        b = embed_with_view(model, seconds, views[1], num_views, batch_size)
    finally:
        model.train(was_training)
    return (a.float() - b.float()).norm(dim=-1).mean().item()


def _l21_row_mean(rows: torch.Tensor) -> torch.Tensor:
    """(1/r)·||A||₂,₁ of a matrix with r rows: the mean ℓ2 norm of its rows."""
    return rows.float().norm(dim=-1).mean()


def weight_convergence(model, texts: Sequence[str], view: int | None = None, num_views: int = 2) -> float:
    """κ: the ℓ2,1-norm gap between the backbone's and the prefix's keys and values, averaged over layers and K/V
    (paper eqs. 7–8). Backbone rows: the real tokens of ``texts`` (padding excluded) in the prompted forward pass
    (eval mode, rows attending to ``view`` of the prefix; ``None``: all of it). Prefix rows: every prefix position.
    """
    encoder = model[0]
    prefix = encoder.prefix_encoder
    if prefix is None:
        raise ConfigurationError("weight_convergence needs a PromptedTransformer with a prefix.")
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for name, module in encoder.auto_model.named_modules():
        match = _KEY_VALUE.search(name)
        if match:
            key = (int(match.group(1)), match.group(2))
            # The first call is the sentence pass (template denoising runs a second, template-only one).
            def hook(module, inputs, output, key=key) -> None:
                if key not in captured:
                    captured[key] = output.detach()

            hooks.append(module.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        if len(hooks) != 2 * prefix.num_layers:
            raise ConfigurationError(f"Found {len(hooks)} key/value projections in "
                                     f"{type(encoder.auto_model).__name__}, expected {2 * prefix.num_layers}: κ "
                                     "supports BERT-style attention modules.")
        with torch.no_grad():
            features = _features(model, texts, view, num_views)
            mask = features["attention_mask"].bool()
            model(features)
            prefix_rows = prefix.key_values()  # (l, 2L, heads, head_dim)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    gaps = []
    for layer in range(prefix.num_layers):
        for index, kind in ((0, "key"), (1, "value")):
            backbone = captured[(layer, kind)][mask]  # (real tokens, hidden)
            own = prefix_rows[:, 2 * layer + index].reshape(prefix.prefix_length, -1)  # (l, hidden)
            gaps.append(_l21_row_mean(backbone) - _l21_row_mean(own))
    return torch.stack(gaps).mean().item()


class PrefixDiagnosticsCallback(TrainerCallback):
    """Logs δ and κ at a stage's start and every ``every`` steps into the trainer's ``log_history`` (``step``,
    ``diffaug_delta``, ``diffaug_kappa``: ``train_result.json``, ``st-prompts plot diffaug-stage1``).

    Probe pairs: columns ``pair_columns`` of the first ``samples`` rows of the stage's training data (semi-supervised:
    the premise twice; supervised: premise and entailment). With ``stop_rule=True`` the stage ends at the first check
    where δ has peaked (below the largest seen) and κ < ``kappa_threshold``.
    """

    def __init__(self, model, every: int = 50, samples: int = 64, pair_columns: tuple[str, str] = ("premise", "premise"),
                 num_views: int = 2, views: tuple[int | None, int | None] = (0, 1), stop_rule: bool = False,
                 kappa_threshold: float = 0.0) -> None:
        if every < 1 or samples < 1:
            raise ConfigurationError("The diagnostics need every >= 1 and samples >= 1.")
        self.model = model
        self.every = every
        self.samples = samples
        self.pair_columns = pair_columns
        self.num_views = num_views
        self.views = views
        self.stop_rule = stop_rule
        self.kappa_threshold = kappa_threshold
        self.history: list[dict] = []
        self._pairs: tuple[list[str], list[str]] | None = None

    def _probe(self, train_dataloader) -> tuple[list[str], list[str]]:
        if self._pairs is None:
            dataset = getattr(train_dataloader, "dataset", None)
            if dataset is None or not hasattr(dataset, "column_names"):
                raise ConfigurationError("PrefixDiagnosticsCallback needs the trainer's train_dataloader.dataset.")
            rows = dataset[: self.samples]
            self._pairs = (list(rows[self.pair_columns[0]]), list(rows[self.pair_columns[1]]))
        return self._pairs

    def measure(self, train_dataloader) -> tuple[float, float]:
        firsts, seconds = self._probe(train_dataloader)
        delta = representation_divergence(self.model, firsts, seconds, self.views, self.num_views)
        kappa = weight_convergence(self.model, firsts, view=None, num_views=self.num_views)
        return delta, kappa

    def _record(self, state, control, train_dataloader) -> None:
        delta, kappa = self.measure(train_dataloader)
        entry = {"step": state.global_step, DELTA_KEY: delta, KAPPA_KEY: kappa}
        peaked = bool(self.history) and delta < max(h[DELTA_KEY] for h in self.history)
        self.history.append(entry)
        state.log_history.append(dict(entry))
        logger.info(f"step {state.global_step}: delta={delta:.4f} kappa={kappa:.4f}")
        if self.stop_rule and peaked and kappa < self.kappa_threshold:
            control.should_training_stop = True
            logger.info(f"Stage 1 ends at step {state.global_step}: delta has peaked and kappa={kappa:.4f} < "
                        f"{self.kappa_threshold}.")

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._record(state, control, train_dataloader)

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        if state.global_step % self.every == 0:
            self._record(state, control, train_dataloader)

    def on_train_end(self, args, state, control, train_dataloader=None, **kwargs):
        if not self.history or self.history[-1]["step"] != state.global_step:
            self._record(state, control, train_dataloader)
