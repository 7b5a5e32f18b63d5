"""The probe: every row's max logit and ties, and the δ sketch terms of a few sampled rows.

On a monitored step each watched attention call flashwatch's kernel did not count gets:
  every row   s = α·q·Kᵀ in FP32 from the input-dtype values (the kernel's arithmetic),
              chunked over batch elements (query rows too where one element is large),
              never the whole [B, H, N, N] at once. Per head: the max score and the rows
              whose second-largest visible score is within eps of the max (tied), over
              real query rows only (padding left out: `row_bias`).
  ~R rows T   taken from the same scores: O_fp32[T] = softmax(s[T]) V, PK[T] = softmax(s[T]) K,
              O_used[T], X[T] (or q[T]); kept in a `Sample` until the gradient gives
              dO[T], then reduced with the other layers' samples by `totals`
              (flashwatch/monitor/samples.py):
                c[T] = rowsum(dO ∘ (O_used - O_fp32))[T]        (docs/design.md §5)
                z[T] = Ω_xᵀ X[T] (Ω_qᵀ q[T] without X), y[T] = Ω_aᵀ PK[T]
                G    = Σ_T c[T] z[T] y[T]ᵀ  (k×k per head): a sketch of dW^Q_hp - dW^Q_lp.
Device ops per call: about 17 whatever R and H (benchmarks/RESULTS.md), the sketch
arithmetic in `totals`, a few dozen ops for all layers of a micro-batch at once.
Cost: one more QKᵀ in FP32 per call (the layer's own forward and backward do ~7).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flashwatch.kernels.common import no_autocast

# Additive float masks at or below this hide the key: Hugging Face fills hidden keys
# with finfo(dtype).min (-3.4e38 in FP32, not -inf), which a row max must not count.
MASKED = -1e30


def sample_rows(generator: torch.Generator, batch: int, n_q: int, n_rows: int):
    """About R = min(n_rows, batch·n_q) query rows, w distinct positions in each of E
    batch elements: w = ⌈R/batch⌉ and E = ⌈R/w⌉ ≤ batch elements drawn at random, so
    E·w rows, between R and R + w - 1 (exactly R when batch divides
    it: 64 rows of B = 8, or every row). Every row has the same chance E·w/(batch·n_q)
    of being drawn, so sums over the sample scaled by batch·n_q/(E·w) stay unbiased;
    equal groups let `recompute` take every element's rows from its scores at once.
    Returns elems [E] (int64, CPU, ascending; None when every element is drawn) and
    t [E, w] (int64, CPU, ascending in each row), from `generator`: in the order the
    scores are computed, so nothing is reordered on the device."""
    rows = min(n_rows, batch * n_q)
    w = -(-rows // batch)
    n_el = -(-rows // w)
    elems = None if n_el == batch else torch.randperm(
        batch, generator=generator)[:n_el].sort().values
    if w == n_q:
        t = torch.arange(n_q).expand(n_el, n_q)
    else:  # w distinct positions per element, uniformly (topk: 2× cheaper than a sort)
        t = torch.rand(n_el, n_q, generator=generator).topk(w, -1).indices.sort(-1).values
    return elems, t


class Rows(NamedTuple):
    """The sampled rows (`sample_rows`) on the host and on the calls' device."""

    elems: torch.Tensor | None  # [E] host
    t: torch.Tensor  # [E, w] host
    elems_dev: torch.Tensor | None  # [E] device
    t_dev: torch.Tensor  # [E, w] device


def rows_on(elems, t, device) -> Rows:
    """`sample_rows`' result with a copy on `device`: one transfer, not blocking."""
    if elems is None:
        return Rows(None, t, None, t.to(device, non_blocking=True))
    both = torch.cat([elems[:, None], t], 1).to(device, non_blocking=True)
    return Rows(elems, t, both[:, 0], both[:, 1:])


def take(x: torch.Tensor, rows: Rows, dim: int) -> torch.Tensor:
    """x [B, ..., N (at dim), ...] at the sampled rows: [E, ..., w, ...], one gather (two
    when only some elements are drawn)."""
    if rows.elems_dev is not None:
        x = x[rows.elems_dev]
    return torch.gather(x, dim, _index(rows.t_dev, x.shape, dim))


def _index(t, shape, dim):
    """t [E, w] as torch.gather's index into a tensor of `shape` along `dim`: a
    broadcast view (take_along_dim would add a remainder op per call)."""
    view = [1] * len(shape)
    view[0], view[dim] = t.shape
    out = list(shape)
    out[0], out[dim] = t.shape
    return t.view(view).expand(out)


def flat(elems, t):
    """(b, t) of every sampled row, [E·w] each, in the order of a [E, ..., w] sample
    flattened (tests and reports; the probe itself keeps the grouped layout)."""
    if elems is None:
        elems = torch.arange(t.shape[0], device=t.device)
    return elems.repeat_interleave(t.shape[1]), t.reshape(-1)


def score_bias(n_q: int, n_k: int, *, causal: bool, attn_mask=None, sliding_window=None,
               device=None) -> torch.Tensor | None:
    """The scores' additive FP32 mask, broadcastable to [B, H, Nq, Nk] (0 visible, -inf
    hidden), or None when nothing is hidden. attn_mask as SDPA's: bool (True = attend)
    or additive float (entries ≤ MASKED hide the key). sliding_window: query t hides key
    j when t - j ≥ window (flashwatch.attention(sliding_window=)). One per mask and
    shape: the watcher reuses it for every layer of a forward (capture.py)."""
    hidden = None
    if causal or sliding_window is not None:
        i = torch.arange(n_q, device=device)[:, None]
        j = torch.arange(n_k, device=device)[None, :]
        if causal:
            hidden = j > i
        if sliding_window is not None:
            far = i - j >= sliding_window
            hidden = far if hidden is None else hidden | far
    bias = None if hidden is None else torch.zeros(
        n_q, n_k, device=device).masked_fill_(hidden, -math.inf)
    if attn_mask is not None:
        m = attn_mask.to(device) if device is not None else attn_mask
        if m.dtype == torch.bool:
            add = torch.zeros(m.shape, device=m.device).masked_fill_(~m, -math.inf)
        else:
            add = m.float().masked_fill(m <= MASKED, -math.inf)
        bias = add if bias is None else bias + add
    return bias


def recompute(q, k, v, rows: Rows, *, causal: bool, scale: float, attn_mask=None, eps: float,
              softcap: float | None = None, sliding_window: int | None = None,
              bias: torch.Tensor | None = None, row_bias: torch.Tensor | None = None,
              every_row: bool = True, score_fn=None):
    """Every row's max and ties per head, and the FP32 rows of the sample, [E, H, w, ·]:
    [j, h, i] is query rows.t[j, i] of batch element rows.elems[j] (j if elems is None).

    q [B, H, Nq, D]; k, v [B, H_kv, Nk, D] with H_kv dividing H (grouped-query attention:
    query head h reads KV head h // (H / H_kv), as SDPA's enable_gqa; never repeated).
    attn_mask, causal, sliding_window: as `score_bias`, or `bias` already built from them.
    softcap: Gemma2's s = softcap·tanh(s/softcap) on the scaled scores, before the masks,
    as flashwatch.attention computes it. row_bias [B, 1, Nq, 1]: 0 for a real query,
    -inf for padding (its row is left out of the max and the ties). every_row=False:
    the sample only (flashwatch's kernel counted the call's rows): tied and row_max None.
    score_fn(s, lo, hi, q0, q1): the scaled scores of elements lo:hi, query rows q0:q1
    as the call's kernel scores them (FlexAttention's score and mask mods, varlen's
    documents: flashwatch/monitor/flex.py), applied to each chunk before the masks.
    Returns a Recomputed.
    """
    with no_autocast(q.device):  # under the user's autocast FP32 products would be BF16
        if bias is None:
            bias = score_bias(q.shape[2], k.shape[2], causal=causal, attn_mask=attn_mask,
                              sliding_window=sliding_window, device=q.device)
        hides_rows = attn_mask is not None or sliding_window is not None or \
            score_fn is not None
        return _recompute(q, k, v, rows, float(scale), bias, row_bias, eps, softcap,
                          hides_rows, every_row, score_fn)


class Recomputed(NamedTuple):
    """`recompute`'s results: the sample's FP32 rows ([j, h, i] as in its docstring)
    and every row's statistics per head."""

    o32: torch.Tensor  # [E, H, w, Dv] softmax(s) V
    pk: torch.Tensor  # [E, H, w, D] softmax(s) K (attention-weighted keys)
    tied: torch.Tensor | None  # [H] int64 rows with a second score within eps of the max
    row_max: torch.Tensor | None  # [H] FP32 max score over the rows (-inf: none visible)
    visible: torch.Tensor | None = None  # [H] rows that see a key (masks that can hide a
    # whole row only; else every real row does)


# FP32 scores of at most this many bytes per chunk (each element's [H, Nq, Nk]): a
# batched product for all elements on small models, bounded memory on large ones
# (GPT-2 Small, B 8 × 1,024 tokens: 400 MB if all at once; one element is 50 MB).
CHUNK_BYTES = 64 << 20


def _chunks(B: int, H: int, Nq: int, Nk: int):
    """(lo, hi, q0, q1): whole elements while one fits CHUNK_BYTES, else query blocks."""
    per_row = 4 * H * Nk
    if per_row * Nq <= CHUNK_BYTES:
        n = max(1, CHUNK_BYTES // (per_row * Nq))
        return [(lo, min(B, lo + n), 0, Nq) for lo in range(0, B, n)]
    qb = max(1, CHUNK_BYTES // per_row)
    return [(b, b + 1, q0, min(Nq, q0 + qb)) for b in range(B) for q0 in range(0, Nq, qb)]


def _recompute(q, k, v, rows, scale, bias, row_bias, eps, softcap, hides_rows, every,
               score_fn=None):
    B, H, Nq, D = q.shape
    G, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if H % G or v.shape[1] != G:
        raise ValueError(f"k and v must have the same number of heads, dividing q's {H}; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    q32 = q.to(torch.float32, memory_format=torch.contiguous_format)
    # K and V side by side in FP32, [B, G, Nk, D + Dv]: one product gives PK and O
    kv32 = torch.cat([k, v], -1, out=torch.empty(B, G, Nk, D + Dv, device=q.device))
    drawn = set(range(B)) if rows.elems is None else set(rows.elems.tolist())  # host
    # softcap bends the scaled scores: scale first, then the cap, then the masks
    cap_scale, scale = (scale / softcap, 1.0) if softcap is not None else (None, scale)
    pieces, tied, top, seen = [], [], [], []
    chunks = _chunks(B, H, Nq, Nk)
    for lo, hi, q0, q1 in chunks:
        n, m = hi - lo, q1 - q0
        qc = q32[lo:hi, :, q0:q1].reshape(n, G, -1, D)  # a view unless q is split
        s = torch.matmul(qc, kv32[lo:hi, :, :, :D].transpose(-1, -2)).view(n, H, m, Nk)
        if softcap is not None:
            s = torch.tanh(s.mul_(cap_scale)).mul_(softcap)
        if score_fn is not None:  # the kernel's own mods see the scaled scores
            s = score_fn(s.mul_(scale), lo, hi, q0, q1)
            if bias is not None:
                bc = bias[..., q0:q1, :]
                s = s + (bc[lo:hi] if bc.dim() == 4 and bc.shape[0] > 1 else bc)
        elif bias is not None:
            bc = bias[..., q0:q1, :]
            bc = bc[lo:hi] if bc.dim() == 4 and bc.shape[0] > 1 else bc
            s = torch.add(bc, s, alpha=scale)
        elif scale != 1.0:
            s.mul_(scale)
        got = _sample_rows(s, rows, drawn, lo, hi, q0, q1, Nq)
        if got is not None:
            pieces.append((lo, got))
        if every:
            mx, second = _top_two(s)
            if row_bias is not None:
                rb = row_bias[lo:hi, :, q0:q1, 0]
                mx, second = mx + rb, second + rb  # padding: -inf, never tied or max
            tied.append((second - mx >= -eps).sum((0, 2)))  # -inf - -inf: NaN, not tied
            top.append(mx.amax((0, 2)))
            if hides_rows:  # a row hidden whole is no row of the model's: not counted
                seen.append(torch.isfinite(mx).sum((0, 2)))
    # elements and positions ascending (sample_rows): the pieces are in the sample's order
    if chunks[0][3] != Nq:  # blocks of query rows: each element's rows side by side
        pieces = [(e, torch.cat([x for f, x in pieces if f == e], 2))
                  for e in dict.fromkeys(e for e, _ in pieces)]
    p = pieces[0][1] if len(pieces) == 1 else torch.cat([x for _, x in pieces])
    p = torch.softmax(p, dim=-1)  # [E, H, w, Nk]
    if hides_rows:  # a row with no visible key: zero weights (O = 0, as SDPA's math
        p = p.nan_to_num_(0.0)  # backend), not NaN
    kv = kv32 if rows.elems_dev is None else kv32[rows.elems_dev]
    E = p.shape[0]
    opk = fp32_matmul(p.view(E, G, -1, Nk), kv).view(E, H, -1, D + Dv)
    o32, pk = opk[..., D:], opk[..., :D]
    if not every:
        return Recomputed(o32, pk, None, None)
    visible = None if not seen else seen[0] if len(seen) == 1 else torch.stack(seen).sum(0)
    if len(tied) == 1:
        return Recomputed(o32, pk, tied[0], top[0], visible)
    return Recomputed(o32, pk, torch.stack(tied).sum(0), torch.stack(top).amax(0), visible)


def tf32_allowed(device: torch.device) -> bool:
    """May cuBLAS run an FP32 matmul on `device` in TF32 (10-bit mantissa)? It does where
    the user allowed it: `torch.backends.cuda.matmul.allow_tf32 = True` (the Hugging Face
    Trainer's `tf32=True`), `torch.set_float32_matmul_precision("high")` (what Lightning
    suggests on every run), `fp32_precision = "tf32"`. Read, never set: setting the flag
    through the other of torch's two APIs makes the user's next read of it raise."""
    if device.type != "cuda":
        return False
    try:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    except Exception:  # torch cannot say (the two APIs mixed): assume it may
        return True


def fp32_matmul(p: torch.Tensor, b: torch.Tensor, matmul=torch.matmul) -> torch.Tensor:
    """p @ b in FP32 for FP32 p (softmax weights) and a BF16-valued b ([K V] as the kernel
    read them), also where TF32 is allowed: TF32 would round p to a 10-bit mantissa
    (unit roundoff 2^-11, an eighth of BF16's 2^-8: ≈ 5e-4 relative on the product, the
    same order as the δ error it measures). There p is split into its BF16 part (exact in
    TF32, as b is) and the rest, 2^-8 smaller, whose TF32 rounding is ≈ 2e-6 of p: two
    matmuls, FP32 accumulation. CPUs (no TF32): one. FP32-valued K and V (a model
    trained in FP32, no autocast) stay rounded to TF32, as the model's own attention is."""
    if not tf32_allowed(p.device):
        return matmul(p, b)
    hi = p.bfloat16().float()
    return matmul(hi, b) + matmul(p - hi, b)


def _top_two(s):
    """Each row's largest and second-largest score, [n, H, m] each (the largest key
    taken out once, so two equal maxima are a tie). torch.max with its index and an
    amax: 3× faster than topk(2) on the CPU. Overwrites s."""
    mx, at = s.max(-1, keepdim=True)
    second = s.scatter_(-1, at, -math.inf).amax(-1)
    return mx[..., 0], second


def _sample_rows(s, rows, drawn, lo, hi, q0, q1, n_q):
    """The scores of the sampled rows in one chunk s [n, H, m, Nk] (elements lo:hi,
    query rows q0:q1): [r, H, w, Nk] for whole elements, [1, H, w', Nk] for one
    element's block of rows, or None if the chunk holds none."""
    n, H, m, Nk = s.shape
    dev = s.device
    local = [e for e in range(lo, hi) if e in drawn]
    if not local:
        return None
    if m == n_q:  # whole elements: the w rows of each drawn one
        if rows.elems is None:
            t = rows.t_dev[lo:hi]
        else:
            j0 = int((rows.elems < lo).sum())  # host
            t = rows.t_dev[j0:j0 + len(local)]
            if len(local) < n:
                s = s[torch.tensor(local).sub_(lo).to(dev, non_blocking=True)]
        return torch.gather(s, 2, _index(t, s.shape[:2] + (0, s.shape[3]), 2))
    # one element (lo) in blocks of query rows: its rows inside this block
    j = lo if rows.elems is None else int((rows.elems < lo).sum())
    inside = ((rows.t[j] >= q0) & (rows.t[j] < q1)).nonzero()[:, 0]  # host: no sync
    if len(inside) == 0:
        return None
    return s[:, :, (rows.t[j, inside] - q0).to(dev, non_blocking=True)]
