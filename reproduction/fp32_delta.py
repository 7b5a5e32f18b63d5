"""Paper-arithmetic attention whose backward can take δ from an FP32 O: the paper's
diagnosis, with the forward left exactly as it was.

`Fp32DeltaAttention` runs the forward in the paper arithmetic (the same
`reference.forward` as backend="paper") and, when `fp32_delta` is set at backward time,
uses δ = rowsum(dO ∘ O_fp32) with O_fp32 a fused FP32 recomputation; otherwise the
backward is exactly backend="paper"'s. `RouteSDPA` sends the model's causal
F.scaled_dot_product_attention calls to it. Used by reproduction.run (arm "fp32_delta")
and reproduction.grad_error.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from flashwatch.kernels import reference
from flashwatch.kernels.common import Mode


class Fp32DeltaAttention(torch.autograd.Function):
    fp32_delta = False  # read at backward time
    record_ties = False  # append each call's tied-rowmax ratio [H] to `tied`
    tied: list = []

    @staticmethod
    def forward(ctx, q, k, v):
        H, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        std = torch.zeros(H, dtype=torch.int32)
        res = reference.forward(q, k, v, causal=True, scale=scale, modes=std, beta=2.0,
                                eps=1e-3, arithmetic="paper")
        hp = reference.forward(q.float(), k.float(), v.float(), causal=True, scale=scale,
                               modes=std, beta=2.0, eps=1e-3, want_ties=False)
        if Fp32DeltaAttention.record_ties:
            Fp32DeltaAttention.tied.append(res.tied_rows.double() / res.rows)
        ctx.save_for_backward(q, k, v, res.o, res.lse, hp.o)
        ctx.scale = scale
        return res.o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, o32 = ctx.saved_tensors
        H = q.shape[1]
        if Fp32DeltaAttention.fp32_delta:
            modes, o32_arg = torch.full((H,), int(Mode.FP32_O), dtype=torch.int32), o32
        else:
            modes, o32_arg = torch.zeros(H, dtype=torch.int32), None
        dq, dk, dv, _ = reference.backward(do, q, k, v, o, o32_arg, lse, causal=True,
                                           scale=ctx.scale, modes=modes,
                                           block_n=reference.PAPER_BLOCK_N)
        return dq, dk, dv


class RouteSDPA(TorchFunctionMode):
    """Inside this mode, causal SDPA calls (no mask, no dropout) run Fp32DeltaAttention."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("attn_mask", "dropout_p", "is_causal")
            extra = dict(zip(names, args[3:], strict=False)) | kwargs
            if not extra.get("is_causal") or extra.get("attn_mask") is not None or \
                    extra.get("dropout_p", 0.0):
                raise ValueError(f"RouteSDPA handles causal attention without mask or "
                                 f"dropout only, got {extra}")
            return Fp32DeltaAttention.apply(*args[:3])
        return func(*args, **kwargs)
