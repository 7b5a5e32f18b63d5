"""Compile every Triton kernel for a GPU target without a GPU (ptxas ships with triton).

Catches errors in the native code path (the one TRITON_INTERPRET=1 never runs) on a
CPU-only machine, and measures registers and spills per autotune config with ptxas -v:

  python benchmarks/compile_check.py [--arch 90]            one config per kernel and D
  python benchmarks/compile_check.py --spills [--dtypes bf16 fp16]
      every candidate config of flashwatch/kernels/triton_tuning.py (forward with STATS on and off:
      ptxas allocates them differently), a table of registers / spill bytes; exits 1 if a
      config inside the tuned space (triton_tuning.tuned_space) spills. --space: only
      those. --causal 1: only the causal variant (a superset of the non-causal code).
      --masked: the attn_mask / softcap / sliding-window variants (MASKED below), checked
      against their own spaces (FWD_SPACE_MASKED, BWD_SPACE_MASKED).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: this compiles the native kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashwatch.kernels import triton_attention as ta  # noqa: E402
from flashwatch.kernels import triton_tuning as tuning  # noqa: E402

PTRS = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ"}
FP32_PTRS = {"O32", "LSE", "DELTA", "ST_MAX", "DQ32"}
FLOATS = {"sm_scale", "qk_scale", "cap", "beta_m1", "eps", "guard", "min_excess"}
# attn_mask, softcap and sliding-window variants (constexprs MASK_KIND: 0 none, 1 bool
# read as u8, 2 float; SOFTCAP; SLIDING, its size the i32 `window`, never specialised)
PLAIN = dict(MASK_KIND=0, SOFTCAP=False, SLIDING=False)
MASKED = [dict(MASK_KIND=1, SOFTCAP=False, SLIDING=False),
          dict(MASK_KIND=2, SOFTCAP=True, SLIDING=False),
          dict(MASK_KIND=0, SOFTCAP=False, SLIDING=True),
          dict(MASK_KIND=1, SOFTCAP=True, SLIDING=True)]


def signature(fn, dt, constexprs):
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name in PTRS:
            return f"*{dt}"
        if name in FP32_PTRS:
            return "*fp32"
        if name in ("HEADS", "ST_CNT"):
            return "*i32"
        if name == "MASK":
            return "*u8" if constexprs.get("MASK_KIND") == 1 else "*fp32"
        return "fp32" if name in FLOATS else "i32"
    return {name: kind(name) for name in fn.arg_names}


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas -v, as triton runs it."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
             f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", src + ".o"],
            capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return regs, int(spill.group(1)), int(spill.group(2))


def compile_one(fn, dt, consts, warps, stages, arch):
    src = ASTSource(fn=fn, signature=signature(fn, dt, consts), constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def quick_jobs(dtypes):
    """One config per kernel, head dim and mode (the FLASHWATCH_TRITON_AUTOTUNE=0 ones)."""
    jobs = []
    for dt in dtypes:
        for d in (64, 128):
            for causal in (False, True):
                for stats, extra in [(False, PLAIN), (True, PLAIN)] + [(True, m) for m in MASKED]:
                    bm, bn, w, s = fixed(ta._fwd_kernel, d, extra)
                    c = dict(D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, STATS=stats,
                             INTERPRET=False, **extra)
                    jobs.append((ta._fwd_kernel, dt, c, w, s))
                for extra in [PLAIN, *MASKED]:
                    bm, bn, w, s = fixed(ta._bwd_kernel, d, extra)
                    c = dict(D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, INTERPRET=False,
                             **extra)
                    jobs.append((ta._bwd_kernel, dt, c, w, s))
            for fn in (ta._bwd_prep, ta._bwd_dq_out):
                jobs.append((fn, dt, dict(D=d, BLOCK_M=64, INTERPRET=False), 4, 1))
    return jobs


def spill_jobs(dtypes, causals, masked=False):
    """Every candidate config of the forward (STATS on and off) and the backward, plain or
    (masked) in each of the MASKED variants."""
    jobs = []
    for dt, d, causal, extra in itertools.product(dtypes, (64, 128), map(bool, causals),
                                                  MASKED if masked else [PLAIN]):
        for (bm, bn, w, s), stats in itertools.product(tuning.FWD_CANDIDATES, (True, False)):
            c = dict(D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, STATS=stats,
                     INTERPRET=False, **extra)
            jobs.append((ta._fwd_kernel, dt, c, w, s))
        for bm, bn, w, s in tuning.BWD_CANDIDATES:
            c = dict(D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, INTERPRET=False, **extra)
            jobs.append((ta._bwd_kernel, dt, c, w, s))
    return jobs


def _space(fn, consts) -> list[tuple]:
    """The tuned space of this kernel variant (triton_tuning.tuned_space)."""
    masked = tuning.is_masked(consts["MASK_KIND"], consts["SOFTCAP"])
    return tuning.tuned_space(consts["D"], backward=fn is ta._bwd_kernel, masked=masked,
                              autotune=True)


def fixed(fn, d, extra) -> tuple:
    """The FLASHWATCH_TRITON_AUTOTUNE=0 config of this kernel variant."""
    masked = tuning.is_masked(extra["MASK_KIND"], extra["SOFTCAP"])
    return tuning.tuned_space(d, backward=fn is ta._bwd_kernel, masked=masked,
                              autotune=False)[0]


def in_space(fn, consts, warps, stages) -> bool:
    if fn not in (ta._fwd_kernel, ta._bwd_kernel):
        return True
    return (consts["BLOCK_M"], consts["BLOCK_N"], warps, stages) in _space(fn, consts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10")
    ap.add_argument("--spills", action="store_true", help="every candidate config, with "
                    "registers and spills; fail if a config in the tuned space spills")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    ap.add_argument("--space", action="store_true", help="--spills: only the configs "
                    "inside the tuned space")
    ap.add_argument("--masked", action="store_true", help="--spills: the attn_mask, "
                    "softcap and sliding-window variants instead of the plain kernels")
    ap.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1],
                    help="--spills: 1 alone measures the causal variant (a superset of the "
                    "non-causal code: one more compare in the masked loops)")
    args = ap.parse_args()
    jobs = (spill_jobs(args.dtypes, args.causal, args.masked) if args.spills
            else quick_jobs(args.dtypes))
    if args.space:
        jobs = [j for j in jobs if in_space(j[0], j[2], j[3], j[4])]
    failures = spilling = 0
    print("kernel       dtype D   causal stats mask cap win BLOCK_M BLOCK_N warps stages "
          "regs spill_st spill_ld smem  in_space")
    for fn, dt, consts, warps, stages in jobs:
        t0 = time.time()
        tag = f"{fn.__name__:12s} {dt:5s} {consts['D']:<3d} {consts.get('CAUSAL', '-')!s:6s} " \
              f"{consts.get('STATS', '-')!s:5s} {consts.get('MASK_KIND', '-')!s:4s} " \
              f"{consts.get('SOFTCAP', '-')!s:3.3s} {consts.get('SLIDING', '-')!s:3.3s}"
        try:
            k = compile_one(fn, dt, consts, warps, stages, args.arch)
            regs, st, ld = ptxas_usage(k.asm["ptx"], args.arch)
        except Exception as e:  # report every failure, then exit non-zero
            failures += 1
            print(f"FAIL {tag} {consts}: {type(e).__name__}: {e}")
            continue
        inside = in_space(fn, consts, warps, stages)
        spilling += inside and (st > 0 or ld > 0)
        print(f"{tag} {consts.get('BLOCK_M', '-')!s:7s} {consts.get('BLOCK_N', '-')!s:7s} "
              f"{warps:<5d} {stages:<6d} {regs:<4d} {st:<8d} {ld:<8d} {k.metadata.shared:<5d} "
              f"{'yes' if inside else 'no'}  ({time.time() - t0:.1f}s)", flush=True)
    print(f"{len(jobs) - failures} compiled, {failures} failed, {spilling} spilling inside "
          f"the tuned space")
    return 1 if failures or spilling else 0


if __name__ == "__main__":
    sys.exit(main())
