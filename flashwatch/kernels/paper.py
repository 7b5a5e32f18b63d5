"""backend="paper": the arithmetic of the paper's public implementation, forward AND backward.

Qiu & Yao, "Why Low-Precision Transformer Training Fails: An Analysis on Flash
Attention" (arXiv 2510.04212) published a pure-PyTorch FlashAttention-2 (an autograd
Function in `attention.py` of github.com/ucker/why-low-precision-training-fails) that
their GPT-2 calls with 512-query chunks and 512-key blocks. Every tensor in it has the
input dtype and every PyTorch op rounds to it, so this module is bit-identical to that
code run eagerly on BF16 tensors (no autocast). Its torch.compile'd or autocast runs may
keep fused pointwise chains in FP32 and differ in the last bits; those are not matched.

Forward, per 512-query chunk, then per 512-key block (every block, also those the
causal mask hides completely), all in the input dtype (BF16 below):
  1. S = Q Kᵀ (one BF16 rounding), then S·scale (a second one).
  2. Masked scores are set to -finfo(bf16).max (-3.39e38, finite), not -inf.
  3. m_blk = rowmax(S) over the block, masked entries included.
  4. BETA heads (the tie rule, per block and unguarded): if ≥ 2 entries of the block
     satisfy S ≥ m_blk - eps (threshold rounded to BF16), m_blk becomes β·m_blk when
     m_blk > 0 and 0 when m_blk < 0. A fully masked block has m_blk = -3.39e38 tied
     with itself, so it gets 0: rows whose max so far is negative are rescaled to 0.
  5. m_new = max(m_blk, m);  P̄ = exp(S - m_new);  l_blk = max(rowsum(P̄), 1e-10).
  6. α = exp(m - m_new);  l = α·l + l_blk;  acc = acc·α + P̄V  (P̄V one BF16 matmul).
  7. After the last block: O = acc / l and LSE = log(l) + m, both BF16; LSE is saved.
Backward, same chunks and blocks, all BF16:
  δ = rowsum(dO ∘ O) (product rounded, then the sum);  S as in step 1, masked with -inf;
  P = exp(S - LSE);  dV += Pᵀ dO;  dP = dO Vᵀ;  dS = (P·scale)·(dP - δ);
  dQ += dS K;  dK += dSᵀ Q. The += are BF16 additions, block after block, so dQ, dK, dV
  are summed in BF16 over the 512-key blocks (dK, dV over the 512-query chunks).

Because the backward recomputes P from the BF16 scores and the BF16 LSE of the forward,
each row of P sums to 1 up to BF16 rounding at any logit size. A backward that
recomputes the scores in FP32 against this LSE does not (row sums 0.14-3.7 at logits
near 900) and trains on wrong gradients.

The tie rule has no underflow guard. A tied block with max m > 0 is shifted by β·m, so
P̄ at the max is exp(-(β-1)·m). With β = 2: above m ≈ 23 the block sum falls below the
1e-10 floor and O = acc / 1e-10 shrinks by the factor l/1e-10 (m = 30: O ≈ 0.002 of
the truth); above m ≈ 92, P̄ is below BF16's smallest subnormal (9.2e-41) and O is
exactly 0 (docs/paper_arithmetic.md has counts for logits 250 and 2,500).

Mode.FP32_O (the paper's diagnosis, δ from an O kept in FP32): the forward is the
STANDARD one above and returns the same BF16 O and LSE. Alongside, for these heads, it
keeps the accumulation in FP32: acc32 = acc32·α + P̄V and l32 = α·l32 + l_blk with the
SAME BF16 S, m, α and P̄, the product P̄V and the sums exact to FP32, and
O32 = acc32 / l32. That is O = PV for the P the backward recomputes, without the BF16
roundings of the block products, the running sums and the division. The backward is
STANDARD except δ = rowsum(dO ∘ O32) in FP32 and dS = (P·scale)·(dP - δ) formed in FP32
(dP - δ cancels in near one-hot rows; rounding δ to BF16 first would add back an
error of the size being removed) and rounded once to BF16 for the two matmuls.

attn_mask and sliding_window (extensions: their code takes neither): hidden scores are
set as their causal mask sets them (-finfo.max forward, -inf backward), and every block
is still computed (their loop skips none); a float mask is added in the input dtype (its
-inf entries hide). A row with no visible key gets O = 0, LSE = +inf.
No softcap here (their code has none).

Counters: tied_rows counts rows whose max over the whole row (visible keys) has ≥ 2
BF16 scores within eps, as every backend defines it (not the per-block rule); max_logit
is the largest visible BF16 score; guarded_rows is always 0 (no guard).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .common import Mode, hidden_keys, no_autocast, update_ties

BLOCK = 512  # their model calls the Function with 512-query chunks and 512-key blocks
SUM_FLOOR = 1e-10  # their floor on each block's row sum (before it enters l)


class PaperForward(NamedTuple):
    o: torch.Tensor  # [B, H, Nq, D] input dtype
    lse: torch.Tensor  # [B, H, Nq] input dtype: log(l) + m as the forward rounds it
    o32: torch.Tensor | None  # [B, H32, Nq, D] fp32: the FP32_O heads (every head with keep_o32)
    tied_rows: torch.Tensor  # [H] int64, row-wide definition
    max_logit: torch.Tensor  # [H] fp32
    rows: int  # rows per head: B·Nq
    pbar_max: torch.Tensor | None  # debug: [B, H, Nq] largest P̄ weight applied to V
    o_unnormalized: torch.Tensor | None  # debug: [B, H, Nq, D] acc before dividing by l


def _scores(qc, kb, scale, q0, q1, k0, k1, causal, mask, fill, window=None):
    """Their S = (Q Kᵀ)·scale in the input dtype with hidden scores set to `fill`
    (-finfo.max in their forward, -inf in their backward). Causal is top-left aligned
    like SDPA (their code aligns bottom-right when Nk > Nq; with Nq = Nk, their only use,
    it is the same). attn_mask and the sliding window (extensions: their code takes
    neither): the window hides like their causal mask; bool False hides, a float mask is
    added in the input dtype and its -inf entries hide. Returns (S, hidden [.., n, m]
    bool or None)."""
    s = torch.matmul(qc, kb.transpose(-1, -2)) * scale
    hide = hidden_keys(q0, q1, k0, k1, causal, window, qc.device)
    if mask is not None:
        mb = mask[:, :, q0:q1, k0:k1]
        if mb.dtype != torch.bool:
            s = s + mb.to(s.dtype)
            mb = ~torch.isneginf(s)
        hide = ~mb if hide is None else hide | ~mb
    if hide is not None:
        s = s.masked_fill(hide, fill)
    return s, hide


def _fp32_heads(modes: torch.Tensor) -> list[int]:
    return torch.nonzero(modes == int(Mode.FP32_O)).flatten().tolist()


def forward(q, k, v, *, causal, scale, modes, beta, eps, want_ties=True,
            debug=False, keep_o32=False, attn_mask=None, window=None) -> PaperForward:
    """Forward pass on validated inputs. `modes` is an int tensor [H] of Mode values.
    keep_o32: o32 holds every head's FP32 O (the same P̄ and α accumulated in FP32, as for
    FP32_O heads), for the δ error on every row; O, LSE and the counters are unchanged.
    attn_mask: as SDPA's; a row with no visible key gets O = 0 and LSE = +inf.
    window: the sliding window (`flashwatch.attention(sliding_window=)`), or None."""
    with no_autocast(q.device):
        mask = None
        if attn_mask is not None:
            mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return _forward(q, k, v, causal, scale, modes, beta, eps, want_ties, debug, keep_o32,
                        mask, window)


class _Chunk(NamedTuple):
    """A query chunk after its last key block: their running shift m, sum l and
    accumulator acc (input dtype); l32, acc32 for the FP32 heads (else None); the
    row-wide max mx and tie count cnt of the visible scores (FP32); pmax (debug)."""

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    l32: torch.Tensor | None
    acc32: torch.Tensor | None
    mx: torch.Tensor
    cnt: torch.Tensor
    pmax: torch.Tensor | None


def _block_max(s, beta_h, any_beta, beta, eps):
    """Their m_blk (step 4): the block's row max, and in BETA heads' rows with ≥ 2
    entries within eps of it (threshold in the input dtype), β·m_blk (m_blk > 0) or 0
    (m_blk < 0). Returns (m_raw, m_blk): the max before and after the rule."""
    m_raw = s.amax(-1, keepdim=True)
    m_blk = m_raw
    if any_beta:
        near = (s >= m_blk - eps).sum(-1, keepdim=True)
        tied = beta_h & (near > 1)
        m_blk = torch.where(tied & (m_blk > 0), m_blk * beta, m_blk)
        m_blk = torch.where(tied & (m_blk < 0), torch.zeros_like(m_blk), m_blk)
    return m_raw, m_blk


def _row_counters(mx, cnt, s, m_raw, hide, visible_max, want_ties, eps):
    """The row-wide max and tie count (every backend's definition) after one block.
    Causal alone: every row sees key 0, so the block maxima (before the tie rule) give
    the largest visible score (a hidden block's -finfo.max never wins). An attn_mask or
    a window can hide a whole block of a row (or the row): visible_max, the max of the
    visible scores."""
    if not visible_max:
        mx_new = torch.maximum(mx, m_raw.squeeze(-1).float())
    s32 = s.float() if hide is None else s.float().masked_fill(hide, -math.inf)
    if visible_max:
        mx_new = torch.maximum(mx, s32.amax(-1))
    if want_ties:
        cnt = update_ties(mx, cnt, s32, mx_new, eps)
    return mx_new, cnt


def _chunk_forward(qc, k, v, q0, q1, causal, scale, mask, window, modes, beta, eps,
                   want_ties, debug, f32) -> _Chunk:
    """Their loop over every 512-key block for query rows q0:q1 (qc, input dtype)."""
    B, H, n, D = qc.shape
    dt, dev = qc.dtype, qc.device
    masked = -torch.finfo(dt).max  # what their forward writes into hidden scores
    beta_h = (modes == int(Mode.BETA)).to(dev).view(1, H, 1, 1)
    any_beta = bool(beta_h.any())
    m = torch.full((B, H, n, 1), masked, dtype=dt, device=dev)  # the running shift
    l = torch.zeros(B, H, n, 1, dtype=dt, device=dev)
    acc = torch.zeros(B, H, n, D, dtype=dt, device=dev)
    l32 = torch.zeros(B, len(f32), n, 1, device=dev) if f32 else None
    acc32 = torch.zeros(B, len(f32), n, D, device=dev) if f32 else None
    # Row-wide tie count and max over the visible FP32 copies of the BF16 scores.
    mx = torch.full((B, H, n), -math.inf, device=dev)
    cnt = torch.zeros(B, H, n, dtype=torch.int64, device=dev)
    pmax = torch.zeros(B, H, n, 1, device=dev) if debug else None
    for k0 in range(0, k.shape[2], BLOCK):
        k1 = min(k0 + BLOCK, k.shape[2])
        kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
        s, hide = _scores(qc, kb, scale, q0, q1, k0, k1, causal, mask, masked, window)
        m_raw, m_blk = _block_max(s, beta_h, any_beta, beta, eps)
        m_new = torch.maximum(m_blk, m)
        p = torch.exp(s - m_new)
        l_blk = p.sum(-1, keepdim=True).clamp(min=SUM_FLOOR)
        alpha = torch.exp(m - m_new)
        l = alpha * l + l_blk
        acc = acc * alpha + torch.matmul(p, vb)
        if f32:  # same P̄ and α, accumulated without BF16 roundings
            p32, a32 = p[:, f32].float(), alpha[:, f32].float()
            l32 = a32 * l32 + p32.sum(-1, keepdim=True).clamp(min=SUM_FLOOR)
            acc32 = acc32 * a32 + torch.matmul(p32, vb[:, f32].float())
        if debug:
            pmax = torch.maximum(pmax * alpha.float(), p.float().amax(-1, keepdim=True))
        m = m_new
        mx, cnt = _row_counters(mx, cnt, s, m_raw, hide,
                                mask is not None or window is not None, want_ties, eps)
    return _Chunk(m, l, acc, l32, acc32, mx, cnt, pmax)


def _forward(q, k, v, causal, scale, modes, beta, eps, want_ties, debug, keep_o32=False,
             mask=None, window=None):
    B, H, Nq, D = q.shape
    dt, dev = q.dtype, q.device
    f32 = list(range(H)) if keep_o32 else _fp32_heads(modes)

    o = torch.empty(B, H, Nq, D, dtype=dt, device=dev)
    lse = torch.empty(B, H, Nq, dtype=dt, device=dev)
    o32 = torch.empty(B, len(f32), Nq, D, dtype=torch.float32, device=dev) if f32 else None
    tied_rows = torch.zeros(H, dtype=torch.int64, device=dev)
    max_logit = torch.full((H,), -math.inf, dtype=torch.float32, device=dev)
    pbar_max = torch.empty(B, H, Nq, dtype=torch.float32, device=dev) if debug else None
    o_unnorm = torch.empty(B, H, Nq, D, dtype=dt, device=dev) if debug else None

    for q0 in range(0, Nq, BLOCK):
        q1 = min(q0 + BLOCK, Nq)
        c = _chunk_forward(q[:, :, q0:q1], k, v, q0, q1, causal, scale, mask, window, modes,
                           beta, eps, want_ties, debug, f32)
        # A row with no visible key (attn_mask or window): O = 0 and LSE = +inf (the
        # backward's P = 0), as SDPA's math backend and the reference give.
        empty = torch.isneginf(c.mx).unsqueeze(-1)
        o[:, :, q0:q1] = (c.acc / c.l).masked_fill(empty, 0)
        lse[:, :, q0:q1] = (torch.log(c.l) + c.m).masked_fill(empty, math.inf).squeeze(-1)
        if f32:
            o32[:, :, q0:q1] = (c.acc32 / c.l32).masked_fill(empty[:, f32], 0)
        if debug:
            pbar_max[:, :, q0:q1] = c.pmax.squeeze(-1)
            o_unnorm[:, :, q0:q1] = c.acc
        if want_ties:
            tied_rows += (c.cnt >= 2).sum((0, 2))
        max_logit = torch.maximum(max_logit, c.mx.amax((0, 2)))
    return PaperForward(o, lse, o32, tied_rows, max_logit, B * Nq, pbar_max, o_unnorm)


def backward(do, q, k, v, o, lse, o32, *, causal, scale, modes, attn_mask=None,
             window=None):
    """Backward pass. lse: [B, H, Nq] as the forward returned it (any float dtype holding
    its values). o32: [B, H32, Nq, D] for the FP32_O heads or None. attn_mask, window:
    the forward's. Returns (dq, dk, dv, delta): gradients in the input dtype, δ [B, H, Nq]
    in FP32."""
    with no_autocast(q.device):
        mask = None
        if attn_mask is not None:
            mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return _backward(do, q, k, v, o, lse, o32, causal, scale, modes, mask, window)


def _backward(do, q, k, v, o, lse, o32, causal, scale, modes, mask=None, window=None):
    Nq, Nk = q.shape[2], k.shape[2]
    dt, dev = q.dtype, q.device
    do = do.to(dt)
    lse = lse.to(dt).unsqueeze(-1)  # exact: the forward rounded it to dt
    delta = (do * o).sum(-1, keepdim=True)
    f32 = _fp32_heads(modes)
    if f32:
        if o32 is None or o32.shape[1] != len(f32):
            raise ValueError(f"o32 must hold the {len(f32)} FP32_O heads' FP32 O, got "
                             f"{None if o32 is None else list(o32.shape)}; pass the o32 "
                             f"that paper.forward returned for these modes")
        delta32 = (do[:, f32].float() * o32).sum(-1, keepdim=True)

    # Contiguous like the registered op's fake outputs, whatever q, k, v's strides are.
    dq, dk, dv = (torch.zeros(t.shape, dtype=dt, device=dev) for t in (q, k, v))
    for q0 in range(0, Nq, BLOCK):
        q1 = min(q0 + BLOCK, Nq)
        qc, doc = q[:, :, q0:q1], do[:, :, q0:q1]
        lse_c, delta_c = lse[:, :, q0:q1], delta[:, :, q0:q1]
        for k0 in range(0, Nk, BLOCK):
            k1 = min(k0 + BLOCK, Nk)
            kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
            s, _ = _scores(qc, kb, scale, q0, q1, k0, k1, causal, mask, -math.inf, window)
            p = torch.exp(s - lse_c)
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), doc)
            dp = torch.matmul(doc, vb.transpose(-1, -2))
            p_scaled = p * scale
            ds = p_scaled * (dp - delta_c)
            if f32:
                diff32 = dp[:, f32].float() - delta32[:, :, q0:q1]
                ds[:, f32] = (p_scaled[:, f32].float() * diff32).to(dt)
            dq[:, :, q0:q1] += torch.matmul(ds, kb)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qc)
    delta = delta.squeeze(-1).float()
    if f32:
        delta[:, f32] = delta32.squeeze(-1)
    return dq, dk, dv, delta

