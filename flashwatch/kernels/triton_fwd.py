"""Forward kernel of the Triton attention (launched by kernels/triton_attention.py).

One program per (query block, batch·head): the Q block stays in registers while the
loop runs over K/V blocks, online softmax in exp2 with the scores folded by
scale·log2(e), ties and the BETA shift in nats (semantics: kernels/reference.py).
"""

import triton
import triton.language as tl

from .triton_helpers import (
    LOG2E,
    _beta_excess,
    _bh_offset,
    _dot,
    _lo,
    _max_nan,
    _raw_excess,
    _rowmax,
    _tile,
    _to_store,
    _update_ties,
)


@triton.jit
def _fwd_inner(acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, stride_kn, stride_vn,
               offs_m, lo, hi, N_K, sm_scale, qk_scale, is_beta, beta_m1, eps, guard,
               min_excess, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, STATS: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = k_base.dtype.element_ty
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kmask = cols < N_K
        if MASKED:
            k = tl.load(_tile(k_base, start_n, stride_kn, BLOCK_N, D), mask=kmask[:, None],
                        other=0.0)
        else:
            k = tl.load(_tile(k_base, start_n, stride_kn, BLOCK_N, D))
        qk = _dot(q, tl.trans(k), INTERPRET)  # raw scores: S = scale·qk
        if MASKED:
            vis = kmask[None, :]
            if CAUSAL:
                vis = vis & (cols[None, :] <= offs_m[:, None])  # top-left aligned
            qk = tl.where(vis, qk, float("-inf"))
        # Row max in nats = the reference's max of fl(qk·scale), at BLOCK_M multiplies.
        m_new = _max_nan(m_i, _rowmax(qk, INTERPRET) * sm_scale)
        # Ties are tracked in every row of a BETA head (the shift needs them) and in every
        # row when counters are on; `is_beta` is one scalar per program, so the branch is
        # uniform and costs nothing on STANDARD heads.
        if STATS:
            cnt = _update_ties(m_i, cnt, qk * sm_scale, m_new, eps)
        else:
            if is_beta:
                cnt = _update_ties(m_i, cnt, qk * sm_scale, m_new, eps)
        sh_new = m_new
        if is_beta:
            sh_new = tl.where(cnt >= 2, m_new + _beta_excess(m_new, beta_m1, guard, min_excess),
                              m_new)
        # Rows that have seen only masked keys keep shift -inf: use 0 so exp gives 0, not NaN.
        sh2 = tl.where(sh_new == float("-inf"), 0.0, sh_new) * LOG2E
        alpha = tl.exp2(sh_i * LOG2E - sh2)
        p = tl.exp2(qk * qk_scale - sh2[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(_tile(v_base, start_n, stride_vn, BLOCK_N, D), mask=kmask[:, None],
                        other=0.0)
        else:
            v = tl.load(_tile(v_base, start_n, stride_vn, BLOCK_N, D))
        # P̄ rounded to the input dtype before P̄V (the rounding the paper analyses).
        acc = acc * alpha[:, None] + _dot(_lo(p, DT, INTERPRET), v, INTERPRET)
        m_i = m_new
        sh_i = sh_new
    return acc, l_i, m_i, sh_i, cnt


@triton.jit
def _fwd_stats(ST_CNT, ST_MAX, idx, cnt, m_i, row_ok, is_beta, beta_m1, guard,
               INTERPRET: tl.constexpr):
    """This query block's (tied rows, guarded rows) and max logit."""
    tied = (cnt >= 2) & row_ok
    guarded = tied & is_beta & (_raw_excess(m_i, beta_m1) > guard)
    tl.store(ST_CNT + 2 * idx, tl.sum(tied.to(tl.int32), 0))
    tl.store(ST_CNT + 2 * idx + 1, tl.sum(guarded.to(tl.int32), 0))
    mx = _rowmax(tl.where(row_ok, m_i, float("-inf"))[None, :], INTERPRET)
    tl.store(ST_MAX + idx + tl.arange(0, 1), mx)


@triton.jit
def _fwd_kernel(Q, K, V, O, O32, LSE, HEADS, ST_CNT, ST_MAX,
                sm_scale, qk_scale, beta_m1, eps, guard, min_excess,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_om,
                B, H, N_Q, N_K, N_MBLK, N_Q_BKT, N_K_BKT,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, STATS: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = O.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    mode = tl.load(HEADS + h)
    slot = tl.load(HEADS + H + h)
    is_beta = mode == 1  # Mode.BETA

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_Q
    q = tl.load(_tile(Q + _bh_offset(pid_bh, H, stride_qb, stride_qh), m0, stride_qm,
                      BLOCK_M, D), mask=row_ok[:, None], other=0.0)
    k_base = K + _bh_offset(pid_bh, H, stride_kb, stride_kh)
    v_base = V + _bh_offset(pid_bh, H, stride_vb, stride_vh)

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
        acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, stride_kn, stride_vn, offs_m,
        0, full_end, N_K, sm_scale, qk_scale, is_beta, beta_m1, eps, guard, min_excess,
        D, BLOCK_N, False, CAUSAL, STATS, INTERPRET)
    acc, l_i, m_i, sh_i, cnt = _fwd_inner(
        acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, stride_kn, stride_vn, offs_m,
        full_end, hi, N_K, sm_scale, qk_scale, is_beta, beta_m1, eps, guard, min_excess,
        D, BLOCK_N, True, CAUSAL, STATS, INTERPRET)

    # A row whose visible scores are all -inf has l = 0: O = 0 and LSE = +inf (backward
    # P = exp(S - LSE) = 0), as the reference (and SDPA's math backend) do; NaN stays NaN.
    empty = l_i == 0.0
    o = tl.where(empty[:, None], 0.0, acc / l_i[:, None])
    tl.store(_tile(O + _bh_offset(pid_bh, H, stride_ob, stride_oh), m0, stride_om, BLOCK_M, D),
             _to_store(o, DT, INTERPRET), mask=row_ok[:, None])
    lse = tl.where(empty, float("inf"), sh_i + tl.log(l_i))  # nats, like the reference
    tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=row_ok)
    if slot >= 0:
        # O before rounding, [slot, b, row, d] contiguous.
        o32_base = O32 + ((slot * B + pid_bh // H).to(tl.int64) * N_Q) * D
        tl.store(_tile(o32_base, m0, D, BLOCK_M, D), o, mask=row_ok[:, None])
    if STATS:
        _fwd_stats(ST_CNT, ST_MAX, pid_bh.to(tl.int64) * N_MBLK + pid_m, cnt, m_i, row_ok,
                   is_beta, beta_m1, guard, INTERPRET)
