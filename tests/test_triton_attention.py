"""Triton attention kernels against the reference, brute force and FP64 math.

On a CPU machine these run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton); with TRITON_INTERPRET=0 and a GPU
(benchmarks/gpu_check.py) the same tests run the compiled kernels on CUDA.

Accuracy rule (docs/design.md §8): with ref = FP64 math and pt = plain PyTorch math in the
same low dtype, |out - ref|max ≤ 2·|pt - ref|max + floor, for O and each gradient.
Counters are compared exactly, to the reference and to a brute-force count.

Inputs for counter tests are multiples of 1/8 in [-2, 2] (q, k): every product is a
multiple of 1/64 and every partial sum of ≤ 128 terms is exact in FP32, so S is
bit-identical whatever order a dot sums in, and ties are exact ties.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

import flashwatch as fw  # noqa: E402
from flashwatch.kernels import reference  # noqa: E402
from flashwatch.kernels import triton_attention as ta  # noqa: E402
from flashwatch.kernels import triton_tuning as tuning  # noqa: E402
from flashwatch.kernels.common import GUARD_NATS, Mode  # noqa: E402

if ta.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device",
                allow_module_level=True)

# The interpreter's forward uses 16-row/16-key blocks; these lengths give 3 blocks with
# a ragged end, and Nq != Nk.
NQ, NK = 37, 45
DTYPES = (torch.bfloat16, torch.float16)
ALL_MODES = [int(Mode.STANDARD), int(Mode.BETA), int(Mode.FP32_O)]


# ---------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------


def quantized(*shape, gen, dtype):
    """Multiples of 1/8 in [-2, 2]: exact scores (see module docstring), frequent ties."""
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(dtype).to(DEVICE)


def causal_mask(nq, nk, device):
    return torch.arange(nk, device=device)[None, :] > torch.arange(nq, device=device)[:, None]


def plain_attention(q, k, v, causal, scale):
    """softmax(scale·QKᵀ)V in whatever dtype q, k, v have (FP64 ref or low-dtype pt)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), v)


def run_plain(q, k, v, do, causal, scale, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    o = plain_attention(*leaves, causal, scale)
    o.backward(do.to(dtype))
    return [o.detach()] + [t.grad for t in leaves]


def run_triton(q, k, v, do, causal, scale, modes, stats=None, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fw.attention(*leaves, causal=causal, scale=scale, head_modes=modes, stats=stats,
                     backend="triton", **kw)
    o.backward(do)
    return [o.detach()] + [t.grad for t in leaves]


def assert_accuracy(outs, q, k, v, do, causal, scale, floor=1e-5):
    ref = run_plain(q, k, v, do, causal, scale, torch.float64)
    pt = run_plain(q, k, v, do, causal, scale, q.dtype)
    for name, out, r, p in zip(("o", "dq", "dk", "dv"), outs, ref, pt, strict=True):
        assert torch.isfinite(out).all(), f"{name} has non-finite values"
        err = (out.double() - r).abs().max().item()
        pt_err = (p.double() - r).abs().max().item()
        assert err <= 2 * pt_err + floor, (
            f"{name}: |triton - fp64| = {err:.3g} > 2·|pytorch {q.dtype} - fp64| "
            f"= 2·{pt_err:.3g} (+{floor:g})")


def brute_force_counters(q, k, causal, scale, modes, beta=2.0, eps=1e-3):
    """Tie, guard and max-logit counters from the full score matrix, no blocking."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    m = s.amax(-1)
    tied = ((s >= (m - eps).unsqueeze(-1)) & (s != -math.inf)).sum(-1) >= 2
    excess = torch.where(m > 0, (beta - 1.0) * m, -m)
    beta_h = (torch.as_tensor(modes, device=q.device) == int(Mode.BETA)).view(1, -1, 1)
    guarded = tied & beta_h & (excess > GUARD_NATS[q.dtype])
    return tied.sum((0, 2)).cpu(), guarded.sum((0, 2)).cpu(), m.amax((0, 2)).cpu()


def assert_counters(stats, q, k, causal, scale, modes):
    tied, guarded, max_logit = brute_force_counters(q, k, causal, scale, modes)
    assert stats.tied_rows.cpu().tolist() == tied.tolist()
    assert stats.guarded_rows.cpu().tolist() == guarded.tolist()
    assert stats.rows.cpu().tolist() == [q.shape[0] * q.shape[2]] * q.shape[1]
    assert torch.equal(stats.max_logit.cpu(), max_logit)
    # and the reference agrees with both
    ref_stats = fw.AttentionStats.zeros(q.shape[1])
    reference.attention(q.cpu(), k.cpu(), k.cpu(), causal=causal, scale=scale,
                        head_modes=modes, stats=ref_stats)
    for name in ("tied_rows", "guarded_rows", "rows", "max_logit"):
        assert torch.equal(getattr(stats, name).cpu(), getattr(ref_stats, name)), name


# ---------------------------------------------------------------------------------
# Triton == reference, every mode
# ---------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------
# the backward: FlashAttention-2's work, strided tensors, awkward shapes
# ---------------------------------------------------------------------------------


def count_dots(monkeypatch):
    """Patch the interpreter so that every tl.dot executed is counted; returns the list
    the counts go to (one entry per dot)."""
    from triton.runtime.interpreter import InterpreterBuilder

    calls = []
    real = InterpreterBuilder.create_dot

    def counting(self, *args, **kwargs):
        calls.append(args[0].data.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", counting)
    return calls


@pytest.mark.skipif(not ta.INTERPRET, reason="counts dots executed by the interpreter")
@pytest.mark.parametrize("causal,pairs", [(False, 3 * 2), (True, 3 + 2)],
                         ids=["full", "causal"])
def test_backward_does_five_matmuls_per_block_pair(monkeypatch, causal, pairs):
    # 16×16 blocks, Nq = 40 (3 query blocks, ragged), Nk = 32 (2 key blocks): 6 (query
    # block, key block) pairs; causal (top-left) keeps the 5 pairs with a visible key.
    # FlashAttention-2 does 5 matmuls per pair (S, dV, dP, dK, dQ); the former
    # three-kernel backward recomputed S and dP for dQ: 7.
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 1, 40, 16, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, 32, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    do = torch.randn(1, 1, 40, 16, generator=gen).to(torch.bfloat16)
    modes = torch.zeros(1, dtype=torch.int32)
    o, lse, o32, *_ = ta.forward(q, k, v, modes, causal=causal, scale=0.25, beta=2.0,
                                 eps=1e-3, want_stats=False)
    calls = count_dots(monkeypatch)
    ta.backward(do, q, k, v, o, o32, lse, modes, causal=causal, scale=0.25)
    assert len(calls) == 5 * pairs


def transposed(b, n, h, d, gen, dtype=torch.bfloat16):
    """[B, H, N, D] view of a [B, N, H, D] tensor, as a model that splits heads makes."""
    return torch.randn(b, n, h, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)


def test_strided_inputs_and_do_without_copies(monkeypatch):
    # q, k, v and dO as a transposing model has them: views of [B, N, H, D]. Nothing may
    # be copied to contiguous (the last dim is contiguous), O and the gradients come back
    # in the inputs' layout, and every value equals the run on contiguous copies.
    gen = torch.Generator().manual_seed(22)
    q, k, v, do = (transposed(2, 37, 3, 16, gen) for _ in range(4))
    want = run_triton(*(t.contiguous() for t in (q, k, v, do)), True, 0.25, ALL_MODES)
    copies = []
    real = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        if not self.is_contiguous(*args, **kwargs):
            copies.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    got = run_triton(q, k, v, do, True, 0.25, ALL_MODES)
    monkeypatch.undo()
    assert copies == []
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a, b), name
        assert a.transpose(1, 2).is_contiguous(), f"{name} is not in the [B, N, H, D] layout"


def test_keep_o32_buffer_read_in_place_by_the_backward():
    # keep_o32 (the watcher's monitored calls) gives every head's FP32 O; the backward reads
    # the FP32_O heads' rows from it in place and gives what the FP32_O-only buffer gives.
    gen = torch.Generator().manual_seed(23)
    q, k, v, do = (torch.randn(1, 3, 21, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
                   for _ in range(4))
    modes = torch.tensor([2, 0, 1], dtype=torch.int32)
    kw = dict(causal=False, scale=0.25, beta=2.0, eps=1e-3, want_stats=False)
    o, lse, o32, *_ = ta.forward(q, k, v, modes, **kw)
    o_all, lse_all, o32_all, *_ = ta.forward(q, k, v, modes, keep_o32=True, **kw)
    assert o32.shape[0] == 1 and o32_all.shape[0] == 3  # FP32 O only for FP32_O heads
    assert torch.equal(o, o_all) and torch.equal(o32_all[0], o32[0])
    grads = ta.backward(do, q, k, v, o, o32, lse, modes, causal=False, scale=0.25)
    grads_all = ta.backward(do, q, k, v, o_all, o32_all, lse_all, modes, causal=False,
                            scale=0.25)
    for a, b in zip(grads, grads_all, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 33), (33, 1), (50, 23)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradients_all_modes_awkward_shapes(nq, nk, causal):
    # FP64 oracle, 2× rule, every mode, lengths 1 and not a multiple of the 16 blocks.
    gen = torch.Generator().manual_seed(nq * 100 + nk + causal)
    q, do = (torch.randn(2, 3, nq, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
             for _ in range(2))
    k, v = (torch.randn(2, 3, nk, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
            for _ in range(2))
    outs = run_triton(q, k, v, do, causal, 0.3, ALL_MODES)
    assert_accuracy(outs, q, k, v, do, causal, 0.3)


# ---------------------------------------------------------------------------------
# planted ties and large logits
# ---------------------------------------------------------------------------------


def planted_ties(dtype, big=False):
    """Rows built to hit every branch of the online tie count. Returns (q, k, scale, tied).

    Query i = e_{i mod 8}, so its scores are `scale · k[:, i mod 8]`: column c of K is the
    score pattern of the 5 rows ≡ c (mod 8). Keys sit in the interpreter's 16-key blocks
    [0,16) [16,32) [32,40). With scale 0.02 and key values near 4 (bf16 spacing 1/32),
    neighbouring values are 0.000625 apart in score, within eps = 1e-3. big=True: values
    near 64 and scale 16, scores ≈ ±1024 (BETA's excess far above the guard); the near
    ties of columns 1 and 3 are then 8 apart and no longer ties.
    """
    nk, nq, d = 40, 40, 16
    gen = torch.Generator().manual_seed(11)
    kk = torch.rand(nk, d, generator=gen) * 2 - 1  # background: scores far below the max
    top, step, scale = (64.0, 0.5, 16.0) if big else (4.0, 1 / 32, 0.02)
    kk[[3, 35], 0] = top  # exact tie split across blocks 0 and 2
    kk[5, 1], kk[20, 1] = top, top + step  # later max, within eps above: tied
    kk[[2, 4], 2], kk[30, 2] = top, top + 2 * step  # tie, then a max > eps higher: not tied
    kk[1, 3], kk[33, 3] = top + step, top  # earlier max, later one within eps below: tied
    kk[7, 4] = top  # unique max
    kk[[0, 17, 39], 5] = top  # three-way tie, one in the ragged last block
    kk[[8, 9], 6] = top  # tie inside one block
    kk[:, 7] = kk[:, 7] - top - 3  # all well below -top ...
    kk[[10, 38], 7] = -top  # ... except a tie at a negative max (BETA excess = -r_m)
    q = torch.zeros(nq, d)
    q[torch.arange(nq), torch.arange(nq) % 8] = 1.0

    def heads(t):
        return t.to(dtype).expand(1, 3, *t.shape).contiguous().to(DEVICE)

    tied_cols = [0, 5, 6, 7] if big else [0, 1, 3, 5, 6, 7]
    return heads(q), heads(kk), scale, 5 * len(tied_cols)


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


# ---------------------------------------------------------------------------------
# public API: errors, torch.compile
# ---------------------------------------------------------------------------------


def test_triton_rejects_float32_and_odd_head_dim():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(TypeError, match="backend='reference' for float32"):
        fw.attention(q, q, q, backend="triton")
    q = torch.randn(1, 2, 8, 24, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dims"):
        fw.attention(q, q, q, backend="triton")


def test_triton_on_cpu_without_interpreter_says_how():
    code = (
        "import torch, flashwatch as fw\n"
        "q = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16)\n"
        "try:\n"
        "    fw.attention(q, q, q, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert "RAISED" in out.stdout, out.stdout + out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout and "backend='reference'" in out.stdout


def test_invalid_mode_value_rejected():
    q = torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="not a flashwatch.Mode"):
        fw.attention(q, q, q, head_modes=torch.tensor([0, 7]), backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_torch_compile_fullgraph(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 3, 20, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
               for _ in range(3))
    do = torch.randn(1, 3, 20, 16, generator=gen).to(torch.bfloat16).to(DEVICE)

    def step(q, k, v, modes, stats):
        return fw.attention(q, k, v, causal=True, head_modes=modes, stats=stats,
                            backend=backend) * 2

    counter = CompileCounterWithBackend("inductor" if backend == "reference" else "aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for modes in ([0, 1, 2], [2, 0, 1]):
        m = torch.tensor(modes, dtype=torch.int32)
        stats, stats_eager = fw.AttentionStats.zeros(3), fw.AttentionStats.zeros(3)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        leaves_e = [t.clone().requires_grad_() for t in (q, k, v)]
        out = compiled(*leaves, m, stats)
        out.backward(do)
        out_e = step(*leaves_e, m, stats_eager)
        out_e.backward(do)
        assert torch.equal(out, out_e)
        for a, b in zip(leaves, leaves_e, strict=True):
            assert torch.equal(a.grad, b.grad)
        for name in ("tied_rows", "rows", "guarded_rows", "max_logit"):
            assert torch.equal(getattr(stats, name), getattr(stats_eager, name)), name
    assert counter.frame_count == 1, "a head-mode change must not recompile"


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


def test_reference_backend_through_the_op_is_the_reference():
    gen = torch.Generator().manual_seed(13)
    q, k, v, do = (torch.randn(2, 3, 19, 8, generator=gen) for _ in range(4))
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        args_r = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        st, st_r = fw.AttentionStats.zeros(3), fw.AttentionStats.zeros(3)
        o = fw.attention(*args, causal=True, head_modes=[2, 1, 0], stats=st)  # auto on CPU
        o_r = reference.attention(*args_r, causal=True, head_modes=[2, 1, 0], stats=st_r)
        o.backward(do.to(dtype))
        o_r.backward(do.to(dtype))
        assert torch.equal(o, o_r)
        for a, b in zip(args, args_r, strict=True):
            assert torch.equal(a.grad, b.grad)
        for name in ("tied_rows", "rows", "guarded_rows", "max_logit"):
            assert torch.equal(getattr(st, name), getattr(st_r, name)), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan arithmetic inside
@pytest.mark.parametrize("where,bad", [("q", math.nan), ("q", -math.inf), ("k", math.inf),
                                       ("k", -math.inf), ("v", math.inf)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nonfinite_inputs_like_the_reference(where, bad, causal):
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, 2, 19, 16, generator=gen).to(torch.bfloat16)
                   for _ in range(4))
    {"q": q, "k": k, "v": v}[where][0, 0, 0 if where != "q" else 4, 3] = bad
    # A row whose every score is -inf (l = 0): O = 0, LSE = +inf, in both backends.
    q[0, 1, 7], k[0, 1, :, 0] = 0.0, -k[0, 1, :, 0].abs() - 1
    q[0, 1, 7, 0] = math.inf
    got = run_triton(*(t.to(DEVICE) for t in (q, k, v, do)), causal, 0.25, [1, 2])
    want = run_plain_reference(q, k, v, do, causal, 0.25, [1, 2])
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        a = a.cpu().float()
        if causal and name != "o":
            # The reference's backward lets a NaN LSE reach masked keys (exp(-inf - NaN) is
            # NaN in its one 1024-row chunk); the kernel skips fully masked blocks, so its
            # NaNs are a subset. Reported as a doubt about the reference.
            assert not (a.isnan() & ~b.isnan() & ~b.isinf()).any(), name
            both = torch.isfinite(a) & torch.isfinite(b)
            assert (a[both] - b[both]).abs().max() <= 2.0 ** -6 * (1 + b[both].abs().max())
            continue
        assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(a.isinf(), b.isinf()), name
        fin = torch.isfinite(b)
        assert (a[fin] - b[fin]).abs().max() <= 2.0 ** -6 * (1 + b[fin].abs().max()), name
    assert torch.equal(got[0][0, 1, 7].cpu(), torch.zeros(16, dtype=torch.bfloat16))


def run_plain_reference(q, k, v, do, causal, scale, modes):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = reference.attention(*leaves, causal=causal, scale=scale, head_modes=modes)
    o.backward(do)
    return [o.detach().float()] + [t.grad.float() for t in leaves]
