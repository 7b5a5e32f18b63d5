"""The δ probe: FP32 recomputation of a few sampled query rows and the sketch terms.

On a monitored step each watched attention call samples about R query rows (b, t). For them:
  O_fp32[T]  = softmax(s[T]) V in FP32 (s = scale·q[T]·Kᵀ from the input-dtype values)
  PK[T]      = softmax(s[T]) K (attention-weighted keys)
  c[T]       = rowsum(dO ∘ O_used)[T] - rowsum(dO ∘ O_fp32)[T]   (docs/design.md §5)
  z[T]       = Ω_xᵀ X[T] (or Ω_qᵀ q[T] without X), y[T] = Ω_aᵀ PK[T]
  G          = Σ_T c[T] z[T] y[T]ᵀ  (k×k per head): a sketch of dW^Q_hp - dW^Q_lp.
Cost per call ∝ R·N·D·H, against the layer's own N²·D·H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashwatch.kernels.common import no_autocast
from flashwatch.signals import smallops


def sample_rows(generator: torch.Generator, batch: int, n_q: int, n_rows: int):
    """About R = min(n_rows, batch·n_q) query rows, w distinct positions in each of E
    batch elements: w = ⌈R/batch⌉ and E = ⌈R/w⌉ ≤ batch elements drawn at random, so
    E·w rows, between R and R + w - 1 (exactly R when batch divides
    it: 64 rows of B = 8, or every row). Every row has the same chance E·w/(batch·n_q)
    of being drawn, so sums over the sample scaled by batch·n_q/(E·w) stay unbiased;
    equal groups let `recompute` run every element's rows in one batched matmul.
    Returns elems [E] (int64, CPU; None when every element is drawn, in order: then
    `recompute` slices instead of gathering) and t [E, w] (int64, CPU), from `generator`."""
    rows = min(n_rows, batch * n_q)
    w = -(-rows // batch)
    n_el = -(-rows // w)
    elems = None if n_el == batch else torch.randperm(batch, generator=generator)[:n_el]
    if w == n_q:
        t = torch.arange(n_q).expand(n_el, n_q)
    else:  # w distinct positions per element, uniformly (topk: 2× cheaper than a sort)
        t = torch.rand(n_el, n_q, generator=generator).topk(w, -1).indices
    return elems, t


def flat(elems, t):
    """(b, t) of every sampled row, [E·w] each, in the order `recompute` returns them."""
    if elems is None:
        elems = torch.arange(t.shape[0], device=t.device)
    return elems.repeat_interleave(t.shape[1]), t.reshape(-1)


def recompute(q, k, v, elems, t, *, causal: bool, scale: float, attn_mask=None, eps: float,
              softcap: float | None = None, sliding_window: int | None = None):
    """FP32 attention for the sampled rows: row j·w + i is query t[j, i] of batch
    element elems[j] (element j if elems is None; `sample_rows`; `flat` gives (b, t)).

    q [B, H, N, D]; k, v [B, H_kv, N, D] with H_kv dividing H (grouped-query attention:
    query head h reads KV head h // (H / H_kv), as SDPA's enable_gqa; never repeated
    here, so K and V are upcast once per KV head, not per query head). attn_mask as
    SDPA's: bool (True = attend) or additive float, broadcastable to [B, H, Nq, Nk].
    softcap: Gemma2's s = softcap·tanh(s/softcap) on the scaled scores, before the masks,
    as flashwatch.attention computes it (ties and row max are of the capped scores).
    sliding_window: query t hides key j when t - j >= sliding_window, as
    flashwatch.attention(sliding_window=) does.
    Returns a Recomputed (o32, pk, tied, row_max).
    """
    with no_autocast(q.device):  # under the user's autocast FP32 einsums would be BF16
        return _recompute(q, k, v, elems, t, causal, scale, attn_mask, eps, softcap,
                          sliding_window)


class Recomputed(NamedTuple):
    """`recompute`'s FP32 rows, row j·w + i as in its docstring."""

    o32: torch.Tensor  # [E·w, H, Dv] softmax(s) V
    pk: torch.Tensor  # [E·w, H, D] softmax(s) K (attention-weighted keys)
    tied: torch.Tensor  # [E·w, H] bool: a second logit within eps of the row max
    row_max: torch.Tensor  # [E·w, H] FP32 max logit (-inf: no visible key)


# FP32 K and V of at most this many bytes per chunk of batch elements: all of them at
# once on small models (one batched matmul instead of one per batch element), bounded
# memory on large ones (GPT-2 Small, B 64: 200 MB if all were upcast together).
CHUNK_BYTES = 32 << 20


def _recompute(q, k, v, elems, t, causal, scale, attn_mask, eps, softcap, window=None):
    B, H, Nq, D = q.shape
    G, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if H % G or v.shape[1] != G:
        raise ValueError(f"k and v must have the same number of heads, dividing q's {H}; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    E, w = t.shape
    mask = None if attn_mask is None else attn_mask.expand(B, H, Nq, Nk)
    step = max(1, CHUNK_BYTES // (4 * G * Nk * (D + Dv)))
    # ~20 tensor ops a call whatever R: on small models the probe's cost is per-op
    # overhead, so no per-row or per-element indexing here (benchmarks/RESULTS.md).
    outs = []
    for lo in range(0, E, step):
        tc = t[lo:lo + step]
        n = len(tc)
        if elems is None:  # every element in order: slices, no gather
            el = torch.arange(lo, lo + n, device=q.device)
            kv = (k[lo:lo + n], v[lo:lo + n])
        else:
            el = elems[lo:lo + step]
            kv = (k[el], v[el])
        # Contiguous FP32 copies [n, G, Nk, D]: k and v are usually strided views of one
        # QKV projection, which the matmuls would copy again (2.2× the recompute's time
        # on the benchmark GPT).
        kb, vb = (x.to(torch.float32, memory_format=torch.contiguous_format) for x in kv)
        qb = q[el[:, None], :, tc].float().transpose(1, 2)  # [n, H, w, D]
        # The H/G query heads of each KV head as one [H/G·w, D] block against it.
        s = smallops.matmul(qb.reshape(n, G, -1, D), kb.transpose(-1, -2)).view(
            n, H, w, Nk) * scale  # [n, H, w, Nk]
        if softcap is not None:
            s = torch.tanh(s / softcap).mul_(softcap)
        if causal or window is not None:  # an additive -inf bias over heads: 10× cheaper
            cols = torch.arange(Nk, device=q.device)  # than a broadcast fill
            hidden = cols > tc[..., None] if causal else None  # [n, w, Nk]
            if window is not None:
                far = tc[..., None] - cols >= window
                hidden = far if hidden is None else hidden | far
            s = s + torch.zeros(hidden.shape, dtype=s.dtype, device=q.device).masked_fill_(
                hidden, -math.inf)[:, None]
        if mask is not None:
            m = mask[el[:, None], :, tc].transpose(1, 2)  # [n, H, w, Nk]
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        mx = s.amax(-1)
        # Masked logits (-inf) are below any finite row max minus eps: never tied.
        tie = (s >= (mx - eps).unsqueeze(-1)).sum(-1) >= 2  # [n, H, w]
        p = torch.softmax(s, dim=-1)
        if mask is not None or window is not None:  # causal alone leaves key 0 visible
            # A row with no visible key: zero weights (O = 0, as SDPA's math backend),
            # not NaN, and no tie.
            empty = torch.isneginf(mx)
            tie = tie & ~empty
            p = p.masked_fill(empty.unsqueeze(-1), 0.0)
        pg = p.view(n, G, -1, Nk)
        o, pk = (smallops.matmul(pg, x).view(n, H, w, -1) for x in (vb, kb))
        outs.append([x.transpose(1, 2).reshape(n * w, H, *x.shape[3:])
                     for x in (o, pk, tie, mx)])
    if len(outs) == 1:
        return Recomputed._make(outs[0])
    return Recomputed._make(torch.cat(parts) for parts in zip(*outs, strict=True))


def o_error(o_used, o32) -> torch.Tensor:
    """d = O_used - O_fp32 in FP64 (exact), [..., R, H, Dv]: what a Sample keeps."""
    return o_used.double() - o32.double()


def c_of(do_rows, d) -> torch.Tensor:
    """c[T] per head, [..., R, H] float64: Σ_d dO·d (d from `o_error`)."""
    return (do_rows.double() * d).sum(-1)


def delta_error(do_rows, o_used, o32) -> torch.Tensor:
    """c[T] per head, [..., R, H] float64: Σ_d dO·(O_used - O_fp32), exact in FP64."""
    return c_of(do_rows, o_error(o_used, o32))


def sketch(c, z, y) -> torch.Tensor:
    """G [..., H, k, k] = Σ_T c[T] z[T] y[T]ᵀ, over any leading batch dims. z is
    [..., R, k] (from X) or [..., R, H, k] (q-space); c [..., R, H], y [..., R, H, k]."""
    c, z, y = c.double(), z.double(), y.double()
    if z.dim() == c.dim():
        return torch.einsum("...rh,...rk,...rhl->...hkl", c, z, y)
    return torch.einsum("...rh,...rhk,...rhl->...hkl", c, z, y)


@dataclass(eq=False)
class Sample:
    """One probed call's sampled rows, reduced with the other calls by `totals` (at the
    report, or once a micro-batch's worth of calls has its gradient): stacked over the
    calls whose shapes match, a few dozen ops for all layers instead of a few dozen per
    call (per-op overhead is the probe's cost on small models: benchmarks/RESULTS.md),
    and on a GPU one copy to the host instead of several per call. Memory: O(R·H·D) a
    call (d), from its forward until its micro-batch is reduced or, with retain_graph,
    until its graph is freed (each further backward through it adds its own c)."""

    heads: torch.Tensor  # [H] int64 (the call's device): the layer's heads in the watcher's arrays
    b: torch.Tensor  # [R] batch element of each row (the call's device)
    t: torch.Tensor  # [R] query position of each row
    tied: torch.Tensor  # [R, H] bool
    row_max: torch.Tensor  # [R, H]
    z: torch.Tensor  # [R, k] Ω_xᵀ X[T], or [R, H, k] Ω_qᵀ q[T] (no X)
    y: torch.Tensor  # [R, H, k] Ω_aᵀ PK[T]
    share_w: torch.Tensor | None  # [R, H] float64 α²·(rows/R)·‖X‖²‖PK‖², None without X
    d: torch.Tensor  # [R, H, Dv] float64 O_used - O_fp32 of the rows (c = Σ_d dO·d)
    c: torch.Tensor | None = None  # [R, H] float64, set by the gradient hook
    c_all: torch.Tensor | None = None  # [2, H] float64 (Σc, Σc²) over every row of the
    # call, where flashwatch's kernel gave c on every row (else Σ over the sample)
    shape: tuple = (0, 0)  # (B, Nq) of the call, on the host


def totals(samples: list[Sample], n_heads: int, k: int, out: dict | None = None,
           device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Per-head sums over the samples, added into `out` (new if None, on `device`, where
    the samples are: nothing moves to the host here): [n_heads] float64 (G [n_heads, k,
    k]): tied (tied sampled rows), row_max (max over the
    sampled rows, -inf if none), G, and from the samples with c: delta_sum, delta_sq
    (Σc, Σc²: over every row where the kernel gave c_all, else over the sampled rows)
    and share_num (Σ ‖e_T‖²)."""
    if out is None:
        f64 = dict(dtype=torch.float64, device=device)
        out = dict(tied=torch.zeros(n_heads, **f64),
                   row_max=torch.full((n_heads,), -math.inf, **f64),
                   G=torch.zeros(n_heads, k, k, **f64), delta_sum=torch.zeros(n_heads, **f64),
                   delta_sq=torch.zeros(n_heads, **f64), share_num=torch.zeros(n_heads, **f64))
    groups: dict = {}
    for s in samples:
        key = (s.tied.shape, s.z.shape, s.y.shape, s.tied.device, s.share_w is None,
               s.c is None, s.c_all is None)
        groups.setdefault(key, []).append(s)
    for members in groups.values():
        _add_group(members, out)
    return out


def _add_group(ms: list[Sample], out: dict) -> None:
    """`totals` of samples of one shape: each field stacked over the L samples."""
    def stack(name):
        return torch.stack([getattr(m, name) for m in ms])

    dev = out["G"].device
    idx = torch.cat([m.heads.to(dev, non_blocking=True) for m in ms])  # [L·H]
    parts = {"tied": stack("tied").sum(1), "row_max": stack("row_max").amax(1)}  # [L, H]
    first = ms[0]
    if first.c is not None:  # no c: no gradient reached these calls
        c = stack("c")  # [L, R, H]
        if first.c_all is not None:  # Σc, Σc² over every row came with it
            c_all = stack("c_all")
            parts["delta_sum"], parts["delta_sq"] = c_all[:, 0], c_all[:, 1]
        else:
            parts["delta_sum"], parts["delta_sq"] = c.sum(1), c.square().sum(1)
        G = sketch(c, stack("z"), stack("y"))  # [L, H, k, k]
        out["G"].index_add_(0, idx, G.reshape(-1, *G.shape[2:]).to(dev))
        if first.share_w is not None:
            parts["share_num"] = (stack("share_w") * c.square()).sum(1)
    for name, v in parts.items():
        v = v.reshape(-1).double().to(dev)
        if name == "row_max":
            out[name].scatter_reduce_(0, idx, v, reduce="amax")
        else:
            out[name].index_add_(0, idx, v)
