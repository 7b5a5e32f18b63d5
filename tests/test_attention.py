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


def test_paper_backend_is_the_reference_in_paper_arithmetic_forward_and_backward():
    # backend="paper" must run exactly reference.attention(arithmetic="paper"), with its
    # 512-key backward blocks, and must differ from the fused arithmetic in BF16.
    modes = [fw.Mode.STANDARD, fw.Mode.BETA, fw.Mode.FP32_O]
    outs, grads, ties = [], [], []
    for which in ("paper-backend", "paper-reference", "fused"):
        q, k, v = (t.requires_grad_() for t in _qkv(shape=(2, 3, 600, 32), seed=3))
        st = fw.AttentionStats.zeros(3)
        if which == "paper-backend":
            o = fw.attention(q, k, v, causal=True, head_modes=modes, stats=st, backend="paper")
        elif which == "paper-reference":
            o = R.attention(q, k, v, causal=True, head_modes=modes, stats=st,
                            arithmetic="paper")
        else:
            o = fw.attention(q, k, v, causal=True, head_modes=modes, stats=st)
        o.float().square().sum().backward()
        outs.append(o)
        grads.append([q.grad, k.grad, v.grad])
        ties.append(st.tied_rows)
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(ties[0], ties[1])
    assert not torch.equal(outs[0][:, 0], outs[2][:, 0])  # STANDARD heads: other arithmetic


def test_watch_config_routes_to_the_paper_backend():
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, position_embedding=False))
    x = torch.randint(0, 256, (2, 64))
    outs = {}
    for backend in ("paper", "reference"):
        with fw.watch(model, backend=backend, route_all=True, mitigation="off"), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            outs[backend] = model(x)[0]
    q, k, v = (torch.randn(2, 4, 64, 16).bfloat16() for _ in range(3))
    direct = R.attention(q, k, v, causal=True, arithmetic="paper")
    assert torch.equal(fw.attention(q, k, v, causal=True, backend="paper"), direct)
    assert not torch.equal(outs["paper"], outs["reference"])  # the watcher used it
