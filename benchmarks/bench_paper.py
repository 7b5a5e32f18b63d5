"""backend="paper" on CPU: fwd+bwd time, and what its unguarded tie rule does to O.

Usage: python benchmarks/bench_paper.py [--reps 5] [--threads 1] [--old REV]
Timing: bf16, B=4, H=8, D=64, causal; backend="paper" against backend="reference" (the
fused FP32-accumulator reference) and, with --old REV, against the paper arithmetic as
it was at git revision REV (its kernels/reference.py, arithmetic="paper"), interleaved
per repetition; the median is reported.
Tie rule: N=1024 causal, B=2, H=4, D=64, keys duplicated (the second half copies random
first-half keys, so rows whose max falls on a copy are tied), q and k scaled so the
largest |score| is the given logit. Per logit: rows with ≥ 2 maxima (row-wide), and
among BETA rows those whose O is exactly 0 and those whose O norm fell below 1 % of
the STANDARD O's (the block sum hit the 1e-10 floor).
"""

from __future__ import annotations

import argparse
import importlib
import math
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import flashwatch as fw
from flashwatch.kernels import paper


def old_paper_attention(rev: str):
    """reference.attention(arithmetic="paper") as kernels/ held it at `rev`."""
    root = pathlib.Path(__file__).resolve().parents[1]
    pkg = pathlib.Path(tempfile.mkdtemp()) / "old_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("common.py", "reference.py"):
        src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:kernels/{name}"],
                             check=True, capture_output=True, text=True).stdout
        (pkg / name).write_text(src)
    sys.path.insert(0, str(pkg.parent))
    ref = importlib.import_module("old_kernels.reference")
    return lambda q, k, v: ref.attention(q, k, v, causal=True, arithmetic="paper")


def fwd_bwd_seconds(fn, q, k, v, do) -> float:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    t0 = time.perf_counter()
    fn(q, k, v).backward(do)
    return time.perf_counter() - t0


def timing(lengths, reps, old_rev):
    ops = {
        "paper": lambda q, k, v: fw.attention(q, k, v, causal=True, backend="paper"),
        "reference": lambda q, k, v: fw.attention(q, k, v, causal=True, backend="reference"),
    }
    if old_rev:
        ops[f"paper@{old_rev}"] = old_paper_attention(old_rev)
    print("| N | " + " | ".join(f"{n} fwd+bwd (ms)" for n in ops) + " |")
    print("|---|" + "---|" * len(ops))
    for n in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(4, 8, n, 64, generator=g).bfloat16() for _ in range(4))
        times = {name: [] for name in ops}
        for op in ops.values():  # warm-up
            fwd_bwd_seconds(op, q, k, v, do)
        for _ in range(reps):
            for name, op in ops.items():
                times[name].append(fwd_bwd_seconds(op, q, k, v, do))
        print(f"| {n} | " + " | ".join(f"{1e3 * statistics.median(t):.1f}"
                                       for t in times.values()) + " |")


def tie_rule(logits):
    B, H, N, D = 2, 4, 1024, 64
    print("| max logit | tied rows | BETA rows with O = 0 | BETA rows with |O| < 1 % of "
          "STANDARD's |")
    print("|---|---|---|---|")
    for logit in logits:
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
        src = torch.randint(0, N // 2, (N - N // 2,), generator=g)
        k[:, :, N // 2:] = k[:, :, src]
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        f = math.sqrt(logit / s.abs().amax().item())
        q, k = (q * f).bfloat16(), (k * f).bfloat16()
        v = torch.randn(B, H, N, D, generator=g).bfloat16()
        out = {}
        for mode in (fw.Mode.STANDARD, fw.Mode.BETA):
            modes = torch.full((H,), int(mode), dtype=torch.int32)
            out[mode] = paper.forward(q, k, v, causal=True, scale=D**-0.5, modes=modes,
                                      beta=2.0, eps=1e-3)
        o_std = out[fw.Mode.STANDARD].o.float().norm(dim=-1)
        o_beta = out[fw.Mode.BETA].o.float().norm(dim=-1)
        rows = B * H * N
        tied = out[fw.Mode.STANDARD].tied_rows.sum().item()
        zero = (o_beta == 0).sum().item()
        small = (o_beta < 0.01 * o_std).sum().item()
        print(f"| {out[fw.Mode.STANDARD].max_logit.max().item():.0f} | {tied} of {rows} | "
              f"{zero} | {small} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--logits", type=float, nargs="+", default=[30.0, 250.0, 2500.0])
    ap.add_argument("--old", default=None, help="git revision whose paper arithmetic to time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), bf16, causal, "
          f"B=4 H=8 D=64, median of {args.reps} interleaved reps")
    timing(args.lengths, args.reps, args.old)
    print()
    tie_rule(args.logits)


if __name__ == "__main__":
    main()
