"""The attention op registered with torch.library, so torch.compile sees one opaque op.

    torch.ops.flashwatch.attention_fwd(q, k, v, modes, causal, scale, beta, eps,
                                       want_stats, backend, keep_o32=False,
                                       attn_mask=None, softcap=None,
                                       sliding_window=None)
        -> (o, lse, o32, tied_rows[H], guarded_rows[H], max_logit[H])
    torch.ops.flashwatch.attention_bwd(do, q, k, v, o, o32, lse, modes, causal, scale,
                                       backend, attn_mask=None, softcap=None,
                                       mask_grad=False, sliding_window=None)
        -> (dq, dk, dv, dmask)

attn_mask (bool or additive float, broadcastable to [B, H, Nq, Nk]) and softcap run on
every backend (softcap: not "paper"), and so does sliding_window (an int); the Triton
kernels read the mask through its broadcast strides, never materialised. A float mask
that requires grad gets one on the reference backend: attention_bwd(..., mask_grad=True)
returns it as a 4th output (empty otherwise); "triton" and "paper" refuse it
(`flashwatch.attention` before calling).

`backend` is "triton" (flashwatch/kernels/triton_attention.py: CUDA, or CPU under
TRITON_INTERPRET=1), "reference" (flashwatch/kernels/reference.py, any device) or "paper"
(flashwatch/kernels/paper.py: the paper implementation's BF16 arithmetic, for research); the caller
resolves "auto" (CUDA → Triton, CPU → reference) before calling, so one registered
implementation serves every device. `modes` is an int tensor [H] of Mode values, read
on the host (it normally lives on the CPU; see `flashwatch.attention`).

o32 is the FP32 copy of O for the FP32_O heads, laid out [H32, B, Nq, D] in head order;
with keep_o32 (the watcher's monitored calls) it holds every head (H32 = H), so the
watcher gets c[T] on every row from the residual O - O_fp32 (docs/design.md §5); the backward
uses the FP32_O heads' rows of it (the Triton kernels in place, the reference a gather).
O, dQ, dK and dV come back in the layout of q, k, v (`common.empty_out`): a model that
transposes [B, N, H, D] into [B, H, N, D] transposes them back without a copy.
H32 depends on the values in `modes`, so the fake implementation gives it an unbacked
size: tracing does not specialise on the modes and changing them recompiles nothing.

Only torch is imported at module level; the Triton module is imported on first use.
"""

from __future__ import annotations

import torch

from . import reference
from .common import Mode, empty_out, normalize_head_modes

OP_BACKENDS = ("reference", "triton", "paper")


def _check_backend(backend: str) -> None:
    if backend not in OP_BACKENDS:
        raise ValueError(f"backend must be one of {OP_BACKENDS} here, got {backend!r}")


def _host_modes(modes: torch.Tensor, num_heads: int) -> torch.Tensor:
    # Value check here, not in the caller: under torch.compile the caller cannot look at
    # tensor values without a graph break, but this runs eagerly in both cases.
    return normalize_head_modes(modes, num_heads)


def _arithmetic(backend: str) -> str:
    # backend="reference" and "paper" both run flashwatch/kernels/reference.py, which chooses the
    # arithmetic for the forward and the backward alike.
    return "paper" if backend == "paper" else "fused"


def _like(t: torch.Tensor, layout_of: torch.Tensor) -> torch.Tensor:
    """t with the strides of `empty_out(layout_of)` (what the fake implementation says)."""
    out = empty_out(layout_of, t.dtype)
    return t if t.stride() == out.stride() else out.copy_(t)


@torch.library.custom_op("flashwatch::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor,
                  causal: bool, scale: float, beta: float, eps: float, want_stats: bool,
                  backend: str, keep_o32: bool = False, attn_mask: torch.Tensor | None = None,
                  softcap: float | None = None, sliding_window: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor]:
    _check_backend(backend)
    B, H, Nq, D = q.shape
    modes = _host_modes(modes, H)
    if backend == "triton":
        from . import triton_attention

        return triton_attention.forward(q, k, v, modes, causal=causal, scale=scale,
                                        beta=beta, eps=eps, want_stats=want_stats,
                                        keep_o32=keep_o32, attn_mask=attn_mask,
                                        softcap=softcap, window=sliding_window)
    res = reference.forward(q, k, v, causal=causal, scale=scale, modes=modes, beta=beta,
                            eps=eps, want_ties=want_stats, arithmetic=_arithmetic(backend),
                            keep_o32=keep_o32, attn_mask=attn_mask, softcap=softcap,
                            window=sliding_window)
    if res.o32 is None:
        o32 = torch.empty(0, B, Nq, D, dtype=torch.float32, device=q.device)
    else:
        o32 = res.o32.permute(1, 0, 2, 3).contiguous()
    return _like(res.o, q), res.lse, o32, res.tied_rows, res.guarded_rows, res.max_logit


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, modes, causal, scale, beta, eps, want_stats, backend,
                        keep_o32=False, attn_mask=None, softcap=None, sliding_window=None):
    B, H, Nq, D = q.shape
    n32 = torch.library.get_ctx().new_dynamic_size()
    return (empty_out(q),
            q.new_empty((B, H, Nq), dtype=torch.float32),
            q.new_empty((n32, B, Nq, D), dtype=torch.float32),
            q.new_empty((H,), dtype=torch.int64),
            q.new_empty((H,), dtype=torch.int64),
            q.new_empty((H,), dtype=torch.float32))


@torch.library.custom_op("flashwatch::attention_bwd", mutates_args=())
def attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  o: torch.Tensor, o32: torch.Tensor, lse: torch.Tensor, modes: torch.Tensor,
                  causal: bool, scale: float, backend: str,
                  attn_mask: torch.Tensor | None = None, softcap: float | None = None,
                  mask_grad: bool = False, sliding_window: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_backend(backend)
    modes = _host_modes(modes, q.shape[1])
    if backend == "triton":
        if mask_grad:
            raise RuntimeError("backend='triton' gives attn_mask no gradient, and this mask "
                               "requires grad; use backend='reference' or attn_mask.detach()")
        # o32 may hold every head (keep_o32): the kernel reads the FP32_O heads' rows in
        # place, no gather (a boolean index is a host sync on CUDA).
        from . import triton_attention

        return (*triton_attention.backward(do, q, k, v, o, o32, lse, modes, causal=causal,
                                           scale=scale, attn_mask=attn_mask,
                                           softcap=softcap, window=sliding_window),
                q.new_empty(0))
    if o32.shape[0] == q.shape[1]:  # keep_o32: every head's FP32 O; δ wants FP32_O heads'
        o32 = o32[(modes == int(Mode.FP32_O)).to(o32.device)]
    o32_bh = o32.permute(1, 0, 2, 3) if o32.shape[0] else None
    dmask = [] if mask_grad else None
    dq, dk, dv, _ = reference.backward(do, q, k, v, o, o32_bh, lse, causal=causal,
                                       scale=scale, modes=modes,
                                       arithmetic=_arithmetic(backend),
                                       attn_mask=attn_mask, softcap=softcap, dmask_out=dmask,
                                       window=sliding_window)
    dmask = dmask[0].contiguous() if dmask else q.new_empty(0)
    return _like(dq, q), _like(dk, k), _like(dv, v), dmask


@attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, o32, lse, modes, causal, scale, backend,
                        attn_mask=None, softcap=None, mask_grad=False, sliding_window=None):
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else q.new_empty(0)
    return empty_out(q), empty_out(k), empty_out(v), dmask


def _setup_context(ctx, inputs, output):
    (q, k, v, modes, causal, scale, _beta, _eps, _want_stats, backend, _keep, attn_mask,
     softcap, window) = inputs
    o, lse, o32, _tied, _guarded, max_logit = output
    # Side outputs carry no gradient; without this, copying max_logit into an
    # AttentionStats would pull the stats tensor into the autograd graph.
    ctx.mark_non_differentiable(lse, o32, max_logit)
    ctx.save_for_backward(q, k, v, o, lse, o32, modes, attn_mask)
    ctx.causal, ctx.scale, ctx.backend, ctx.softcap = causal, scale, backend, softcap
    ctx.window = window
    # A float mask that requires grad (a learned bias, e.g. T5's) gets dS summed to its
    # shape (reference only: the paper arithmetic refuses in its backward).
    ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad


def _backward(ctx, do, _dlse, _do32, _dtied, _dguarded, _dmax):
    # Only o is differentiable; lse, o32 and the counters are side outputs. dO goes in
    # with its own strides (a transposing model's dO is a strided view): every backend
    # takes any strides, the Triton kernels copy only if the last dim is not contiguous.
    q, k, v, o, lse, o32, modes, attn_mask = ctx.saved_tensors
    dq, dk, dv, dmask = attention_bwd(do, q, k, v, o, o32, lse, modes, ctx.causal,
                                      ctx.scale, ctx.backend, attn_mask, ctx.softcap,
                                      ctx.mask_grad, ctx.window)
    dmask = dmask if ctx.mask_grad else None
    return dq, dk, dv, None, None, None, None, None, None, None, None, dmask, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
