"""Forward kernel of the Triton attention (launched by flashwatch/kernels/triton_attention.py).

One program per (query block, batch·head): the Q block stays in registers while the
loop runs over K/V blocks, online softmax in exp2 with the scores folded by
scale·log2(e), ties and the BETA shift in nats (semantics: flashwatch/kernels/reference.py).

attn_mask, softcap and the sliding window are constexpr specialisations (MASK_KIND 0
none / 1 bool / 2 float, SOFTCAP, SLIDING): one compiled kernel per combination; the cap,
the mask's pointer and strides and the window size are data (`window` is an int the
kernel is not specialised on: do_not_specialize, so 1, 16 or 4096 share one binary).
`_scores` (triton_helpers.py) applies them per tile; `_fwd_bounds` skips the key blocks
outside every row's window and masks only the blocks on the window's edge.
"""

import triton
import triton.language as tl

from .triton_helpers import (
    _beta_excess,
    _bh_offset,
    _dot,
    _exp_shifted,
    _fwd_bounds,
    _in_nats,
    _lo,
    _max_nan,
    _raw_excess,
    _rowmax,
    _scores,
    _tile,
    _to_store,
    _update_ties,
)


@triton.jit
def _fwd_inner(acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, mask_base, stride_kn, stride_vn,
               stride_mm, stride_mn, offs_m, lo, hi, N_Q, N_K, sm_scale, qk_scale, cap,
               window, is_beta, beta_m1, eps, guard, min_excess, D: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               SLIDING: tl.constexpr, STATS: tl.constexpr, MASK_KIND: tl.constexpr,
               SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = k_base.dtype.element_ty
    # x is the raw dot (s = scale·x) unless a softcap or float mask makes it s itself.
    NATS: tl.constexpr = SOFTCAP or MASK_KIND == 2
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kmask = cols < N_K
        if MASKED:
            k = tl.load(_tile(k_base, start_n, stride_kn, BLOCK_N, D), mask=kmask[:, None],
                        other=0.0)
        else:
            k = tl.load(_tile(k_base, start_n, stride_kn, BLOCK_N, D))
        x, _t = _scores(_dot(q, tl.trans(k), INTERPRET), offs_m[:, None], cols[None, :],
                        mask_base, stride_mm, stride_mn, N_Q, N_K, sm_scale, cap, window,
                        MASKED, CAUSAL, SLIDING, MASK_KIND, SOFTCAP, INTERPRET)
        # Row max in nats = the reference's max of fl(x·scale), at BLOCK_M multiplies.
        m_new = _max_nan(m_i, _in_nats(_rowmax(x, INTERPRET), sm_scale, NATS))
        # Ties are tracked in every row of a BETA head (the shift needs them) and in every
        # row when counters are on; `is_beta` is one scalar per program, so the branch is
        # uniform and costs nothing on STANDARD heads.
        if STATS:
            cnt = _update_ties(m_i, cnt, _in_nats(x, sm_scale, NATS), m_new, eps)
        else:
            if is_beta:
                cnt = _update_ties(m_i, cnt, _in_nats(x, sm_scale, NATS), m_new, eps)
        sh_new = m_new
        if is_beta:
            sh_new = tl.where(cnt >= 2, m_new + _beta_excess(m_new, beta_m1, guard, min_excess),
                              m_new)
        alpha, p = _exp_shifted(x, sh_i, sh_new, qk_scale, NATS)
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
def _fwd_store(O, O32, LSE, acc, l_i, sh_i, pid_bh, slot, m0, offs_m, row_ok, B, H, N_Q,
               stride_ob, stride_oh, stride_om, D: tl.constexpr, BLOCK_M: tl.constexpr,
               INTERPRET: tl.constexpr):
    """O = acc/l in the input dtype, LSE in nats, and the FP32 O for a head with a slot.
    A row whose visible scores are all -inf has l = 0: O = 0 and LSE = +inf (backward
    P = exp(S - LSE) = 0), as the reference (and SDPA's math backend) do; NaN stays NaN."""
    empty = l_i == 0.0
    o = tl.where(empty[:, None], 0.0, acc / l_i[:, None])
    tl.store(_tile(O + _bh_offset(pid_bh, H, stride_ob, stride_oh), m0, stride_om, BLOCK_M, D),
             _to_store(o, O.dtype.element_ty, INTERPRET), mask=row_ok[:, None])
    lse = tl.where(empty, float("inf"), sh_i + tl.log(l_i))  # nats, like the reference
    tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=row_ok)
    if slot >= 0:
        # O before rounding, [slot, b, row, d] contiguous.
        o32_base = O32 + ((slot * B + pid_bh // H).to(tl.int64) * N_Q) * D
        tl.store(_tile(o32_base, m0, D, BLOCK_M, D), o, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["window"])
def _fwd_kernel(Q, K, V, O, O32, LSE, HEADS, ST_CNT, ST_MAX, MASK,
                sm_scale, qk_scale, cap, beta_m1, eps, guard, min_excess,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                stride_mb, stride_mh, stride_mm, stride_mn,
                B, H, N_Q, N_K, N_MBLK, N_Q_BKT, N_K_BKT, window,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, SLIDING: tl.constexpr, STATS: tl.constexpr,
                MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    is_beta = tl.load(HEADS + h) == 1  # Mode.BETA
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_Q
    q = tl.load(_tile(Q + _bh_offset(pid_bh, H, stride_qb, stride_qh), m0, stride_qm,
                      BLOCK_M, D), mask=row_ok[:, None], other=0.0)
    k_base = K + _bh_offset(pid_bh, H, stride_kb, stride_kh)
    v_base = V + _bh_offset(pid_bh, H, stride_vb, stride_vh)
    mask_base = MASK + _bh_offset(pid_bh, H, stride_mb, stride_mh)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sh_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    cnt = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo, a, b, hi = _fwd_bounds(m0, N_K, window, BLOCK_M, BLOCK_N, CAUSAL, SLIDING)
    if SLIDING:
        acc, l_i, m_i, sh_i, cnt = _fwd_inner(
            acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, mask_base, stride_kn, stride_vn,
            stride_mm, stride_mn, offs_m, lo, a, N_Q, N_K, sm_scale, qk_scale, cap, window,
            is_beta, beta_m1, eps, guard, min_excess, D, BLOCK_N, True, CAUSAL, SLIDING,
            STATS, MASK_KIND, SOFTCAP, INTERPRET)
    acc, l_i, m_i, sh_i, cnt = _fwd_inner(
        acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, mask_base, stride_kn, stride_vn,
        stride_mm, stride_mn, offs_m, a, b, N_Q, N_K, sm_scale, qk_scale, cap, window,
        is_beta, beta_m1, eps, guard, min_excess, D, BLOCK_N, False, CAUSAL, SLIDING, STATS,
        MASK_KIND, SOFTCAP, INTERPRET)
    acc, l_i, m_i, sh_i, cnt = _fwd_inner(
        acc, l_i, m_i, sh_i, cnt, q, k_base, v_base, mask_base, stride_kn, stride_vn,
        stride_mm, stride_mn, offs_m, b, hi, N_Q, N_K, sm_scale, qk_scale, cap, window,
        is_beta, beta_m1, eps, guard, min_excess, D, BLOCK_N, True, CAUSAL, SLIDING, STATS,
        MASK_KIND, SOFTCAP, INTERPRET)
    _fwd_store(O, O32, LSE, acc, l_i, sh_i, pid_bh, tl.load(HEADS + H + h), m0, offs_m,
               row_ok, B, H, N_Q, stride_ob, stride_oh, stride_om, D, BLOCK_M, INTERPRET)
    if STATS:
        _fwd_stats(ST_CNT, ST_MAX, pid_bh.to(tl.int64) * N_MBLK + pid_m, cnt, m_i, row_ok,
                   is_beta, beta_m1, guard, INTERPRET)
