"""What a model hands F.scaled_dot_product_attention, for oracles computed in the tests,
and the FP64 truth of a report's per-head max logit and tied rows from it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import flashwatch as fw

EPS = fw.WatchConfig().eps


class SdpaCalls(TorchFunctionMode):
    """q, k, mask, causal flag and scale of every SDPA call made inside it, as the model
    passed them (q and k cast as autocast casts SDPA's inputs)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            if torch.is_autocast_enabled(q.device.type):
                dt = torch.get_autocast_dtype(q.device.type)
                q, k = q.to(dt), k.to(dt)
            self.calls.append(dict(q=q.detach(), k=k.detach(), mask=kwargs.get("attn_mask"),
                                   causal=kwargs.get("is_causal", False),
                                   scale=kwargs.get("scale")))
        return func(*args, **kwargs)


def scores(call) -> torch.Tensor:
    """The call's scaled scores in FP64, [B, H, Nq, Nk], hidden keys at -inf (bool masks,
    causal, float masks at or below -1e30 as Hugging Face fills them)."""
    q, k = call["q"].double(), call["k"].double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q @ k.transpose(-1, -2)) * (call["scale"] or 1 / math.sqrt(q.shape[-1]))
    n, m = s.shape[-2:]
    if call["causal"]:
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), -math.inf)
    mask = call["mask"]
    if mask is not None:
        s = (s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool
             else s + mask.double().masked_fill(mask <= -1e30, -math.inf))
    return s


def head_truth(call, real=None):
    """FP64 per head over the call's query rows (real [B, Nq] bool: those only): tied
    rows (a second visible score within EPS of a finite row max), the max score, and the
    number of rows counted."""
    s = scores(call)
    mx = s.amax(-1, keepdim=True)
    tied = ((s >= mx - EPS).sum(-1) >= 2) & torch.isfinite(mx[..., 0])
    if real is not None:
        tied = tied & real[:, None]
        mx = mx.masked_fill(~real[:, None, :, None], -math.inf)
    return tied.sum((0, 2)), mx.amax((0, 2, 3)), (s.shape[0] * s.shape[2] if real is None
                                                  else int(real.sum()))


def check_heads(report, calls, layers, real=None, rel=1e-6):
    """The report holds exactly the heads of `layers` (layers[i] made calls[i]), each
    with the FP64 truth's max logit (within rel) and tied rows (exactly)."""
    by = {(h.layer, h.head): h for h in report.heads}
    want = []
    for name, call in zip(layers, calls, strict=True):
        tied, mx, rows = head_truth(call, real)
        for h in range(len(tied)):
            want.append((name, h))
            rec = by[(name, h)]
            assert rec.attention_max_logit == pytest.approx(float(mx[h]), rel=rel, abs=1e-6), (
                name, h)
            assert round(rec.tied_rowmax_ratio * rows) == int(tied[h]), (name, h)
    assert sorted(by) == sorted(want)
