"""flashwatch/signals/drift.py against brute force: κ from the past sum's top singular pair,
the top pair itself against an SVD, drift z, coherence, spectral growth and the
cumulative κ replayed over a stream with missing steps and a window reset, sign z and
the δ-share window. The calibration streams: tests/signals/test_signals.py; state and argument
checks: tests/signals/test_signals_state.py."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import unit_rank1

from flashwatch.signals.drift import HeadSignals, top_singular_pair

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _svd_kappa(C, G):
    U, S, Vh = torch.linalg.svd(C)
    return (U[:, 0] @ G @ Vh[0]).item(), S


def test_kappa_direction_comes_from_the_past_only():
    # G_0 along e1, G_1 along e2 ten times stronger. From the past (C_0 = G_0), κ_1 =
    # e1ᵀ G_1 e1 = 0; with C_1 = G_0 + G_1 the direction would be e2 and κ_1 = 10.
    k = 4
    e = torch.eye(k, dtype=F64)
    s = HeadSignals(1, k, 8)
    out0 = s.update(torch.outer(e[0], e[0])[None], torch.ones(1, dtype=F64))
    assert out0.r_projection.item() == 0.0  # C is zero before the first step
    out1 = s.update(10 * torch.outer(e[1], e[1])[None], torch.ones(1, dtype=F64))
    assert out1.r_projection.item() == pytest.approx(0.0, abs=1e-12)
    out2 = s.update(torch.outer(e[1], e[1])[None], torch.ones(1, dtype=F64))
    assert out2.r_projection.item() == pytest.approx(1.0)  # now C = diag(1, 10, 0, 0)


def test_kappa_is_unbiased_under_noise():
    # Zero-mean G: κ_t is a martingale difference, so mean κ ≈ 0. Projecting G_t on the
    # top pair of a sum that holds G_t would give E κ ≈ σ_1(G) ≈ 2·sqrt(k) > 0 early on.
    n, k = 2000, 8
    g = torch.Generator().manual_seed(3)
    s = HeadSignals(n, k, 8)
    kappas = []
    for _ in range(5):
        out = s.update(torch.randn(n, k, k, generator=g, dtype=F64), torch.ones(n, dtype=F64))
        kappas.append(out.r_projection)
    kappa = torch.stack(kappas[1:])  # step 0 is 0 by definition
    stderr = kappa.std() / math.sqrt(kappa.numel())
    assert kappa.mean().abs() < 4 * stderr, (kappa.mean(), stderr)


def test_top_singular_pair_matches_svd():
    g = torch.Generator().manual_seed(4)
    C = torch.randn(500, 8, 8, generator=g, dtype=F64)
    C[:250] += 20 * unit_rank1(250, 8, g)
    u, v, s1 = top_singular_pair(C)
    U, S, Vh = torch.linalg.svd(C)
    # Without a gap (σ_2 ≈ σ_1, pure noise) v mixes the top directions; σ_1 is still close.
    assert torch.allclose(s1, S[:, 0], rtol=3e-2)  # worst here: σ_2 = 0.978 σ_1, 1.1 %
    gap = S[:, 0] / S[:, 1] > 1.5  # (1/1.5)^128 ≈ 3e-23: exact to rounding
    assert gap[:250].all()  # the planted rank-1 part dominates
    assert torch.allclose(s1[gap], S[gap, 0], rtol=1e-12)
    assert torch.allclose((v * Vh[:, 0]).sum(1).abs()[gap], torch.ones(int(gap.sum()), dtype=F64))
    assert torch.allclose((u * U[:, :, 0]).sum(1)[gap], (v * Vh[:, 0]).sum(1)[gap])  # joint sign
    u0, v0, s0 = top_singular_pair(torch.zeros(2, 8, 8, dtype=F64))
    assert (s0 == 0).all() and torch.isfinite(u0).all() and torch.isfinite(v0).all()


def test_signals_match_brute_force_over_history():
    """Replays a stream with missing steps and a window reset against full-history math."""
    n, k, W, steps = 5, 6, 8, 60
    g = torch.Generator().manual_seed(5)
    R = unit_rank1(n, k, g)
    s = HeadSignals(n, k, W)
    hist_G = [[] for _ in range(n)]  # every G of the head (C: never reset)
    win = [[] for _ in range(n)]  # (κ, G, σ) since the last reset, oldest first
    cum = [0.0] * n
    for t in range(steps):
        G = 2.0 * R + torch.randn(n, k, k, generator=g, dtype=F64)
        sigma = 1 + 0.01 * t + torch.rand(n, generator=g, dtype=F64)
        if t % 7 == 3:
            G[1] = float("nan")  # head 1: no data this step
        if t % 11 == 5:
            G[2, 0, 0] = float("inf")  # head 2: a non-finite entry also means no data
        if t % 13 == 4:
            sigma[3] = float("nan")  # head 3: σ unknown this step
        out = s.update(G, sigma)
        for h in range(n):
            has = bool(torch.isfinite(G[h]).all())
            if not has:
                assert math.isnan(out.r_projection[h])
            else:
                C = sum(hist_G[h]) if hist_G[h] else torch.zeros(k, k, dtype=F64)
                kappa_ref, S = _svd_kappa(C, G[h])
                kappa = out.r_projection[h].item()
                if S[0] == 0:
                    assert kappa == 0.0
                elif S[0] / S[1] > 1.5:
                    assert kappa == pytest.approx(kappa_ref, rel=1e-9, abs=1e-9)
                else:  # no dominant direction yet: any unit pair, so |κ| ≤ σ_1(G)
                    assert abs(kappa) <= torch.linalg.matrix_norm(G[h], ord=2) + 1e-9
                hist_G[h].append(G[h])
                win[h].append((kappa, G[h], sigma[h].item()))
                win[h] = win[h][-W:]
                cum[h] += kappa
            kap = [w[0] for w in win[h]]
            s2 = sum(x * x for x in kap)
            z_ref = sum(kap) / math.sqrt(s2) if s2 > 0 else 0.0
            Gs = [w[1] for w in win[h]]
            den = sum(torch.linalg.matrix_norm(x).item() for x in Gs)
            coh_ref = torch.linalg.matrix_norm(sum(Gs)).item() / den if den > 0 else 0.0
            sig = [w[2] for w in win[h]]
            growth_ref = sig[-1] / sig[0] - 1 if sig and sig[0] > 0 else math.nan
            assert out.delta_drift_z[h].item() == pytest.approx(z_ref, rel=1e-9, abs=1e-12)
            assert out.delta_coherence[h].item() == pytest.approx(coh_ref, rel=1e-9, abs=1e-12)
            assert out.r_projection_cumulative[h].item() == pytest.approx(cum[h], rel=1e-9,
                                                                          abs=1e-9)
            assert out.window_fill[h].item() == len(win[h])
            got = out.spectral_growth[h].item()
            assert (math.isnan(got) and math.isnan(growth_ref)) or got == pytest.approx(
                growth_ref, rel=1e-12)
        if t == 30:  # after a mode switch the watcher empties the switched heads' windows
            mask = torch.tensor([True, False, False, True, False])
            s.reset_window(mask)
            for h in (0, 3):
                win[h] = []
    assert 0 < s.fill[0] <= W  # the reset head refilled


def test_coherence_and_z_extremes():
    k = 3
    s = HeadSignals(2, k, 4)
    G = torch.randn(2, k, k, generator=torch.Generator().manual_seed(6), dtype=F64)
    G[1] = 0.0
    for _ in range(4):
        out = s.update(G, torch.ones(2, dtype=F64))
    assert out.delta_coherence[0].item() == pytest.approx(1.0)  # all G identical
    assert out.delta_coherence[1].item() == 0.0 and out.delta_drift_z[1].item() == 0.0
    assert out.delta_drift_z[0].item() == pytest.approx(math.sqrt(3))  # κ_0 = 0, 3 equal κ
    assert out.spectral_growth[0].item() == 0.0


def test_sign_z_and_share_window_match_brute_force():
    # Σc, Σc² and share per step for 3 heads over 12 steps of a window of 5; head 2
    # has no share on some steps (NaN) and no data (NaN G) on step 7.
    g = torch.Generator().manual_seed(3)
    n, k, w = 3, 4, 5
    sig = HeadSignals(n, k, w)
    hist = {h: [] for h in range(n)}
    for step in range(12):
        G = torch.randn(n, k, k, generator=g, dtype=torch.float64)
        csum = torch.randn(n, generator=g, dtype=torch.float64) + 0.5
        csq = torch.rand(n, generator=g, dtype=torch.float64) + 1.0
        share = torch.rand(n, generator=g, dtype=torch.float64)
        if step % 3 == 0:
            share[2] = float("nan")
        if step == 7:
            G[2] = float("nan")
        weight = torch.rand(n, generator=g, dtype=torch.float64) * 10  # ‖dW^Q‖²
        if step == 4:
            weight[1] = 0.0  # no W^Q gradient: that step's share is unknown
        vals = sig.update(G, torch.ones(n, dtype=torch.float64), csum, csq, share,
                          share_weight=weight)
        for h in range(n):
            if torch.isfinite(G[h]).all():
                s = share[h].item() if weight[h] > 0 else math.nan
                hist[h].append((csum[h].item(), csq[h].item(), s, weight[h].item()))
            last = hist[h][-w:]
            z = sum(a for a, _, _, _ in last) / math.sqrt(sum(b for _, b, _, _ in last))
            assert vals.delta_sign_z[h].item() == pytest.approx(z, rel=1e-12)
            shares = [s for _, _, s, _ in last if not math.isnan(s)]
            if not shares:
                assert math.isnan(vals.delta_error_share_mean[h].item())
                continue
            # Σ‖E‖² / Σ‖dW^Q‖² with ‖E‖² = share²·‖dW^Q‖²
            known = [(s, wt) for _, _, s, wt in last if not math.isnan(s)]
            rms = math.sqrt(sum(s * s * wt for s, wt in known) / sum(wt for _, wt in known))
            assert vals.delta_error_share_mean[h].item() == pytest.approx(rms, rel=1e-12)
            if len(shares) >= 2:
                mean = sum(shares) / len(shares)
                std = math.sqrt(sum((s - mean) ** 2 for s in shares) / (len(shares) - 1))
                assert vals.delta_error_share_std[h].item() == pytest.approx(std, rel=1e-9)
