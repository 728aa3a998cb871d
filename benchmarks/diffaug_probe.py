"""Why DiffAug's stage 1 struggles on the packaged MiniLM: two probes on the *untrained* DiffAug model.

1. **[MASK] pooling quality.** STS-B dev Spearman of the untrained DiffAug encoder (PromptBERT template, random
   reparameterised prefix, eval mode, every row attending to all 2l positions), with and without template
   denoising, and without the template with [CLS] pooling (``--pooling cls``, the official code's
   ``apply_prompt=False``). Compare with the backbone's own [CLS] and mean pooling (run_all rows ``backbone-cls``
   and ``backbone-mean``).
2. **Linear probe on stage-1 features.** The exact classifier input of stage 1 (``(u, v, |u - v|)`` from
   :class:`st_prompts.losses.PrefixViewSoftmaxLoss`, premise on view 0 and hypothesis on view 1) is captured for
   NLI pairs, and a fresh ``Linear(3H, 2)`` is trained on it with AdamW (stage 1's learning rate 1e-3, batch 64,
   200 steps); held-out accuracy is reported for dropout on (as in training) or off, for each of those features.
   It shows how much entailment-vs-contradiction signal a linear head can get out of the frozen features before the
   prefix has learned anything.

Run by hand (minutes on a CPU)::

    python benchmarks/diffaug_probe.py --data-dir ../shared/data --threads 1

It writes ``benchmarks/results/diffaug_probe.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from st_prompts import methods
from st_prompts.data.training_data import nli_path, read_nli_pairs
from st_prompts.evaluation.sts import stsb_dev_evaluator
from st_prompts.methods import diffaug

RESULTS = Path(__file__).resolve().parent / "results"


def _model(pooling: str = "mask"):
    torch.manual_seed(0)
    settings = methods.settings("diffaug", supervised=False, scale="cpu", pooling=pooling)
    return settings, diffaug.build_model(settings)


#: (pooling, template denoising) of every probed feature kind.
KINDS = (("mask", True), ("mask", False), ("cls", False))


def _kind(pooling: str, denoise: bool) -> str:
    if pooling == "mask":
        return f"template [MASK], {'denoised' if denoise else 'plain'}"
    return f"no template, [{pooling.upper()}]" if pooling == "cls" else f"no template, {pooling}"


def sts_probe(data_dir: Path) -> dict:
    evaluator = stsb_dev_evaluator(data_dir / "senteval")
    out = {}
    for pooling, denoise in KINDS:
        _, model = _model(pooling)
        model.eval()
        model[0].template_denoising = denoise
        scores = evaluator(model)
        key = next(k for k in scores if k.endswith("spearman_cosine"))
        out[_kind(pooling, denoise)] = round(100 * scores[key], 2)
    return out


def _features(model, loss, pairs, train_mode: bool, batch_size: int = 128):
    captured = {}
    classifier = loss.classifier

    def hook(_module, inputs):
        captured["x"] = inputs[0].detach()

    handle = classifier.register_forward_pre_hook(hook)
    model.train(train_mode)
    xs, ys = [], []
    try:
        with torch.no_grad():
            for i in range(0, len(pairs), batch_size):
                batch = pairs[i:i + batch_size]
                first = model.preprocess([p[0] for p in batch])
                second = model.preprocess([p[1] for p in batch])
                labels = torch.tensor([p[2] for p in batch])
                loss([first, second], labels)
                xs.append(captured["x"])
                ys.append(labels)
    finally:
        handle.remove()
    return torch.cat(xs), torch.cat(ys)


def linear_probe(x: torch.Tensor, y: torch.Tensor, n_train: int, steps: int = 200, lr: float = 1e-3) -> dict:
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    head = torch.nn.Linear(x.shape[1], 2)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    order = torch.randperm(n_train)
    for step in range(steps):
        start = (step * 64) % n_train
        if start + 64 > n_train:
            order = torch.randperm(n_train)
            start = 0
        idx = order[start:start + 64]
        optimizer.zero_grad()
        value = torch.nn.functional.cross_entropy(head(x_train[idx]), y_train[idx])
        value.backward()
        optimizer.step()
        losses.append(value.item())
    with torch.no_grad():
        logits = head(x_test)
        return {
            "train_loss_last20": round(sum(losses[-20:]) / 20, 4),
            "heldout_loss": round(torch.nn.functional.cross_entropy(logits, y_test).item(), 4),
            "heldout_accuracy": round((logits.argmax(1) == y_test).float().mean().item(), 4),
            "heldout_majority": round(max(y_test.float().mean().item(), 1 - y_test.float().mean().item()), 4),
        }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=3072, help="NLI pairs to featurise (2/3 train, 1/3 held out)")
    parser.add_argument("--out", type=Path, default=RESULTS / "diffaug_probe")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()

    report = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
              "command": "python benchmarks/diffaug_probe.py --data-dir ../shared/data --threads %d" % args.threads,
              "sts_b_dev_untrained": sts_probe(args.data_dir)}
    pairs, _ = read_nli_pairs(nli_path(args.data_dir), limit=None, seed=42)
    random.Random(0).shuffle(pairs)
    pairs = pairs[:args.pairs]
    n_train = (2 * len(pairs)) // 3
    probes = {}
    for dropout in (False, True):
        for pooling, denoise in KINDS:
            settings, model = _model(pooling)
            model[0].template_denoising = denoise
            loss = diffaug.nli_loss(model, settings)
            torch.manual_seed(1)
            x, y = _features(model, loss, pairs, train_mode=dropout)
            name = f"{_kind(pooling, denoise)}, dropout {'on' if dropout else 'off'}"
            probes[name] = linear_probe(x, y, n_train)
            print(name, probes[name], flush=True)
    report["linear_probe"] = probes
    report["pairs"] = {"train": n_train, "heldout": len(pairs) - n_train}
    report["seconds"] = round(time.time() - started, 1)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# DiffAug probes on the untrained model (packaged all-MiniLM-L6-v2, `--scale cpu` preset)",
        "",
        f"Machine: {report['machine']}. Command: `{report['command']}` ({report['seconds']} s).",
        "",
        "## STS-B dev Spearman ×100, eval mode, random prefix",
        "",
        "| " + " | ".join(report["sts_b_dev_untrained"]) + " |",
        "|" + "---|" * len(report["sts_b_dev_untrained"]),
        "| " + " | ".join(str(v) for v in report["sts_b_dev_untrained"].values()) + " |",
        "",
        "The prefix attends to all 2l positions. The backbone alone (no prefix): run_all rows `backbone-cls` and "
        "`backbone-mean`.",
        "",
        f"## Linear probe on stage-1 features ({n_train} train / {len(pairs) - n_train} held-out NLI pairs, "
        "entailment vs contradiction)",
        "",
        "| features | held-out accuracy | majority class | held-out CE | train CE (last 20 steps) |",
        "|---|---|---|---|---|",
    ]
    for name, p in probes.items():
        lines.append(f"| {name} | {100 * p['heldout_accuracy']:.1f} % | {100 * p['heldout_majority']:.1f} % | "
                     f"{p['heldout_loss']} | {p['train_loss_last20']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
