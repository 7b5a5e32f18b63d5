"""Largest singular value of each head's W^Q: from its small Gram matrix, or by batched,
warm-started power iteration where the weight is sharded.

`wq_spectral_norm` (docs/design.md §5) is watched every monitored step for every head, so it
must be cheap.

`gram_norm` (a weight this process holds whole): W^Q_h is d_head × d_model with
d_head ≤ 128, so M = W Wᵀ is a small [d_head, d_head] matrix. Raising it to the power
p = 8^GRAM_ROUNDS by repeated squaring leaves (nearly) only its top eigenvector; the
Rayleigh quotient of that vector is λ_1 to within λ_1·m/(2ep) in the worst case
(eigenvalues crowding λ_1, m = d_head), 5e-5 relative in σ at m = 128, and in
practice to FP32 rounding. A fixed number of operations, with no convergence loop: a
warm start needed 8-48 iterations between monitored steps 10 apart early in training
(AdamW lr 1e-3 turns W^Q's top singular vector fast), 4 ms of a 13 ms monitored step
of the CPU benchmark GPT, against ≈ 0.5 ms here. Cost: the Gram H·d²·d_model·2 flops,
then 3·GRAM_ROUNDS squarings of H·d³·2 flops, once.

`power_iteration` (sharded W^Q, flashwatch/parallel/power.py, where no process holds a head's
rows together): one product with W and one with Wᵀ per iteration, batched over heads.
A warm start from the previous step's vector needs only a few iterations
(`WatchConfig.power_iters`, default 4) when W^Q moves little between monitored steps.

Why ‖W v‖ converges fast even when v does not: with v = Σ_j c_j v_j (v_j the right
singular vectors), ‖W v‖² = Σ_j c_j² σ_j², so directions whose σ_j is close to σ_1 barely
lower the estimate. Only the gap-free part of the spectrum matters, and the relative
error falls like 1/iterations even with no gap at all (random Gaussian matrices).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flashwatch._checks import check_float, check_int
from flashwatch.signals import smallops

COLD_START_MAX_ITERS = 500  # cold-start cap; 64×768 Gaussian (no gap): 1.7e-4 rel. error
# A warm start runs `iters` iterations, then goes on until σ settles (at most this many):
# a large optimizer step can turn the top singular vector further than 4 iterations
# recover when σ_2 is close to σ_1 (seen with AdamW lr 3e-3 on a fresh GPT: 1.6 % low).
WARM_MAX_ITERS = 100
DEFAULT_SEED = 0


def start_vector(n_heads: int, dim: int, *, seed: int = DEFAULT_SEED,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Seeded random unit vectors [n_heads, dim], identical on every device and rank."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    v = torch.randn(n_heads, dim, generator=gen, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    return v.to(device=device, dtype=dtype)


GRAM_ROUNDS = 6  # M^(8^6) = M^262144: the module docstring's bound


def psd_power(M: torch.Tensor, rounds: int) -> torch.Tensor:
    """M^(8^rounds) of each PSD M[i] ([n, m, m]) up to a positive factor per matrix, by
    repeated squaring: only the top eigenvector(s) survive. Each round divides by the
    trace (≥ λ_1), so λ_1 ∈ [1/m, 1] and its 8th power (3 squarings) stays
    ≥ m^-8 > 0 and nothing overflows. A zero M[i] stays zero."""
    floor = 1e-300 if M.dtype == torch.float64 else 1e-30
    if smallops.on_numpy(M):  # flashwatch/signals/smallops.py: ≈ 1.5× faster on the CPU
        a = M.detach().numpy()
        for _ in range(rounds):
            a = a / np.maximum(np.trace(a, axis1=1, axis2=2), floor)[:, None, None]
            for _ in range(3):
                a = a @ a
        return torch.from_numpy(a)
    for _ in range(rounds):
        trace = M.diagonal(dim1=1, dim2=2).sum(dim=1)
        M = M / trace.clamp_min(floor)[:, None, None]
        for _ in range(3):  # bmm: matrix_power's matmul adds ~15 view ops a round
            M = torch.bmm(M, M)
    return M


def _check_w(W) -> None:
    if not isinstance(W, torch.Tensor):
        raise TypeError(f"W must be a torch.Tensor [H, a, b], got {type(W).__name__}")
    if W.dim() != 3:
        raise ValueError(
            f"W must have shape [H, a, b] (one matrix per head), got {list(W.shape)}; "
            f"use W.unsqueeze(0) for a single matrix"
        )
    if not W.dtype.is_floating_point:
        raise TypeError(f"W must be a floating-point tensor, got dtype {W.dtype}; "
                        f"cast with W.float()")


def gram_norm(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest singular value of each W[h] (shape [H, a, b]) and its right singular
    vector, from the Gram matrix of the smaller side (module docstring).

    Returns (sigma [H], v [H, b]), float64 when W is float64, else float32 (bf16/fp16
    weights are upcast). A zero W[h] gives σ = 0 and v = 0; a non-finite one σ = NaN.
    """
    _check_w(W)
    H, a, b = W.shape
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    W = W.detach().to(dtype)
    # Each head scaled to max |entry| 1 (σ scaled back at the end): the Gram of an
    # exploding weight (entries 1e18) would overflow FP32, of a vanishing one underflow.
    amax = W.abs().amax(dim=(1, 2))
    W = W / torch.where(amax > 0, amax, 1.0)[:, None, None]
    left = a <= b  # M = W Wᵀ [a, a], whose top eigenvector is the left singular vector
    P = psd_power(W @ W.mT if left else W.mT @ W, GRAM_ROUNDS)
    # P ≈ e eᵀ: its row with the largest diagonal entry is the longest multiple of e.
    e = P[torch.arange(H, device=P.device), P.diagonal(dim1=1, dim2=2).argmax(dim=1)]
    e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-30)
    x = (e[:, None, :] @ W)[:, 0] if left else (W @ e[:, :, None])[:, :, 0]  # Wᵀe or W e
    sigma = x.norm(dim=1)
    v = x / sigma[:, None].clamp_min(1e-30) if left else e
    finite = torch.isfinite(sigma) & torch.isfinite(v).all(dim=1)
    return torch.where(finite, sigma * amax, torch.full_like(sigma, math.nan)), v


def power_iteration(W: torch.Tensor, v: torch.Tensor | None = None, iters: int = 4,
                    tol: float = 1e-6, *, seed: int = DEFAULT_SEED,
                    max_iters: int = WARM_MAX_ITERS) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest singular value of each W[h] (shape [H, a, b]).

    v      [H, b] right singular vector estimate from the previous call (warm start), or
           None for a cold start from seeded random vectors.
    iters  iterations on a warm start, continued until the relative change of every σ
           is below `tol` (at most max(iters, max_iters), default WARM_MAX_ITERS). A cold
           start iterates until then (at most COLD_START_MAX_ITERS iterations).
    Returns (sigma [H], v [H, b]); float64 when W is float64, else float32 (bf16/fp16
    weights are upcast: their own rounding would limit σ to ~3 significant digits).
    A zero W[h] gives σ = 0 and keeps its vector. A non-finite W[h] gives σ = NaN and
    returns the seeded start vector for that head, so a later call can recover.
    """
    _check_w(W)
    check_int("iters", iters, min=1)
    check_int("max_iters", max_iters, min=1, hint=f"e.g. {WARM_MAX_ITERS}")
    check_float("tol", tol, above=0, hint="e.g. 1e-7")
    H, _, b = W.shape
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    W = W.detach().to(dtype)
    # Drawn only when needed: a warm start rarely uses it, and drawing it costs 0.5 ms
    # per layer on CPU (80 layers: benchmarks/bench_scale.py).
    def start() -> torch.Tensor:
        return start_vector(H, b, seed=seed, dtype=dtype, device=W.device)

    if v is None:
        cold, v = True, start()
    else:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"v must be a torch.Tensor [H, b] or None, got {type(v).__name__}")
        if tuple(v.shape) != (H, b):
            raise ValueError(
                f"v must have shape [H, b] = {[H, b]} to match W {list(W.shape)}, got "
                f"{list(v.shape)}; pass v=None for a cold start"
            )
        cold, v = False, v.detach().to(device=W.device, dtype=dtype)
        # A stale vector that is zero or non-finite cannot be iterated: restart it.
        bad = ~torch.isfinite(v).all(dim=1) | (v.norm(dim=1) == 0)
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-300)
        if bool(bad.any()):
            v = torch.where(bad[:, None], start(), v)

    def step(v):  # (WᵀW v, ‖W v‖²) per head
        u = torch.bmm(W, v[:, :, None])[:, :, 0]
        return torch.bmm(u[:, None, :], W)[:, 0, :], u.square().sum(dim=1)

    return iterate(step, v, start, iters=iters, tol=tol, cold=cold, max_iters=max_iters)


def iterate(step, v: torch.Tensor, start, *, iters: int, tol: float, cold: bool,
            max_iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The power-iteration loop for plain and sharded W^Q alike (flashwatch/parallel/power.py):
    step(v) -> (WᵀW v [H, b], ‖W v‖² [H]); start() -> the seeded vectors that replace a
    head's v when its σ comes out non-finite. Returns (σ [H], v [H, b])."""
    sigma = torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
    n_iters = COLD_START_MAX_ITERS if cold else max(iters, max_iters)
    for i in range(n_iters):
        w, usq = step(v)
        new_sigma = usq.sqrt()
        w_norm = w.norm(dim=1, keepdim=True)
        # Keep v where WᵀWv = 0 (zero matrix): dividing would make NaN.
        v = torch.where(w_norm > 0, w / w_norm.clamp_min(1e-300), v)
        change = (new_sigma - sigma).abs() / new_sigma.clamp_min(1e-300)
        sigma = new_sigma
        if (cold or i + 1 >= iters) and bool((change[torch.isfinite(change)] < tol).all()):
            break
    # The last v is one half-step ahead of sigma; use it for the returned σ too.
    sigma = step(v)[1].sqrt()
    finite = torch.isfinite(sigma) & torch.isfinite(v).all(dim=1)
    sigma = torch.where(finite, sigma, torch.full_like(sigma, math.nan))
    if not bool(finite.all()):
        v = torch.where(finite[:, None], v, start())
    return sigma, v
