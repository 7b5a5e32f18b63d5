"""`flashwatch.attention` (defined here): the public attention op and its dispatch.

Both backends run through the `torch.library` op in `flashwatch.kernels.ops`, so
`torch.compile(fullgraph=True)` traces a call as one opaque op with no graph break.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util

import torch

from flashwatch.kernels import ops  # noqa: F401  (registers torch.ops.flashwatch.*)
from flashwatch.kernels.common import (
    TRITON_DTYPES,
    TRITON_HEAD_DIMS,
    AttentionStats,
    Mode,
    check_inputs,
)

BACKENDS = ("auto", "reference", "triton", "paper")

# Set by a Watcher while one of its attention modules runs, so that calls to
# flashwatch.attention inside it are attributed to that layer (and get its head modes).
INTERCEPT: contextvars.ContextVar = contextvars.ContextVar("flashwatch_intercept",
                                                            default=None)


def _traceable_head_modes(head_modes, num_heads: int) -> torch.Tensor:
    """head_modes as an int32 CPU tensor [H], without reading tensor values.

    Used while torch.compile traces: reading values (as `check_inputs` does to validate
    them) would break the graph. The op checks the values when it runs.
    """
    if head_modes is None:
        return torch.zeros(num_heads, dtype=torch.int32)
    if isinstance(head_modes, torch.Tensor):
        if head_modes.dtype.is_floating_point or head_modes.dtype == torch.bool:
            raise TypeError(
                f"head_modes must be an integer tensor of flashwatch.Mode values, got dtype "
                f"{head_modes.dtype}; build it with torch.tensor([...], dtype=torch.int32)"
            )
        if head_modes.dim() != 1 or head_modes.shape[0] != num_heads:
            raise ValueError(
                f"head_modes must have shape [{num_heads}] (one flashwatch.Mode per head), "
                f"got {list(head_modes.shape)}"
            )
        return head_modes.detach().to("cpu", torch.int32)
    if len(head_modes) != num_heads:
        raise ValueError(
            f"head_modes has {len(head_modes)} entries but q has {num_heads} heads; pass "
            f"one flashwatch.Mode per head"
        )
    return torch.tensor([int(Mode(m)) for m in head_modes], dtype=torch.int32)


class NotInKernel(RuntimeError):
    """A call the resolved backend cannot run (a float attn_mask that requires grad on
    Triton or "paper"): the watcher leaves such calls on the original kernel instead of
    counting an error."""


@functools.cache
def _triton_installed() -> bool:
    """Whether triton can be imported (without importing it: 1 s and ≈ 1 GB of it)."""
    return importlib.util.find_spec("triton") is not None


def _resolve_backend(backend: str, q: torch.Tensor, attn_mask=None) -> str:
    if backend == "auto":  # Triton where it runs natively, the reference for the rest
        triton_ok = (q.device.type == "cuda" and q.dtype in TRITON_DTYPES
                     and q.shape[-1] in TRITON_HEAD_DIMS and _triton_installed())
        backend = "triton" if triton_ok else "reference"
    if backend in ("triton", "paper") and attn_mask is not None and \
            attn_mask.requires_grad and torch.is_grad_enabled():
        # Not silently the reference on CUDA: it holds [B, H, 1024, 128] FP32 tiles and
        # runs ~20 ops a block, far from what a user of backend="auto" expects there.
        raise NotInKernel(f"backend={backend!r} gives attn_mask no gradient, and this mask "
                          f"requires grad (a learned bias); use backend='reference' (FP32 "
                          f"[B, H, Nq, Nk] in the backward) or attn_mask.detach()")
    if backend == "triton":
        try:
            from flashwatch.kernels import triton_attention
        except ImportError as e:
            raise RuntimeError(f"backend='triton' needs the triton package ({e}); install "
                               f"it with `pip install triton`, or use backend='reference'"
                               ) from e
        triton_attention.check_usable(q)  # device, dtype and D, with the fix to apply
    return backend


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, head_modes=None, beta: float = 2.0,
              eps: float = 1e-3, stats: AttentionStats | None = None,
              backend: str = "auto", attn_mask: torch.Tensor | None = None,
              softcap: float | None = None, sliding_window: int | None = None
              ) -> torch.Tensor:
    """Attention like `F.scaled_dot_product_attention`, with per-head modes and counters.

    q, k, v: [B, H, N, D], bfloat16, float16 or float32, one device.
    causal: mask key j for query i when j > i (top-left aligned, like SDPA's is_causal).
    scale: softmax scale, default 1/sqrt(D).
    head_modes: None (all STANDARD), a sequence of `Mode` or an int tensor [H]; changing
      it between calls recompiles nothing (the kernels read it as data).
    beta, eps: the β fix's multiplier (> 1) and tie tolerance (> 0, in scaled scores).
    stats: an `AttentionStats` that this call accumulates its per-head counters into.
    backend: "auto" (Triton for bf16/fp16 CUDA tensors with D in 16/32/64/128, else the
      reference), "reference" (pure PyTorch, any device and dtype), or "triton"
      (bf16/fp16 only; CPU tensors need TRITON_INTERPRET=1 set before Python starts),
      or "paper" (flashwatch/kernels/paper.py: the paper's public implementation, bit-identical to
      it run eagerly, forward and backward; everything in the input dtype, 512-key
      blocks; for research such as docs/REPRODUCTION.md, less accurate on purpose).
    attn_mask: as SDPA's, bool (True = attend) or an additive float mask, broadcastable
      to [B, H, Nq, Nk]; with causal both apply. Scores it hides (False, or -inf after
      adding) are never ties nor the max logit; a row with no visible key gives O = 0
      and zero gradients (SDPA's math backend does the same). A float mask that
      requires grad (a learned bias such as T5's) gets its gradient on the reference
      backend ("triton" and "paper": refused with NotInKernel, a RuntimeError).
      Triton reads it tile by tile through its broadcast strides (never materialised).
    softcap: Gemma2's attention-logit softcapping, s = softcap·tanh(s/softcap) on the
      scaled scores before the masks; ties and max logit are of the capped scores.
      Every backend but "paper" (ValueError).
    sliding_window: Mistral's and Gemma2's local attention: query i sees key j only if
      i - j < sliding_window (Hugging Face's sliding_window_overlay; top-left indices,
      like causal); with causal both apply, without it later keys stay visible. Hides
      like causal, after the softcap and together with attn_mask. Every backend; Triton
      skips key blocks outside the window and recompiles nothing for a new size.

    Inside a layer watched by `flashwatch.watch`, the watcher adds its head modes (the
    stronger of the two per head) and measures the call; beta and eps there are the
    watcher's WatchConfig values (a different beta or eps passed here is logged once).
    """
    # Dynamo cannot trace ContextVar.get (graph break), so compiled code skips the watcher
    # hook: a torch.compile'd call runs with the head modes it was given.
    intercept = None if torch.compiler.is_compiling() else INTERCEPT.get()
    if intercept is not None:
        return intercept(q, k, v, causal=causal, scale=scale, head_modes=head_modes,
                         beta=beta, eps=eps, stats=stats, backend=backend,
                         attn_mask=attn_mask, softcap=softcap,
                         sliding_window=sliding_window)
    return call_kernel(q, k, v, causal=causal, scale=scale, head_modes=head_modes, beta=beta,
                     eps=eps, stats=stats, backend=backend, attn_mask=attn_mask,
                     softcap=softcap, sliding_window=sliding_window)


def call_kernel(q, k, v, *, causal, scale, head_modes, beta, eps, stats, backend,
              o32_out: list | None = None, attn_mask=None, softcap=None,
              sliding_window=None, lse_out: list | None = None):
    """o32_out (the watcher's monitored calls): a list that receives the kernel's FP32 O,
    [H, B, Nq, D] when the kernel kept every head's (not the "paper" arithmetic).
    lse_out: a list that receives the log-sum-exp of the scaled scores, [B, H, Nq] FP32,
    natural log, +inf for a row that sees no key; it carries no gradient."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if torch.compiler.is_compiling():
        scale, _ = check_inputs(q, k, v, causal=causal, scale=scale, head_modes=None,
                                beta=beta, eps=eps, stats=stats, attn_mask=attn_mask,
                                softcap=softcap, sliding_window=sliding_window)
        modes = _traceable_head_modes(head_modes, q.shape[1])
    else:
        scale, modes = check_inputs(q, k, v, causal=causal, scale=scale,
                                    head_modes=head_modes, beta=beta, eps=eps, stats=stats,
                                    attn_mask=attn_mask, softcap=softcap,
                                    sliding_window=sliding_window)
    backend = _resolve_backend(backend, q, attn_mask)
    if backend == "paper" and softcap is not None:
        raise ValueError(f"softcap={softcap} is not supported by backend='paper' (the "
                         f"paper's code has no softcapping); use backend='reference'")
    o, _lse, _o32, tied, guarded, max_logit = torch.ops.flashwatch.attention_fwd(
        q, k, v, modes, causal, scale, float(beta), float(eps), stats is not None, backend,
        o32_out is not None, attn_mask, None if softcap is None else float(softcap),
        sliding_window)
    if o32_out is not None:
        o32_out.append(_o32)
    if lse_out is not None:
        lse_out.append(_lse)
    if stats is not None:
        stats.add_(tied, q.shape[0] * q.shape[2], guarded, max_logit.detach())
    return o
