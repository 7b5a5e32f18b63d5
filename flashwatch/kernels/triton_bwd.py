"""Backward kernels of the Triton attention (launched by flashwatch/kernels/triton_attention.py).

  `_bwd_prep`    δ = rowsum(dO∘O) (O32 for FP32_O heads), dQ's FP32 buffer zeroed
  `_bwd_kernel`  one program per (key block, batch·head): K/V resident, loop over query
                 blocks doing FlashAttention-2's five matmuls; dK, dV in registers, dQ
                 added into the FP32 buffer with atomics
  `_bwd_dq_out`  dQ = scale·dQ32 rounded to the input dtype, in q's layout

attn_mask, softcap and the sliding window as in the forward (constexprs MASK_KIND,
SOFTCAP, SLIDING; `_scores`): the tile is recomputed as the forward saw it, and dS goes
through the cap's 1 - tanh² before its matmuls; still five matmuls per block pair, and
no work on the query blocks that see none of the key block (`_bwd_bounds`: causal, or
every key outside their window).
"""

import triton
import triton.language as tl

from .triton_helpers import (
    _bh_offset,
    _bwd_bounds,
    _dot,
    _lo,
    _p_from_lse,
    _scores,
    _tile,
    _to_store,
    _up,
)


@triton.jit
def _bwd_prep(O, O32, DO, DELTA, DQ32, HEADS,
              stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
              B, H, N_Q, D: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    """δ = rowsum(dO ∘ O) in FP32, from the FP32 O for FP32_O heads; zeroes dQ32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_Q
    do = _up(tl.load(_tile(DO + _bh_offset(pid_bh, H, stride_dob, stride_doh), m0, stride_dom,
                           BLOCK_M, D), mask=row_ok[:, None], other=0.0), INTERPRET)
    if tl.load(HEADS + h) == 2:  # Mode.FP32_O (its slot: O32 may hold every head)
        slot = tl.load(HEADS + H + h)
        o32_base = O32 + ((slot * B + pid_bh // H).to(tl.int64) * N_Q) * D
        o = tl.load(_tile(o32_base, m0, D, BLOCK_M, D), mask=row_ok[:, None], other=0.0)
    else:
        o = _up(tl.load(_tile(O + _bh_offset(pid_bh, H, stride_ob, stride_oh), m0, stride_om,
                              BLOCK_M, D), mask=row_ok[:, None], other=0.0), INTERPRET)
    rows = pid_bh.to(tl.int64) * N_Q
    tl.store(DELTA + rows + offs_m, tl.sum(do * o, 1), mask=row_ok)
    tl.store(_tile(DQ32 + rows * D, m0, D, BLOCK_M, D), tl.zeros([BLOCK_M, D], tl.float32),
             mask=row_ok[:, None])


@triton.jit
def _bwd_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, mask_base,
               stride_qm, stride_dom, stride_mm, stride_mn, offs_n, lo, hi, N_Q, N_K,
               sm_scale, qk_scale, cap, window, D: tl.constexpr, BLOCK_M: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
               MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    """Query blocks [lo, hi) against this key block: FlashAttention-2's five matmuls."""
    DT: tl.constexpr = q_base.dtype.element_ty
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qmask = offs_m < N_Q
        if MASKED:
            q = tl.load(_tile(q_base, start_m, stride_qm, BLOCK_M, D), mask=qmask[:, None],
                        other=0.0)
            do = tl.load(_tile(do_base, start_m, stride_dom, BLOCK_M, D), mask=qmask[:, None],
                         other=0.0)
            lse = tl.load(lse_base + offs_m, mask=qmask, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=qmask, other=0.0)
        else:
            q = tl.load(_tile(q_base, start_m, stride_qm, BLOCK_M, D))
            do = tl.load(_tile(do_base, start_m, stride_dom, BLOCK_M, D))
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # Transposed tile (keys × queries) so dK, dV accumulate without transposes. The
        # padding keys are hidden too: their S = 0 would give exp(-lse), which overflows
        # when lse < -88 (logits around -1000) and leaves Inf/NaN in unstored rows.
        xT, tT = _scores(_dot(k, tl.trans(q), INTERPRET), offs_m[None, :],  # 1: S
                         offs_n[:, None], mask_base, stride_mm, stride_mn, N_Q, N_K,
                         sm_scale, cap, window, MASKED, CAUSAL, SLIDING, MASK_KIND, SOFTCAP,
                         INTERPRET)
        pT = _p_from_lse(xT, lse, qk_scale, SOFTCAP or MASK_KIND == 2)
        dv += _dot(_lo(pT, DT, INTERPRET), do, INTERPRET)  # 2: dV += PᵀdO
        dpT = _dot(v, tl.trans(do), INTERPRET)  # 3: dP = dO Vᵀ
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:  # through s = cap·tanh(scale·qk/cap): dS·(1 - tanh²), scale later
            dsT = dsT * (1.0 - tT * tT)
        dsT = _lo(dsT, DT, INTERPRET)
        dk += _dot(dsT, q, INTERPRET)  # 4: dK += dSᵀQ
        dq = _dot(tl.trans(dsT), k, INTERPRET)  # 5: dQ += dS K
        dq_ptrs = _tile(dq_base, start_m, D, BLOCK_M, D)
        if MASKED:
            tl.atomic_add(dq_ptrs, dq, mask=qmask[:, None], sem="relaxed")
        else:
            tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["window"])
def _bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ32, DK, DV, MASK, sm_scale, qk_scale, cap,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                stride_mb, stride_mh, stride_mm, stride_mn,
                H, N_Q, N_K, N_Q_BKT, N_K_BKT, window,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, SLIDING: tl.constexpr, MASK_KIND: tl.constexpr,
                SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = DK.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kmask = offs_n < N_K
    k = tl.load(_tile(K + _bh_offset(pid_bh, H, stride_kb, stride_kh), n0, stride_kn,
                      BLOCK_N, D), mask=kmask[:, None], other=0.0)
    v = tl.load(_tile(V + _bh_offset(pid_bh, H, stride_vb, stride_vh), n0, stride_vn,
                      BLOCK_N, D), mask=kmask[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    q_base = Q + _bh_offset(pid_bh, H, stride_qb, stride_qh)
    do_base = DO + _bh_offset(pid_bh, H, stride_dob, stride_doh)
    mask_base = MASK + _bh_offset(pid_bh, H, stride_mb, stride_mh)
    rows = pid_bh.to(tl.int64) * N_Q  # LSE, δ and dQ32 are [B·H, N_Q(, D)] contiguous

    # Query blocks: [lo, a) masked (causal diagonal, or the ragged last key block),
    # [a, b) see this whole key block (no mask), [b, hi) masked (the window's edge, the
    # ragged end of Q); the rest never see these keys (`_bwd_bounds`).
    lo, a, b, hi = _bwd_bounds(n0, N_Q, N_K, window, BLOCK_M, BLOCK_N, CAUSAL, SLIDING)
    dk, dv = _bwd_inner(dk, dv, k, v, q_base, do_base, LSE + rows, DELTA + rows,
                        DQ32 + rows * D, mask_base, stride_qm, stride_dom, stride_mm,
                        stride_mn, offs_n, lo, a, N_Q, N_K, sm_scale, qk_scale, cap, window,
                        D, BLOCK_M, True, CAUSAL, SLIDING, MASK_KIND, SOFTCAP, INTERPRET)
    dk, dv = _bwd_inner(dk, dv, k, v, q_base, do_base, LSE + rows, DELTA + rows,
                        DQ32 + rows * D, mask_base, stride_qm, stride_dom, stride_mm,
                        stride_mn, offs_n, a, b, N_Q, N_K, sm_scale, qk_scale, cap, window,
                        D, BLOCK_M, False, CAUSAL, SLIDING, MASK_KIND, SOFTCAP, INTERPRET)
    dk, dv = _bwd_inner(dk, dv, k, v, q_base, do_base, LSE + rows, DELTA + rows,
                        DQ32 + rows * D, mask_base, stride_qm, stride_dom, stride_mm,
                        stride_mn, offs_n, b, hi, N_Q, N_K, sm_scale, qk_scale, cap, window,
                        D, BLOCK_M, True, CAUSAL, SLIDING, MASK_KIND, SOFTCAP, INTERPRET)
    tl.store(_tile(DK + _bh_offset(pid_bh, H, stride_dkb, stride_dkh), n0, stride_dkn,
                   BLOCK_N, D), _to_store(dk * sm_scale, DT, INTERPRET), mask=kmask[:, None])
    tl.store(_tile(DV + _bh_offset(pid_bh, H, stride_dvb, stride_dvh), n0, stride_dvn,
                   BLOCK_N, D), _to_store(dv, DT, INTERPRET), mask=kmask[:, None])


@triton.jit
def _bwd_dq_out(DQ32, DQ, sm_scale, stride_dqb, stride_dqh, stride_dqm, H, N_Q,
                D: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    """dQ = scale·dQ32, rounded once to the input dtype, in q's layout."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    row_ok = (m0 + tl.arange(0, BLOCK_M)) < N_Q
    dq = tl.load(_tile(DQ32 + pid_bh.to(tl.int64) * N_Q * D, m0, D, BLOCK_M, D),
                 mask=row_ok[:, None], other=0.0)
    tl.store(_tile(DQ + _bh_offset(pid_bh, H, stride_dqb, stride_dqh), m0, stride_dqm,
                   BLOCK_M, D), _to_store(dq * sm_scale, DQ.dtype.element_ty, INTERPRET),
             mask=row_ok[:, None])
