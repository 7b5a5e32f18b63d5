"""The δ probe: FP32 recomputation of a few sampled query rows and the sketch terms.

On a monitored step each watched attention call samples R query rows (b, t). For them:
  O_fp32[T]  = softmax(s[T]) V in FP32 (s = scale·q[T]·Kᵀ from the input-dtype values)
  PK[T]      = softmax(s[T]) K (attention-weighted keys)
  c[T]       = rowsum(dO ∘ O_used)[T] - rowsum(dO ∘ O_fp32)[T]   (DESIGN.md §5)
  z[T]       = Ω_xᵀ X[T] (or Ω_qᵀ q[T] without X), y[T] = Ω_aᵀ PK[T]
  G          = Σ_T c[T] z[T] y[T]ᵀ  (k×k per head): a sketch of dW^Q_hp - dW^Q_lp.
Cost per call ∝ R·N·D·H, against the layer's own N²·D·H.
"""

from __future__ import annotations

import math

import torch


def sample_rows(generator: torch.Generator, batch: int, n_q: int, n_rows: int):
    """R = min(n_rows, batch·n_q) distinct (b, t) pairs, drawn from `generator`."""
    total = batch * n_q
    idx = torch.randperm(total, generator=generator)[: min(n_rows, total)]
    return idx // n_q, idx % n_q


def recompute(q, k, v, b, t, *, causal: bool, scale: float, attn_mask=None, eps: float):
    """FP32 attention for the sampled rows.

    q, k, v: [B, H, N, D] (k and v already repeated to H heads). attn_mask as SDPA's:
    bool (True = attend) or additive float, broadcastable to [B, H, Nq, Nk].
    Returns o32 [R, H, D], pk [R, H, D], tied [R, H] bool, row_max [R, H] (fp32).
    """
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    qr = q[b, :, t].float()  # [R, H, D]
    kr, vr = k[b].float(), v[b].float()  # [R, H, Nk, D]
    s = torch.einsum("rhd,rhnd->rhn", qr, kr) * scale
    if causal:
        hidden = torch.arange(Nk, device=q.device).view(1, Nk) > t.view(-1, 1).to(q.device)
        s = s.masked_fill(hidden.unsqueeze(1), -math.inf)
    if attn_mask is not None:
        mask = attn_mask.expand(B, H, Nq, Nk)[b, :, t]
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.float()
    row_max = s.amax(-1)
    thr = (row_max - eps).unsqueeze(-1)
    tied = ((s >= thr) & (s != -math.inf)).sum(-1) >= 2
    p = torch.softmax(s, dim=-1)
    o32 = torch.einsum("rhn,rhnd->rhd", p, vr)
    pk = torch.einsum("rhn,rhnd->rhd", p, kr)
    return o32, pk, tied, row_max


def delta_error(do_rows, o_used, o32) -> torch.Tensor:
    """c[T] per head, [R, H] float64: Σ_d dO·(O_used - O_fp32), exact in FP64."""
    return (do_rows.double() * (o_used.double() - o32.double())).sum(-1)


def sketch(c, z, y) -> torch.Tensor:
    """G [H, k, k] = Σ_T c[T] z[T] y[T]ᵀ. z is [R, k] (from X) or [R, H, k] (q-space)."""
    c, z, y = c.double(), z.double(), y.double()
    if z.dim() == 2:
        return torch.einsum("rh,rk,rhl->hkl", c, z, y)
    return torch.einsum("rh,rhk,rhl->hkl", c, z, y)
