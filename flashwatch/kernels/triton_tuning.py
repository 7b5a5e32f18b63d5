"""Autotune spaces and keys of the Triton attention kernels (triton_attention.py).

Keys: the autotuner tunes once per (length bucket, D, CAUSAL, SLIDING[, STATS],
MASK_KIND, SOFTCAP, dtypes), where a length's bucket is its next power of two
(`bucket`), passed to the kernels as the otherwise unused int arguments N_Q_BKT and
N_K_BKT. A new exact
length in a seen bucket reuses the tuned config and the compiled kernel (ints are
specialised only on divisibility by 16 and == 1), so training with varying lengths
neither retunes nor recompiles after warm-up, and a CUDA-graph capture never meets a
tuning run. The sliding window's size (`window`) is not in the key and the kernels are
not specialised on it (do_not_specialize): a new size neither retunes nor recompiles;
only turning it on or off (SLIDING) does.

Spaces: only configs that ptxas compiles for sm_90 without spilling, per head dim, and
for the attn_mask and softcap variants their own (`tuned_space`;
`benchmarks/compile_check.py --spills [--masked]` measures every config; its numbers are
in benchmarks/RESULTS.md). FLASHWATCH_TRITON_AUTOTUNE=0 keeps one config per head dim
and variant (the native test run: tuning every test shape would cost minutes of
compiles).

Interpreter (TRITON_INTERPRET=1): the same autotuned launch, pruned to the blocks in
`INTERP_BLOCKS` (16 is the smallest tl.dot tile; small blocks keep CPU tests fast and
let N ≈ 40 cross several blocks and a ragged end), so the key and its cache are tested
on CPU too.
"""

from __future__ import annotations

import os

import triton

AUTOTUNE = os.environ.get("FLASHWATCH_TRITON_AUTOTUNE", "1") != "0"
FWD_MIN_BLOCK_M = 64  # the forward's counter buffer has a slot per 64 query rows
INTERP_BLOCKS = dict(BLOCK_M=16, BLOCK_N=16)  # tests swap in other blocks (rectangular)

FWD_KEY = ["N_Q_BKT", "N_K_BKT", "D", "CAUSAL", "SLIDING", "STATS", "MASK_KIND", "SOFTCAP"]
BWD_KEY = ["N_Q_BKT", "N_K_BKT", "D", "CAUSAL", "SLIDING", "MASK_KIND", "SOFTCAP"]


def bucket(n: int) -> int:
    """The autotune key of a length: its next power of two."""
    return triton.next_power_of_2(n)


def _cfg(num_warps, num_stages, **blocks):
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


def _grid(pairs, warps=(4, 8), stages=(2, 3)):
    """(block, ..., warps, stages) tuples for every combination."""
    return [(*p, w, s) for p in pairs for w in warps for s in stages]


# Candidate spaces: every config compile_check.py measures, (BLOCK_M, BLOCK_N, warps,
# stages). The backward runs one program per key block (BLOCK_N keys resident).
FWD_CANDIDATES = _grid([(64, 16), (64, 32), (64, 64), (128, 32), (128, 64)])
BWD_CANDIDATES = _grid([(16, 32), (32, 16), (32, 32), (32, 64), (64, 32), (64, 64)],
                       stages=(1, 2))

# The spill-free subsets, per head dim, from `compile_check.py --spills` (sm_90, ptxas
# 13.4): every candidate in bf16 causal (forward with STATS on), and the kept ones in
# bf16 and fp16, causal and not, forward with STATS on and off (fp16 gives bf16's numbers);
# D 16 and 32 use the D=64 set. Measured: every backward config with 4 warps spills
# except BLOCK_M 16; BLOCK_N 64 spills in every forward config (its [BLOCK_M, 64] score,
# tie and P̄ tiles); at D=128 the backward fits only with BLOCK_M 16 or (32, 16).
FWD_SPACE = {
    64: [(64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 8, 2), (64, 32, 8, 3), (128, 32, 8, 2),
         (128, 32, 8, 3)],
    128: [(64, 32, 8, 2), (64, 32, 8, 3)],  # (128, 32, 8) spills 24 B causal, STATS off
}
BWD_SPACE = {
    64: [(16, 32, 4, 1), (16, 32, 4, 2), (16, 32, 8, 1), (16, 32, 8, 2), (32, 16, 8, 1),
         (32, 16, 8, 2), (32, 32, 8, 1), (32, 32, 8, 2), (32, 64, 8, 1), (32, 64, 8, 2)],
    128: [(16, 32, 4, 1), (16, 32, 4, 2), (16, 32, 8, 1), (16, 32, 8, 2), (32, 16, 8, 1)],
}
# One config per head dim when tuning is off (FLASHWATCH_TRITON_AUTOTUNE=0).
FWD_FIXED = {64: (128, 32, 8, 2), 128: (64, 32, 8, 2)}
BWD_FIXED = {64: (32, 64, 8, 2), 128: (16, 32, 8, 1)}

# attn_mask and softcap variants (MASK_KIND 1 or 2, or SOFTCAP; a sliding window alone
# fits the plain spaces): the mask's pointer and value tiles and the cap's tanh take
# registers the plain forward does not have, and most of its space spills there
# (`compile_check.py --spills --masked`, causal bf16, STATS on: a bool mask spills 296 B
# in (128, 32, 8) at D=64 and 376 B in (64, 32, 8) at D=128; every 4-warp forward spills
# ≥ 1 kB at D=64). Their own spill-free subsets, measured in all four MASKED variants of
# compile_check.py: the forward keeps 8 warps and, at D=128, 16-key blocks (203-231
# registers); the backward keeps the plain space but (16, 32, 4, 2) at D=128 (20 B with a
# float mask and softcap).
FWD_SPACE_MASKED = {64: [(64, 32, 8, 2), (64, 32, 8, 3)],
                    128: [(64, 16, 8, 2), (64, 16, 8, 3)]}
BWD_SPACE_MASKED = {64: BWD_SPACE[64],
                    128: [(16, 32, 4, 1), (16, 32, 8, 1), (16, 32, 8, 2), (32, 16, 8, 1)]}
FWD_FIXED_MASKED = {64: (64, 32, 8, 2), 128: (64, 16, 8, 2)}
BWD_FIXED_MASKED = BWD_FIXED


def _space_d(d: int) -> int:
    return 128 if d > 64 else 64


def is_masked(mask_kind: int, softcap: bool) -> bool:
    """Whether a kernel variant uses the masked spaces (attn_mask or softcap)."""
    return bool(mask_kind) or bool(softcap)


# (backward, masked) -> (tuned space, fixed config), per head dim
_TABLES = {(False, False): (FWD_SPACE, FWD_FIXED),
           (False, True): (FWD_SPACE_MASKED, FWD_FIXED_MASKED),
           (True, False): (BWD_SPACE, BWD_FIXED),
           (True, True): (BWD_SPACE_MASKED, BWD_FIXED_MASKED)}


def tuned_space(d: int, *, backward: bool, masked: bool, autotune: bool | None = None
                ) -> list[tuple]:
    """The configs the autotuner may pick for head dim d: the tuned space, or the one
    fixed config without autotuning (default: FLASHWATCH_TRITON_AUTOTUNE=0)."""
    space, fixed = _TABLES[bool(backward), bool(masked)]
    if AUTOTUNE if autotune is None else autotune:
        return list(space[_space_d(d)])
    return [fixed[_space_d(d)]]


def _tuple(c: triton.Config, names) -> tuple:
    return (*(c.kwargs[n] for n in names), c.num_warps, c.num_stages)


def _pruner(backward, names, interpret):
    def prune(configs, named_args, **kwargs):
        if interpret:
            return [triton.Config({n: INTERP_BLOCKS[n] for n in names})]

        def arg(name):
            return kwargs.get(name, named_args.get(name))
        keep = set(tuned_space(arg("D"), backward=backward,
                               masked=is_masked(arg("MASK_KIND"), arg("SOFTCAP"))))
        return [c for c in configs if _tuple(c, names) in keep]
    return prune


def autotuned(kernel, *, backward: bool, interpret: bool, reset_to_zero=None,
              restore_value=None):
    """`kernel` wrapped in triton.autotune with this module's key and space.
    reset_to_zero / restore_value: the arguments a benchmark run would leave changed."""
    names = ("BLOCK_M", "BLOCK_N")
    cands = BWD_CANDIDATES if backward else FWD_CANDIDATES
    if interpret:  # two entries, so that the autotuner caches its (pruned) pick per key
        cands = [(16, 16, 1, 1), (16, 32, 1, 1)]
    configs = [_cfg(c[-2], c[-1], **dict(zip(names, c[:-2], strict=True))) for c in cands]
    prune = _pruner(backward, names, interpret)
    return triton.autotune(configs=configs, key=BWD_KEY if backward else FWD_KEY,
                           prune_configs_by={"early_config_prune": prune},
                           reset_to_zero=reset_to_zero, restore_value=restore_value)(kernel)
