"""W^Q spectral norm of a sharded weight on 2 gloo ranks: the sharded power iteration
(local rows, one all_reduce of H·(d_model + 1) numbers per iteration) against gathering
W^Q (`full_tensor()`) and then the plain power iteration, or the Gram-matrix norm
(`spectral.gram_norm`, what flashwatch's gathering fallback runs).

    python benchmarks/bench_sharded_spectral.py [--d-model 2048] [--heads 16] [--reps 5]

A Llama-style q_proj Linear [H·d_head, d_model] sharded on dim 0 (FSDP2's layout); cold
start, then warm starts after a small perturbation (an optimizer step's worth).
Prints the median time per call of each and the numbers each rank sends per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from flashwatch.parallel import power  # noqa: E402
from flashwatch.signals.spectral import gram_norm, power_iteration  # noqa: E402
from flashwatch.sites import find_sites  # noqa: E402


class Attention(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model, bias=False)
                                                 for _ in range(3))
        self.num_heads = heads


def _worker(rank, world, init_file, args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    attn = Attention(args.d_model, args.heads)
    site = find_sites(attn)[0]
    full = attn.q_proj.weight.detach().clone()
    attn.q_proj.weight = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    H, C = args.heads, args.d_model

    def sharded(v):
        return power.spectral_norm(site, v, 4)

    def gathered(v):
        return power_iteration(site.wq().full_tensor().float(), v, 4)

    def gathered_gram(v):
        return gram_norm(site.wq().full_tensor().float())

    times = {}
    for name, fn in (("sharded", sharded), ("gathered", gathered),
                     ("gathered, Gram", gathered_gram)):
        t0 = time.perf_counter()
        sigma, v = fn(None)
        cold = time.perf_counter() - t0
        warm = []
        for i in range(args.reps):
            with torch.no_grad():  # a small step: W moves by 1e-3 of its scale
                local = attn.q_proj.weight.to_local()
                local.add_(torch.randn(local.shape, generator=torch.Generator().manual_seed(i))
                           * 1e-3 * local.std())
            dist.barrier()
            t0 = time.perf_counter()
            sigma, v = fn(v)
            warm.append(time.perf_counter() - t0)
        final = attn.q_proj.weight.full_tensor().detach().double()  # a collective
        exact = torch.linalg.matrix_norm(final.unflatten(0, (H, -1)), ord=2)
        err = ((sigma.double() - exact).abs() / exact).max().item()
        times[name] = (cold, statistics.median(warm), err)
    if rank == 0:
        for name, (cold, warm, err) in times.items():
            print(f"{name:15s} cold {cold * 1e3:8.1f} ms  warm {warm * 1e3:7.1f} ms  "
                  f"max rel. error {err:.1e}")
        print(f"numbers sent per iteration by the sharded one: H·(d_model+1) = "
              f"{H * (C + 1):,}; the gather moves W^Q, {full.numel():,}, per call")
    dist.destroy_process_group()


def main():
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
