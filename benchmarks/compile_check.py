"""Compile every Triton kernel for a GPU target without a GPU (ptxas ships with triton).

Catches errors in the native code path (the one TRITON_INTERPRET=1 never runs) on a
CPU-only machine:  python benchmarks/compile_check.py [--arch 90]
Compiles forward (causal × stats, D 64/128), δ, dK/dV and dQ kernels in bf16 and fp16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: this compiles the native kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashwatch.kernels import triton_attention as ta  # noqa: E402


def signature(fn, types, constexprs):
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types(name)
    return sig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    jobs = []
    for dt in ("bf16", "fp16"):
        ptr = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ"}

        def types(name, dt=dt, ptr=ptr):
            if name in ptr:
                return f"*{dt}"
            if name in ("O32", "LSE", "DELTA", "ST_MAX"):
                return "*fp32"
            if name in ("HEADS", "ST_CNT"):
                return "*i32"
            if name in ("sm_scale", "beta_m1", "eps", "guard", "min_excess"):
                return "fp32"
            return "i32"

        for d in (64, 128):
            w = 8 if d == 128 else 4
            for causal in (False, True):
                for stats in (False, True):
                    c = dict(D=d, BLOCK_M=128, BLOCK_N=64, CAUSAL=causal, STATS=stats,
                             INTERPRET=False)
                    jobs.append((ta._fwd_kernel, types, dict(c), w, 3, dt))
                c = dict(D=d, BLOCK_M=64, BLOCK_N=128, CAUSAL=causal, INTERPRET=False)
                jobs.append((ta._bwd_dkdv, types, c, w, 2, dt))
                c = dict(D=d, BLOCK_M=128, BLOCK_N=64, CAUSAL=causal, INTERPRET=False)
                jobs.append((ta._bwd_dq, types, c, w, 2, dt))
            jobs.append((ta._bwd_delta, types, dict(D=d, BLOCK_M=64, INTERPRET=False), 4, 1, dt))
    failures = 0
    for fn, types, consts, warps, stages, dt in jobs:
        t0 = time.time()
        src = ASTSource(fn=fn, signature=signature(fn, types, consts), constexprs=consts)
        try:
            k = triton.compile(src, target=target,
                               options={"num_warps": warps, "num_stages": stages})
            smem = k.metadata.shared
            print(f"ok   {fn.__name__:12s} {dt} {consts} smem={smem} ({time.time() - t0:.1f}s)")
        except Exception as e:  # report every failure, then exit non-zero
            failures += 1
            print(f"FAIL {fn.__name__:12s} {dt} {consts}: {type(e).__name__}: {e}")
    print(f"{len(jobs) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
