"""Autotune keys of the Triton kernels (kernels/triton_tuning.py): lengths are bucketed to
their next power of two, so a new exact length reuses the tuned config. Runs the same
autotuned launch the GPU runs, in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), where its pick is pruned to the interpreter's blocks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import flashwatch as fw  # noqa: E402
from flashwatch.kernels import triton_attention as ta  # noqa: E402
from flashwatch.kernels import triton_tuning as tuning  # noqa: E402

DEVICE = "cpu" if ta.INTERPRET else "cuda"
if not ta.INTERPRET and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device",
                allow_module_level=True)


def test_bucket_is_next_power_of_two():
    assert [tuning.bucket(n) for n in (1, 2, 3, 37, 64, 65, 4095, 4096)] == [
        1, 2, 4, 64, 64, 128, 4096, 4096]


def fwd_bwd(n, gen):
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
               .requires_grad_() for _ in range(3))
    fw.attention(q, k, v, causal=True, backend="triton").sum().backward()


def test_lengths_in_one_bucket_share_one_tuning_entry(monkeypatch):
    for tuned in ta.TUNED:
        monkeypatch.setattr(tuned, "cache", {})
    gen = torch.Generator().manual_seed(0)
    fwd_bwd(37, gen)
    fwd_bwd(45, gen)  # same bucket (64): no new tuning entry
    assert [len(t.cache) for t in ta.TUNED] == [1, 1]
    fwd_bwd(70, gen)  # bucket 128: one more
    assert [len(t.cache) for t in ta.TUNED] == [2, 2]
    keys = sorted(ta.TUNED[1].cache)
    assert [key[:2] for key in keys] == [(64, 64), (128, 128)]  # (N_Q_BKT, N_K_BKT) first


@pytest.mark.parametrize("space,candidates", [
    (tuning.FWD_SPACE, tuning.FWD_CANDIDATES), (tuning.BWD_SPACE, tuning.BWD_CANDIDATES),
    (tuning.FWD_SPACE_MASKED, tuning.FWD_CANDIDATES),
    (tuning.BWD_SPACE_MASKED, tuning.BWD_CANDIDATES)],
    ids=["fwd", "bwd", "fwd_masked", "bwd_masked"])
def test_tuned_spaces_are_measured_candidates(space, candidates):
    # Every config the autotuner may pick was measured by compile_check.py --spills.
    for d, configs in space.items():
        assert configs, f"no config left for D={d}"
        assert set(configs) <= set(candidates), d


# Configs ptxas spills in, measured by `benchmarks/compile_check.py --spills --masked`
# (sm_90, bf16, causal; benchmarks/RESULTS.md), as (backward, D, MASK_KIND, SOFTCAP):
# [(BLOCK_M, BLOCK_N, warps, stages), ...]. The plain kernels fit in each of them.
SPILL_MASKED = {
    (False, 64, 1, False): [(128, 32, 8, 2), (64, 32, 4, 2)],  # 296 B, 1320 B
    (False, 128, 1, False): [(64, 32, 8, 2)],  # 376 B: the plain fixed config
    (False, 128, 2, True): [(64, 32, 8, 2), (128, 16, 8, 2)],  # 136 B, 40 B (STATS off)
    (True, 128, 2, True): [(16, 32, 4, 2)],  # 20 B
}


def _kept(backward, d, mask_kind, softcap):
    """The native (non-interpreter) pruner's pick from every candidate, as tuples."""
    names = ("BLOCK_M", "BLOCK_N")
    cands = tuning.BWD_CANDIDATES if backward else tuning.FWD_CANDIDATES
    configs = [tuning._cfg(w, s, BLOCK_M=bm, BLOCK_N=bn) for bm, bn, w, s in cands]
    prune = tuning._pruner(backward, names, interpret=False)
    kept = prune(configs, {"D": d}, MASK_KIND=mask_kind, SOFTCAP=softcap)
    return {tuning._tuple(c, names) for c in kept}


@pytest.mark.parametrize("key", list(SPILL_MASKED), ids=str)
def test_masked_variants_never_pick_a_config_measured_spilling(key):
    backward, d, kind, cap = key
    masked, plain = _kept(backward, d, kind, cap), _kept(backward, d, 0, False)
    assert masked and not masked & set(SPILL_MASKED[key])
    assert set(SPILL_MASKED[key]) & plain  # one the plain kernels may pick (they fit)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_each_variant_prunes_to_its_space_and_one_config_untuned(monkeypatch, backward, d):
    plain = tuning.BWD_SPACE if backward else tuning.FWD_SPACE
    masked = tuning.BWD_SPACE_MASKED if backward else tuning.FWD_SPACE_MASKED
    row = 64 if d <= 64 else 128  # D 16 and 32 use the D=64 spaces
    for kind, cap in [(0, False), (1, False), (2, False), (0, True), (1, True)]:
        want = masked if kind or cap else plain
        assert _kept(backward, d, kind, cap) == set(want[row]), (kind, cap)
    monkeypatch.setattr(tuning, "AUTOTUNE", False)
    plain_one, masked_one = _kept(backward, d, 0, False), _kept(backward, d, 1, True)
    assert len(plain_one) == 1 and len(masked_one) == 1
    assert plain_one <= set(plain[row]) and masked_one <= set(masked[row])
