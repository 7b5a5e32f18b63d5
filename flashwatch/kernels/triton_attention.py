"""FlashAttention-2 in Triton with per-head modes and inline counters (docs/design.md §4).

This module holds the launchers `forward` and `backward` (plain tensors in, tensors
out). The kernels: triton_fwd.py (`_fwd_kernel`: Q block resident, loop over K/V
blocks) and triton_bwd.py (`_bwd_prep`: δ and a zeroed FP32 dQ buffer; `_bwd_kernel`:
K/V block resident, loop over Q blocks, dK and dV in registers, dQ by atomic adds;
`_bwd_dq_out`: dQ rounded to the input dtype). Helpers (interpreter-safe rounding, ties,
the shared prologue) are in triton_helpers.py, autotune spaces and keys in
triton_tuning.py, the autograd / torch.library wiring in ops.py.

Semantics are those of `flashwatch/kernels/reference.py` (fused arithmetic); tests compare the two.
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
from triton.runtime.interpreter import InterpretedFunction

from . import triton_tuning as tuning
from .common import GUARD_NATS, MIN_EXCESS, TRITON_DTYPES, TRITON_HEAD_DIMS, Mode, empty_out
from .triton_bwd import _bwd_dq_out, _bwd_kernel, _bwd_prep
from .triton_fwd import _fwd_kernel

__all__ = ["INTERPRET", "TUNED", "backward", "check_usable", "forward", "head_table"]


# True when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 was
# set when this module was imported). Decided once: triton.jit picks at decoration time.
INTERPRET = isinstance(_fwd_kernel, InterpretedFunction)

# Benchmarking a config runs the kernel repeatedly. The forward's counter slots are
# restored after each run (a config with larger blocks writes fewer slots and would leave
# another config's counts behind); the backward's dQ32 is zeroed before each run.
_fwd_tuned = tuning.autotuned(_fwd_kernel, backward=False, interpret=INTERPRET,
                              restore_value=["ST_CNT", "ST_MAX"])
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


def _cap(softcap) -> float:
    return 1.0 if softcap is None else float(softcap)  # unread unless SOFTCAP


def _window(window, nq: int) -> int:
    """The window as the kernels take it (unread unless SLIDING). A window >= Nq hides
    nothing (i - j <= Nq - 1), so it is clamped to Nq: an int32 whatever the caller's."""
    return nq if window is None else min(int(window), nq)


def _mask_args(attn_mask, q, k, dummy: torch.Tensor):
    """(pointer tensor, its 4 strides, MASK_KIND) for the kernels. The mask is a broadcast
    view [B, H, Nq, Nk] (stride 0 on broadcast dims), never materialised; a bool mask is
    read as uint8 (0 hides). No mask: `dummy`, never read (MASK_KIND 0)."""
    if attn_mask is None:
        return dummy, (0, 0, 0, 0), 0
    m = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), 1
    return m, m.stride(), 2


def forward(q, k, v, modes, *, causal: bool, scale: float, beta: float, eps: float,
            want_stats: bool, keep_o32: bool = False, attn_mask=None, softcap=None,
            window=None):
    """Returns (o, lse, o32, tied_rows[H], guarded_rows[H], max_logit[H]).

    o is in q's layout (`common.empty_out`), lse [B, H, Nq] fp32 in nats. o32 is
    [H32, B, Nq, D] fp32 for the FP32_O heads in head order (H32 may be 0), or for every
    head with keep_o32. Counters are zeros / -inf when want_stats is False.
    attn_mask (bool or float, broadcastable to [B, H, Nq, Nk]), softcap and window (the
    sliding window, an int or None) as the reference takes them: validated by the
    caller (`common.check_inputs`).
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
    mask, mask_strides, mask_kind = _mask_args(attn_mask, q, k, lse)
    _fwd_tuned[lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * H)](
        q, k, v, o, o32_arg, lse, heads, st_cnt, st_max, mask,
        scale, scale * math.log2(math.e), _cap(softcap), beta - 1.0, eps,
        GUARD_NATS[q.dtype], MIN_EXCESS,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *mask_strides,
        B, H, Nq, Nk, n_mblk, tuning.bucket(Nq), tuning.bucket(Nk), _window(window, Nq),
        D=D, CAUSAL=causal, SLIDING=window is not None, STATS=want_stats,
        MASK_KIND=mask_kind, SOFTCAP=softcap is not None, INTERPRET=INTERPRET)
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


def backward(do, q, k, v, o, o32, lse, modes, *, causal: bool, scale: float,
             attn_mask=None, softcap=None, window=None):
    """Returns (dq, dk, dv) in the input dtype and the layouts of q, k, v.

    o32 holds the FP32_O heads' FP32 O ([H32, B, Nq, D], as `forward` returns it) or every
    head's (keep_o32); δ reads the FP32_O heads' rows from it in place. do and o may have
    any strides with a contiguous last dim. attn_mask, softcap, window: the forward's (the mask
    gets no gradient here; the caller refuses a mask that requires one).
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
    mask, mask_strides, mask_kind = _mask_args(attn_mask, q, k, lse)
    _bwd_tuned[lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * H)](
        q, k, v, do, lse, delta, dq32, dk, dv, mask, scale, scale * math.log2(math.e),
        _cap(softcap), *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dk), *_strides(dv), *mask_strides, H, Nq, Nk, tuning.bucket(Nq),
        tuning.bucket(Nk), _window(window, Nq), D=D, CAUSAL=causal,
        SLIDING=window is not None, MASK_KIND=mask_kind, SOFTCAP=softcap is not None,
        INTERPRET=INTERPRET)
    _bwd_dq_out[rows](dq32, dq, scale, *_strides(dq), H, Nq, D=D, BLOCK_M=_PREP_BLOCK_M,
                      INTERPRET=INTERPRET)
    return dq, dk, dv
