"""The monitor's cross-rank exchange on its own gloo group: time per monitored step.

Usage: python benchmarks/bench_reduce.py [--heads 144 1536 5120] [--reps 50]

Two gloo processes on this machine (loopback). Per head count n (k = sketch_dim 8): the
time of one reduce.exchange (one SUM of n·(12 + k²) + 1 and one MAX of 9n + 2 float64
values, with packing) and of the vote (one 4-value MAX), median over --reps after 5
warm-up rounds, and the payload in bytes. GPT-2 Small has 144 heads, a 1.5 B model
≈ 1,536, the scale benchmark 5,120.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from flashwatch.monitor import aggregate  # noqa: E402
from flashwatch.parallel import reduce


def _worker(rank, world, init_file, heads, reps, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    monitor = reduce.MonitorGroup(timeout_s=60)
    rows = []
    for n in heads:
        shapes = aggregate.shapes(n, 8)
        local = {k.removeprefix("max:"): torch.rand(s, dtype=torch.float64)
                 for k, s in shapes.items()}
        times, votes = [], []
        for i in range(reps + 5):
            t0 = time.perf_counter()
            reduce.exchange(monitor, local, local, shapes, step=i)
            t1 = time.perf_counter()
            monitor.all_reduce_(torch.zeros(4, dtype=torch.float64), "max")
            t2 = time.perf_counter()
            if i >= 5:
                times.append(t1 - t0)
                votes.append(t2 - t1)
        size = sum(torch.Size(s).numel() for s in shapes.values()) * 8
        rows.append((n, size, statistics.median(times) * 1e3, statistics.median(votes) * 1e3))
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[144, 1536, 5120])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), args.heads, args.reps, out),
                 nprocs=2, join=True)
        rows = torch.load(out)
    print("| heads | payload (bytes) | exchange (ms, median) | vote (ms, median) |")
    print("|---|---|---|---|")
    for n, size, t, v in rows:
        print(f"| {n} | {size:,} | {t:.2f} | {v:.3f} |")


if __name__ == "__main__":
    main()
