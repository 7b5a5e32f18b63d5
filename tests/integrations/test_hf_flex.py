"""Hugging Face models loaded with attn_implementation="flex_attention" are watched as they
are: a tiny random-init Llama (GQA 4:2, rotary) on a right-padded batch, every head's
max logit and tied rows against an FP64 truth.

The truth is computed here from the q, k each flex_attention op call received (caught by
our own TorchFunctionMode, outside the watched layers' own), with the mask written from
the batch's attention_mask (causal, padded keys hidden) rather than read from
transformers' BlockMask; two checks tie it to what the model ran: transformers' mask_mod
(torch's create_mask) is that mask, and softmax(truth)·v in FP64 is the op's output.
Padded query rows are left out (flashwatch's Tokens reads the attention_mask the model's
forward receives). transformers' flex path has no backward on a CPU (torch raises), so
these forwards run under no_grad; docs/compatibility.md has the same model's row.
"""

from __future__ import annotations

import math

import pytest
import torch
from sdpa_calls import check_heads, head_truth, scores
from torch.overrides import TorchFunctionMode

from standins import hf_inputs, hf_tiny

pytest.importorskip("transformers")
flex_hop = pytest.importorskip("torch._higher_order_ops.flex_attention").flex_attention

from torch.nn.attention.flex_attention import create_mask  # noqa: E402

import flashwatch as fw  # noqa: E402
from flashwatch import Mode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
HOP_ARGS = ("query", "key", "value", "score_mod", "block_mask", "scale")


def flex_llama(recipe: str, sharpen: float = 1.0):
    """standins' "llama_flex": 2 layers, width 32, 4 heads on 2 KV heads; sharpen scales
    W^Q and W^K (logits of a few units instead of ~0.04)."""
    model, _ = hf_tiny("llama_flex")
    assert model.config._attn_implementation == "flex_attention"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharpen)
            layer.self_attn.k_proj.weight.mul_(sharpen)
    return model.to(torch.bfloat16) if recipe == "bf16" else model


class FlexCalls(TorchFunctionMode):
    """q, k, v, scale, mask_mod and output of every flex_attention op call that runs
    inside it (a call Dynamo traces is seen again when its graph runs: that one counts),
    q, k, v cast as the op casts them under autocast (Llama's rotary hands it FP32 q, k
    and a BF16 v)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is flex_hop and not torch.compiler.is_compiling():
            a = dict(zip(HOP_ARGS, args[:len(HOP_ARGS)], strict=True))
            a.update(kwargs)
            q, k, v = (a[n].detach() for n in ("query", "key", "value"))
            if torch.is_autocast_enabled(q.device.type):
                dt = torch.get_autocast_dtype(q.device.type)
                q, k, v = q.to(dt), k.to(dt), v.to(dt)
            self.calls.append(dict(q=q, k=k, v=v, scale=float(a["scale"]),
                                   mask_mod=a["block_mask"][-1], out=out[0].detach()))
        return out


def truth_calls(calls, real):
    """The calls as sdpa_calls reads them: a bool mask written from `real` [B, N] (keys at
    or before the query, padded keys hidden), checked against the model's own."""
    out = []
    for c in calls:
        B, H, N, _ = c["q"].shape
        mask = torch.ones(N, N, dtype=torch.bool).tril() & real[:, None, None, :]
        own = create_mask(c["mask_mod"], B, 1, N, N, device="cpu")
        assert torch.equal(own, mask), "transformers' flex mask is not causal + padding"
        call = dict(q=c["q"], k=c["k"], mask=mask, causal=False, scale=c["scale"])
        # the truth's scores are the kernel's: its output in FP64 from them
        p = torch.softmax(scores(call), -1)
        v = c["v"].double().repeat_interleave(H // c["v"].shape[1], 1)
        fp32 = c["out"].dtype == torch.float32  # else BF16: its rounding (seen: ≤ 1e-3)
        torch.testing.assert_close(c["out"].double(), p @ v, rtol=1e-5 if fp32 else 8e-3,
                                   atol=1e-6 if fp32 else 2e-3)
        out.append(call)
    return out


def _run(model, inputs, recipe):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "autocast")
    with torch.no_grad(), ctx:
        return model(**inputs)


@pytest.mark.parametrize("sharpen", [1.0, 10.0])
@pytest.mark.parametrize("recipe", ["fp32", "bf16", "autocast"])
def test_flex_llama_is_measured_exactly(recipe, sharpen):
    model = flex_llama(recipe, sharpen)
    inputs = hf_inputs("causal", B=2, N=12, padded=True)
    real = inputs["attention_mask"].bool()
    w = fw.watch(model, every_n_steps=1, rows_per_head="all")  # not refused
    with FlexCalls() as seen:
        _run(model, inputs, recipe)
    report = w.step()
    w.remove()
    assert report.monitor_errors_total == 0
    assert len(seen.calls) == 2 and all(c["q"].shape[1] == 4 and c["k"].shape[1] == 2
                                        for c in seen.calls)  # GQA as the op got it
    calls = truth_calls(seen.calls, real)
    check_heads(report, calls, LAYERS, real, rel=1e-4)
    # the padded rows change the truth: counting them would fail the check above
    assert any(not torch.equal(a, b) for c in calls
               for a, b in zip(head_truth(c, real)[:2], head_truth(c)[:2], strict=True))
    with pytest.raises(AssertionError):
        check_heads(report, calls, LAYERS, None, rel=1e-4)


def test_head_modes_run_on_a_flex_layer():
    """transformers hands flex_attention its own score_mod closure (softcap, float masks
    and position biases folded in; for Llama it returns the score unchanged: its fx
    trace is the identity, flex.score_kind), so FP32_O on a layer runs flashwatch's
    kernel with the padded causal mask as a dense mask: the same output, not listed
    unmitigable, still measured. QK-clip acts on the weights: it clips a flex layer."""
    model = flex_llama("fp32", 10.0)
    inputs = hf_inputs("causal", B=2, N=12, padded=True)
    base = _run(model, inputs, "fp32").logits
    w = fw.watch(model, every_n_steps=1, rows_per_head="all")
    w.set_head_modes(LAYERS[0], [Mode.FP32_O] * 4)
    moded = _run(model, inputs, "fp32").logits
    report = w.step()
    w.remove()
    # flashwatch's kernel against transformers' compiled flex, both FP32
    torch.testing.assert_close(moded, base, rtol=1e-4, atol=1e-5)
    assert report.unmitigable == {} and report.monitor_errors_total == 0
    assert [h.head_mode for h in report.heads if h.layer == LAYERS[0]] == [Mode.FP32_O] * 4
    assert all(math.isfinite(h.attention_max_logit) for h in report.heads)

    lowest = min(h.attention_max_logit for h in report.heads)
    w = fw.watch(model, every_n_steps=1, rows_per_head="all", mitigation="auto",
                 qk_clip_threshold=lowest / 2)
    reports = []
    for _ in range(2):
        _run(model, inputs, "fp32")
        reports.append(w.step())
    w.remove()
    assert reports[-1].qk_clips_total > 0
