"""`flashwatch.attention` (defined here): the public attention op and its backend dispatch."""

from __future__ import annotations

import contextvars

import torch

from flashwatch.kernels import reference
from flashwatch.kernels.common import AttentionStats

BACKENDS = ("auto", "reference", "triton")

# Set by a Watcher while one of its attention modules runs, so that calls to
# flashwatch.attention inside it are attributed to that layer (and get its head modes).
_INTERCEPT: contextvars.ContextVar = contextvars.ContextVar("flashwatch_intercept",
                                                            default=None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, head_modes=None, beta: float = 2.0,
              eps: float = 1e-3, stats: AttentionStats | None = None,
              backend: str = "auto") -> torch.Tensor:
    """Attention like `F.scaled_dot_product_attention`, with per-head modes and counters.

    q, k, v: [B, H, N, D], bfloat16, float16 or float32, one device.
    causal: mask key j for query i when j > i (top-left aligned, like SDPA's is_causal).
    scale: softmax scale, default 1/sqrt(D).
    head_modes: None (all STANDARD), a sequence of `Mode` or an int tensor [H].
    beta, eps: the β fix's multiplier (> 1) and tie tolerance (> 0, in scaled scores).
    stats: an `AttentionStats` that this call accumulates its per-head counters into.
    backend: "auto" (the reference today; Triton on CUDA once available), "reference",
      or "triton".

    Inside a layer watched by `flashwatch.watch`, the watcher adds its head modes (the
    stronger of the two per head) and measures the call.
    """
    intercept = _INTERCEPT.get()
    if intercept is not None:
        return intercept(q, k, v, causal=causal, scale=scale, head_modes=head_modes,
                         beta=beta, eps=eps, stats=stats, backend=backend)
    return _dispatch(q, k, v, causal=causal, scale=scale, head_modes=head_modes, beta=beta,
                     eps=eps, stats=stats, backend=backend)


def _dispatch(q, k, v, *, causal, scale, head_modes, beta, eps, stats, backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        raise RuntimeError(
            "backend='triton' is not available in this version of flashwatch (the Triton "
            "kernels are not built yet); use backend='auto' or backend='reference'"
        )
    return reference.attention(q, k, v, causal=causal, scale=scale, head_modes=head_modes,
                               beta=beta, eps=eps, stats=stats)
