"""False alarms of the δ-share rule on noise (issue 37): the README's plain-PyTorch
quickstart (GPT 2 layers × 4 heads, width 64, batches 8 × 64, AdamW lr 3e-3, BF16
autocast, every_n_steps 5, mitigation "auto") trained on random tokens; prints the mode
switches, flagged head-steps and the largest raw delta_error_share per seed.

    OMP_NUM_THREADS=1 python benchmarks/share_noise.py --steps 300 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import time

import torch

import flashwatch as fw
from flashwatch.nanogpt import GPT, GPTConfig

QUICKSTART = dict(block_size=64, n_layer=2, n_head=4, n_embd=64)  # README's model


def quickstart_run(seed: int, steps: int, **watch):
    """The quickstart on random tokens for `steps` steps; returns (reports, watcher),
    the watcher removed. tests/mitigation/test_policy_noise.py runs it too."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**QUICKSTART))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    w = fw.watch(model, **{"mitigation": "auto", "every_n_steps": 5, **watch})
    reports = []
    for _ in range(steps):
        b = torch.randint(0, 256, (8, QUICKSTART["block_size"] + 1), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        r = w.step()
        if r is not None:
            reports.append(r)
    w.remove()
    return reports, w


def run(seed: int, steps: int) -> str:
    t0 = time.perf_counter()
    reports, w = quickstart_run(seed, steps)
    switches = [e for e in w.events if e.kind == "mode"]
    flagged = sum(h.flagged for r in reports for h in r.heads)
    top = max(h.delta_error_share for r in reports for h in r.heads)
    return (f"seed {seed}, {steps} steps: {len(switches)} switches, {flagged} flagged "
            f"head-steps, max raw share {top:.3g}, {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    args = ap.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:
        print(run(seed, args.steps), flush=True)


if __name__ == "__main__":
    main()
