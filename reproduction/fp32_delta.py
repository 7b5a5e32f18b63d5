"""Paper-arithmetic attention whose backward can take δ from an FP32 O: the paper's
diagnosis, with the forward left exactly as it was.

`Fp32DeltaAttention` runs backend="paper"'s forward with every head in Mode.FP32_O, whose
BF16 O and LSE are bit-identical to STANDARD's and which also keeps the forward's
accumulation in FP32 (flashwatch/kernels/paper.py). When `fp32_delta` is set at backward time the
backward is the paper backend's FP32_O one (δ = rowsum(dO ∘ O_fp32), dS formed in FP32
and rounded once); otherwise it is exactly backend="paper"'s STANDARD backward.
`RouteSDPA` sends the model's causal F.scaled_dot_product_attention calls to it. Used by
reproduction.run (arm "fp32_delta") and reproduction.grad_error. It is not simply
`head_modes=FP32_O`: the two arms switch only δ at backward time, on one forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from flashwatch.kernels import paper
from flashwatch.kernels.common import Mode


class Fp32DeltaAttention(torch.autograd.Function):
    fp32_delta = False  # read at backward time
    record_ties = False  # append each call's tied-rowmax ratio [H] to `tied`
    tied: list = []
    record_c = False  # append each BF16-δ backward's Σ_T c[T] per head [H] (FP64) to `c_sums`
    c_sums: list = []
    record_rows = False  # append each BF16-δ backward's (q, k, dO, O, O_fp32) to `rows`
    rows: list = []

    @staticmethod
    def forward(ctx, q, k, v):
        H, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        fp32_o = torch.full((H,), int(Mode.FP32_O), dtype=torch.int32)
        res = paper.forward(q, k, v, causal=True, scale=scale, modes=fp32_o, beta=2.0,
                            eps=1e-3)
        if Fp32DeltaAttention.record_ties:
            Fp32DeltaAttention.tied.append(res.tied_rows.double() / res.rows)
        ctx.save_for_backward(q, k, v, res.o, res.lse, res.o32)
        ctx.scale = scale
        return res.o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, o32 = ctx.saved_tensors
        mode = Mode.FP32_O if Fp32DeltaAttention.fp32_delta else Mode.STANDARD
        if Fp32DeltaAttention.record_rows and mode == Mode.STANDARD:
            Fp32DeltaAttention.rows.append((q, k, do, o, o32))
        if Fp32DeltaAttention.record_c and mode == Mode.STANDARD:
            # c[T] = rowsum(dO ∘ O) − rowsum(dO ∘ O_fp32) on every row, summed per head
            c = (do.double() * (o.double() - o32.double())).sum(-1)
            Fp32DeltaAttention.c_sums.append(c.sum((0, 2)))
        modes = torch.full((q.shape[1],), int(mode), dtype=torch.int32)
        dq, dk, dv, _ = paper.backward(do, q, k, v, o, lse, o32 if mode == Mode.FP32_O else None,
                                       causal=True, scale=ctx.scale, modes=modes)
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
