"""flashwatch/dispatch.py: the public op `flashwatch.attention` and its backend dispatch."""

from __future__ import annotations

import pytest
import torch

import flashwatch as fw
from flashwatch.kernels import reference as R


def _qkv(shape=(2, 3, 40, 32), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]


def test_auto_on_cpu_is_the_reference_bit_for_bit():
    q, k, v = _qkv()
    modes = [fw.Mode.STANDARD, fw.Mode.BETA, fw.Mode.FP32_O]
    a = fw.attention(q, k, v, causal=True, head_modes=modes)
    b = R.attention(q, k, v, causal=True, head_modes=modes)
    assert torch.equal(a, b)


def test_triton_backend_rejects_what_it_cannot_run_with_a_clear_error():
    # (CPU without TRITON_INTERPRET=1: tests/test_triton_attention.py, in a subprocess)
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match="backend='reference'"):
        fw.attention(q, k, v, backend="triton")


def test_matches_sdpa_layout_and_accepts_non_contiguous_inputs():
    # Models often hold [B, N, H, D] and transpose(1, 2) into SDPA: no copy required.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 40, 3, 32, generator=g).bfloat16().transpose(1, 2)
               for _ in range(3))
    assert not q.is_contiguous()
    out = fw.attention(q, k, v, causal=True)
    want = fw.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, want)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True)
    assert (out.double() - sdpa).abs().max() < 2e-2


def test_gradients_flow_to_every_input_and_stats_fill():
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    stats = fw.AttentionStats.zeros(3)
    o = fw.attention(q, k, v, stats=stats)
    o.float().square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.dtype == torch.bfloat16
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    assert stats.rows.tolist() == [80, 80, 80]
    assert torch.isfinite(stats.max_logit).all()


def test_no_grad_and_inference_mode():
    q, k, v = _qkv()
    with torch.inference_mode():
        a = fw.attention(q, k, v)
    assert torch.equal(a, fw.attention(q, k, v))


def test_user_autocast_does_not_change_the_fp32_math():
    # Under CPU autocast an FP32 matmul runs in BF16; the op's FP32 scores and
    # accumulator must not (seen: 0.2 off before the op turned autocast off).
    q, k, v = (t.float() * 3 for t in _qkv())
    want = fw.attention(q, k, v, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fw.attention(q, k, v, causal=True)
    assert torch.equal(got, want)
