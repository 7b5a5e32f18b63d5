"""The δ error along a run: Eq. 3 measured exactly on each saved checkpoint.

    python -m reproduction.checkpoints --runs runs/v2/nope-grammar-hotter/unmitigated-s0 \
        --batches 16 --json out.json

For every checkpoint a run saved (model_step{N}.pt from --save-every, and model.pt), on
`--batches` fresh batches: reproduction.grad_error's per-head numbers (rel_error: ‖ΔdW^Q‖
/ ‖dW^Q‖, the share of the W^Q gradient that is δ rounding error; coherence: does the
error point one way from batch to batch, ≈ 1/sqrt(batches) if not) and the sign
statistic of the paper's coefficient sum on every row, z = Σ_b S_b / sqrt(Σ_b S_b²) with
S_b = Σ_T c[T] of batch b (≈ N(0, 1) when the sign is random, ≈ sqrt(batches) when it
persists). Prints one line per checkpoint: the median and max over heads, and the head
with the largest |z|.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import torch

from examples.gpt import GPT, GPTConfig
from reproduction.fp32_delta import Fp32DeltaAttention
from reproduction.grad_error import measure
from reproduction.run import make_data


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, path) of a run's saved weights in step order; model.pt is the last step."""
    out = [(int(m.group(1)), p) for p in run.glob("model_step*.pt")
           if (m := re.fullmatch(r"model_step(\d+)\.pt", p.name))]
    summ = json.loads((run / "summary.json").read_text())
    if (run / "model.pt").is_file():
        out.append((summ["steps_done"], run / "model.pt"))
    return sorted(out)


def measure_run(run: Path, batches: int) -> list[dict]:
    summ = json.loads((run / "summary.json").read_text())
    s, seed = summ["settings"], summ["seed"]
    data = make_data(s, seed)
    rows = []
    for step, path in checkpoints(run):
        model = GPT(GPTConfig(block_size=s["block"], vocab_size=s["vocab"],
                              n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                              position_embedding=s["position_embedding"]))
        model.load_state_dict(torch.load(path))
        Fp32DeltaAttention.c_sums, Fp32DeltaAttention.record_c = [], True
        try:
            heads = measure(model, data, s, batches, seed)
        finally:
            Fp32DeltaAttention.record_c = False
        S = torch.stack(Fp32DeltaAttention.c_sums).view(batches, s["n_layer"] * s["n_head"])
        z = S.sum(0) / S.square().sum(0).sqrt()
        for h, zi in zip(heads, z.tolist(), strict=True):
            h.update(step=step, sign_z=zi)
        rows += heads
    return rows


def _median(rows: list[dict], key: str) -> float:
    return sorted(r[key] for r in rows)[len(rows) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reproduction.checkpoints", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, nargs="+", required=True)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--json", type=Path, help="write every run's per-head rows here")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    everything = {}
    null = 1 / math.sqrt(a.batches)
    print(f"coherence of a random direction ≈ {null:.2f}; |z| of a random sign: N(0, 1)")
    print("| run | step | rel_error median (max) | coherence median (max) | max abs z "
          "(head) | tied median |")
    print("|---|---|---|---|---|---|")
    for run in a.runs:
        rows = measure_run(run, a.batches)
        everything[str(run)] = rows
        for step in sorted({r["step"] for r in rows}):
            at = [r for r in rows if r["step"] == step]
            top = max(at, key=lambda r: abs(r["sign_z"]))
            print(f"| {run.parent.name}/{run.name} | {step} | {_median(at, 'rel_error'):.3f} "
                  f"({max(r['rel_error'] for r in at):.3f}) | {_median(at, 'coherence'):.2f} "
                  f"({max(r['coherence'] for r in at):.2f}) | {top['sign_z']:+.1f} "
                  f"({top['layer']}/{top['head']}) | {_median(at, 'tied'):.2f} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(everything) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
