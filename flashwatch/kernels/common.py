"""Types and input checks shared by every attention backend (reference and Triton).

Only torch and flashwatch._checks (standard library only) are imported here:
`flashwatch.kernels` must stay usable without the rest of flashwatch (docs/design.md §2).
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashwatch._checks import check_bool, check_float, check_int

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# What the Triton kernels take (the reference takes all SUPPORTED_DTYPES and any D).
TRITON_DTYPES = (torch.bfloat16, torch.float16)
TRITON_HEAD_DIMS = (16, 32, 64, 128)
ARITHMETICS = ("fused", "paper")

# BETA underflow guard (docs/design.md §4). The shift may exceed the row max r_m by at most
# GUARD_NATS; exp(-60) = 8.8e-27 keeps P̄ at the max 12 orders of magnitude above the
# FP32/BF16 normal minimum (1.2e-38 = exp(-87.3)). FP16 has a 5-bit exponent (smallest
# normal 6.1e-5 = exp(-9.7)), so its guard is 4 nats. Guarded rows get a shift that still
# depends on the row (GUARD/2 + fmod(excess, GUARD/2)), never one constant: a constant
# makes P̄ at the max round the same way in every row and brings the bias back.
GUARD_NATS = {torch.bfloat16: 60.0, torch.float32: 60.0, torch.float16: 4.0}
# Rows whose β-excess is tiny (r_m near 0) would still round P̄ at the max to exactly 1
# (any P̄ > 1 - 2^-9 does in BF16). They get MIN_EXCESS + excess instead, also
# row-dependent; 0.5 nats puts P̄_max at 0.61 or below.
MIN_EXCESS = 0.5


class Mode(enum.IntEnum):
    """Per-head attention mode. Values are stable: they are stored in checkpoints."""

    STANDARD = 0  # FlashAttention-2 as usual
    BETA = 1  # in rows with tied maxima subtract β·r_m (r_m > 0) or 0, so every P̄ < 1
    FP32_O = 2  # keep O in FP32 for these heads and use it for δ in the backward


@dataclass
class AttentionStats:
    """Per-head counters filled in place by `attention(..., stats=...)`.

    Calls accumulate: counts add up and `max_logit` keeps the maximum, so one object can
    span the micro-batches of an optimizer step. `reset()` zeroes it.

    tied_rows[h]    rows whose max r_m has ≥ 2 scaled scores s ≥ r_m - eps (int64)
    rows[h]         rows seen (batch × query length) (int64)
    guarded_rows[h] BETA rows whose shift hit the underflow guard (int64)
    max_logit[h]    largest scaled score seen, -inf before any call (float32)
    """

    tied_rows: torch.Tensor
    rows: torch.Tensor
    guarded_rows: torch.Tensor
    max_logit: torch.Tensor

    @classmethod
    def zeros(cls, num_heads: int, device: torch.device | str | None = None) -> AttentionStats:
        check_int("num_heads", num_heads, min=1, hint="one counter per attention head")
        counts = [torch.zeros(num_heads, dtype=torch.int64, device=device) for _ in range(3)]
        max_logit = torch.full((num_heads,), -math.inf, dtype=torch.float32, device=device)
        return cls(*counts, max_logit)

    @property
    def num_heads(self) -> int:
        return self.rows.numel()

    def reset(self) -> None:
        self.tied_rows.zero_()
        self.rows.zero_()
        self.guarded_rows.zero_()
        self.max_logit.fill_(-math.inf)

    def tie_ratio(self) -> torch.Tensor:
        """tied_rows / rows per head (0 where no rows were seen)."""
        return self.tied_rows.double() / self.rows.clamp(min=1).double()

    def add_(self, tied: torch.Tensor, rows: int, guarded: torch.Tensor, max_logit: torch.Tensor):
        """Accumulate one call's per-head results (tensors of shape [H])."""
        dev = self.rows.device
        self.tied_rows += tied.to(dev, torch.int64)
        self.rows += rows
        self.guarded_rows += guarded.to(dev, torch.int64)
        self.max_logit.copy_(torch.maximum(self.max_logit, max_logit.to(dev, torch.float32)))


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def normalize_head_modes(head_modes, num_heads: int) -> torch.Tensor:
    """Return head_modes as an int32 CPU tensor [H] with values in Mode, or raise."""
    if head_modes is None:
        return torch.zeros(num_heads, dtype=torch.int32)
    if isinstance(head_modes, torch.Tensor):
        if head_modes.dtype.is_floating_point or head_modes.dtype.is_complex or (
            head_modes.dtype == torch.bool
        ):
            raise TypeError(
                f"head_modes must be an integer tensor of flashwatch.Mode values, got dtype "
                f"{head_modes.dtype}; build it with torch.tensor([...], dtype=torch.int32)"
            )
        modes = head_modes.detach().to("cpu", torch.int64).reshape(-1)
        if head_modes.dim() != 1:
            raise ValueError(
                f"head_modes must be 1-D with one entry per head, got shape {_shape(head_modes)}"
            )
    elif isinstance(head_modes, Sequence) and not isinstance(head_modes, (str, bytes)):
        for i, m in enumerate(head_modes):
            check_int(f"head_modes[{i}]", m, hint="head_modes entries must be flashwatch.Mode "
                      "values (Mode.STANDARD, Mode.BETA, Mode.FP32_O)")
        modes = torch.tensor([int(m) for m in head_modes], dtype=torch.int64)
    else:
        raise TypeError(
            f"head_modes must be None, a sequence of flashwatch.Mode or an int tensor [H], "
            f"got {type(head_modes).__name__}"
        )
    if modes.numel() != num_heads:
        raise ValueError(
            f"head_modes has {modes.numel()} entries but q has {num_heads} heads; pass one "
            f"flashwatch.Mode per head"
        )
    valid = {int(m) for m in Mode}
    bad = [int(m) for m in modes.tolist() if int(m) not in valid]
    if bad:
        raise ValueError(
            f"head_modes contains {bad[0]}, which is not a flashwatch.Mode; use "
            f"{', '.join(f'{m.name}={m.value}' for m in Mode)}"
        )
    return modes.to(torch.int32)


def check_mask(attn_mask, q: torch.Tensor, k: torch.Tensor) -> None:
    """attn_mask as SDPA takes it: bool (True = attend) or an additive float mask,
    broadcastable to [B, H, Nq, Nk], on q's device. Shapes and dtypes only (traceable)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = attend) or an additive float mask, "
                        f"got dtype {attn_mask.dtype}; convert with attn_mask.bool() or "
                        f"attn_mask.to(q.dtype)")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        ok = attn_mask.dim() <= 4 and torch.broadcast_shapes(attn_mask.shape, full) == full
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"attn_mask of shape {_shape(attn_mask)} does not broadcast to "
                         f"[B, H, Nq, Nk] = {list(full)}; give it shape [Nq, Nk], "
                         f"[B, 1, Nq, Nk] or [B, H, Nq, Nk]")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q on {q.device}; move it "
                         f"with attn_mask.to(q.device)")


def check_window(sliding_window) -> None:
    """sliding_window: None, or a positive int (key j is visible to query i only if
    i - j < sliding_window, as Mistral's and Gemma2's configs give it)."""
    if sliding_window is None:
        return
    check_int("sliding_window", sliding_window, min=1,
              hint="query i sees key j only if i - j < sliding_window; pass None for no "
                   "window or a value >= 1, the model config's sliding_window (e.g. 4096)")


def _check_tensor(name: str, t) -> None:
    """One of q, k, v on its own: a 4-D tensor of a supported dtype, not empty."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must have shape [B, H, N, D] like scaled_dot_product_attention, got "
            f"shape {_shape(t)}; add missing batch/head dims with {name}.unsqueeze(...)"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; supported are bfloat16, float16 and float32 "
            f"(cast with {name}.to(torch.bfloat16))"
        )
    if t.shape[2] < 1 or t.shape[3] < 1:
        raise ValueError(f"{name} has an empty sequence or head dimension: {_shape(t)}")


def _check_qkv_agree(q, k, v) -> None:
    """q, k, v together: one dtype, one device, the same B, H and D; k and v one length."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to "
            f"the same dtype"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; move them "
            f"with .to(q.device)"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k, v batch sizes differ: {_shape(q)}, {_shape(k)}, {_shape(v)}"
        )
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(
            f"q, k, v head counts differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}; for "
            f"grouped-query attention repeat k and v per head first "
            f"(k.repeat_interleave(q.shape[1] // k.shape[1], dim=1))"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must have the same sequence length, got k {_shape(k)} and v {_shape(v)}"
        )
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(
            f"q, k, v must share the head dimension D, got {_shape(q)}, {_shape(k)}, "
            f"{_shape(v)}"
        )


def _check_stats(stats, num_heads: int) -> None:
    if stats is None:
        return
    if not isinstance(stats, AttentionStats):
        raise TypeError(
            f"stats must be a flashwatch.AttentionStats or None, got {type(stats).__name__}; "
            f"create one with AttentionStats.zeros(num_heads)"
        )
    if stats.num_heads != num_heads:
        raise ValueError(
            f"stats holds {stats.num_heads} heads but q has {num_heads}; create it with "
            f"AttentionStats.zeros({num_heads})"
        )


def check_inputs(q, k, v, *, causal, scale, head_modes, beta, eps, stats, attn_mask=None,
                 softcap=None, sliding_window=None):
    """Validate a call to any attention backend.

    Returns (scale, head_modes) normalized: scale as float, head_modes as an int32 CPU
    tensor [H]. Raises TypeError/ValueError naming the argument, the value and the fix.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    _check_qkv_agree(q, k, v)
    check_bool("causal", causal, hint="a bool, as SDPA's is_causal")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    else:
        scale = check_float("scale", scale, above=0, hint="pass None for 1/sqrt(D)")
    check_float("beta", beta, above=1,
                hint="the paper uses 2 to 8; beta <= 1 would let P̄ reach 1 again")
    check_float("eps", eps, above=0,
                hint="it is the tie tolerance in scaled-score units (default 1e-3)")
    if softcap is not None:
        check_float("softcap", softcap, above=0,
                    hint="pass None for no softcapping (Gemma2 uses 50.0)")
    check_mask(attn_mask, q, k)
    check_window(sliding_window)
    _check_stats(stats, q.shape[1])
    return scale, normalize_head_modes(head_modes, q.shape[1])


def hidden_keys(q0: int, q1: int, k0: int, k1: int, causal: bool, window, device):
    """Bool [q1 - q0, k1 - k0], True where query i (q0 <= i < q1) may not see key j:
    causal hides j > i (top-left aligned, as SDPA's is_causal), the sliding window hides
    i - j >= window (Hugging Face's sliding_window_overlay: kv_idx > q_idx - window is
    visible). None when nothing in the tile is hidden."""
    causal = causal and k1 - 1 > q0  # a tile left of the diagonal: nothing to hide
    if window is not None and q1 - 1 - k0 < window:
        window = None  # every key of the tile is inside every row's window
    if not causal and window is None:
        return None
    rows = torch.arange(q0, q1, device=device).unsqueeze(1)
    cols = torch.arange(k0, k1, device=device).unsqueeze(0)
    hide = cols > rows if causal else None
    if window is not None:
        far = rows - cols >= window
        hide = far if hide is None else hide | far
    return hide


def key_range(q0: int, q1: int, nk: int, causal: bool, window) -> tuple[int, int]:
    """[first, end) of the keys any query row in [q0, q1) can see: causal hides keys
    >= q1, the window keys <= q0 - window. Keys outside hide for every row."""
    first = 0 if window is None else max(0, q0 - window + 1)
    return first, min(nk, q1) if causal else nk


def update_ties(m_old, cnt_old, s, m_new, eps):
    """Exact online count (saturating at 2) of scores ≥ rowmax - eps.

    With thr = m_new - eps (FP32): if the max did not move, old count + block count; if
    it moved but the old max is still ≥ thr, the old max and the new one are both within
    eps, so the row is tied (≥ 2); otherwise no old score can reach thr and the count is
    the block's. Equal to a brute-force count over the whole row (tests check this).
    Masked keys (-inf) never count.
    """
    thr = (m_new - eps).unsqueeze(-1)
    blk = ((s >= thr) & (s != -math.inf)).sum(-1)
    old = torch.where(m_new == m_old, cnt_old, (m_old >= thr.squeeze(-1)).long())
    return (old + blk).clamp_(max=2)


def empty_out(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output shaped like t in t's dimension order (dense), e.g. O for q or dK for k.

    A model that views [B, N, H, D] as [B, H, N, D] gets O (and dQ, dK, dV) back in its
    own layout, so transposing back is free instead of a copy. Contiguous when that order
    would not put the last dim innermost (the Triton kernels need stride(-1) == 1). The op's
    fake implementation and every backend use this, so traced and real strides agree.
    """
    out = torch.empty_like(t, dtype=dtype)
    if out.stride(-1) != 1:
        out = torch.empty(t.shape, dtype=out.dtype, device=t.device)
    return out


def no_autocast(device: torch.device):
    """A context in which the user's torch.autocast is off: FP32 math in the reference and
    the probe must stay FP32 (under CPU autocast an FP32 matmul otherwise runs in BF16)."""
    try:
        if not torch.is_autocast_enabled(device.type):  # nothing to turn off: ≈ 6× cheaper
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:  # a device type without autocast
        return contextlib.nullcontext()
