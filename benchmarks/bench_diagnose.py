"""Time and memory of `flashwatch.diagnosis.diagnose` on a GPT-2-shaped 124M-parameter model
or a 1B-parameter GPT shape, CPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_diagnose.py --batches 4 --block 1024 \
        --dtype float32
    OMP_NUM_THREADS=1 python benchmarks/bench_diagnose.py --shape 1b --batches 1 \
        --block 512 --dtype float32 --layers 0,17

examples/gpt.py at GPT-2 Small's shape (12 layers, 12 heads, d 768, vocab 50,257,
1,024 positions: 124M parameters) or `--shape 1b` (18 layers, 32 heads of 64, d 2,048:
1.01B parameters), random init, random token ids. `--layers` measures a subset of the
attention layers (as `flashwatch diagnose --layers`): the forward still runs every
layer, the backward stops at the first layer measured. Side by side in one
process: a plain training step of the same batch (BF16 autocast forward, backward of
every parameter, in `--dtype`: bfloat16 autocast or float32) and diagnose on the same
batches in the same dtype (every row of every head measured in FP64).
Peak memory is the process's maximum resident set (ru_maxrss), read after building the
model, after the plain steps and after diagnose.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/

from examples.gpt import GPT, GPTConfig  # noqa: E402
from flashwatch import diagnose  # noqa: E402
from flashwatch.diagnosis.cli import parse_layers  # noqa: E402

SHAPES = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768),
          "1b": dict(n_layer=18, n_head=32, n_embd=2048)}


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--shape", choices=tuple(SHAPES), default="gpt2")
    p.add_argument("--n-layer", type=int, default=None, help="model depth (the shape's)")
    p.add_argument("--layers", default=None, help="layers measured, e.g. 0,5-7 (all)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--plain-steps", type=int, default=1, help="plain steps timed (1)")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else None
    torch.manual_seed(0)
    shape = SHAPES[a.shape] | ({} if a.n_layer is None else dict(n_layer=a.n_layer))
    model = GPT(GPTConfig(block_size=1024, vocab_size=50257, **shape))
    layers = parse_layers(a.layers) if a.layers else None
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(50257, (a.batch_size, a.block + 1), generator=gen)
               for _ in range(a.batches)]
    rss_model = rss_mib()

    t0 = time.perf_counter()
    for b in batches[:a.plain_steps]:  # the plain training step, for scale
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
    plain = (time.perf_counter() - t0) / a.plain_steps
    rss_plain = rss_mib()

    t0 = time.perf_counter()
    res = diagnose(model, batches, dtype=dtype, name=a.shape, layers=layers)
    diag = (time.perf_counter() - t0) / a.batches
    rss_diag = rss_mib()

    print(f"command: OMP_NUM_THREADS={torch.get_num_threads()} python "
          f"benchmarks/bench_diagnose.py --shape {a.shape} --batches {a.batches} "
          f"--batch-size {a.batch_size} --block {a.block} --dtype {a.dtype} --plain-steps "
          f"{a.plain_steps}" + (f" --n-layer {a.n_layer}" if a.n_layer else "")
          + (f" --layers {a.layers}" if a.layers else ""))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{params / 1e6:.1f}M parameters, {a.batches} batches of "
          f"{a.batch_size}×{a.block} tokens")
    print("| what | per batch (s) | ratio to the plain step | peak RSS after (MiB) |")
    print("|---|---|---|---|")
    print(f"| model built | – | – | {rss_model:.0f} |")
    print(f"| plain {a.dtype} training step (fwd + bwd) | {plain:.2f} | 1.00 | {rss_plain:.0f} |")
    measured = f"{len(layers)} of {shape['n_layer']} layers" if layers else "every layer"
    print(f"| diagnose ({measured}, every row, FP64) | {diag:.2f} | {diag / plain:.2f} | "
          f"{rss_diag:.0f} |")
    top = res["heads"][0]
    print(f"heads: {len(res['heads'])}; top: {top['layer']}/{top['head']} {top['verdict']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
