"""The δ probe: FP32 recomputation of a few sampled query rows and the sketch terms.

On a monitored step each watched attention call samples R query rows (b, t). For them:
  O_fp32[T]  = softmax(s[T]) V in FP32 (s = scale·q[T]·Kᵀ from the input-dtype values)
  PK[T]      = softmax(s[T]) K (attention-weighted keys)
  c[T]       = rowsum(dO ∘ O_used)[T] - rowsum(dO ∘ O_fp32)[T]   (docs/design.md §5)
  z[T]       = Ω_xᵀ X[T] (or Ω_qᵀ q[T] without X), y[T] = Ω_aᵀ PK[T]
  G          = Σ_T c[T] z[T] y[T]ᵀ  (k×k per head): a sketch of dW^Q_hp - dW^Q_lp.
Cost per call ∝ R·N·D·H, against the layer's own N²·D·H.
"""

from __future__ import annotations

import math

import torch

from flashwatch.kernels.common import no_autocast


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
    with no_autocast(q.device):  # under the user's autocast FP32 einsums would be BF16
        return _recompute(q, k, v, b, t, causal, scale, attn_mask, eps)


# FP32 K and V of at most this many bytes per chunk of batch elements: all of them at
# once on small models (one batched matmul instead of one per batch element), bounded
# memory on large ones (GPT-2 Small, B 64: 200 MB if all were upcast together).
CHUNK_BYTES = 32 << 20


def _recompute(q, k, v, b, t, causal, scale, attn_mask, eps):
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[-1]
    R = len(b)
    dev = q.device
    o32 = torch.empty(R, H, Dv, device=dev)
    pk = torch.empty(R, H, D, device=dev)
    tied = torch.empty(R, H, dtype=torch.bool, device=dev)
    row_max = torch.empty(R, H, device=dev)
    mask = None if attn_mask is None else attn_mask.expand(B, H, Nq, Nk)
    # The sampled rows grouped by batch element and padded to the largest group
    # (slot = position within its group), so every group runs in one batched matmul.
    elems, inverse, counts = torch.unique(b, return_inverse=True, return_counts=True)
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(b)
    slot[order] = torch.arange(R, device=dev) - starts[inverse[order]]
    per_elem = 4 * H * Nk * (D + Dv)
    step = max(1, CHUNK_BYTES // per_elem)
    width = int(counts.max())
    for lo in range(0, len(elems), step):
        el = elems[lo:lo + step]
        sel = torch.nonzero((inverse >= lo) & (inverse < lo + step)).flatten()
        gi, si = inverse[sel] - lo, slot[sel]  # group and slot of each selected row
        n = len(el)
        tpad = torch.zeros(n, width, dtype=torch.long, device=dev)
        tpad[gi, si] = t[sel]
        kb, vb = k[el].float(), v[el].float()  # [n, H, Nk, D]
        qb = q[el[:, None], :, tpad].float().transpose(1, 2)  # [n, H, width, D]
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [n, H, width, Nk]
        if causal:
            hidden = torch.arange(Nk, device=dev) > tpad[..., None]  # [n, width, Nk]
            s = s.masked_fill(hidden[:, None], -math.inf)
        if mask is not None:
            m = mask[el[:, None], :, tpad].transpose(1, 2)  # [n, H, width, Nk]
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        mx = s.amax(-1)
        thr = (mx - eps).unsqueeze(-1)
        tie = ((s >= thr) & (s != -math.inf)).sum(-1) >= 2  # [n, H, width]
        # A row with no visible key: zero weights (O = 0, as SDPA's math backend), not NaN.
        p = torch.softmax(s, dim=-1).masked_fill(torch.isneginf(mx).unsqueeze(-1), 0.0)
        o = torch.matmul(p, vb)
        pkb = torch.matmul(p, kb)
        o32[sel] = o[gi, :, si]
        pk[sel] = pkb[gi, :, si]
        tied[sel] = tie[gi, :, si]
        row_max[sel] = mx[gi, :, si]
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
