"""Triton attention forward and counters against the reference, brute force and FP64
math: every mode, awkward and rectangular blocks, planted ties, large logits, modes as
data (shared helpers and the accuracy rule: tests/_triton.py)."""

from __future__ import annotations

import math

import pytest
import torch

import flashwatch as fw
from flashwatch.kernels import reference
from flashwatch.kernels.common import Mode
from tests._triton import (
    ALL_MODES,
    DEVICE,
    DTYPES,
    NK,
    NQ,
    assert_accuracy,
    assert_counters,
    planted_ties,
    quantized,
    run_triton,
    ta,
    tuning,
)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_matches_reference_all_modes(dtype, causal, head_dim):
    # One head per mode. Causal uses Nq > Nk (rows past Nk see every key), full Nq < Nk.
    nq, nk = (NK, NQ) if causal else (NQ, NK)
    gen = torch.Generator().manual_seed(head_dim + 7 * causal)
    B, H = 1, len(ALL_MODES)
    q = quantized(B, H, nq, head_dim, gen=gen, dtype=dtype)
    k = quantized(B, H, nk, head_dim, gen=gen, dtype=dtype)
    # Copy the first third of the keys into the last third (other blocks): rows whose max
    # is a copied key are tied across blocks, so BETA shifts change mid-row.
    third = nk // 3
    k[:, :, nk - third:] = k[:, :, :third]
    v = torch.randn(B, H, nk, head_dim, generator=gen).to(dtype).to(DEVICE)
    do = torch.randn(B, H, nq, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = 1.0 / math.sqrt(head_dim)
    stats = fw.AttentionStats.zeros(H)
    outs = run_triton(q, k, v, do, causal, scale, ALL_MODES, stats=stats)
    assert_accuracy(outs, q, k, v, do, causal, scale)
    assert_counters(stats, q, k, causal, scale, ALL_MODES)
    assert stats.tied_rows.sum() > 0, "test data should contain tied rows"
    # Same blocking as the reference (16-key blocks): results agree to rounding noise.
    if ta.INTERPRET:
        modes = torch.tensor(ALL_MODES, dtype=torch.int32)
        res = reference.forward(q, k, v, causal=causal, scale=scale, modes=modes, beta=2.0,
                                eps=1e-3, block_n=16)
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        assert (outs[0].float() - res.o.float()).abs().max() <= ulp * res.o.abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_single_query_and_key(dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, 3, 1, 32, generator=gen).to(dtype).to(DEVICE)
                   for _ in range(4))
    for causal in (False, True):
        outs = run_triton(q, k, v, do, causal, 0.2, ALL_MODES)
        assert_accuracy(outs, q, k, v, do, causal, 0.2)
        assert torch.equal(outs[0], v), "one key: O = V exactly"


@pytest.mark.skipif(not ta.INTERPRET, reason="block sizes are autotuned when compiled")
@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rectangular_blocks(monkeypatch, block_m, block_n, causal):
    # The GPU runs BLOCK_M != BLOCK_N (forward 64×32 or 128×32, backward 16×32 or 32×64); the
    # region split (unmasked / causal diagonal / ragged end) must hold for both ratios.
    monkeypatch.setattr(tuning, "INTERP_BLOCKS", dict(BLOCK_M=block_m, BLOCK_N=block_n))
    for tuned in ta.TUNED:  # the pick is cached per tuning key: forget it for this test
        monkeypatch.setattr(tuned, "cache", {})
    gen = torch.Generator().manual_seed(block_m + causal)
    nq, nk = (70, 53) if causal else (53, 70)
    q = quantized(1, 3, nq, 16, gen=gen, dtype=torch.bfloat16)
    k = quantized(1, 3, nk, 16, gen=gen, dtype=torch.bfloat16)
    k[:, :, 30:50] = k[:, :, :20]
    v = torch.randn(1, 3, nk, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    do = torch.randn(1, 3, nq, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    stats = fw.AttentionStats.zeros(3)
    outs = run_triton(q, k, v, do, causal, 0.25, ALL_MODES, stats=stats)
    assert_accuracy(outs, q, k, v, do, causal, 0.25)
    assert_counters(stats, q, k, causal, 0.25, ALL_MODES)
    modes = torch.tensor(ALL_MODES, dtype=torch.int32)
    res = reference.forward(q, k, v, causal=causal, scale=0.25, modes=modes, beta=2.0,
                            eps=1e-3, block_n=block_n)
    assert (outs[0].float() - res.o.float()).abs().max() <= 2.0 ** -7 * res.o.abs().max()
    dq, dk, dv, _ = reference.backward(do, q, k, v, res.o, res.o32, res.lse, causal=causal,
                                       scale=0.25, modes=modes, block_n=block_n)
    for got, want in zip(outs[1:], (dq, dk, dv), strict=True):
        assert (got.float() - want.float()).abs().max() <= 2.0 ** -6 * want.abs().max()


def test_causal_fewer_queries_than_keys():
    # Top-left causal with Nq < Nk: keys ≥ Nq are never visible, their dK, dV are 0.
    gen = torch.Generator().manual_seed(4)
    nq, nk = 21, NK
    q = quantized(1, 3, nq, 16, gen=gen, dtype=torch.bfloat16)
    k = quantized(1, 3, nk, 16, gen=gen, dtype=torch.bfloat16)
    k[:, :, 14:28] = k[:, :, :14]  # ties across blocks
    v = torch.randn(1, 3, nk, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    do = torch.randn(1, 3, nq, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    stats = fw.AttentionStats.zeros(3)
    outs = run_triton(q, k, v, do, True, 0.25, ALL_MODES, stats=stats)
    assert_accuracy(outs, q, k, v, do, True, 0.25)
    assert_counters(stats, q, k, True, 0.25, ALL_MODES)
    assert not outs[2][:, :, nq:].any() and not outs[3][:, :, nq:].any()


def test_lse_and_fp32_copy_match_reference():
    gen = torch.Generator().manual_seed(3)
    q = quantized(2, 3, NQ, 32, gen=gen, dtype=torch.bfloat16)
    k = quantized(2, 3, NK, 32, gen=gen, dtype=torch.bfloat16)
    v = torch.randn(2, 3, NK, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    modes = torch.tensor([2, 0, 2], dtype=torch.int32)
    o, lse, o32, *_ = ta.forward(q, k, v, modes, causal=False, scale=0.3, beta=2.0,
                                 eps=1e-3, want_stats=False)
    res = reference.forward(q, k, v, causal=False, scale=0.3, modes=modes, beta=2.0,
                            eps=1e-3, block_n=16)
    assert o32.shape == (2, 2, NQ, 32)  # [H32, B, Nq, D], heads 0 and 2
    torch.testing.assert_close(o32, res.o32.permute(1, 0, 2, 3), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, res.lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(o32.to(torch.bfloat16)[0], o[:, 0])  # O is the FP32 copy rounded


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_planted_ties_counted_exactly(dtype, causal):
    q, k, scale, n_tied = planted_ties(dtype)
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(k.shape, generator=gen).to(dtype).to(DEVICE)
    do = torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE)
    stats = fw.AttentionStats.zeros(3)
    outs = run_triton(q, k, v, do, causal, scale, ALL_MODES, stats=stats)
    assert_counters(stats, q, k, causal, scale, ALL_MODES)
    if not causal:
        assert stats.tied_rows.tolist() == [n_tied] * 3
    assert_accuracy(outs, q, k, v, do, causal, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_large_logits_beta_guard(dtype):
    q, k, scale, n_tied = planted_ties(dtype, big=True)
    gen = torch.Generator().manual_seed(6)
    v = torch.randn(k.shape, generator=gen).to(dtype).to(DEVICE)
    do = torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE)
    modes = [int(Mode.BETA), int(Mode.STANDARD), int(Mode.BETA)]
    stats = fw.AttentionStats.zeros(3)
    outs = run_triton(q, k, v, do, False, scale, modes, stats=stats)
    assert_counters(stats, q, k, False, scale, modes)
    assert stats.max_logit[0] >= 1000
    # every tied row has |r_m| = 1024 ≫ guard: all tied BETA rows are guarded
    assert stats.tied_rows.tolist() == [n_tied] * 3
    assert stats.guarded_rows.tolist() == [n_tied, 0, n_tied]
    assert_accuracy(outs, q, k, v, do, False, scale)


# ---------------------------------------------------------------------------------
# modes are data: a change takes effect on the next call
# ---------------------------------------------------------------------------------


def test_head_mode_change_between_calls():
    q, k, scale, n_tied = planted_ties(torch.bfloat16, big=True)
    gen = torch.Generator().manual_seed(8)
    v = torch.randn(k.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    do = torch.randn(q.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    results = {}
    # Same 16-key blocking as the interpreter kernels: agreement to 1 ulp (bf16 2^-7 of
    # max|O|). Compiled kernels use other blocks, so BETA shifts move at other keys.
    ulps = 1 if ta.INTERPRET else 4
    for modes in ([0, 0, 0], [1, 2, 0], [0, 0, 0]):
        stats = fw.AttentionStats.zeros(3)
        outs = run_triton(q, k, v, do, False, scale, modes, stats=stats)
        results.setdefault(tuple(modes), []).append((outs, stats))
        # the reference with the same modes, and the same 16-key blocking
        res = reference.forward(q, k, v, causal=False, scale=scale,
                                modes=torch.tensor(modes, dtype=torch.int32), beta=2.0,
                                eps=1e-3, block_n=16)
        assert (outs[0].float() - res.o.float()).abs().max() <= (
            ulps * 2.0 ** -7 * res.o.abs().max())
        # Gradients: the FP64 2× rule. Not the reference to an ulp: the kernel's P (exp2 of
        # the scale·log2e-folded scores) differs from the reference's exp(S - LSE) in the
        # last FP32 bits at |S| ≈ 1000, which can flip a BF16 rounding of dS; times
        # k ≈ 64 and scale 16 that moves dQ by 4 (measured), 3.6 reference ulps.
        assert_accuracy(outs, q, k, v, do, False, scale)
    (std, std_stats), (std2, _) = results[(0, 0, 0)]
    (mixed, mixed_stats), = results[(1, 2, 0)]
    assert std_stats.guarded_rows.tolist() == [0, 0, 0]
    assert mixed_stats.guarded_rows.tolist() == [n_tied, 0, 0]  # head 0 became BETA
    # BETA (head 0) changes which P̄ values round to 1, so O changes in tied rows
    assert not torch.equal(std[0][:, 0], mixed[0][:, 0])
    assert torch.equal(std[0][:, 2], mixed[0][:, 2])  # STANDARD head untouched
    # FP32_O (head 1) changes δ, hence dQ; going back to all-STANDARD restores it
    assert not torch.equal(std[1][:, 1], mixed[1][:, 1])
    for a, b in zip(std, std2, strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # numpy inside the interpreter
def test_nan_input_row_matches_reference():
    gen = torch.Generator().manual_seed(12)
    q = quantized(1, 3, NQ, 16, gen=gen, dtype=torch.bfloat16)
    k = quantized(1, 3, NK, 16, gen=gen, dtype=torch.bfloat16)
    v = torch.randn(1, 3, NK, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    q[0, 1, 5, 3] = math.nan  # one query row of head 1
    stats, ref_stats = fw.AttentionStats.zeros(3), fw.AttentionStats.zeros(3)
    o = fw.attention(q, k, v, head_modes=ALL_MODES, stats=stats, backend="triton")
    ref = reference.attention(q.cpu(), k.cpu(), v.cpu(), head_modes=ALL_MODES,
                              stats=ref_stats)
    assert torch.equal(torch.isnan(o).cpu(), torch.isnan(ref))
    assert torch.isnan(o[0, 1, 5]).all() and not torch.isnan(o[0, 1, :5]).any()
    for name in ("tied_rows", "rows", "guarded_rows", "max_logit"):
        torch.testing.assert_close(getattr(stats, name).cpu(), getattr(ref_stats, name),
                                   rtol=0, atol=0, equal_nan=True, msg=name)
    assert torch.isnan(stats.max_logit[1]) and not torch.isnan(stats.max_logit[[0, 2]]).any()
