"""What measuring a FlexAttention call costs next to an SDPA call, CPU, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_flex.py [--rounds 5]

A 4-layer attention stack (d 256, 8 heads, B 4 × N 512, FP32, forward only: torch has no
flex backward on the CPU) in four variants: SDPA causal, flex causal (its block mask),
flex causal + softcap score_mod, flex with a block-causal document mask. For each: the
median forward time unwatched, and the median monitored step (forward + watcher.step())
watched with every step monitored, interleaved round by round so the machine's noise
hits all alike. flex runs its eager (unfused) implementation here, as torch runs it on a
CPU; the monitored-step cost is the probe's chunked FP32 recomputation with the mods
vmapped over index vectors (flashwatch/monitor/flex.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402

L, D, H, B, N = 4, 256, 8, 4, 512


class Layer(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.num_heads, self.call = H, call
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = (p(x).view(B, N, H, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return x + self.o_proj(self.call(q, k, v).transpose(1, 2).reshape(B, N, D))


def variants() -> dict:
    causal = create_block_mask(lambda b, h, q, k: q >= k, None, None, N, N, device="cpu")
    doc = (torch.arange(N) // 100).expand(B, N)
    docs = create_block_mask(lambda b, h, q, k: (q >= k) & (doc[b, q] == doc[b, k]),
                             B, None, N, N, device="cpu")
    return {
        "sdpa_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "flex_causal": lambda q, k, v: flex_attention(q, k, v, block_mask=causal),
        "flex_softcap": lambda q, k, v: flex_attention(
            q, k, v, block_mask=causal, score_mod=lambda s, b, h, qi, ki: 30 * torch.tanh(s / 30)),
        "flex_documents": lambda q, k, v: flex_attention(q, k, v, block_mask=docs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(B, N, D)
    models = {name: nn.Sequential(*(Layer(call) for _ in range(L)))
              for name, call in variants().items()}
    times = {name: {"plain": [], "monitored": []} for name in models}
    with torch.no_grad():
        for model in models.values():  # warm: flex's first call compiles its op
            model(x)
        for _ in range(args.rounds):
            for name, model in models.items():
                t0 = time.perf_counter()
                model(x)
                times[name]["plain"].append(time.perf_counter() - t0)
                w = fw.watch(model, config=fw.WatchConfig(every_n_steps=1))
                t0 = time.perf_counter()
                model(x)
                report = w.step()
                times[name]["monitored"].append(time.perf_counter() - t0)
                assert report.monitor_errors_total == 0, name
                w.remove()
    print(f"{'variant':16s} {'forward ms':>11s} {'monitored ms':>13s} {'ratio':>6s}")
    for name, t in times.items():
        plain, mon = statistics.median(t["plain"]), statistics.median(t["monitored"])
        print(f"{name:16s} {1e3 * plain:11.1f} {1e3 * mon:13.1f} {mon / plain:6.2f}")


if __name__ == "__main__":
    main()
