"""flashwatch/kernels/common.py: input validation, Mode, AttentionStats."""

from __future__ import annotations

import math

import pytest
import torch

import flashwatch as fw
from flashwatch.kernels.common import AttentionStats, Mode, normalize_head_modes


def _qkv(B=1, H=2, N=5, D=16, dtype=torch.bfloat16):
    return [torch.randn(B, H, N, D).to(dtype) for _ in range(3)]


def _call(**overrides):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(overrides)
    return fw.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


BAD_CALLS = [
    # (overrides, exception, words the message must contain)
    (dict(q=torch.randn(2, 5, 16)), ValueError, ["q", "[B, H, N, D]", "[2, 5, 16]"]),
    (dict(k=[[1.0]]), TypeError, ["k", "torch.Tensor"]),
    (dict(v=torch.randn(1, 2, 5, 16, dtype=torch.float64)), TypeError, ["v", "float64"]),
    (dict(q=torch.randn(1, 2, 5, 16).to(torch.int32)), TypeError, ["q", "int32"]),
    (dict(q=torch.randn(1, 2, 5, 16)), TypeError, ["one dtype", "float32", "bfloat16"]),
    (dict(k=torch.randn(1, 4, 5, 16).bfloat16()), ValueError, ["head counts", "repeat"]),
    (dict(k=torch.randn(1, 2, 6, 16).bfloat16()), ValueError, ["same sequence length"]),
    (dict(q=torch.randn(2, 2, 5, 16).bfloat16()), ValueError, ["batch"]),
    (dict(v=torch.randn(1, 2, 5, 8).bfloat16()), ValueError, ["head dimension"]),
    (dict(q=torch.randn(1, 2, 0, 16).bfloat16()), ValueError, ["empty"]),
    (dict(head_modes=[0]), ValueError, ["head_modes", "1 entries", "2 heads"]),
    (dict(head_modes=[0, 7]), ValueError, ["head_modes", "7", "BETA=1"]),
    (dict(head_modes=[0, 1.0]), TypeError, ["head_modes", "1.0"]),
    (dict(head_modes=[0, True]), TypeError, ["head_modes[1]", "True (bool)", "Mode.BETA"]),
    (dict(head_modes=torch.tensor([0.0, 1.0])), TypeError, ["head_modes", "float32"]),
    (dict(head_modes=torch.zeros(2, 1, dtype=torch.int32)), ValueError, ["1-D"]),
    (dict(head_modes="beta"), TypeError, ["head_modes", "str"]),
    (dict(eps=0.0), ValueError, ["eps", "> 0"]),
    (dict(eps=-1e-3), ValueError, ["eps"]),
    (dict(eps=math.nan), ValueError, ["eps"]),
    (dict(beta=1.0), ValueError, ["beta", "> 1"]),
    (dict(beta="2"), TypeError, ["beta", "str"]),
    (dict(scale=0.0), ValueError, ["scale", "None"]),
    (dict(scale=math.inf), ValueError, ["scale"]),
    (dict(scale=True), TypeError, ["scale", "bool", "None"]),
    (dict(causal=1), TypeError, ["causal", "bool"]),
    (dict(stats=AttentionStats.zeros(3)), ValueError, ["stats", "3 heads", "zeros(2)"]),
    (dict(stats={"tied_rows": 0}), TypeError, ["stats", "AttentionStats"]),
    (dict(backend="cuda"), ValueError, ["backend", "'cuda'"]),
    (dict(attn_mask=torch.ones(5, 5, dtype=torch.int64)), TypeError, ["attn_mask", "int64"]),
    (dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError,
     ["attn_mask", "[5, 6]", "[1, 2, 5, 5]"]),
    (dict(attn_mask=torch.ones(3, 1, 5, 5, dtype=torch.bool)), ValueError, ["attn_mask"]),
    (dict(attn_mask=torch.zeros(5, 5, requires_grad=True), backend="paper"), RuntimeError,
     ["attn_mask", "paper", "detach"]),
    (dict(attn_mask=[[True]]), TypeError, ["attn_mask", "list"]),
    (dict(softcap=0.0), ValueError, ["softcap", "None"]),
    (dict(softcap="50"), TypeError, ["softcap", "str"]),
    (dict(sliding_window=0), ValueError, ["sliding_window", "got 0", "None"]),
    (dict(sliding_window=-4), ValueError, ["sliding_window", "-4", ">= 1"]),
    (dict(sliding_window=4.0), TypeError, ["sliding_window", "float", "4096"]),
    (dict(sliding_window=True), TypeError, ["sliding_window", "bool"]),
    (dict(softcap=5.0, backend="paper"), ValueError, ["softcap", "paper", "reference"]),
]


@pytest.mark.parametrize("overrides,exc,words", BAD_CALLS,
                         ids=[f"{i}-{next(iter(o))}" for i, (o, _, _) in enumerate(BAD_CALLS)])
def test_bad_inputs_raise_documented_errors(overrides, exc, words):
    with pytest.raises(exc) as info:
        _call(**overrides)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_devices_must_match():
    meta = torch.empty(1, 2, 5, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="one device"):
        _call(k=meta)


def test_reference_rejects_unknown_arithmetic():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="arithmetic"):
        fw.kernels.reference_attention(q, k, v, arithmetic="bf16")


def test_head_modes_accepts_enum_list_ints_and_tensors():
    want = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert torch.equal(normalize_head_modes([Mode.STANDARD, Mode.BETA, Mode.FP32_O], 3), want)
    assert torch.equal(normalize_head_modes((0, 1, 2), 3), want)
    assert torch.equal(normalize_head_modes(torch.tensor([0, 1, 2]), 3), want)
    assert torch.equal(normalize_head_modes(None, 3), torch.zeros(3, dtype=torch.int32))


def test_mode_values_are_stable():
    # Stored in checkpoints and in the kernels' mode tensors: never renumber.
    assert (Mode.STANDARD, Mode.BETA, Mode.FP32_O) == (0, 1, 2)


def test_attention_stats_zeros_and_tie_ratio():
    st = AttentionStats.zeros(2)
    assert st.num_heads == 2 and st.max_logit.isneginf().all()
    st.add_(torch.tensor([1, 3]), 4, torch.tensor([0, 1]), torch.tensor([2.0, math.nan]))
    assert st.tie_ratio().tolist() == [0.25, 0.75]
    assert st.guarded_rows.tolist() == [0, 1]
    assert math.isnan(st.max_logit[1].item())  # a NaN logit is reported, not hidden
    with pytest.raises(ValueError, match="num_heads"):
        AttentionStats.zeros(0)
