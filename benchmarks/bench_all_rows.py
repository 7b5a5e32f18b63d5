"""Cost of the δ error on every row: monitored training steps, all rows vs sampled rows.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_all_rows.py [--steps 20] [--threads 1]
       python benchmarks/bench_all_rows.py --device cuda --block 1024   (gpu_check.py)

GPT 4 layers × 4 heads, d=128, T=128 (--block), B=8, bf16 autocast, AdamW; every step
monitored
(every_n_steps=1), so each timed step pays the full monitoring cost. Arms, trained in
alternation step by step from one initialisation so that machine noise hits all alike:
  plain             not watched (SDPA)
  sdpa_sampled      watched, SDPA (a foreign kernel), rows_per_head=64
  sdpa_all          watched, SDPA, rows_per_head="all" (every row recomputed in FP32)
  own_sampled       watched, route_all (flashwatch's kernel: reference on CPU, Triton
                    on CUDA), c on 64 rows
                    only (the kernel's FP32 O not requested: the earlier behaviour)
  own_all           watched, route_all, c on every row from the kernel's FP32 O (default)
Prints the median step per arm and the ratios all / sampled side by side.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from flashwatch.kernels import dispatch as fw_dispatch  # noqa: E402

ARMS = ("plain", "sdpa_sampled", "sdpa_all", "own_sampled", "own_all")


def without_fp32_o(real):
    """call_kernel that never hands the watcher the kernel's FP32 O (sampled rows only)."""
    def dispatch(*args, o32_out=None, **kw):
        return real(*args, **kw)
    return dispatch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cfg = GPTConfig(block_size=args.block, vocab_size=256, n_layer=4, n_head=4, n_embd=128)
    torch.manual_seed(0)
    base = GPT(cfg).to(dev)
    models = {arm: copy.deepcopy(base) for arm in ARMS}
    kw = dict(every_n_steps=1, mitigation="off")
    watchers = {
        "sdpa_sampled": fw.watch(models["sdpa_sampled"], **kw),
        "sdpa_all": fw.watch(models["sdpa_all"], rows_per_head="all", **kw),
        "own_sampled": fw.watch(models["own_sampled"], route_all=True, **kw),
        "own_all": fw.watch(models["own_all"], route_all=True, **kw),
    }
    opts = {arm: torch.optim.AdamW(m.parameters(), lr=1e-3) for arm, m in models.items()}
    real = fw_dispatch.call_kernel
    g = torch.Generator().manual_seed(0)
    times = {arm: [] for arm in ARMS}
    for step in range(args.steps + 2):
        idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
        x, y = idx[:, :-1].to(dev), idx[:, 1:].to(dev)
        for arm in ARMS:
            fw_dispatch.call_kernel = without_fp32_o(real) if arm == "own_sampled" else real
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                _, loss = models[arm](x, y)
            loss.backward()
            opts[arm].step()
            opts[arm].zero_grad(set_to_none=True)
            if arm in watchers:
                report = watchers[arm].step()
                assert report.heads[0].delta_error_all_rows == arm.endswith("_all"), arm
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if step >= 2:  # warm-up
                times[arm].append(time.perf_counter() - t0)
    fw_dispatch.call_kernel = real
    med = {arm: statistics.median(t) for arm, t in times.items()}
    print(f"GPT {cfg.n_layer}L {cfg.n_head}H d={cfg.n_embd} T={cfg.block_size} B=8, bf16 "
          f"autocast, {dev}, {torch.get_num_threads()} thread(s), {args.steps} monitored "
          f"steps per arm")
    print("| arm | median step | / plain |")
    print("|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {1e3 * med[arm]:.1f} ms | {med[arm] / med['plain']:.3f} |")
    print(f"| all / sampled, SDPA (rows_per_head=\"all\") | | "
          f"{med['sdpa_all'] / med['sdpa_sampled']:.3f} |")
    print(f"| all / sampled, own kernel (FP32 O residual) | | "
          f"{med['own_all'] / med['own_sampled']:.3f} |")


if __name__ == "__main__":
    main()
