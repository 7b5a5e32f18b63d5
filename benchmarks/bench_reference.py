"""Reference attention vs F.scaled_dot_product_attention on CPU, fwd+bwd, side by side.

Usage: python benchmarks/bench_reference.py [--reps 7] [--threads 2]
Each repetition times both ops back to back (interleaved), so machine noise hits both;
the reported figure is the median of the per-repetition ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import flashwatch as fw


def fwd_bwd_seconds(fn, q, k, v, do) -> float:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    t0 = time.perf_counter()
    fn(q, k, v).backward(do)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, "
          f"B=4 H=8 D=64, median of {args.reps} interleaved reps")
    print("| N | causal | reference fwd+bwd (ms) | SDPA fwd+bwd (ms) | ratio |")
    print("|---|---|---|---|---|")
    ops = {
        "ref": lambda causal: lambda q, k, v: fw.attention(q, k, v, causal=causal,
                                                           backend="reference"),
        "sdpa": lambda causal: lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal),
    }
    for n in args.lengths:
        for causal in (False, True):
            g = torch.Generator().manual_seed(0)
            q, k, v, do = (torch.randn(4, 8, n, 64, generator=g).bfloat16() for _ in range(4))
            for op in ops.values():  # warm-up
                fwd_bwd_seconds(op(causal), q, k, v, do)
            ref_t, sdpa_t, ratios = [], [], []
            for _ in range(args.reps):
                a = fwd_bwd_seconds(ops["ref"](causal), q, k, v, do)
                b = fwd_bwd_seconds(ops["sdpa"](causal), q, k, v, do)
                ref_t.append(a)
                sdpa_t.append(b)
                ratios.append(a / b)
            print(f"| {n} | {causal} | {1e3 * statistics.median(ref_t):.1f} | "
                  f"{1e3 * statistics.median(sdpa_t):.1f} | "
                  f"{statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
