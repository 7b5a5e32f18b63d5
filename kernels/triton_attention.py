"""FlashAttention-2 in Triton with per-head modes and inline counters (docs/design.md §4).

Layout of this file, in the order of the Triton fused-attention tutorial:
  1. small @triton.jit helpers (dtype rounding for the interpreter, dots, BETA shift, ties)
  2. forward kernel            `_fwd_kernel`   (Q block resident, loop over K/V blocks)
  3. backward kernels          `_bwd_delta`    (δ = rowsum(dO∘O), O32 for FP32_O heads)
                               `_bwd_dkdv`     (K/V block resident, loop over Q blocks)
                               `_bwd_dq`       (Q block resident, loop over K/V blocks)
  4. launchers                 `forward`, `backward` (plain tensors in, tensors out)
The autograd / torch.library wiring lives in `kernels/ops.py`.

Semantics are those of `kernels/reference.py` (fused arithmetic); tests compare the two.

Per-head modes come from an int32 tensor read inside the kernels (HEADS[h] = mode,
HEADS[H + h] = slot of the head in the FP32 O buffer or -1), so changing modes never
recompiles. Counters are written only when the constexpr STATS is set: one
(tied, guarded, max logit) triple per (batch·head, query block), reduced on the host.

Inputs: bf16 or fp16 (fp32 inputs raise TypeError: the kernels are written for
tensor-core dots on 16-bit operands; use backend="reference" for fp32). D must be 16,
32, 64 or 128.

Interpreter (TRITON_INTERPRET=1, how CPU CI runs these kernels): triton 3.9's
interpreter mishandles BF16 (triton-lang/triton#11584: `tl.dot` multiplies the raw
uint16 bit patterns, fp32→bf16 `.to()` truncates, bf16 compares are wrong). With the
constexpr INTERPRET set, every dot runs on FP32 operands with input_precision="ieee"
(exact products of 16-bit values, FP32 accumulation like a tensor core), every
fp32→bf16 rounding is the explicit integer round-to-nearest-even of `_rne_bf16_bits`,
and bf16 values are widened and stored through bit patterns (the interpreter's own
bf16<->fp32 casts also flush subnormals, found while testing this). FP16 casts in the
interpreter go through numpy and are already correct. On a GPU the native path runs.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .common import GUARD_NATS, MIN_EXCESS, TRITON_DTYPES, TRITON_HEAD_DIMS, Mode

# ----------------------------------------------------------------------------------
# 1. helpers
# ----------------------------------------------------------------------------------


@triton.jit
def _rne_bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint32, low 16 bits), round to nearest even.

    (u + 0x7FFF + lsb) >> 16 rounds the 16 dropped bits to nearest, ties to the even
    kept bit; a carry moves into the exponent, so overflow gives ±Inf as IEEE requires.
    NaN maps to 0x7FC0 like torch: the integer add would turn a NaN with a small payload
    (0x7F800001) into Inf.
    """
    u = x.to(tl.uint32, bitcast=True)
    bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, bits)


@triton.jit
def _rne_bf16(x):
    """fp32 -> nearest-even bf16 value, held exactly in an fp32 tensor."""
    return (_rne_bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _up(x, INTERPRET: tl.constexpr):
    """Exact widening to fp32. The interpreter's bf16 `.to(tl.float32)` flushes bf16
    subnormals (checked: all 254 of them go wrong), so widen the bits instead."""
    if INTERPRET:
        if x.dtype == tl.bfloat16:
            u = x.to(tl.uint16, bitcast=True).to(tl.uint32)
            return (u << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def _lo(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """Round fp32 x to the input dtype DT, as a dot operand (P̄ before P̄V, dS, P)."""
    if INTERPRET:
        if DT == tl.bfloat16:
            return _rne_bf16(x)
        else:
            return x.to(DT).to(tl.float32)  # numpy's fp16 cast: RNE, subnormals right
    else:
        return x.to(DT)


@triton.jit
def _to_store(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """Round fp32 x to DT for a store (O, dQ, dK, dV)."""
    if INTERPRET:
        if DT == tl.bfloat16:
            # Build the bf16 from its bits: the interpreter's fp32->bf16 cast truncates and
            # mangles subnormals even when the value is already a bf16 value.
            return _rne_bf16_bits(x).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DT)
    else:
        return x.to(DT)


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.dot(_up(a, INTERPRET), _up(b, INTERPRET), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rowmax(s, INTERPRET: tl.constexpr):
    """NaN-propagating row max (torch.amax semantics; the reference relies on them)."""
    if INTERPRET:
        # The interpreter reduces tl.max with np.nanmax and runs custom combine functions
        # element by element in Python (~1000x slower), so mark NaN rows explicitly.
        m = tl.max(s, 1)
        has_nan = tl.max((s != s).to(tl.int32), 1) > 0
        return tl.where(has_nan, float("nan"), m)
    else:
        return tl.reduce(s, 1, _max_nan)


@triton.jit
def _raw_excess(m, beta_m1):
    # Paper rule: shift = β·m (m > 0) or 0 (m ≤ 0), i.e. this far above m.
    return tl.where(m > 0, beta_m1 * m, -m)


@triton.jit
def _beta_excess(m, beta_m1, guard, min_excess):
    """`reference.beta_excess` (shift - m for a tied BETA row), guard included."""
    ex = _raw_excess(m, beta_m1)
    half = guard * 0.5
    wrapped = half + (ex - tl.floor(ex / half) * half)
    ex = tl.where(ex > guard, wrapped, ex)
    return tl.where(ex < min_excess, min_excess + ex, ex)


@triton.jit
def _update_ties(m_old, cnt_old, s, m_new, eps):
    """`reference._update_ties`: exact online count (saturating at 2) of s ≥ max - eps."""
    thr = m_new - eps
    hit = (s >= thr[:, None]) & (s != float("-inf"))
    blk = tl.sum(hit.to(tl.int32), 1)
    old = tl.where(m_new == m_old, cnt_old, (m_old >= thr).to(tl.int32))
    return tl.minimum(old + blk, 2)


# ----------------------------------------------------------------------------------
# 2. forward
# ----------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, stride_kn, stride_vn,
               offs_m, offs_d, lo, hi, N_K, sm_scale, is_beta, beta_m1, eps, guard,
               min_excess, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, STATS: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = k_base.dtype.element_ty
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            kmask = cols < N_K
            k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        # S in nats, one FP32 rounding of the dot times scale, as the reference does.
        s = _dot(q, tl.trans(k), INTERPRET) * sm_scale
        if MASKED:
            vis = kmask[None, :]
            if CAUSAL:
                vis = vis & (cols[None, :] <= offs_m[:, None])  # top-left aligned
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, _rowmax(s, INTERPRET), propagate_nan=tl.PropagateNan.ALL)
        # Ties are tracked in every row of a BETA head (the shift needs them) and in every
        # row when counters are on; `is_beta` is one scalar per program, so the branch is
        # uniform and costs nothing on STANDARD heads.
        if STATS:
            cnt = _update_ties(m_i, cnt, s, m_new, eps)
        else:
            if is_beta:
                cnt = _update_ties(m_i, cnt, s, m_new, eps)
        sh_new = m_new
        if is_beta:
            sh_new = tl.where(cnt >= 2, m_new + _beta_excess(m_new, beta_m1, guard, min_excess),
                              m_new)
        # Rows that have seen only masked keys keep shift -inf: use 0 so exp gives 0, not NaN.
        safe = tl.where(sh_new == float("-inf"), 0.0, sh_new)
        alpha = tl.exp(sh_i - safe)
        p = tl.exp(s - safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        # P̄ rounded to the input dtype before P̄V (the rounding the paper analyses).
        acc = acc * alpha[:, None] + _dot(_lo(p, DT, INTERPRET), v, INTERPRET)
        m_i = m_new
        sh_i = sh_new
    return acc, l_i, m_i, sh_i, cnt


@triton.jit
def _fwd_kernel(Q, K, V, O, O32, LSE, HEADS, ST_CNT, ST_MAX,
                sm_scale, beta_m1, eps, guard, min_excess,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_om,
                B, H, N_Q, N_K, N_MBLK,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, STATS: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = O.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    mode = tl.load(HEADS + h)
    slot = tl.load(HEADS + H + h)
    is_beta = mode == 1  # Mode.BETA

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < N_Q
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sh_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    cnt = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # Key blocks [0, full_end) need no mask for any row of this query block; the rest
    # (causal diagonal and/or the ragged end of K) are masked.
    if CAUSAL:
        hi = tl.minimum(N_K, m0 + BLOCK_M)
        full_end = (tl.minimum(m0 + 1, N_K) // BLOCK_N) * BLOCK_N
    else:
        hi = N_K
        full_end = (N_K // BLOCK_N) * BLOCK_N
    acc, l_i, m_i, sh_i, cnt = _fwd_inner(
        acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        0, full_end, N_K, sm_scale, is_beta, beta_m1, eps, guard, min_excess,
        BLOCK_N, False, CAUSAL, STATS, INTERPRET)
    acc, l_i, m_i, sh_i, cnt = _fwd_inner(
        acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        full_end, hi, N_K, sm_scale, is_beta, beta_m1, eps, guard, min_excess,
        BLOCK_N, True, CAUSAL, STATS, INTERPRET)

    # A row whose visible scores are all -inf has l = 0: O = 0 and LSE = +inf (backward
    # P = exp(S - LSE) = 0), as the reference (and SDPA's math backend) do; NaN stays NaN.
    empty = l_i == 0.0
    o = tl.where(empty[:, None], 0.0, acc / l_i[:, None])
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, _to_store(o, DT, INTERPRET), mask=row_ok[:, None])
    lse = tl.where(empty, float("inf"), sh_i + tl.log(l_i))
    tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=row_ok)
    if slot >= 0:
        # FP32_O head: O before rounding, [slot, b, row, d] contiguous.
        o32_ptrs = O32 + ((slot * B + b) * N_Q + offs_m[:, None]) * D + offs_d[None, :]
        tl.store(o32_ptrs, o, mask=row_ok[:, None])
    if STATS:
        tied = (cnt >= 2) & row_ok
        guarded = tied & is_beta & (_raw_excess(m_i, beta_m1) > guard)
        idx = pid_bh.to(tl.int64) * N_MBLK + pid_m
        tl.store(ST_CNT + 2 * idx, tl.sum(tied.to(tl.int32), 0))
        tl.store(ST_CNT + 2 * idx + 1, tl.sum(guarded.to(tl.int32), 0))
        mx = _rowmax(tl.where(row_ok, m_i, float("-inf"))[None, :], INTERPRET)
        tl.store(ST_MAX + idx + tl.arange(0, 1), mx)


# ----------------------------------------------------------------------------------
# 3. backward
# ----------------------------------------------------------------------------------


@triton.jit
def _bwd_delta(O, O32, DO, DELTA, HEADS,
               stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
               B, H, N_Q, D: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    """δ = rowsum(dO ∘ O) in FP32; FP32_O heads use their FP32 copy of O."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    slot = tl.load(HEADS + H + h)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < N_Q
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = _up(do, INTERPRET)
    if slot >= 0:
        o = tl.load(O32 + ((slot * B + b) * N_Q + offs_m[:, None]) * D + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
    else:
        o = _up(tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
                        + offs_d[None, :], mask=row_ok[:, None], other=0.0), INTERPRET)
    tl.store(DELTA + pid_bh.to(tl.int64) * N_Q + offs_m, tl.sum(do * o, 1), mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                offs_n, offs_d, lo, hi, N_Q, N_K, sm_scale, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = q_base.dtype.element_ty
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :]
        do_ptrs = do_base + offs_m[:, None] * stride_dom + offs_d[None, :]
        if MASKED:
            qmask = offs_m < N_Q
            q = tl.load(q_ptrs, mask=qmask[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=qmask[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=qmask, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=qmask, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # Transposed tile (keys × queries) so dK, dV accumulate without transposes.
        sT = _dot(k, tl.trans(q), INTERPRET) * sm_scale
        if MASKED:
            # Padding keys too: their S = 0 would give exp(-lse), which overflows when
            # lse < -88 (logits around -1000) and leaves Inf/NaN in unstored rows.
            vis = qmask[None, :] & (offs_n < N_K)[:, None]
            if CAUSAL:
                vis = vis & (offs_m[None, :] >= offs_n[:, None])
            sT = tl.where(vis, sT, float("-inf"))
        pT = tl.exp(sT - lse[None, :])
        dv += _dot(_lo(pT, DT, INTERPRET), do, INTERPRET)
        dpT = _dot(v, tl.trans(do), INTERPRET)
        dsT = _lo(pT * (dpT - delta[None, :]), DT, INTERPRET)
        dk += _dot(dsT, q, INTERPRET)
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_dob, stride_doh, stride_dom,
              H, N_Q, N_K,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = DK.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kmask = offs_n < N_K
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :], mask=kmask[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :], mask=kmask[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    lse_base = LSE + pid_bh.to(tl.int64) * N_Q
    delta_base = DELTA + pid_bh.to(tl.int64) * N_Q

    # Query blocks: [lo, a_end) straddle the causal diagonal (masked), [a_end, b_end) see
    # this whole key block (no mask), [b_end, N_Q) is the ragged end of Q (masked). The
    # ragged last key block is masked throughout.
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M
        full_start = tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full_start = 0
    if n0 + BLOCK_N > N_K:
        a_end = N_Q
    else:
        a_end = tl.minimum(full_start, N_Q)
    b_end = tl.maximum(a_end, (N_Q // BLOCK_M) * BLOCK_M)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm,
                         stride_dom, offs_n, offs_d, lo, a_end, N_Q, N_K, sm_scale,
                         BLOCK_M, True, CAUSAL, INTERPRET)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm,
                         stride_dom, offs_n, offs_d, a_end, b_end, N_Q, N_K, sm_scale,
                         BLOCK_M, False, CAUSAL, INTERPRET)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm,
                         stride_dom, offs_n, offs_d, b_end, N_Q, N_Q, N_K, sm_scale,
                         BLOCK_M, True, CAUSAL, INTERPRET)
    # dK, dV are written [B, H, N_K, D] contiguous.
    out = pid_bh.to(tl.int64) * N_K * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, _to_store(dk * sm_scale, DT, INTERPRET), mask=kmask[:, None])
    tl.store(DV + out, _to_store(dv, DT, INTERPRET), mask=kmask[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
              lo, hi, N_K, sm_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = k_base.dtype.element_ty
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            kmask = cols < N_K
            k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k), INTERPRET) * sm_scale
        if MASKED:
            vis = kmask[None, :]
            if CAUSAL:
                vis = vis & (cols[None, :] <= offs_m[:, None])
            s = tl.where(vis, s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), INTERPRET)
        ds = _lo(p * (dp - delta[:, None]), DT, INTERPRET)
        dq += _dot(ds, k, INTERPRET)
    return dq


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, sm_scale,
            stride_qb, stride_qh, stride_qm,
            stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn,
            stride_dob, stride_doh, stride_dom,
            H, N_Q, N_K,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = DQ.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < N_Q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    # Padding rows get lse = δ = 0 with q = dO = 0: finite P, dS = 0, never stored.
    lse = tl.load(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * N_Q + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        hi = tl.minimum(N_K, m0 + BLOCK_M)
        full_end = (tl.minimum(m0 + 1, N_K) // BLOCK_N) * BLOCK_N
    else:
        hi = N_K
        full_end = (N_K // BLOCK_N) * BLOCK_N
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                   offs_d, 0, full_end, N_K, sm_scale, BLOCK_N, False, CAUSAL, INTERPRET)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                   offs_d, full_end, hi, N_K, sm_scale, BLOCK_N, True, CAUSAL, INTERPRET)
    out = pid_bh.to(tl.int64) * N_Q * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(DQ + out, _to_store(dq * sm_scale, DT, INTERPRET), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------
# 4. launchers
# ----------------------------------------------------------------------------------

# True when the kernels above were built by Triton's interpreter (TRITON_INTERPRET=1 was
# set when this module was imported). Decided once: triton.jit picks at decoration time.
INTERPRET = isinstance(_fwd_kernel, InterpretedFunction)

# Interpreter blocks: 16 is the smallest tl.dot tile; small blocks keep CPU tests fast
# and let tests with N ≈ 40 cross several blocks and a ragged end.
_INTERP_FWD = dict(BLOCK_M=16, BLOCK_N=16)
_INTERP_BWD = dict(BLOCK_M=16, BLOCK_N=16)

# GPU: the forward keeps BLOCK_M fixed (128) because the counter buffer is indexed by
# query block; the backward tunes freely. Configs that do not fit shared memory are
# dropped by the autotuner (OutOfResources). FLASHWATCH_TRITON_AUTOTUNE=0 skips tuning
# and takes one config per head dim (the native test run uses it: tuning every test
# shape would cost minutes of compiles).
_FWD_BLOCK_M = 128
AUTOTUNE = os.environ.get("FLASHWATCH_TRITON_AUTOTUNE", "1") != "0"


def _cfg(num_warps, num_stages, **blocks):
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


_FWD_CONFIGS = [_cfg(w, s, BLOCK_N=bn) for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
_DKDV_CONFIGS = [_cfg(w, s, BLOCK_M=bm, BLOCK_N=bn) for bm, bn in ((32, 128), (64, 128), (64, 64))
                 for w in (4, 8) for s in (2, 3)]
_DQ_CONFIGS = [_cfg(w, s, BLOCK_M=bm, BLOCK_N=bn) for bm, bn in ((128, 32), (128, 64), (64, 64))
               for w in (4, 8) for s in (2, 3)]


def _fixed(pick):
    """Autotuner pruning hook that keeps one config (chosen by head dim) when tuning is off."""
    def prune(configs, named_args, **kwargs):
        if AUTOTUNE:
            return configs
        d = kwargs.get("D", named_args.get("D"))
        return [pick(configs, d)]
    return prune


def _pick_fwd(configs, d):  # BLOCK_N 64, 4 warps up to D=64, 8 warps at D=128; 3 stages
    return next(c for c in configs if c.kwargs["BLOCK_N"] == 64 and c.num_stages == 3
                and c.num_warps == (8 if d >= 128 else 4))


def _pick_bwd(configs, d):  # the (BLOCK_M, BLOCK_N) = first pair, 8 warps at D=128
    first = (configs[0].kwargs["BLOCK_M"], configs[0].kwargs["BLOCK_N"])
    return next(c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == first
                and c.num_stages == 2 and c.num_warps == (8 if d >= 128 else 4))


if not INTERPRET:
    _fwd_tuned = triton.autotune(configs=_FWD_CONFIGS, key=["N_Q", "N_K", "D", "CAUSAL", "STATS"],
                                 prune_configs_by={"early_config_prune": _fixed(_pick_fwd)},
                                 )(_fwd_kernel)
    _dkdv_tuned = triton.autotune(configs=_DKDV_CONFIGS, key=["N_Q", "N_K", "D", "CAUSAL"],
                                  prune_configs_by={"early_config_prune": _fixed(_pick_bwd)},
                                  )(_bwd_dkdv)
    _dq_tuned = triton.autotune(configs=_DQ_CONFIGS, key=["N_Q", "N_K", "D", "CAUSAL"],
                                prune_configs_by={"early_config_prune": _fixed(_pick_bwd)},
                                )(_bwd_dq)


def check_usable(q: torch.Tensor) -> None:
    """Raise a clear error if these kernels cannot run on q (device, dtype, D)."""
    if q.device.type == "cpu" and not INTERPRET:
        hint = ("set TRITON_INTERPRET=1 in the environment before Python starts (Triton "
                "reads it when the kernels are defined)")
        if os.environ.get("TRITON_INTERPRET") == "1":
            hint = ("TRITON_INTERPRET=1 was set after flashwatch's Triton kernels were "
                    "imported; set it before Python starts")
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors, or Triton's CPU interpreter for CPU "
            f"tensors: {hint}, move q, k, v to CUDA, or use backend='reference'"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise RuntimeError(
            f"backend='triton' runs on CUDA tensors, got device {q.device}; use "
            f"backend='reference'"
        )
    if q.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"backend='triton' takes bfloat16 or float16 q, k, v, got {q.dtype}; cast with "
            f"q.to(torch.bfloat16) or use backend='reference' for float32"
        )
    if q.shape[-1] not in TRITON_HEAD_DIMS:
        raise ValueError(
            f"backend='triton' supports head dims {TRITON_HEAD_DIMS}, got D={q.shape[-1]}; "
            f"use backend='reference' or pad D"
        )


_heads_cache: dict = {}


def head_table(modes: torch.Tensor, device: torch.device,
               all_slots: bool = False) -> tuple[torch.Tensor, int]:
    """int32 [2H] on `device`: modes, then each head's slot in the FP32 O buffer (or -1).
    all_slots: every head gets a slot (the forward then stores every head's FP32 O; the
    slot only decides where O32 is written and read, never the arithmetic).

    Cached by value, so steady-state calls copy nothing to the device.
    """
    key = (str(device), tuple(int(m) for m in modes.tolist()), all_slots)
    hit = _heads_cache.get(key)
    if hit is None:
        slots, n32 = [], 0
        for m in key[1]:
            keep = all_slots or m == int(Mode.FP32_O)
            slots.append(n32 if keep else -1)
            n32 += keep
        table = torch.tensor(list(key[1]) + slots, dtype=torch.int32, device=device)
        if len(_heads_cache) > 256:
            _heads_cache.clear()
        hit = _heads_cache[key] = (table, n32)
    return hit


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(q, k, v, modes, *, causal: bool, scale: float, beta: float, eps: float,
            want_stats: bool, keep_o32: bool = False):
    """Returns (o, lse, o32, tied_rows[H], guarded_rows[H], max_logit[H]).

    o32 is [H32, B, Nq, D] fp32 for the FP32_O heads in head order (H32 may be 0), or
    for every head with keep_o32.
    Counters are zeros / -inf when want_stats is False.
    """
    check_usable(q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dev = q.device
    heads, n32 = head_table(modes, dev, all_slots=keep_o32)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, Nq, dtype=torch.float32, device=dev)
    o32 = torch.empty(n32, B, Nq, D, dtype=torch.float32, device=dev)
    o32_arg = o32 if n32 else lse  # never written when no head has a slot
    block_m = _INTERP_FWD["BLOCK_M"] if INTERPRET else _FWD_BLOCK_M
    n_mblk = triton.cdiv(Nq, block_m)
    if want_stats:
        st_cnt = torch.empty(B * H * n_mblk * 2, dtype=torch.int32, device=dev)
        st_max = torch.empty(B * H * n_mblk, dtype=torch.float32, device=dev)
    else:
        st_cnt = torch.empty(1, dtype=torch.int32, device=dev)
        st_max = torch.empty(1, dtype=torch.float32, device=dev)
    guard = GUARD_NATS[q.dtype]
    args = (q, k, v, o, o32_arg, lse, heads, st_cnt, st_max,
            scale, beta - 1.0, eps, guard, MIN_EXCESS,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            B, H, Nq, Nk, n_mblk)
    grid = (n_mblk, B * H)
    if INTERPRET:
        _fwd_kernel[grid](*args, D=D, CAUSAL=causal, STATS=want_stats, INTERPRET=True,
                          **_INTERP_FWD)
    else:
        _fwd_tuned[grid](*args, D=D, BLOCK_M=_FWD_BLOCK_M, CAUSAL=causal,
                         STATS=want_stats, INTERPRET=False)
    if want_stats:
        cnt = st_cnt.view(B, H, n_mblk, 2)
        tied = cnt[..., 0].sum((0, 2), dtype=torch.int64)
        guarded = cnt[..., 1].sum((0, 2), dtype=torch.int64)
        max_logit = st_max.view(B, H, n_mblk).amax((0, 2))  # NaN-propagating, as reference
    else:
        tied = torch.zeros(H, dtype=torch.int64, device=dev)
        guarded = torch.zeros(H, dtype=torch.int64, device=dev)
        max_logit = torch.full((H,), -math.inf, dtype=torch.float32, device=dev)
    return o, lse, o32, tied, guarded, max_logit


def backward(do, q, k, v, o, o32, lse, modes, *, causal: bool, scale: float):
    """Returns (dq, dk, dv) in the input dtype; δ uses o32 for FP32_O heads."""
    check_usable(q)
    q, k, v, o, do = (_last_dim_contiguous(t) for t in (q, k, v, o, do))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dev = q.device
    heads, n32 = head_table(modes, dev)
    if o32.shape[0] != n32:
        raise RuntimeError(
            f"o32 holds {o32.shape[0]} heads but modes name {n32} FP32_O heads; the modes "
            f"tensor changed between forward and backward"
        )
    delta = torch.empty(B, H, Nq, dtype=torch.float32, device=dev)
    bm = 16 if INTERPRET else 64
    _bwd_delta[(triton.cdiv(Nq, bm), B * H)](
        o, o32 if n32 else delta, do, delta, heads,
        o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        B, H, Nq, D=D, BLOCK_M=bm, INTERPRET=INTERPRET)
    dq = torch.empty(B, H, Nq, D, dtype=q.dtype, device=dev)
    dk = torch.empty(B, H, Nk, D, dtype=q.dtype, device=dev)
    dv = torch.empty(B, H, Nk, D, dtype=q.dtype, device=dev)
    strides = (q.stride(0), q.stride(1), q.stride(2),
               k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2),
               do.stride(0), do.stride(1), do.stride(2))
    if INTERPRET:
        _bwd_dkdv[(triton.cdiv(Nk, _INTERP_BWD["BLOCK_N"]), B * H)](
            q, k, v, do, lse, delta, dk, dv, scale, *strides, H, Nq, Nk, D=D,
            CAUSAL=causal, INTERPRET=True, **_INTERP_BWD)
        _bwd_dq[(triton.cdiv(Nq, _INTERP_BWD["BLOCK_M"]), B * H)](
            q, k, v, do, lse, delta, dq, scale, *strides, H, Nq, Nk, D=D,
            CAUSAL=causal, INTERPRET=True, **_INTERP_BWD)
    else:
        _dkdv_tuned[lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * H)](
            q, k, v, do, lse, delta, dk, dv, scale, *strides, H, Nq, Nk, D=D,
            CAUSAL=causal, INTERPRET=False)
        _dq_tuned[lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * H)](
            q, k, v, do, lse, delta, dq, scale, *strides, H, Nq, Nk, D=D,
            CAUSAL=causal, INTERPRET=False)
    return dq, dk, dv
