"""Reference attention in pure PyTorch: the CPU backend and the oracle for every test.

Semantics (docs/design.md §4), `arithmetic="fused"` (what a FlashAttention-2 kernel does):
  S = scale·QKᵀ in FP32, keys in blocks of BLOCK_N, online row max and row sum in FP32,
  P̄ = exp(S - shift) cast to the input dtype before P̄V, FP32 accumulator, O = acc/l
  stored in the input dtype, LSE saved. Backward recomputes P from LSE and uses
  δ = rowsum(dO ∘ O) in FP32; P and dS are cast to the input dtype before their
  matmuls, as a fused backward kernel does.

Masks and softcap (`attention(attn_mask=, softcap=, sliding_window=)`): each block's
  scores are s = scale·QKᵀ, then s = cap·tanh(s/cap) (Gemma2), then causal, the sliding
  window (i - j >= window hidden) and attn_mask hide scores with -inf (a float mask is
  added: its -inf hides, finite values bias). Key blocks hidden for every row of a
  query chunk (causal, window) are skipped. Hidden scores never count as ties or max
  logit (`common.update_ties`); a row with no visible key gives O = 0 and LSE = +inf
  (`_finalize`), so its backward P and gradients are 0.

`arithmetic="paper"` runs flashwatch/kernels/paper.py (the arithmetic of the paper's public
implementation, forward and backward); `forward` and `backward` only forward to it, so
this module is the one place that chooses the arithmetic (paper.py imports common.py
only: no import cycle).

Per-head modes (kernels.common.Mode):
  STANDARD  shift = running row max.
  BETA      in rows whose max r_m has ≥ 2 scores within eps (checked over the whole row,
            online and exactly: see `common.update_ties`), shift = r_m + excess with
            excess = (β-1)·r_m for r_m > 0 and -r_m otherwise, bounded by the guard in
            `beta_shift`. When a tie or a new max appears mid-row the shift changes and
            acc and l are rescaled, as online softmax does for a new max.
  FP32_O    O = acc/l is also kept in FP32 for these heads and δ uses it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import paper
from .common import (
    ARITHMETICS,
    GUARD_NATS,
    MIN_EXCESS,
    AttentionStats,
    Mode,
    check_inputs,
    hidden_keys,
    key_range,
    no_autocast,
    update_ties,
)

BLOCK_N = 128  # keys per block in the fused arithmetic (a typical Triton BLOCK_N)
# Queries per chunk. Chunking only bounds memory (a [B, H, BLOCK_M, BLOCK_N] FP32 score
# tile); each query row is computed independently, so results do not depend on it.
BLOCK_M = 1024


class ForwardResult(NamedTuple):
    o: torch.Tensor  # [B, H, Nq, D] input dtype
    lse: torch.Tensor  # [B, H, Nq] fp32, log-sum-exp of the scaled scores
    o32: torch.Tensor | None  # [B, H32, Nq, D] fp32 for the FP32_O heads, else None
    tied_rows: torch.Tensor  # [H] int64
    guarded_rows: torch.Tensor  # [H] int64
    max_logit: torch.Tensor  # [H] fp32
    rows: int  # rows per head: B·Nq
    pbar_max: torch.Tensor | None  # debug: [B, H, Nq] largest P̄ weight applied to V
    o_unnormalized: torch.Tensor | None  # debug: [B, H, Nq, D] acc before dividing by l


def beta_excess(m: torch.Tensor, beta: float, guard: float) -> tuple[torch.Tensor, torch.Tensor]:
    """How far BETA's shift lies above the row max m, and whether the guard applied.

    Paper rule: shift = β·m for m > 0, 0 for m ≤ 0, i.e. excess = (β-1)·m or -m.
    Guard: an excess above `guard` nats would push P̄ towards FP32 underflow (logits in
    the thousands do this); it becomes guard/2 + (excess mod guard/2), which still varies
    from row to row. An excess below MIN_EXCESS (m near 0) would leave P̄ at the max
    rounding to 1; it becomes MIN_EXCESS + excess.
    """
    excess = torch.where(m > 0, (beta - 1.0) * m, -m)
    guarded = excess > guard
    half = guard / 2
    wrapped = half + (excess - torch.floor(excess / half) * half)
    excess = torch.where(guarded, wrapped, excess)
    excess = torch.where(excess < MIN_EXCESS, MIN_EXCESS + excess, excess)
    return excess, guarded


def _block_scores(qc, kb, q0, q1, k0, k1, causal, scale, softcap, mask, window=None):
    """The FP32 scores of query rows q0:q1 against keys k0:k1, as the softmax sees them:
    s = scale·QKᵀ, then Gemma2's softcap s = cap·tanh(s/cap), then the masks (causal and
    the sliding window: -inf; attn_mask: bool False → -inf, float added). Returns
    (s, tanh) with tanh = None without softcap (the backward's chain rule needs it)."""
    s = torch.matmul(qc, kb.transpose(-1, -2)).mul_(scale)
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    hide = hidden_keys(q0, q1, k0, k1, causal, window, qc.device)
    if hide is not None:
        s.masked_fill_(hide, -math.inf)
    if mask is not None:
        m = mask[:, :, q0:q1, k0:k1]
        s = s.masked_fill_(~m, -math.inf) if m.dtype == torch.bool else s.add_(m.float())
    return s, t


def _full_mask(attn_mask, q, k):
    # A broadcast view [B, H, Nq, Nk] of the user's mask: nothing is materialised.
    if attn_mask is None:
        return None
    return attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _head_mask(modes: torch.Tensor, mode: Mode, device) -> torch.Tensor:
    return (modes == int(mode)).to(device).view(1, -1, 1)


def _finalize(acc, l, shift):
    """O = acc/l and LSE = shift + log l, in acc's dtype.

    A row whose every visible score is -inf (l = 0) gives O = 0 and LSE = +inf (so the
    backward's P = exp(S - LSE) is 0), as SDPA's math backend does; NaN stays NaN.
    """
    empty = l == 0
    o = torch.where(empty.unsqueeze(-1), torch.zeros_like(acc), acc / l.unsqueeze(-1))
    lse = torch.where(empty, math.inf, shift.float() + torch.log(l.float()))
    return o, lse


class _ShiftRule(NamedTuple):
    """How a call's rows are shifted and counted: the BETA heads ([1, H, 1] bool) and
    their β, the tie tolerance, the dtype's guard; track: count ties (the caller wants
    the counters, or a BETA head needs them for its shift)."""

    beta_h: torch.Tensor
    any_beta: bool
    track: bool
    beta: float
    eps: float
    guard: float


def _shift_rule(modes, beta, eps, want_ties, dt, dev) -> _ShiftRule:
    any_beta = bool((modes == int(Mode.BETA)).any())
    return _ShiftRule(_head_mask(modes, Mode.BETA, dev), any_beta, want_ties or any_beta,
                      beta, eps, GUARD_NATS[dt])


def _chunk_softmax(qc, k, v, q0, q1, rule, causal, scale, softcap, mask, window, block_n,
                   debug):
    """Online softmax of query rows q0:q1 (qc: their FP32 q) over the key blocks they can
    see. Returns (acc, l, m, shift, cnt, pmax): the FP32 accumulator, row sum, row max,
    shift, tie count and (debug, else None) the largest P̄ weight applied to V."""
    B, H, _, D = qc.shape
    dt, dev, Nk = k.dtype, qc.device, k.shape[2]
    shape = (B, H, q1 - q0)
    m = torch.full(shape, -math.inf, device=dev)
    shift = torch.full(shape, -math.inf, device=dev)
    cnt = torch.zeros(shape, dtype=torch.int64, device=dev)
    l = torch.zeros(shape, device=dev)
    acc = torch.zeros(*shape, D, device=dev)
    pmax = torch.zeros(shape, device=dev) if debug else None
    # Keys outside [k_first, k_end) are hidden for every row here: skipped blocks
    # would add exactly 0 (P = 0, alpha = 1), so skipping them changes no bit.
    k_first, k_end = key_range(q0, q1, Nk, causal, window)
    for k0 in range(k_first - k_first % block_n, k_end, block_n):
        k1 = min(k0 + block_n, k_end)
        s, _ = _block_scores(qc, k[:, :, k0:k1].float(), q0, q1, k0, k1, causal, scale,
                             softcap, mask, window)
        m_new = torch.maximum(m, s.amax(-1))
        if rule.track:
            cnt = update_ties(m, cnt, s, m_new, rule.eps)
        shift_new = m_new
        if rule.any_beta:
            excess, _ = beta_excess(m_new, rule.beta, rule.guard)
            shift_new = torch.where(rule.beta_h & (cnt >= 2), m_new + excess, m_new)
        # A row that has seen only masked keys keeps shift -inf; use 0 there so that
        # exp(-inf - 0) = 0 instead of NaN. alpha rescales what was summed so far.
        safe = torch.where(shift_new == -math.inf, 0.0, shift_new)
        alpha = torch.exp(shift - safe)
        p = torch.exp(s.sub_(safe.unsqueeze(-1)))
        p_lo = p.to(dt).float() if dt != torch.float32 else p
        l = l * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.matmul(p_lo, v[:, :, k0:k1].float())
        if debug:
            pmax = torch.maximum(pmax * alpha, p_lo.amax(-1))
        m, shift = m_new, shift_new
    return acc, l, m, shift, cnt, pmax


def _chunk_counts(rule, m, cnt) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head (tied rows, guarded rows) of one chunk from its row max and tie count."""
    tied = cnt >= 2
    guarded = torch.zeros_like(tied)
    if rule.any_beta:
        _, over = beta_excess(m, rule.beta, rule.guard)
        guarded = over & tied & rule.beta_h
    return tied.sum((0, 2)), guarded.sum((0, 2))


def _forward_fused(q, k, v, causal, scale, modes, beta, eps, want_ties, debug,
                   block_n=BLOCK_N, block_m=BLOCK_M, keep_o32=False, attn_mask=None,
                   softcap=None, window=None) -> ForwardResult:
    B, H, Nq, D = q.shape
    mask = _full_mask(attn_mask, q, k)
    dt, dev = q.dtype, q.device
    rule = _shift_rule(modes, beta, eps, want_ties, dt, dev)
    fp32_idx = torch.nonzero(modes == int(Mode.FP32_O)).flatten().tolist()
    if keep_o32:  # every head's FP32 O (the watcher's residual for c[T] on every row)
        fp32_idx = list(range(H))

    o = torch.empty_like(q)
    lse = torch.empty(B, H, Nq, dtype=torch.float32, device=dev)
    o32 = None
    if fp32_idx:
        o32 = torch.empty(B, len(fp32_idx), Nq, D, dtype=torch.float32, device=dev)
    tied_rows = torch.zeros(H, dtype=torch.int64, device=dev)
    guarded_rows = torch.zeros(H, dtype=torch.int64, device=dev)
    max_logit = torch.full((H,), -math.inf, dtype=torch.float32, device=dev)
    pbar_max = torch.empty(B, H, Nq, dtype=torch.float32, device=dev) if debug else None
    o_unnorm = torch.empty(B, H, Nq, D, dtype=torch.float32, device=dev) if debug else None

    for q0 in range(0, Nq, block_m):
        q1 = min(q0 + block_m, Nq)
        acc, l, m, shift, cnt, pmax = _chunk_softmax(
            q[:, :, q0:q1].float(), k, v, q0, q1, rule, causal, scale, softcap, mask, window,
            block_n, debug)
        oc, lse[:, :, q0:q1] = _finalize(acc, l, shift)
        o[:, :, q0:q1] = oc.to(dt)
        if fp32_idx:
            o32[:, :, q0:q1] = oc[:, fp32_idx]
        if debug:
            pbar_max[:, :, q0:q1] = pmax
            o_unnorm[:, :, q0:q1] = acc
        if rule.track:
            tied, guarded = _chunk_counts(rule, m, cnt)
            tied_rows += tied
            guarded_rows += guarded
        max_logit = torch.maximum(max_logit, m.amax((0, 2)))
    return ForwardResult(o, lse, o32, tied_rows, guarded_rows, max_logit, B * Nq,
                         pbar_max, o_unnorm)


def forward(q, k, v, *, causal, scale, modes, beta, eps, arithmetic="fused",
            want_ties=True, debug=False, block_n=None, keep_o32=False, attn_mask=None,
            softcap=None, window=None) -> ForwardResult:
    """Forward pass on validated inputs. `modes` is an int tensor [H] of Mode values.
    keep_o32 (fused only): o32 holds every head's FP32 O, not only the FP32_O heads'.
    attn_mask, softcap, window (sliding_window): as `attention` (softcap: fused
    arithmetic only)."""
    with no_autocast(q.device):
        if arithmetic == "fused":
            return _forward_fused(q, k, v, causal, scale, modes, beta, eps, want_ties, debug,
                                  block_n=block_n or BLOCK_N, keep_o32=keep_o32,
                                  attn_mask=attn_mask, softcap=softcap, window=window)
    if softcap is not None:
        raise ValueError(f"softcap={softcap} is not supported by the paper arithmetic (the "
                         f"paper's code has no softcapping); use backend='reference'")
    res = paper.forward(q, k, v, causal=causal, scale=scale, modes=modes, beta=beta, eps=eps,
                        want_ties=want_ties, debug=debug, keep_o32=keep_o32,
                        attn_mask=attn_mask, window=window)
    H = q.shape[1]
    return ForwardResult(res.o, res.lse.float(), res.o32, res.tied_rows,
                         torch.zeros(H, dtype=torch.int64, device=q.device), res.max_logit,
                         res.rows, res.pbar_max, res.o_unnormalized)


def backward(do, q, k, v, o, o32, lse, *, causal, scale, modes, arithmetic="fused",
             block_n=BLOCK_N, block_m=BLOCK_M, attn_mask=None, softcap=None,
             dmask_out: list | None = None, window=None):
    """FlashAttention-2 backward. Returns (dq, dk, dv, delta); delta is the δ used.
    o32: [B, H32, Nq, D] for the FP32_O heads or None. arithmetic as in `forward` (block_n
    and block_m apply to "fused" only). attn_mask, softcap, window: those of the forward.
    dmask_out ("fused", a float attn_mask): a list that receives the mask's gradient, in
    its shape and dtype (a bias such as T5's is learned); costs an FP32 [B, H, Nq, Nk]."""
    if arithmetic == "paper":
        if dmask_out is not None:
            raise ValueError("the paper arithmetic gives attn_mask no gradient; use the "
                             "fused arithmetic (backend='reference') or detach the mask")
        return paper.backward(do, q, k, v, o, lse, o32, causal=causal, scale=scale,
                              modes=modes, attn_mask=attn_mask, window=window)
    dm = None
    if dmask_out is not None:
        dm = torch.zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2], device=q.device)
    with no_autocast(q.device):
        res = _backward(do, q, k, v, o, o32, lse, causal, scale, modes, block_n, block_m,
                        _full_mask(attn_mask, q, k), softcap, dm, window)
    if dm is not None:  # the broadcast dims summed back to the mask's own shape
        dmask_out.append(dm.sum_to_size(attn_mask.shape).to(attn_mask.dtype))
    return res


def _backward(do, q, k, v, o, o32, lse, causal, scale, modes, block_n, block_m, mask,
              softcap, dm=None, window=None):
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dt, dev = q.dtype, q.device
    do32 = do.float()
    delta = (do32 * o.float()).sum(-1)
    fp32_idx = torch.nonzero(modes == int(Mode.FP32_O)).flatten().tolist()
    if fp32_idx:
        delta[:, fp32_idx] = (do32[:, fp32_idx] * o32).sum(-1)

    def lo(x):  # round to the input dtype, as a kernel does before a tensor-core matmul
        return x.to(dt).float() if dt != torch.float32 else x

    k32, v32 = k.float(), v.float()
    dq = torch.zeros(B, H, Nq, D, device=dev)
    dk = torch.zeros(B, H, Nk, D, device=dev)
    dv = torch.zeros(B, H, Nk, D, device=dev)
    for q0 in range(0, Nq, block_m):
        q1 = min(q0 + block_m, Nq)
        qc, doc = q[:, :, q0:q1].float(), do32[:, :, q0:q1]
        lse_c = lse[:, :, q0:q1].unsqueeze(-1)
        delta_c = delta[:, :, q0:q1].unsqueeze(-1)
        k_first, k_end = key_range(q0, q1, Nk, causal, window)
        for k0 in range(k_first - k_first % block_n, k_end, block_n):
            k1 = min(k0 + block_n, k_end)
            kb, vb = k32[:, :, k0:k1], v32[:, :, k0:k1]
            s, t = _block_scores(qc, kb, q0, q1, k0, k1, causal, scale, softcap, mask,
                                 window)
            p = torch.exp(s.sub_(lse_c))  # 0 where masked; rows with no visible key: LSE=+inf
            dv[:, :, k0:k1] += torch.matmul(lo(p).transpose(-1, -2), doc)
            dp = torch.matmul(doc, vb.transpose(-1, -2))
            ds = p.mul_(dp.sub_(delta_c))
            if dm is not None:  # the mask is added after the cap: its gradient is dS
                dm[:, :, q0:q1, k0:k1] = ds
            if t is not None:  # through s = cap·tanh(s_raw/cap): ds_raw = ds·(1 - tanh²)
                ds = ds.mul_(1 - t.square())
            ds = lo(ds)
            dq[:, :, q0:q1] += torch.matmul(ds, kb).mul_(scale)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qc).mul_(scale)
    return dq.to(dt), dk.to(dt), dv.to(dt), delta


class ReferenceAttention(torch.autograd.Function):
    """autograd.Function over `forward`/`backward`; inputs already validated."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, modes, beta, eps, arithmetic, stats, attn_mask,
                softcap, window):
        res = forward(q, k, v, causal=causal, scale=scale, modes=modes, beta=beta, eps=eps,
                      arithmetic=arithmetic, want_ties=stats is not None, attn_mask=attn_mask,
                      softcap=softcap, window=window)
        if stats is not None:
            stats.add_(res.tied_rows, res.rows, res.guarded_rows, res.max_logit)
        ctx.save_for_backward(q, k, v, res.o, res.lse, res.o32)
        ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad
        ctx.causal, ctx.scale, ctx.modes, ctx.arithmetic = causal, scale, modes, arithmetic
        ctx.attn_mask, ctx.softcap, ctx.window = attn_mask, softcap, window
        return res.o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, o32 = ctx.saved_tensors
        dmask = [] if ctx.mask_grad else None
        dq, dk, dv, _ = backward(do, q, k, v, o, o32, lse, causal=ctx.causal, scale=ctx.scale,
                                 modes=ctx.modes, arithmetic=ctx.arithmetic,
                                 attn_mask=ctx.attn_mask, softcap=ctx.softcap,
                                 dmask_out=dmask, window=ctx.window)
        dmask = dmask[0] if dmask else None
        return dq, dk, dv, None, None, None, None, None, None, None, dmask, None, None


def attention(q, k, v, *, causal=False, scale=None, head_modes=None, beta=2.0, eps=1e-3,
              stats: AttentionStats | None = None, arithmetic: str = "fused",
              attn_mask=None, softcap=None, sliding_window=None) -> torch.Tensor:
    """softmax(scale·QKᵀ)V with per-head modes and counters, in pure PyTorch.

    q, k, v: [B, H, N, D] (bf16, fp16 or fp32, one dtype and device). causal masks key j
    for query i when j > i (top-left, like SDPA). head_modes: [H] of Mode (None: all
    STANDARD). stats: an AttentionStats to accumulate into. arithmetic: "fused" (a
    FlashAttention-2 kernel's arithmetic) or "paper" (the paper's BF16 implementation).
    attn_mask, softcap, sliding_window: as `flashwatch.attention` (docs/attention.md).
    """
    scale, modes = check_inputs(q, k, v, causal=causal, scale=scale, head_modes=head_modes,
                                beta=beta, eps=eps, stats=stats, attn_mask=attn_mask,
                                softcap=softcap, sliding_window=sliding_window)
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic must be one of {ARITHMETICS}, got {arithmetic!r}")
    softcap = None if softcap is None else float(softcap)
    return ReferenceAttention.apply(q, k, v, causal, scale, modes, float(beta), float(eps),
                                    arithmetic, stats, attn_mask, softcap, sliding_window)
