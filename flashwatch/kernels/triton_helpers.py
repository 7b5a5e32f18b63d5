"""@triton.jit helpers shared by the attention kernels (flashwatch/kernels/triton_attention.py).

  dtype rounding that is right in the interpreter   `_rne_bf16_bits`, `_rne_bf16`, `_up`,
                                                     `_lo`, `_to_store`, `_dot`
  row max, BETA shift and the online tie count       `_rowmax`, `_beta_excess`, `_update_ties`
  scores as the softmax sees them (softcap, masks)  `_scores`, `_tanh`, `_mask_load`,
                                                     `_in_nats`, `_exp_shifted`, `_p_from_lse`
  which key / query blocks a block pair needs       `_fwd_bounds`, `_bwd_bounds`
  the prologue every kernel shares                  `_bh_offset`, `_tile`, `_row_offset`

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

import triton
import triton.language as tl

# log2(e): scores are multiplied by scale·LOG2E once and exponentiated with exp2 (one
# FMA and one ex2 per score, as in FlashAttention-2), shifts and LSE stay in nats.
LOG2E = tl.constexpr(1.4426950408889634)


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


@triton.jit
def _bh_offset(pid_bh, H, stride_b, stride_h):
    """Element offset of (batch, head) = divmod(pid_bh, H) in a [B, H, N, D] tensor, in
    int64: B·H·N·D passes 2^31 at long context (B 64, H 32, N 8192, D 128)."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    return b * stride_b + h * stride_h


@triton.jit
def _tile(base, start, stride, BLOCK: tl.constexpr, D: tl.constexpr):
    """Pointers to rows [start, start + BLOCK) × [0, D) of a row-major head at `base`.
    The row start goes in as an int64 scalar; the in-tile offsets (< BLOCK·stride) stay
    int32, so the [BLOCK, D] pointer arithmetic costs what it did with int32 offsets."""
    row0 = base + _row_offset(start, stride)
    return row0 + tl.arange(0, BLOCK)[:, None] * stride + tl.arange(0, D)[None, :]


@triton.jit
def _row_offset(start, stride):
    """start·stride in int64 (row 2^20 of a [B, N, H, D] view with H·D = 4096 is 2^32)."""
    return tl.cast(start, tl.int64) * stride


@triton.jit
def _tanh(x):
    """tanh in FP32 (tl.math has none in triton 3.9): odd, so computed on |x| as
    (1 - e)/(1 + e) with e = exp(-2|x|) ≤ 1, which never overflows (tanh(±inf) = ±1, NaN
    stays NaN). Below |x| = 1/8, where 1 - e cancels, the Taylor series to x⁷ (the next
    term is < 2e-10 of x there); both branches are within a few ulps of torch.tanh."""
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|) = 2^(-2·log2(e)·|x|)
    a2 = a * a
    series = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333
                                                          + a2 * -0.05396825396825397)))
    t = tl.where(a < 0.125, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _mask_load(mask_base, r, c, stride_mm, stride_mn, N_Q, N_K, INTERPRET: tl.constexpr):
    """attn_mask at rows r × keys c, as FP32 (bool: 0/1). r and c are index tiles that
    broadcast ([M, 1] × [1, N] forward, [1, M] × [N, 1] backward); a broadcast mask has
    stride 0 there, so a key-padding mask [B, 1, 1, Nk] reads one [Nk] row per (b, h)."""
    ptrs = mask_base + r.to(tl.int64) * stride_mm + c.to(tl.int64) * stride_mn
    return _up(tl.load(ptrs, mask=(r < N_Q) & (c < N_K), other=0), INTERPRET)


@triton.jit
def _scores(qk, r, c, mask_base, stride_mm, stride_mn, N_Q, N_K, sm_scale, cap, window,
            BOUNDS: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
            MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    """One tile's scores as the softmax sees them (`reference._block_scores`): s =
    scale·qk, s = cap·tanh(s/cap) (SOFTCAP), then hidden keys set to -inf: out of bounds,
    causal and outside the sliding window (BOUNDS: the tiles that straddle them),
    attn_mask False (MASK_KIND 1), or a float mask added (MASK_KIND 2). Returns (x, t),
    t = tanh(s/cap) for the backward (else qk).

    Without SOFTCAP or a float mask x stays the raw dot (s = scale·x, folded into exp2 by
    the caller); with them x = s in nats (`_exp_shifted`, `_p_from_lse`)."""
    x = qk
    t = qk
    if SOFTCAP or MASK_KIND == 2:
        x = qk * sm_scale
    if SOFTCAP:
        t = _tanh(x / cap)
        x = t * cap
    if MASK_KIND == 2:
        x = x + _mask_load(mask_base, r, c, stride_mm, stride_mn, N_Q, N_K, INTERPRET)
    if BOUNDS:
        vis = (r < N_Q) & (c < N_K)
        if CAUSAL:
            vis = vis & (c <= r)  # top-left aligned, like SDPA's is_causal
        if SLIDING:
            vis = vis & (r - c < window)  # Hugging Face's sliding_window_overlay
        if MASK_KIND == 1:
            vis = vis & (_mask_load(mask_base, r, c, stride_mm, stride_mn, N_Q, N_K,
                                    INTERPRET) != 0)
        x = tl.where(vis, x, float("-inf"))
    else:
        if MASK_KIND == 1:
            vis = _mask_load(mask_base, r, c, stride_mm, stride_mn, N_Q, N_K, INTERPRET) != 0
            x = tl.where(vis, x, float("-inf"))
    return x, t


@triton.jit
def _in_nats(x, sm_scale, NATS: tl.constexpr):
    """Scores x of `_scores` in nats: x itself (NATS) or scale·x."""
    if NATS:
        return x
    else:
        return x * sm_scale


@triton.jit
def _exp_shifted(x, sh_old, sh_new, qk_scale, NATS: tl.constexpr):
    """(alpha, P): exp(shift_old - shift_new) and exp(s - shift_new) of one tile. A row that
    has seen only hidden keys keeps shift -inf: use 0 there so exp gives 0, not NaN.
    NATS (x = s in nats, `_scores`): subtract before scaling. Hugging Face's padding rows
    have every score near finfo.min, where s·log2(e) overflows to -inf and the folded
    form would give -inf - -inf = NaN; the difference is exact there (0: P = 1, as the
    reference)."""
    sh = tl.where(sh_new == float("-inf"), 0.0, sh_new)
    if NATS:
        alpha = tl.exp2((sh_old - sh) * LOG2E)
        p = tl.exp2((x - sh[:, None]) * LOG2E)
    else:
        sh2 = sh * LOG2E
        alpha = tl.exp2(sh_old * LOG2E - sh2)
        p = tl.exp2(x * qk_scale - sh2[:, None])
    return alpha, p


@triton.jit
def _p_from_lse(xT, lse, qk_scale, NATS: tl.constexpr):
    """The backward's Pᵀ = exp(S - LSE) of a transposed tile (keys × queries); LSE = +inf
    (a row with no visible key) gives 0. NATS: as `_exp_shifted`."""
    if NATS:
        return tl.exp2((xT - lse[None, :]) * LOG2E)
    else:
        return tl.exp2(xT * qk_scale - (lse * LOG2E)[None, :])


@triton.jit
def _fwd_bounds(m0, N_K, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, SLIDING: tl.constexpr):
    """Key blocks for the query block at m0, as (lo, a, b, hi): [lo, a) straddle the
    window's edge (masked), [a, b) need no mask for any row, [b, hi) straddle the causal
    diagonal or the ragged end of K (masked). Keys before lo are outside the window of
    every row (i - j >= window), keys from hi on are after the diagonal: never loaded."""
    lo = 0
    win_end = 0
    if SLIDING:  # row i sees keys j > i - window: the block's first row sees the fewest
        lo = (tl.maximum(m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        win_end = tl.cdiv(tl.maximum(m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(N_K, m0 + BLOCK_M)
        full_end = (tl.minimum(m0 + 1, N_K) // BLOCK_N) * BLOCK_N
    else:
        hi = N_K
        full_end = (N_K // BLOCK_N) * BLOCK_N
    a = tl.maximum(lo, tl.minimum(win_end, hi))
    return lo, a, tl.maximum(a, full_end), hi


@triton.jit
def _bwd_bounds(n0, N_Q, N_K, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, SLIDING: tl.constexpr):
    """Query blocks for the key block at n0, as (lo, a, b, hi): [lo, a) straddle the
    causal diagonal (all of [lo, hi) if the key block is K's ragged end), [a, b) see the
    whole key block, [b, hi) straddle the window's edge or the ragged end of Q. Rows
    before lo see none of these keys (causal), rows from hi on have them all outside
    their window (i >= j + window): never loaded."""
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M
        full_start = tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full_start = 0
    hi = N_Q
    full_stop = (N_Q // BLOCK_M) * BLOCK_M
    if SLIDING:  # key j is seen by rows i < j + window: the block's first key by the fewest
        hi = tl.minimum(N_Q, n0 + BLOCK_N + window - 1)
        full_stop = tl.minimum(full_stop, ((n0 + window) // BLOCK_M) * BLOCK_M)
    if n0 + BLOCK_N > N_K:
        a = hi
    else:
        a = tl.minimum(full_start, hi)
    return lo, a, tl.maximum(a, full_stop), hi
