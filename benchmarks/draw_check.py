"""One run of ``benchmarks/run_all.py`` with the earlier per-example prefix dropout draw (``torch.bernoulli_``, one
random number per entry, scale ``1 / (1 - p)`` in float32) and the current code otherwise.

It separates the two things that changed when the prefix dropout mask moved to ``draw_keep_mask``: the random numbers
(a run with the new draw follows another random stream, like another seed) and everything else (the fused backward's
summation order, the inference key padding), which should move a run only by rounding::

    python benchmarks/draw_check.py --data-dir ../shared/data --row dcpcse-unsup --seed 42

Writes ``benchmarks/results/draw_check/ROW-seedN.json`` (a run_all run record) and prints the metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def earlier_values(self, batch_size: int):
    """``PrefixEncoder.values`` as it drew the per-example mask before ``draw_keep_mask``."""
    import torch

    from st_prompts.prompts.prefix import PrefixDraw

    values = self.key_values().permute(1, 2, 0, 3).unsqueeze(1)
    if not (self.training and self.dropout.p > 0):
        return PrefixDraw(values, batch_size)
    if self.shared_dropout:
        return PrefixDraw(self.dropout(values), batch_size)
    keep = torch.empty_like(values.expand(-1, batch_size, -1, -1, -1), dtype=torch.bool)
    keep.bernoulli_(1 - self.dropout.p)
    scale = torch.ones((), dtype=values.dtype, device=values.device).div_(1 - self.dropout.p)
    return PrefixDraw(values, batch_size, keep, scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--row", default="dcpcse-unsup")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    import run_all
    from st_prompts.prompts.prefix import PrefixEncoder

    torch.set_num_threads(args.threads)
    PrefixEncoder.values = earlier_values
    row = run_all.ROWS[args.row]
    record = run_all.run_one(row, args.seed, args.data_dir, False, run_all.senteval_dir(args.data_dir))
    record["prefix_dropout_draw"] = "torch.bernoulli_ (the earlier draw; benchmarks/draw_check.py)"
    out = run_all.RESULTS_DIR.parent / "draw_check" / f"{args.row}-seed{args.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    run_all.write_json(out, record)
    print(json.dumps(record["metrics"]), f"best step {record['best_step']}", f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
