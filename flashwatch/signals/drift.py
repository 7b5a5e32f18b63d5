"""Per-head online signals of the δ error (docs/design.md §5), for n heads at once.

Each monitored step brings, per head, the k×k sketch G_t = Σ_T c[T] z[T] y[T]ᵀ of the
W^Q gradient error and the W^Q spectral norm σ. From them:

  r_projection             κ_t = uᵀ G_t v, (u, v) = top singular pair of C_{t-1} = Σ_{s<t} G_s.
                           The direction comes from the past only: with C_t (which holds
                           G_t) zero-mean noise would project onto itself and κ would be
                           biased positive (E[uᵀGv] ≈ ‖G‖ at the first steps).
  r_projection_cumulative  Σ κ over all steps.
  delta_drift_z            Σκ / sqrt(Σκ²) over the window. Because (u, v) is fixed before
                           G_t is seen, κ_t is a martingale difference under zero-mean G,
                           so this self-normalised sum is ≈ N(0, 1) (and, for symmetric
                           noise, P(z ≥ x) ≤ exp(-x²/2) whatever the tails). A persistent
                           bias makes it grow like sqrt(steps in window).
  delta_coherence          ‖Σ_W G‖_F / Σ_W ‖G‖_F ∈ [0, 1]: 1 when all G point one way,
                           ≈ 1/sqrt(window) for independent zero-mean G.
  spectral_growth          σ_now / σ_oldest_in_window − 1.
  delta_sign_z             Σ_W Σc / sqrt(Σ_W Σc²) from the per-step sums over rows of
                           c[T] (all rows when flashwatch's kernel ran): ≈ N(0, 1) when
                           row errors are zero-mean and independent, ≈ r·sqrt(M·W) for a
                           per-row signal-to-noise r over M rows per step. Rows of one
                           sequence share dO and keys, so it is not a calibrated alarm:
                           reported, not used by the policy.
  delta_error_share_mean   sqrt(Σ_W ‖E‖² / Σ_W ‖dW^Q‖²): the window's share², each step
                           weighted by its gradient energy (the square is what the
                           estimator gets right on average: a single sampled step is
                           skewed low; the weight keeps a step whose W^Q gradient is
                           nearly 0 from dominating: seen at 1e10 in unweighted RMS
                           windows of lr 3e-2 runs), and the spread of the per-step shares
  delta_error_share_std    (their standard deviation over the window's steps).

Memory is fixed: C [n, k, k], Σκ [n], ring buffers of the last `window` steps (κ, G,
‖G‖_F, σ) and the window sum of G, whatever the number of steps. The κ and ‖G‖_F window
sums are recomputed from their rings every step (n·window adds). Σ_W G is kept as a
running sum (add the new G, subtract the one leaving): re-summing the G ring costs
n·window·k² adds (3 ms per step for 800 heads here, the bulk of an update); it is
re-summed exactly from the ring each time a head's ring wraps, so rounding cannot
accumulate beyond one window. All of it is in state_dict, so a restored state
reproduces the outputs bit for bit.

Missing data. A head whose G_t has any non-finite entry (NaN rows = the probe saw no
row of this head this step) gets no update at all: C, Σκ and its window are unchanged
(its window does not advance, so σ of that step is not stored either) and its κ for the
step is NaN; drift z, coherence and spectral growth are recomputed from the unchanged
window, i.e. they repeat the last values. σ may be NaN (unknown) on a step with data: the
window advances and spectral_growth is NaN while that NaN is the newest or oldest σ.

Everything lives on the CPU in float64: the per-step tensors are tiny, float64 keeps
Σκ exact enough over millions of steps, and decisions must not depend on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashwatch._checks import check_int
from flashwatch.signals.spectral import psd_power

F64 = torch.float64


@dataclass
class SignalValues:
    """Outputs of one `HeadSignals.update` call, each a CPU tensor [n] (float64 unless said)."""

    r_projection: torch.Tensor  # κ_t; NaN for heads without data this step
    r_projection_cumulative: torch.Tensor  # Σ κ over all steps
    delta_drift_z: torch.Tensor  # Σκ / sqrt(Σκ²) over the window; 0 when Σκ² = 0
    delta_coherence: torch.Tensor  # ‖Σ_W G‖_F / Σ_W ‖G‖_F; 0 when Σ_W ‖G‖_F = 0
    spectral_growth: torch.Tensor  # σ_now / σ_oldest − 1; NaN if unknown, < 1 step or σ_oldest ≤ 0
    window_fill: torch.Tensor  # int64: steps in each head's window (0..window)
    # Reported only (the policy does not read them), so optional for callers that build
    # SignalValues by hand:
    delta_sign_z: torch.Tensor | None = None  # Σ_W Σc / sqrt(Σ_W Σc²); 0 when Σ_W Σc² = 0
    delta_error_share_mean: torch.Tensor | None = None  # sqrt(mean share²) over the window
    delta_error_share_std: torch.Tensor | None = None  # std of the shares (NaN below 2)


class _StartVectors(dict):
    """Fixed seeded start vector per sketch size (generic: not orthogonal to anything)."""

    def __missing__(self, k: int) -> torch.Tensor:
        self[k] = torch.randn(k, generator=torch.Generator().manual_seed(0), dtype=F64)
        return self[k]


_START = _StartVectors()


def top_singular_pair(C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top singular pair (u [n, k], v [n, k], σ_1 [n]) of each C[i] (float64 [n, k, k]).

    (CᵀC)^64 by repeated squaring, applied to a fixed seeded start vector: other
    directions shrink by (σ_2/σ_1)^128 (1e-22 for σ_1 = 1.5 σ_2). 6 tiny batched matmuls
    instead of a batched SVD, which costs ~20 µs per 8×8 matrix on a CPU (3.5 ms for
    200 heads) and dominated the update. Where σ_2 ≈ σ_1
    (no dominant direction, e.g. pure noise) the result is some unit vector of the top
    cluster, a deterministic function of C: κ only needs (u, v) to be fixed by the past.
    u = C v / ‖C v‖, so the joint sign of (u, v) is consistent and cancels in uᵀ G v.
    Returns zero vectors and σ_1 = 0 where C = 0.
    """
    u, v, s1 = _top_pair(C.detach().cpu().double().numpy())
    return torch.from_numpy(u), torch.from_numpy(v), torch.from_numpy(s1)


def _top_pair(C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`top_singular_pair` on a float64 ndarray [n, k, k]."""
    k = C.shape[-1]
    M = psd_power(torch.from_numpy(C.transpose(0, 2, 1) @ C), 2).numpy()  # (CᵀC)^64
    v = M @ _START[k].numpy()
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)
    cv = (C @ v[:, :, None])[:, :, 0]
    s1 = np.linalg.norm(cv, axis=1)
    return cv / np.maximum(s1, 1e-300)[:, None], v, s1


class HeadSignals:
    """Online δ-error signals for `n_heads` heads with k×k sketches and a sliding window."""

    _TENSORS = ("C", "kappa_cum", "kappa_ring", "g_ring", "g_sum", "gnorm_ring", "sigma_ring",
                "csum_ring", "csq_ring", "share_ring", "share_w_ring", "pos", "fill")

    def __init__(self, n_heads: int, sketch_dim: int, window: int) -> None:
        self.n_heads = check_int("n_heads", n_heads, min=1)
        self.sketch_dim = check_int("sketch_dim", sketch_dim, min=1)
        self.window = check_int("window", window, min=2)
        n, k, w = n_heads, sketch_dim, window
        self.C = torch.zeros(n, k, k, dtype=F64)  # Σ of all past G (never reset)
        self.kappa_cum = torch.zeros(n, dtype=F64)  # Σ κ over all steps (never reset)
        # Ring buffers of the window. Empty slots hold 0 (σ: NaN) so whole-ring sums are
        # window sums. pos = next slot to write, fill = valid slots, per head: heads
        # advance independently (missing data, reset_window).
        self.kappa_ring = torch.zeros(n, w, dtype=F64)
        self.g_ring = torch.zeros(n, w, k, k, dtype=F64)
        self.g_sum = torch.zeros(n, k, k, dtype=F64)  # Σ of g_ring over the window
        self.gnorm_ring = torch.zeros(n, w, dtype=F64)
        self.sigma_ring = torch.full((n, w), float("nan"), dtype=F64)
        self.csum_ring = torch.zeros(n, w, dtype=F64)  # Σc of each step
        self.csq_ring = torch.zeros(n, w, dtype=F64)  # Σc² of each step
        self.share_ring = torch.full((n, w), float("nan"), dtype=F64)
        self.share_w_ring = torch.ones(n, w, dtype=F64)  # each step's ‖dW^Q‖² (its weight)
        self.pos = torch.zeros(n, dtype=torch.int64)
        self.fill = torch.zeros(n, dtype=torch.int64)

    def update(self, G: torch.Tensor, sigma: torch.Tensor, csum=None, csq=None,
               share=None, share_weight=None) -> SignalValues:
        """Add one monitored step: G [n, k, k] (non-finite = no data), sigma [n] (NaN =
        unknown); optional csum, csq [n] (Σc, Σc² over the step's rows; non-finite = 0),
        share [n] (delta_error_share of the step, NaN = unknown) and share_weight [n]
        (the step's ‖dW^Q‖², the weight of its share² in the window; None = 1)."""
        n, k = self.n_heads, self.sketch_dim
        G = self._as_f64("G", G, (n, k, k))
        sigma = self._as_f64("sigma", sigma, (n,))
        nan = np.full(n, np.nan)
        csum = nan if csum is None else self._as_f64("csum", csum, (n,))
        csq = nan if csq is None else self._as_f64("csq", csq, (n,))
        share = nan if share is None else self._as_f64("share", share, (n,))
        weight = np.ones(n) if share_weight is None else self._as_f64(
            "share_weight", share_weight, (n,))
        # numpy on views of the state tensors (they stay the state): a few hundred ops on
        # [n_heads] arrays cost ≈ 1 µs each in numpy against ≈ 5 µs in torch (CPU).
        arrays = self._arrays()
        C, kappa_cum, kappa_ring, g_ring, g_sum, gnorm_ring, sigma_ring, csum_ring, \
            csq_ring, share_ring, share_w_ring, pos, fill = arrays
        with np.errstate(invalid="ignore"):
            share = np.where(np.isfinite(weight) & (weight > 0), share, np.nan)
        has = np.isfinite(G).reshape(n, -1).all(axis=1)  # heads with data this step
        G = np.where(has[:, None, None], G, 0.0)

        # κ from the direction of the past sum only (C before adding G_t).
        u, v, s1 = _top_pair(C)
        kappa = (u[:, None, :] @ G @ v[:, :, None])[:, 0, 0]
        kappa = np.where(s1 > 0, kappa, 0.0)  # C = 0: κ = 0

        # Write this step into each head's ring; heads without data keep theirs.
        idx = np.arange(n) if has.all() else np.flatnonzero(has)
        slot = pos[idx]
        Gi = G[idx]
        C[idx] += Gi
        kappa_cum[idx] += kappa[idx]
        kappa_ring[idx, slot] = kappa[idx]
        g_sum[idx] += Gi - g_ring[idx, slot]  # the slot held the oldest G (or 0)
        g_ring[idx, slot] = Gi
        gnorm_ring[idx, slot] = np.linalg.norm(Gi, axis=(1, 2))
        sigma_ring[idx, slot] = sigma[idx]
        csum_ring[idx, slot] = np.nan_to_num(csum[idx], nan=0.0, posinf=0.0, neginf=0.0)
        csq_ring[idx, slot] = np.nan_to_num(csq[idx], nan=0.0, posinf=0.0, neginf=0.0)
        share_ring[idx, slot] = share[idx]
        share_w_ring[idx, slot] = np.where(np.isfinite(share[idx]), weight[idx], 1.0)
        pos[idx] = (slot + 1) % self.window
        fill[idx] = np.minimum(fill[idx] + 1, self.window)
        wrapped = idx[pos[idx] == 0]  # re-sum exactly once per window
        if wrapped.size:
            g_sum[wrapped] = g_ring[wrapped].sum(axis=1)

        return self._values(np.where(has, kappa, np.nan), arrays)

    def _arrays(self) -> list[np.ndarray]:
        """numpy views of the state tensors, in `_TENSORS` order (writes go to the state)."""
        return [getattr(self, name).numpy() for name in self._TENSORS]

    def _values(self, kappa: np.ndarray, arrays: list[np.ndarray]) -> SignalValues:
        _, kappa_cum, kappa_ring, _, g_sum, gnorm_ring, sigma_ring, csum_ring, csq_ring, \
            share_ring, share_w_ring, pos, fill = arrays
        rows, w = np.arange(self.n_heads), self.window
        with np.errstate(invalid="ignore", divide="ignore"):  # NaN/0 where np.where drops it
            s1 = kappa_ring.sum(axis=1)
            s2 = (kappa_ring ** 2).sum(axis=1)
            z = np.where(s2 > 0, s1 / np.sqrt(np.maximum(s2, 1e-300)), 0.0)
            num = np.linalg.norm(g_sum, axis=(1, 2))
            den = gnorm_ring.sum(axis=1)
            # min(…, 1) only hides the last-bit rounding of the triangle inequality.
            coh = np.where(den > 0, np.minimum(num / np.maximum(den, 1e-300), 1.0), 0.0)
            newest = sigma_ring[rows, (pos - 1) % w]
            oldest = sigma_ring[rows, (pos - fill) % w]
            ok = (fill > 0) & (oldest > 0) & np.isfinite(newest)  # NaN > 0 is False
            growth = np.where(ok, newest / np.maximum(oldest, 1e-300) - 1.0, np.nan)
            c1, c2 = csum_ring.sum(axis=1), csq_ring.sum(axis=1)
            sign_z = np.where(c2 > 0, c1 / np.sqrt(np.maximum(c2, 1e-300)), 0.0)
            known = np.isfinite(share_ring)
            share_n = known.sum(axis=1)
            wt = np.where(known, share_w_ring, 0.0)
            share_rms = np.where(share_n > 0, np.sqrt(
                np.nansum(share_ring ** 2 * wt, axis=1) / np.maximum(wt.sum(axis=1), 1e-300)),
                np.nan)
            present = ~np.isnan(share_ring)  # the mean of the non-NaN shares (nanmean)
            mean = np.where(present, share_ring, 0.0).sum(axis=1, keepdims=True) / present.sum(
                axis=1, keepdims=True)
            share_var = np.nansum((share_ring - mean) ** 2, axis=1) / np.maximum(share_n - 1, 1)
            share_std = np.where(share_n >= 2, np.sqrt(share_var), np.nan)
        t = torch.from_numpy
        return SignalValues(
            r_projection=t(kappa),
            r_projection_cumulative=t(kappa_cum.copy()),
            delta_drift_z=t(z),
            delta_coherence=t(coh),
            spectral_growth=t(growth),
            window_fill=t(fill.copy()),
            delta_sign_z=t(sign_z),
            delta_error_share_mean=t(share_rms),
            delta_error_share_std=t(share_std),
        )

    def reset_window(self, mask: torch.Tensor) -> None:
        """Empty the window of the heads in `mask` (bool [n]); C and Σκ are kept.

        Used after a mode switch so the verification window sees post-switch steps only.
        """
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor [n_heads], got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != (self.n_heads,):
            raise ValueError(f"mask must have shape [{self.n_heads}] (one entry per head), "
                             f"got {list(mask.shape)}")
        m = mask.cpu()
        self.kappa_ring[m] = 0.0
        self.g_ring[m] = 0.0
        self.g_sum[m] = 0.0
        self.gnorm_ring[m] = 0.0
        self.sigma_ring[m] = float("nan")
        self.csum_ring[m] = 0.0
        self.csq_ring[m] = 0.0
        self.share_ring[m] = float("nan")
        self.share_w_ring[m] = 1.0
        self.pos[m] = 0
        self.fill[m] = 0

    def state_dict(self) -> dict:
        sd = {name: getattr(self, name).clone() for name in self._TENSORS}
        sd.update(n_heads=self.n_heads, sketch_dim=self.sketch_dim, window=self.window)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for name in ("n_heads", "sketch_dim", "window"):
            if sd.get(name) != getattr(self, name):
                raise ValueError(
                    f"state has {name}={sd.get(name)!r} but these signals have "
                    f"{getattr(self, name)}; build HeadSignals with the same n_heads, "
                    f"sketch_dim and window as the saved run"
                )
        if "share_w_ring" not in sd and "share_ring" in sd:  # saved before weighting: 1
            sd = {**sd, "share_w_ring": torch.ones_like(sd["share_ring"])}
        for name in self._TENSORS:
            mine = getattr(self, name)
            t = sd.get(name)
            if not isinstance(t, torch.Tensor) or t.shape != mine.shape or t.dtype != mine.dtype:
                raise ValueError(f"state entry {name!r} must be a {mine.dtype} tensor of shape "
                                 f"{list(mine.shape)}, got {t!r:.80}")
        for name in self._TENSORS:
            setattr(self, name, sd[name].detach().cpu().clone())

    def _as_f64(self, name: str, t, shape: tuple) -> np.ndarray:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {list(shape)}, got "
                            f"{type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (n_heads={self.n_heads}, "
                             f"sketch_dim={self.sketch_dim}), got {list(t.shape)}")
        if not (t.dtype.is_floating_point):
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        return t.detach().to("cpu", F64).numpy()
