"""Oracles shared by the attention tests (docs/design.md §8).

ref  = FP64 math attention (the truth).
pt   = plain PyTorch math attention in the inputs' own low dtype (the yardstick).
Rule = |out - ref|max ≤ 2·|pt - ref|max + floor, for O and each gradient.
"""

from __future__ import annotations

import math

import torch

# Absolute floor added to the 2× rule, per dtype: below these the comparison measures
# noise in the oracle itself (e.g. N=1 where pt is exact and any rounding "fails").
FLOOR = {torch.bfloat16: 1e-4, torch.float16: 1e-5, torch.float32: 1e-6}


def causal_mask(nq: int, nk: int, device=None) -> torch.Tensor:
    """True where key j is hidden from query i (j > i), top-left like SDPA."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).triu(1)


def math_attention(q, k, v, *, causal, scale, dtype):
    """softmax(scale·QKᵀ)V computed with every op in `dtype` (differentiable)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), v)


def fwd_bwd(fn, q, k, v, do):
    """Run fn(q, k, v) forward and backward; return (o, dq, dk, dv) detached."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(do.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_within_rule(name, out, pt, truth, dtype, ref=None):
    """|out - truth|max ≤ 2·|pt - ref|max + floor; ref defaults to truth."""
    e_out, e_pt = max_err(out, truth), max_err(pt, truth if ref is None else ref)
    bound = 2 * e_pt + FLOOR[dtype]
    assert e_out <= bound, f"{name}: error {e_out:.3g} > 2×{e_pt:.3g} + {FLOOR[dtype]:g}"


def brute_counts(q, k, *, causal, scale, eps):
    """Brute-force per-head counters over FP32 scores: (tied_rows, max_logit)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    m = s.amax(-1)
    thr = (m - eps).unsqueeze(-1)
    count = ((s >= thr) & (s != -math.inf)).sum(-1)
    return (count >= 2).sum((0, 2)), m.amax((0, 2))


def tie_heavy(shape, dtype, generator, levels=3):
    """Small-integer entries: scores are exact integers, so rows with tied maxima abound."""
    return torch.randint(-levels, levels + 1, shape, generator=generator).to(dtype)


def duplicate_keys(k, generator):
    """Overwrite the second half of the keys with copies of random first-half keys, so
    that every row whose max falls on a copied key is tied (copies land in other blocks
    for long sequences)."""
    n = k.shape[2]
    half = n // 2
    if half == 0:
        return k
    src = torch.randint(0, half, (n - half,), generator=generator)
    k = k.clone()
    k[:, :, half:] = k[:, :, src]
    return k


def grads_given_delta(q, k, v, do, delta, *, causal, scale):
    """FP64 dq, dk of attention when the backward uses the given δ [B, H, Nq].

    FlashAttention-2 computes δ = rowsum(dO ∘ O) from the O it stored; with O in BF16
    that δ is off (the paper's subject) and dq, dk inherit the error. This oracle is exact
    except for δ, so it isolates that one documented deviation.
    """
    q, k, v, do = (t.double() for t in (q, k, v, do))
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    p = torch.softmax(s, dim=-1)
    dp = torch.matmul(do, v.transpose(-1, -2))
    ds = p * (dp - delta.double().unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale
