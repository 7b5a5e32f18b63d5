"""flashwatch/monitor/aggregate.py: the per-head arrays a report carries, against FP64 on a
watched model: sums over micro-batches, the δ-error share (probing's row terms over the
‖dW^Q‖² capture keeps), guarded rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    QKV,
    SMALL,
    batch,
    fused_o_fp64,
)

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode
from standins import TiedAttention


def test_gradient_accumulation_gives_one_monitor_step_with_all_micro_batches():
    torch.manual_seed(3)
    model = GPT(GPTConfig(**SMALL))
    g = torch.Generator().manual_seed(3)
    batches = [batch(g) for _ in range(2)]

    def run(micro):
        w = fw.watch(model, rows_per_head=4 * 32, route_all=True)
        for x, y in micro:
            model(x, y)[1].backward()
        model.zero_grad()
        r = w.step()
        w.remove()
        return r

    both = run(batches)
    a, b = run(batches[:1]), run(batches[1:])
    for hb, ha, hbb in zip(both.heads, a.heads, b.heads, strict=True):
        assert hb.delta_error_sum == pytest.approx(ha.delta_error_sum + hbb.delta_error_sum,
                                                   rel=1e-9, abs=1e-12)
        assert hb.tied_rowmax_ratio == pytest.approx(
            (ha.tied_rowmax_ratio + hbb.tied_rowmax_ratio) / 2)


def _share_case(seed, C=128, H=2, B=4, T=32, rows="all", watch_seed=0, routed=False):
    """One bf16 step of QKV; returns (report, per-head FP64 ‖E‖², Σ‖e_T‖², ‖dW^Q‖²).
    routed: SDPA runs flashwatch's reference kernel (route_all), whose own FP32 O (P̄
    rounded to BF16 before P̄V, l unrounded) is what c is measured against."""
    torch.manual_seed(seed)
    model = QKV(C, H).bfloat16()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).bfloat16()
    wgt = torch.randn(B, T, C, generator=g)
    w = fw.watch(model, sites={"": dict(num_heads=H, q_module="q_proj")}, every_n_steps=1,
                 rows_per_head=rows, seed=watch_seed, route_all=routed, backend="reference")
    (model(x).float() * wgt).sum().backward()
    report = w.step()
    w.remove()
    D = C // H
    with torch.no_grad():
        q, k, v = (p(x).view(B, T, H, D).transpose(1, 2)
                   for p in (model.q_proj, model.k_proj, model.v_proj))
        o_used = (fw.attention(q, k, v, causal=True, backend="reference") if routed
                  else F.scaled_dot_product_attention(q, k, v, is_causal=True))
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, -1)
    pk = p @ k.double()  # [B, H, T, D]
    do = wgt.bfloat16().double().view(B, T, H, D).transpose(1, 2)
    o_fp32 = fused_o_fp64(q, k, v, D ** -0.5) if routed else p @ v.double()
    c = (do * (o_used.double() - o_fp32)).sum(-1)  # [B, H, T]
    X = x.double()  # [B, T, C]
    E = D ** -0.5 * torch.einsum("bht,bhtd,btc->hdc", c, pk, X)  # Eq. 3, this layer
    diag = D ** -0.5 * c.abs() * pk.norm(dim=-1) * X.norm(dim=-1).unsqueeze(1)
    gq = model.q_proj.weight.grad.double().view(H, D, C)
    return (report, E.square().sum((1, 2)), diag.square().sum((0, 2)),
            gq.square().sum((1, 2)))


def test_delta_error_share_is_sum_of_row_terms_over_the_gradient_fp64():
    # Every row sampled: the estimate is exactly sqrt(Σ_T ‖e_T‖²) / ‖dW^Q_h‖ in FP64.
    report, _, diag, gq = _share_case(21)
    got = torch.tensor([h.delta_error_share for h in report.heads], dtype=torch.float64)
    assert torch.allclose(got, (diag / gq).sqrt(), rtol=2e-2), (got, (diag / gq).sqrt())


def test_routed_share_measures_c_against_the_kernels_own_fp32_o():
    # flashwatch's kernel: c = δ_used - δ(kernel's FP32 O), the error FP32_O removes; the
    # exact-softmax recomputation would also count P̄'s BF16 rounding (a larger c).
    report, _, diag, gq = _share_case(22, rows=16, routed=True)
    report_all, _, diag_all, _ = _share_case(22, routed=True)
    got = torch.tensor([h.delta_error_share for h in report_all.heads], dtype=torch.float64)
    assert torch.allclose(got, (diag_all / gq).sqrt(), rtol=2e-2), (got, diag_all, gq)
    assert all(h.delta_error_all_rows for h in report.heads)  # every row for Σc, 16 for E
    _, _, diag_sdpa, _ = _share_case(22)  # the same step measured as a foreign kernel
    assert not torch.allclose(diag_all, diag_sdpa, rtol=0.05)


def test_delta_error_share_estimates_the_exact_eq3_norm():
    # Row errors of random data add incoherently: Σ‖e_T‖² estimates ‖Σ e_T‖² = ‖E‖²;
    # with 128 rows in d_model = 128 the cross terms leave ~5 % per case, so the mean
    # ratio over 6 cases is within 15 %.
    ratios = []
    for seed in range(6):
        report, exact, _, gq = _share_case(30 + seed)
        est = torch.tensor([h.delta_error_share for h in report.heads], dtype=torch.float64)
        ratios.append(est / (exact / gq).sqrt())
    ratio = torch.stack(ratios).mean(0)
    assert ((ratio > 0.85) & (ratio < 1.15)).all(), torch.stack(ratios)


def test_sampled_share_squared_is_unbiased_over_row_samples():
    # R = 16 of M = 128 rows, scaled by M/R: E[share²] over row samples = the all-row
    # Σ‖e_T‖²/‖dW^Q‖². ‖PK_T‖ of early causal rows is large, so single samples are skewed
    # low (median ≈ 0.5 of the truth here) while the mean of squares is right: measured
    # 0.95 and 1.12 over 32 samples (standard error 0.15); the bound is ~3 standard errors.
    # The naive ‖(M/R) Σ_sampled e_T‖² would be ≈ M/R = 8 times too large.
    full, _, _, _ = _share_case(5)
    full = torch.tensor([h.delta_error_share for h in full.heads], dtype=torch.float64)
    samples = []
    for seed in range(32):
        r, _, _, _ = _share_case(5, rows=16, watch_seed=seed)
        samples.append(torch.tensor([h.delta_error_share for h in r.heads],
                                    dtype=torch.float64))
    mean_sq = torch.stack(samples).square().mean(0) / full.square()
    assert ((mean_sq > 0.55) & (mean_sq < 1.45)).all(), mean_sq


def test_share_uses_the_whole_accumulated_gradient_even_after_zero_grad():
    # Two micro-batches, zero_grad() before watcher.step(): the hook kept ‖g_a + g_b‖²,
    # and ‖E‖² estimates add, so share² = (s_a² ‖g_a‖² + s_b² ‖g_b‖²) / ‖g_a + g_b‖².
    torch.manual_seed(14)
    C, H, B, T = 64, 2, 2, 16
    model = QKV(C, H).bfloat16()
    g = torch.Generator().manual_seed(14)
    xs = [torch.randn(B, T, C, generator=g).bfloat16() for _ in range(2)]
    ws = [torch.randn(B, T, C, generator=g) for _ in range(2)]
    site = {"": dict(num_heads=H, q_module="q_proj")}

    def run(pairs):
        w = fw.watch(model, sites=site, every_n_steps=1, rows_per_head="all")
        for x, wgt in pairs:
            (model(x).float() * wgt).sum().backward()
        grad = model.q_proj.weight.grad.double().view(H, C // H, C).square().sum((1, 2))
        model.zero_grad(set_to_none=True)
        share = torch.tensor([h.delta_error_share for h in w.step().heads],
                             dtype=torch.float64)
        w.remove()
        return share, grad

    pairs = list(zip(xs, ws, strict=True))
    s_ab, g_ab = run(pairs)
    (s_a, g_a), (s_b, g_b) = run(pairs[:1]), run(pairs[1:])
    want = ((s_a ** 2 * g_a + s_b ** 2 * g_b) / g_ab).sqrt()
    assert torch.allclose(s_ab, want, rtol=1e-6), (s_ab, want)
    assert not torch.allclose(g_ab, g_a + g_b, rtol=1e-2)  # the cross term matters


def test_guarded_rows_reach_the_report_exactly():
    # All keys equal (tie=True), q scaled so the row max r_m spreads over ±150: BETA's
    # excess, (β-1)·r_m = r_m above 0 and -r_m below, passes the 60-nat guard in the
    # rows with |r_m| > 60.
    torch.manual_seed(13)
    model = TiedAttention(C=32, H=2, tie=True)
    with torch.no_grad():
        model.c_attn.weight[:32] *= 300.0
    model = model.bfloat16()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(13)).bfloat16()
    w = fw.watch(model, every_n_steps=1)
    w.set_head_modes(w.sites[0].name, [Mode.BETA, Mode.STANDARD])
    model(x).float().sum().backward()
    report = w.step()
    w.remove()
    with torch.no_grad():
        q, k, _ = (t.view(2, 16, 2, -1).transpose(1, 2) for t in model.c_attn(x).split(32, 2))
        s = (q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5
        s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), -math.inf)
        m = s.amax(-1)
        tied = ((s >= (m - 1e-3).unsqueeze(-1)).sum(-1) >= 2)
        want = (tied & (m.abs() > 60.0)).sum((0, 2))
    assert 0 < want[0] < tied[:, 0].sum()
    assert [h.guarded_rows for h in report.heads] == [int(want[0]), 0]


def test_finish_scales_each_head_by_its_own_replica_count():
    """Under pipeline parallelism a stage's heads have 1 holder, replicated ones W: the
    same summed contribution is a mean over the ranks that hold the head, never over the
    world (a 2-stage job would halve every stage's Σc and G)."""
    from flashwatch.monitor import aggregate

    n, k = 3, 2
    shapes = aggregate.shapes(n, k)
    sums = {key: torch.full(s, 8.0, dtype=torch.float64) for key, s in shapes.items()
            if not key.startswith("max:")}
    sums["delta_missed"] = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)  # head 2 sampled
    maxes = {key[4:]: torch.zeros(s, dtype=torch.float64) for key, s in shapes.items()
             if key.startswith("max:")}
    holders = [1, 2, 4]
    a = aggregate.finish(sums, maxes, holders)
    assert a.delta_sum_w.tolist() == [8.0, 4.0, 2.0]  # Σc ÷ holders
    assert a.delta_sq_w.tolist() == [8.0, 2.0, 0.5]  # Σc² ÷ holders²
    assert a.delta_sum.tolist() == [8.0, 4.0, 8.0 / 16]  # sampled rows: ÷ holders² too
    assert a.G[:, 0, 0].tolist() == [8.0, 4.0, 2.0]
    same = aggregate.finish(sums, maxes, 2)  # one world size: every head alike
    assert same.delta_sum_w.tolist() == [4.0, 4.0, 4.0]
