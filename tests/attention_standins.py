"""Stand-ins for the attention kernels torch 2.13 lacks on the CPU, for the tests of
FlexAttention and varlen calls (tests/monitor/test_flex.py, tests/trainers/test_torchtitan
_flex.py, tests/trainers/test_torchtitan_trainer_flex.py). Each is a context manager that
changes torch while inside and puts back what it changed on leaving, checked: the tests
after see torch unchanged.

  differentiable_flex()  torch's own math implementation of the flex_attention
                         higher-order op (math_attention, its CompositeExplicitAutograd
                         forward) as the op's Autograd kernel, so autograd records it and
                         a backward runs; flex_attention's refusal of CPU inputs that
                         require grad (_validate_device) is off.
  cpu_varlen()           CPU kernels for torch_attn::_varlen_attn and its backward
                         (torch's only kernel is CUDA flash attention): attention per
                         packed document in FP32, P rounded to the input's dtype before
                         P·V as flash attention does, the FP32 log-sum-exp; the backward
                         the gradients of that attention per document, by hand. Yields
                         the (query, key) of each forward call.

benchmarks/gpu_check.py (gpu_flex.py) runs the real kernels.
"""

from __future__ import annotations

import contextlib
import importlib
import math

import torch

VARLEN_OPS = ("_varlen_attn", "_varlen_attn_backward")


# ---------------------------------------------------------------------------- flex


@contextlib.contextmanager
def differentiable_flex():
    """flex_attention differentiable on the CPU while inside (module docstring)."""
    from torch._C import DispatchKey

    hop_mod = importlib.import_module("torch._higher_order_ops.flex_attention")
    api = importlib.import_module("torch.nn.attention.flex_attention")
    hop, key = hop_mod.flex_attention, DispatchKey.Autograd
    kernel, validate = hop.py_kernels[key], api._validate_device

    def autograd_kernel(*args):
        return hop_mod.math_attention(*args)

    hop.py_kernels[key] = autograd_kernel
    api._validate_device = lambda query, key, value: None
    hop._dispatch_cache.clear()  # the dispatcher caches the kernel of each key
    try:
        yield
    finally:
        hop.py_kernels[key] = kernel
        api._validate_device = validate
        hop._dispatch_cache.clear()
    assert hop.py_kernels[key] is kernel and api._validate_device is validate


# --------------------------------------------------------------------------- varlen


def band(nq, nk, window, causal=False):
    """[nq, nk] bool: the keys each query row of one document sees, flash attention's
    varlen convention: queries and keys aligned at the document's end; window (left,
    right) with -1 unbounded, causal as right = 0."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    off = (torch.arange(nk) - nk)[None, :] - (torch.arange(nq) - nq)[:, None]  # key - query
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if right >= 0:
        ok &= off <= right
    if left >= 0:
        ok &= off >= -left
    return ok


def _documents(cu_q, cu_k):
    """(q0, q1, k0, k1) of each packed document."""
    cu_k = cu_q if cu_k is None else cu_k
    return [(int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1]))
            for i in range(cu_q.numel() - 1)]


def _heads(x, n_heads):
    """[T, H_kv, D] as FP32 [H, T, D], K/V heads repeated for grouped-query attention."""
    x = x.float().transpose(0, 1)
    return x.repeat_interleave(n_heads // x.shape[0], 0) if x.shape[0] != n_heads else x


def _scores(q, k, q0, q1, k0, k1, scale, window, causal):
    """FP32 [H, nq, nk] scaled scores of one document, hidden keys at -inf."""
    H = q.shape[1]
    s = _heads(q[q0:q1], H) @ _heads(k[k0:k1], H).transpose(-1, -2)
    s = s * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    return s.masked_fill(~band(q1 - q0, k1 - k0, window, causal), -math.inf)


def varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                   scale=None, window_size=None, enable_gqa=False, seqused_k=None,
                   block_table=None, num_splits=None):
    """torch_attn::_varlen_attn on the CPU: (out [T, H, Dv] in the query's dtype,
    log-sum-exp [H, T] FP32, the rng state of no dropout), the op's fake shapes."""
    assert seqused_k is None and block_table is None  # a training call
    H = query.shape[1]
    out = query.new_zeros(query.shape[0], H, value.shape[-1])
    lse = torch.full((H, query.shape[0]), -math.inf)
    for q0, q1, k0, k1 in _documents(cu_seq_q, cu_seq_k):
        s = _scores(query, key, q0, q1, k0, k1, scale, window_size, is_causal)
        lse[:, q0:q1] = s.logsumexp(-1)
        p = s.softmax(-1).nan_to_num(0.0).to(value.dtype).float()  # rows that see no key: 0
        out[q0:q1] = (p @ _heads(value[k0:k1], H)).transpose(0, 1).to(out.dtype)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q,
                    max_k, is_causal, rng_state, scale=None, window_size=None):
    """torch_attn::_varlen_attn_backward on the CPU: dq, dk, dv of the attention per
    document (softmax of FP32 scores), by hand in FP32; K/V heads' gradients summed over
    the query heads that share them."""
    H, H_kv = query.shape[1], key.shape[1]
    sc = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    dq, dk, dv = (torch.zeros(t.shape) for t in (query, key, value))
    for q0, q1, k0, k1 in _documents(cu_seq_q, cu_seq_k):
        q, k, v = _heads(query[q0:q1], H), _heads(key[k0:k1], H), _heads(value[k0:k1], H)
        go = _heads(grad_out[q0:q1], H)
        p = _scores(query, key, q0, q1, k0, k1, scale, window_size, is_causal).softmax(-1)
        p = p.nan_to_num(0.0)
        dp = go @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * sc
        dq[q0:q1] = (ds @ k).transpose(0, 1)
        # [H, nk, D] -> [nk, H_kv, D]: the query heads of a K/V group summed
        dk[k0:k1] = (ds.transpose(-1, -2) @ q).unflatten(0, (H_kv, -1)).sum(1).transpose(0, 1)
        dv[k0:k1] = (p.transpose(-1, -2) @ go).unflatten(0, (H_kv, -1)).sum(1).transpose(0, 1)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _cpu_kernel(op):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_attn::{op}", "CPU")


@contextlib.contextmanager
def cpu_varlen():
    """varlen_forward and varlen_backward as the CPU kernels of torch_attn's ops while
    inside, in a library of their own destroyed on leaving; yields the list of (query,
    key) each forward call received."""
    import torch.nn.attention.varlen  # noqa: F401  (defines the ops)

    assert not any(map(_cpu_kernel, VARLEN_OPS))  # torch has none: the stand-ins are the only
    seen = []

    def forward(query, key, *args, **kwargs):
        seen.append((query, key))
        return varlen_forward(query, key, *args, **kwargs)

    lib = torch.library.Library("torch_attn", "IMPL")
    try:
        lib.impl("_varlen_attn", forward, "CPU")
        lib.impl("_varlen_attn_backward", varlen_backward, "CPU")
        yield seen
    finally:
        lib._destroy()
    assert not any(map(_cpu_kernel, VARLEN_OPS))
