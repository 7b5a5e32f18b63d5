"""FlashAttention-2 in Triton with per-head modes and inline counters (docs/design.md §4).

Layout of this file, in the order of the Triton fused-attention tutorial:
  1. forward kernel   `_fwd_kernel`  (Q block resident, loop over K/V blocks)
  2. backward         `_bwd_prep`    δ = rowsum(dO∘O) (O32 for FP32_O heads), dQ32 zeroed
                      `_bwd_kernel`  K/V block resident, loop over Q blocks: dK, dV in
                                     registers, dQ added into an FP32 buffer (atomics)
                      `_bwd_dq_out`  dQ32·scale rounded to the input dtype
  3. launchers        `forward`, `backward` (plain tensors in, tensors out)
Helpers (interpreter-safe rounding, ties, prologue) are in triton_helpers.py, autotune
spaces and keys in triton_tuning.py, the autograd / torch.library wiring in ops.py.

Semantics are those of `kernels/reference.py` (fused arithmetic); tests compare the two.
The backward does FlashAttention-2's five matmuls per (query block, key block) pair:
S = QKᵀ, dV += PᵀdO, dP = dOVᵀ, dK += dSᵀQ, dQ += dSK. dQ is summed in FP32 by
atomic adds, in an order that varies between runs on a GPU (last-bit differences in dQ
once a query row meets three or more key blocks); dK and dV are deterministic.

Scores: the dot is multiplied by scale·log2(e) once and exponentiated with exp2 (one FMA
and one ex2 per score). Row maxima, BETA shifts, ties and LSE stay in nats, bit for bit
the reference's: max_j fl(x_j·scale) = fl(max_j(x_j)·scale) since rounding is monotone
and scale > 0, and the tie test multiplies the dot by scale only when it counts (STATS
or a BETA head). LSE is stored in nats, as the reference stores it.

Per-head modes come from an int32 tensor read inside the kernels (HEADS[h] = mode,
HEADS[H + h] = slot of the head in the FP32 O buffer or -1), so changing modes never
recompiles. Counters are written only when the constexpr STATS is set: one
(tied, guarded, max logit) triple per (batch·head, query block), reduced on the host.

Inputs: bf16 or fp16 (fp32 inputs raise TypeError: the kernels are written for
tensor-core dots on 16-bit operands; use backend="reference" for fp32). D must be 16,
32, 64 or 128. Any strides with a contiguous last dim (others are copied); outputs come
back in the inputs' layout. Offsets of a (batch, head) and of a row block are int64.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import triton_tuning as tuning
from .common import GUARD_NATS, MIN_EXCESS, TRITON_DTYPES, TRITON_HEAD_DIMS, Mode, empty_out
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
    _up,
    _update_ties,
)

# ----------------------------------------------------------------------------------
# 1. forward
# ----------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------
# 2. backward
# ----------------------------------------------------------------------------------


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
def _bwd_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
               stride_qm, stride_dom, offs_n, lo, hi, N_Q, N_K, qk_scale,
               D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, INTERPRET: tl.constexpr):
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
        # Transposed tile (keys × queries) so dK, dV accumulate without transposes.
        qkT = _dot(k, tl.trans(q), INTERPRET)  # 1: S
        if MASKED:
            # Padding keys too: their S = 0 would give exp(-lse), which overflows when
            # lse < -88 (logits around -1000) and leaves Inf/NaN in unstored rows.
            vis = qmask[None, :] & (offs_n < N_K)[:, None]
            if CAUSAL:
                vis = vis & (offs_m[None, :] >= offs_n[:, None])
            qkT = tl.where(vis, qkT, float("-inf"))
        pT = tl.exp2(qkT * qk_scale - (lse * LOG2E)[None, :])
        dv += _dot(_lo(pT, DT, INTERPRET), do, INTERPRET)  # 2: dV += PᵀdO
        dpT = _dot(v, tl.trans(do), INTERPRET)  # 3: dP = dO Vᵀ
        dsT = _lo(pT * (dpT - delta[None, :]), DT, INTERPRET)
        dk += _dot(dsT, q, INTERPRET)  # 4: dK += dSᵀQ
        dq = _dot(tl.trans(dsT), k, INTERPRET)  # 5: dQ += dS K
        dq_ptrs = _tile(dq_base, start_m, D, BLOCK_M, D)
        if MASKED:
            tl.atomic_add(dq_ptrs, dq, mask=qmask[:, None], sem="relaxed")
        else:
            tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ32, DK, DV, sm_scale, qk_scale,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                H, N_Q, N_K, N_Q_BKT, N_K_BKT,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, INTERPRET: tl.constexpr):
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
    rows = pid_bh.to(tl.int64) * N_Q  # LSE, δ and dQ32 are [B·H, N_Q(, D)] contiguous

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
    dk, dv = _bwd_inner(dk, dv, k, v, q_base, do_base, LSE + rows, DELTA + rows,
                        DQ32 + rows * D, stride_qm, stride_dom, offs_n, lo, a_end, N_Q, N_K,
                        qk_scale, D, BLOCK_M, True, CAUSAL, INTERPRET)
    dk, dv = _bwd_inner(dk, dv, k, v, q_base, do_base, LSE + rows, DELTA + rows,
                        DQ32 + rows * D, stride_qm, stride_dom, offs_n, a_end, b_end, N_Q,
                        N_K, qk_scale, D, BLOCK_M, False, CAUSAL, INTERPRET)
    dk, dv = _bwd_inner(dk, dv, k, v, q_base, do_base, LSE + rows, DELTA + rows,
                        DQ32 + rows * D, stride_qm, stride_dom, offs_n, b_end, N_Q, N_Q, N_K,
                        qk_scale, D, BLOCK_M, True, CAUSAL, INTERPRET)
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


# ----------------------------------------------------------------------------------
# 3. launchers
# ----------------------------------------------------------------------------------

# True when the kernels above were built by Triton's interpreter (TRITON_INTERPRET=1 was
# set when this module was imported). Decided once: triton.jit picks at decoration time.
INTERPRET = isinstance(_fwd_kernel, InterpretedFunction)

_fwd_tuned = tuning.autotuned(_fwd_kernel, backward=False, interpret=INTERPRET)
# Benchmarking a config runs the kernel repeatedly: dQ32 is zeroed before each run.
_bwd_tuned = tuning.autotuned(_bwd_kernel, backward=True, interpret=INTERPRET,
                              reset_to_zero=["DQ32"])
TUNED = (_fwd_tuned, _bwd_tuned)  # their .cache: one entry per tuning key seen
_PREP_BLOCK_M = 16 if INTERPRET else 64  # δ and dQ-out: memory-bound row blocks


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


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def forward(q, k, v, modes, *, causal: bool, scale: float, beta: float, eps: float,
            want_stats: bool, keep_o32: bool = False):
    """Returns (o, lse, o32, tied_rows[H], guarded_rows[H], max_logit[H]).

    o is in q's layout (`common.empty_out`), lse [B, H, Nq] fp32 in nats. o32 is
    [H32, B, Nq, D] fp32 for the FP32_O heads in head order (H32 may be 0), or for every
    head with keep_o32. Counters are zeros / -inf when want_stats is False.
    """
    check_usable(q)
    o = empty_out(q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dev = q.device
    heads, n32 = head_table(modes, dev, all_slots=keep_o32)
    lse = torch.empty(B, H, Nq, dtype=torch.float32, device=dev)
    o32 = torch.empty(n32, B, Nq, D, dtype=torch.float32, device=dev)
    o32_arg = o32 if n32 else lse  # never written when no head has a slot
    # Counter slots per (batch·head, block of the smallest BLOCK_M); a config with larger
    # blocks leaves some at their initial 0 / -inf, which the reductions below ignore.
    min_m = tuning.INTERP_BLOCKS["BLOCK_M"] if INTERPRET else tuning.FWD_MIN_BLOCK_M
    n_mblk = triton.cdiv(Nq, min_m)
    if want_stats:
        st_cnt = torch.zeros(2 * B * H * n_mblk, dtype=torch.int32, device=dev)
        st_max = torch.full((B * H * n_mblk,), -math.inf, dtype=torch.float32, device=dev)
    else:
        st_cnt = torch.empty(2, dtype=torch.int32, device=dev)
        st_max = torch.empty(1, dtype=torch.float32, device=dev)
    _fwd_tuned[lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * H)](
        q, k, v, o, o32_arg, lse, heads, st_cnt, st_max,
        scale, scale * math.log2(math.e), beta - 1.0, eps, GUARD_NATS[q.dtype], MIN_EXCESS,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        B, H, Nq, Nk, n_mblk, tuning.bucket(Nq), tuning.bucket(Nk),
        D=D, CAUSAL=causal, STATS=want_stats, INTERPRET=INTERPRET)
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
    """Returns (dq, dk, dv) in the input dtype and the layouts of q, k, v.

    o32 holds the FP32_O heads' FP32 O ([H32, B, Nq, D], as `forward` returns it) or every
    head's (keep_o32); δ reads the FP32_O heads' rows from it in place. do and o may have
    any strides with a contiguous last dim.
    """
    check_usable(q)
    dq, dk, dv = empty_out(q), empty_out(k), empty_out(v)
    q, k, v, o, do = (_last_dim_contiguous(t) for t in (q, k, v, o, do))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dev = q.device
    heads, n32 = head_table(modes, dev, all_slots=o32.shape[0] == H)
    if o32.shape[0] != n32:
        raise RuntimeError(
            f"o32 holds {o32.shape[0]} heads but modes name {n32} FP32_O heads (and q has "
            f"{H}); the modes tensor changed between forward and backward"
        )
    delta = torch.empty(B, H, Nq, dtype=torch.float32, device=dev)
    dq32 = torch.empty(B, H, Nq, D, dtype=torch.float32, device=dev)
    rows = (triton.cdiv(Nq, _PREP_BLOCK_M), B * H)
    _bwd_prep[rows](o, o32 if n32 else delta, do, delta, dq32, heads, *_strides(o),
                    *_strides(do), B, H, Nq, D=D, BLOCK_M=_PREP_BLOCK_M, INTERPRET=INTERPRET)
    _bwd_tuned[lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * H)](
        q, k, v, do, lse, delta, dq32, dk, dv, scale, scale * math.log2(math.e),
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
        *_strides(dv), H, Nq, Nk, tuning.bucket(Nq), tuning.bucket(Nk),
        D=D, CAUSAL=causal, INTERPRET=INTERPRET)
    _bwd_dq_out[rows](dq32, dq, scale, *_strides(dq), H, Nq, D=D, BLOCK_M=_PREP_BLOCK_M,
                      INTERPRET=INTERPRET)
    return dq, dk, dv
