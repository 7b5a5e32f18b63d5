"""flashwatch/kernels/reference.py: accuracy, exact counters, BETA, FP32_O, paper arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch.kernels import reference as R
from flashwatch.kernels.common import GUARD_NATS, AttentionStats, Mode
from oracle import (
    assert_within_rule,
    brute_counts,
    duplicate_keys,
    fwd_bwd,
    grads_given_delta,
    math_attention,
    max_err,
    tie_heavy,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ALL_MODES = [Mode.STANDARD, Mode.BETA, Mode.FP32_O]  # one head each: every mode per call

# (N, D, B): awkward lengths (1, 7, 513 and 1100 are not multiples of the 128-key block;
# 1100 spans three 512-key blocks), every supported head dim, B·H = 3 or 6.
SHAPES = [(1, 16, 2), (7, 32, 1), (64, 64, 2), (513, 128, 1), (1100, 64, 1)]


def _modes(modes):
    return torch.tensor([int(m) for m in modes], dtype=torch.int32)


def _forward(q, k, v, *, causal=False, scale=1.0, modes=None, beta=2.0, eps=1e-3,
             arithmetic="fused", debug=True, **kw):
    modes = _modes(modes or [Mode.STANDARD] * q.shape[1])
    return R.forward(q, k, v, causal=causal, scale=scale, modes=modes, beta=beta, eps=eps,
                     arithmetic=arithmetic, debug=debug, **kw)


def _one_hot_queries(scores: torch.Tensor, dtype, d=16):
    """q, k such that scale=1 scores equal `scores` [B, H, Nq, Nk] exactly.

    Each query i is the one-hot e_i (i < d) and k[:, :, j, i] = scores[..., i, j]; needs
    Nq ≤ d and scores representable in `dtype`.
    """
    B, H, Nq, Nk = scores.shape
    assert Nq <= d
    q = torch.zeros(B, H, Nq, d)
    q[:, :, torch.arange(Nq), torch.arange(Nq)] = 1.0
    k = torch.zeros(B, H, Nk, d)
    k[..., :Nq] = scores.transpose(-1, -2)
    assert torch.equal(k.to(dtype).float(), k), "planted scores not representable"
    return q.to(dtype), k.to(dtype)


# ---------------------------------------------------------------------------------------
# Accuracy: docs/design.md §8 rule for O, dq, dk, dv.


@pytest.mark.parametrize("data", ["randn", "ties"])
@pytest.mark.parametrize("N,D,B", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_accuracy_every_mode(dtype, causal, N, D, B, data):
    g = torch.Generator().manual_seed(N * 1000 + D)
    shape = (B, len(ALL_MODES), N, D)
    if data == "randn":
        q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    else:  # integer scores: many rows with exact tied maxima, where BETA does its work
        q, k = tie_heavy(shape, dtype, g), duplicate_keys(tie_heavy(shape, dtype, g), g)
        v = torch.randn(shape, generator=g).to(dtype)
    do = torch.randn(shape, generator=g).to(dtype)
    scale = 1 / math.sqrt(D)

    def ours(q, k, v):
        return R.attention(q, k, v, causal=causal, head_modes=ALL_MODES)

    def math_in(dt):
        return lambda q, k, v: math_attention(q, k, v, causal=causal, scale=scale, dtype=dt)

    out = fwd_bwd(ours, q, k, v, do)
    pt = fwd_bwd(math_in(dtype), q, k, v, do)
    ref = fwd_bwd(math_in(torch.float64), q, k, v, do)
    # Where P is nearly one-hot (tied integer scores, the first rows of a causal mask) dP
    # and δ cancel, and δ = rowsum(dO ∘ O) from the stored low-precision O
    # (FlashAttention-2's formula, which plain autograd does not use) dominates the dq/dk
    # error. So dq and dk of STANDARD and BETA heads are held to the rule against an
    # oracle exact but for that δ; FP32_O heads (δ from FP32 O) against the plain truth.
    delta_lp = (do.double() * out[0].double()).sum(-1)
    dq_lp, dk_lp = grads_given_delta(q, k, v, do, delta_lp, causal=causal, scale=scale)
    for h, mode in enumerate(ALL_MODES):
        for i, name in enumerate(("o", "dq", "dk", "dv")):
            truth = ref[i]
            if mode != Mode.FP32_O and name in ("dq", "dk"):
                truth = dq_lp if name == "dq" else dk_lp
            assert out[i].dtype == dtype
            assert_within_rule(f"{name} head {h} ({mode.name})", out[i][:, h], pt[i][:, h],
                               truth[:, h], dtype, ref=ref[i][:, h])


def test_tie_heavy_data_really_has_ties():
    # Guards the accuracy test above: its "ties" inputs must exercise BETA's shift.
    g = torch.Generator().manual_seed(0)
    shape = (1, 1, 64, 64)
    q, k = tie_heavy(shape, BF16, g), duplicate_keys(tie_heavy(shape, BF16, g), g)
    tied, _ = brute_counts(q, k, causal=False, scale=1 / 8, eps=1e-3)
    assert tied.item() >= 20


# ---------------------------------------------------------------------------------------
# Counters: equal to a brute-force count, exactly.


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("N,D", [(1, 16), (7, 32), (513, 64), (1100, 16)])
def test_counters_equal_brute_force(dtype, causal, N, D):
    g = torch.Generator().manual_seed(N + D)
    shape = (2, 3, N, D)
    q = tie_heavy(shape, dtype, g, levels=2)
    k = duplicate_keys(tie_heavy(shape, dtype, g, levels=2), g)
    v = torch.randn(shape, generator=g).to(dtype)
    for arithmetic in ("fused", "paper"):
        stats = AttentionStats.zeros(3)
        R.attention(q, k, v, causal=causal, stats=stats, arithmetic=arithmetic)
        tied, max_logit = brute_counts(q, k, causal=causal, scale=1 / math.sqrt(D), eps=1e-3)
        if arithmetic == "paper":  # scores rounded to the input dtype: count on those
            s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D))
            tied, max_logit = brute_counts(s, torch.eye(N, dtype=dtype).expand(2, 3, N, N),
                                           causal=causal, scale=1.0, eps=1e-3)
        assert torch.equal(stats.tied_rows, tied), arithmetic
        assert torch.equal(stats.rows, torch.full((3,), 2 * N)), arithmetic
        assert torch.equal(stats.max_logit, max_logit.float()), arithmetic
        assert stats.guarded_rows.sum() == 0
    assert tied.sum() > 0 or N == 1  # the planted data must contain ties


def test_counters_ties_split_across_blocks_and_exactly_at_eps():
    # Scores are planted exactly (fp32, one-hot queries), one row per head so that the
    # per-head counter reads out each row: {key: score}, and whether the row is tied.
    eps = 1e-3
    at_eps = (torch.tensor(3.0) - eps).item()  # the fp32 threshold rowmax - eps itself
    below = torch.nextafter(torch.tensor(at_eps), torch.tensor(-math.inf)).item()
    rows = [
        ({10: 3.0, 700: 3.0}, True),  # tie split across 128- and 512-key blocks
        ({0: 3.0, 1099: 3.0}, True),  # first and last key
        ({5: 3.0, 900: at_eps}, True),  # the only tie is exactly at eps
        ({5: 3.0, 900: below}, False),  # one ulp outside eps
        ({900: 3.0, 5: at_eps}, True),  # the max arrives after its near-tie
        ({5: at_eps, 300: 3.0 - 0.2 * eps, 900: 3.0 + 0.7 * eps}, True),  # max rises twice
        ({5: 3.0, 300: 3.0, 900: 3.0 + 0.5 * eps}, True),  # rises by < eps after a tie
        ({5: 3.0, 300: 3.0, 900: 3.0 + 2 * eps}, False),  # rises by > eps: count resets
    ]
    Nk = 1100
    s = torch.full((1, len(rows), 1, Nk), -5.0)
    for h, (planted, _) in enumerate(rows):
        for key, val in planted.items():
            s[0, h, 0, key] = val
    q, k = _one_hot_queries(s, FP32)
    v = torch.randn(1, len(rows), Nk, 16)
    expected = [int(t) for _, t in rows]
    tied, _ = brute_counts(q, k, causal=False, scale=1.0, eps=eps)
    assert tied.tolist() == expected  # the oracle agrees with the plan
    for block_n in (64, 128, 512):
        res = _forward(q, k, v, block_n=block_n)
        assert res.tied_rows.tolist() == expected, block_n


def test_counters_respect_the_causal_mask():
    s = torch.zeros(1, 1, 4, 4)
    s[0, 0, :, :] = torch.tensor([1.0, 2.0, 2.0, 2.0])  # keys 1..3 tie at the max
    q, k = _one_hot_queries(s, FP32)
    res = _forward(q, k, torch.randn(1, 1, 4, 16), causal=True)
    # row 0 sees key 0; row 1 sees one 2.0; rows 2 and 3 see two or three: 2 tied rows.
    assert res.tied_rows.tolist() == [2]
    assert res.max_logit.tolist() == [2.0]


def test_stats_accumulate_across_calls_and_reset():
    g = torch.Generator().manual_seed(1)
    q, k = tie_heavy((1, 2, 32, 16), BF16, g), tie_heavy((1, 2, 32, 16), BF16, g)
    v = torch.randn(1, 2, 32, 16).to(BF16)
    once = AttentionStats.zeros(2)
    R.attention(q, k, v, stats=once)
    twice = AttentionStats.zeros(2)
    R.attention(q, k, v, stats=twice)
    R.attention(q * 2, k, v, stats=twice)
    tied2, max2 = brute_counts(q * 2, k, causal=False, scale=0.25, eps=1e-3)
    assert torch.equal(twice.tied_rows, once.tied_rows + tied2)
    assert torch.equal(twice.rows, 2 * once.rows)
    assert torch.equal(twice.max_logit, torch.maximum(once.max_logit, max2))
    twice.reset()
    assert twice.rows.sum() == 0 and twice.max_logit.isneginf().all()


# ---------------------------------------------------------------------------------------
# BETA.


def _tied_rows_data(dtype, n_rows=16, nk=300, r_max=2.0, split=(3, 200)):
    """Rows with two tied maxima r_max at keys `split`, others 10 nats lower."""
    s = torch.full((1, 1, n_rows, nk), r_max - 10.0)
    s[..., list(split)] = r_max
    q, k = _one_hot_queries(s, dtype)
    v = -2.0 - torch.rand(1, 1, nk, 16)
    return q, k, v.to(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_beta_no_pbar_equals_one_in_tied_rows(dtype):
    q, k, v = _tied_rows_data(dtype)
    std = _forward(q, k, v, modes=[Mode.STANDARD])
    beta = _forward(q, k, v, modes=[Mode.BETA])
    assert (std.pbar_max == 1.0).all()  # the control: STANDARD puts P̄ = 1 at both maxima
    assert (beta.pbar_max < 1.0).all()
    assert beta.tied_rows.item() == 16 and beta.guarded_rows.item() == 0
    # Exact arithmetic is unchanged by the shift: outputs agree to the dtype's rounding.
    ulp = torch.finfo(dtype).eps
    assert max_err(beta.o, std.o) <= 4 * ulp * std.o.abs().max().item()


def test_beta_finds_a_tie_split_across_blocks_the_shift_rescales():
    q, k, v = _tied_rows_data(BF16, nk=1100, split=(3, 1000))
    res = _forward(q, k, v, modes=[Mode.BETA], block_n=128)
    assert res.tied_rows.item() == 16
    # The first maximum was summed with P̄ = 1 before the tie was seen; after the rescale
    # its weight is exp(-excess), so the largest weight applied is < 1.
    assert (res.pbar_max < 1.0).all()


@pytest.mark.parametrize("dtype", [BF16, FP32, FP16])
def test_beta_large_logits_stay_finite_and_accurate_with_exact_guard_count(dtype):
    # Rows: tied at +1e3, tied at +1e4 (bf16/fp32 only), tied at -1e3, untied at +1e3,
    # tied at +20 (excess 20 < 60 in bf16: unguarded; > 4 in fp16: guarded).
    big = 9984.0 if dtype != FP16 else 1984.0  # ~1e4 (bf16 spacing there is 64)
    rows = [(1000.0, True), (big, True), (-1000.0, True), (1000.0, False), (20.0, True)]
    nk = 64
    s = torch.full((1, 1, len(rows), nk), 0.0)
    for i, (m, tied) in enumerate(rows):
        s[0, 0, i] = m - (128.0 if abs(m) > 1000 else 16.0)  # representable, ≥ 16 nats below
        s[0, 0, i, 7] = m
        if tied:
            s[0, 0, i, 40] = m
    q, k = _one_hot_queries(s, dtype)
    v = torch.randn(1, 1, nk, 16).to(dtype)
    res = _forward(q, k, v, modes=[Mode.BETA])
    assert torch.isfinite(res.o).all()
    # β = 2: the excess is (β-1)·m = m for m > 0 and -m otherwise, i.e. |m|.
    expect_guarded = sum(1 for m, tied in rows if tied and abs(m) > GUARD_NATS[dtype])
    assert res.guarded_rows.item() == expect_guarded
    assert res.tied_rows.item() == sum(t for _, t in rows)
    assert (res.pbar_max < 1.0)[0, 0, [i for i, (_, t) in enumerate(rows) if t]].all()
    ref = math_attention(q, k, v, causal=False, scale=1.0, dtype=torch.float64)
    ulp = torch.finfo(dtype).eps
    assert max_err(res.o, ref) <= 4 * ulp * ref.abs().max().item()


def test_beta_excess_rule():
    m = torch.tensor([2.0, -3.0, 0.1, 0.0, 100.5, 1234.25, -777.125])
    exc, guarded = R.beta_excess(m, beta=2.0, guard=60.0)
    # paper rule (β-1)·m or -m; 0.1 and 0 are lifted by MIN_EXCESS; >60 wraps into [30,60)
    assert exc[:2].tolist() == [2.0, 3.0]
    assert exc[2].item() == pytest.approx(0.6) and exc[3].item() == 0.5
    assert guarded.tolist() == [False, False, False, False, True, True, True]
    assert ((exc[4:] >= 30) & (exc[4:] < 60)).all()
    assert len(set(exc[4:].tolist())) == 3  # row-dependent, never one constant


# ---------------------------------------------------------------------------------------
# FP32_O.


def test_fp32_o_delta_uses_o_in_fp32():
    g = torch.Generator().manual_seed(3)
    shape = (2, 2, 96, 32)
    q, k, v, do = (torch.randn(shape, generator=g).to(BF16) for _ in range(4))
    modes = [Mode.STANDARD, Mode.FP32_O]
    res = _forward(q, k, v, modes=modes, scale=32**-0.5)
    assert res.o32.shape == (2, 1, 96, 32) and res.o32.dtype == FP32
    # O32 is acc/l before the final rounding (P̄ is still cast to bf16 for P̄V, as in the
    # kernel); the returned O is that value rounded once.
    assert torch.equal(res.o[:, 1], res.o32[:, 0].to(BF16))
    ref = math_attention(q, k, v, causal=False, scale=32**-0.5, dtype=torch.float64)

    def mean_err(a, b):
        return (a.double() - b.double()).abs().mean().item()

    assert mean_err(res.o32[:, 0], ref[:, 1]) < 0.75 * mean_err(res.o[:, 1], ref[:, 1])
    _, _, _, delta = R.backward(do, q, k, v, res.o, res.o32, res.lse, causal=False,
                                scale=32**-0.5, modes=_modes(modes))
    assert torch.equal(delta[:, 1], (do[:, 1].float() * res.o32[:, 0]).sum(-1))
    assert torch.equal(delta[:, 0], (do[:, 0].float() * res.o[:, 0].float()).sum(-1))
    # Same head computed both ways: δ from O32 is closer to the FP64 δ than δ from bf16 O.
    true_delta = (do[:, 1].double() * ref[:, 1]).sum(-1)
    delta_lp = (do[:, 1].float() * res.o[:, 1].float()).sum(-1)
    assert mean_err(delta[:, 1], true_delta) < 0.75 * mean_err(delta_lp, true_delta)


# ---------------------------------------------------------------------------------------
# arithmetic="paper".


def test_paper_reproduces_the_seed_worked_example():
    # P̄ = [1, exp(-8), 1]; V = [-2.40625, -2.59375, -2.296875]: the block product P̄V
    # sums -2.40625 + (≈ -0.00087) + -2.296875 = -4.70399… and rounds to -4.71875.
    s = torch.tensor([0.0, -8.0, 0.0]).view(1, 1, 1, 3)
    q, k = _one_hot_queries(s, BF16)
    v = torch.zeros(1, 1, 3, 16)
    v[0, 0, :, 0] = torch.tensor([-2.40625, -2.59375, -2.296875])
    res = _forward(q, k, v.to(BF16), arithmetic="paper")
    p2 = torch.tensor(math.exp(-8.0)).to(BF16).double()
    small = (p2 * -2.59375).item()
    assert -0.00088 < small < -0.00086
    true_sum = -2.40625 + small - 2.296875
    assert res.o_unnormalized[0, 0, 0, 0].item() == -4.71875
    assert res.o_unnormalized[0, 0, 0, 0].item() - true_sum == pytest.approx(-0.0148, abs=1e-4)
    # The fused arithmetic accumulates in FP32 and has no such error in its accumulator.
    fused = _forward(q, k, v.to(BF16))
    assert fused.o_unnormalized[0, 0, 0, 0].item() == pytest.approx(true_sum, abs=1e-6)


def _bias_rows(n_rows, tied, seed, r_max=(0.0, 0.0)):
    """Planted rows: max r_m ~ U(r_max) at key 0 (and key 1 if tied), 62 others 10-14
    nats lower, V < 0 (one sign) drawn per row in [-2.5, -1.5]."""
    g = torch.Generator().manual_seed(seed)
    nk = 64
    lo, hi = r_max
    r = lo + (hi - lo) * torch.rand(n_rows, 1, generator=g)
    s = r - 10.0 - 4.0 * torch.rand(n_rows, nk, generator=g)
    s[:, :1] = r
    if tied:
        s[:, 1:2] = r
    s = s.to(BF16)
    v = (-1.5 - torch.rand(n_rows, nk, 1, generator=g)).to(BF16)
    return s, v


def _row_errors(s, v, *, modes=(Mode.STANDARD,), arithmetic="paper", beta=2.0):
    """O error of each planted row against FP64, via the reference on [1, 1, 1, nk] calls
    batched as B = rows (scores planted with one-hot queries)."""
    n_rows, nk = s.shape
    q = torch.zeros(n_rows, 1, 1, 16, dtype=BF16)
    q[..., 0] = 1.0
    k = torch.zeros(n_rows, 1, nk, 16, dtype=BF16)
    k[:, 0, :, 0] = s
    vv = torch.zeros(n_rows, 1, nk, 16, dtype=BF16)
    vv[:, 0, :, 0] = v[..., 0]
    res = _forward(q, k, vv, modes=list(modes), arithmetic=arithmetic, beta=beta, debug=False)
    ref = torch.softmax(s.double(), -1).unsqueeze(1) @ v.double()
    return res.o[:, 0, 0, 0].double() - ref[:, 0, 0]


def _lean(err: torch.Tensor) -> float:
    """mean(err)/mean(|err|): -1 all errors negative, 0 no lean, +1 all positive."""
    return (err.mean() / err.abs().mean()).item()


# Sample: 4096 planted rows per case; the lean's standard error is about
# 1/sqrt(4096) = 0.016, so the margins below are ≥ 9 standard errors from the measured
# values (benchmarks/bias_lean.py prints the whole table).


def test_paper_bias_leans_to_the_sign_of_v_only_in_tied_rows():
    n = 4096
    lean_tied = _lean(_row_errors(*_bias_rows(n, True, seed=0)))
    lean_single = _lean(_row_errors(*_bias_rows(n, False, seed=1)))
    assert lean_tied < -0.5, lean_tied  # measured -0.84: V < 0 and the error leans < 0
    assert abs(lean_single) < 0.15, lean_single  # measured +0.04


def test_paper_beta_reduces_the_lean_when_the_row_max_is_positive():
    # The paper's rule shifts only rows with r_m > 0. What remains (measured -0.24 vs
    # -0.84) comes from the BF16 running sum l, which drops the small positive terms.
    n = 4096
    s, v = _bias_rows(n, True, seed=2, r_max=(1.0, 3.0))
    lean_std = _lean(_row_errors(s, v))
    lean_beta = _lean(_row_errors(s, v, modes=(Mode.BETA,)))
    assert lean_std < -0.5, lean_std
    assert lean_beta > lean_std / 2, (lean_beta, lean_std)


def test_fused_tied_rows_lean_less_and_beta_is_unbiased_when_r_m_varies():
    # docs/design.md §1: in a fused FP32-accumulator kernel the lean is smaller (measured +0.18,
    # other sign). BETA there dithers through bf16(P̄)/P̄ at the max (l sums the FP32 P̄),
    # which averages out only when r_m varies from row to row (measured +0.004).
    n = 4096
    s, v = _bias_rows(n, True, seed=3, r_max=(1.0, 3.0))
    lean_std = _lean(_row_errors(s, v, arithmetic="fused"))
    lean_beta = _lean(_row_errors(s, v, modes=(Mode.BETA,), arithmetic="fused"))
    assert abs(lean_std) < 0.4, lean_std
    assert abs(lean_beta) < 0.1, lean_beta


def test_paper_per_block_check_misses_a_split_tie_that_row_wide_beta_finds():
    q, k, v = _tied_rows_data(BF16, nk=1100, split=(3, 700))  # blocks 0 and 1 of 512
    paper = _forward(q, k, v, modes=[Mode.BETA], arithmetic="paper")
    fused = _forward(q, k, v, modes=[Mode.BETA])
    assert (paper.pbar_max == 1.0).all()  # per-block check: no block sees two maxima
    assert (fused.pbar_max < 1.0).all()
    assert paper.tied_rows.item() == fused.tied_rows.item() == 16  # counters are row-wide
    q, k, v = _tied_rows_data(BF16, nk=400, split=(3, 300))  # one block: the check sees it
    paper = _forward(q, k, v, modes=[Mode.BETA], arithmetic="paper")
    assert (paper.pbar_max < 1.0).all()


# ---------------------------------------------------------------------------------------
# Non-finite inputs: propagate like SDPA (math backend) and never crash.


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_inputs_propagate_like_sdpa(where, bad, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    # Row/key 0 is visible to every query even when causal, so SDPA's additive mask and
    # our skipped keys see the same values.
    {"q": q, "k": k, "v": v}[where][0, 0, 0 if where != "q" else 4, 3] = bad
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    got = R.attention(qq, kk, vv, causal=causal)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], atol=1e-5)
    got.sum().backward()  # must not raise or hang
    assert qq.grad.shape == q.shape


def test_nonfinite_score_behind_the_causal_mask_does_not_leak():
    # A future key with Inf in k is masked for earlier rows: they stay finite (SDPA's
    # math backend adds -inf to the score and gets NaN there; FlashAttention kernels,
    # like this reference, replace masked scores).
    q, k, v = (torch.randn(1, 1, 6, 16) for _ in range(3))
    q[..., 3] = 1.0
    k[0, 0, 5, 3] = math.inf
    o = R.attention(q, k, v, causal=True)
    assert torch.isfinite(o[0, 0, :5]).all()
    assert torch.isnan(o[0, 0, 5]).all()
