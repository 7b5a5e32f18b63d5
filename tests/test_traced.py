"""flashwatch/traced.py: the probe ops, their registry and the layer's Interceptor.
The compiled recipes that use them are in tests/test_compile.py."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import traced


def _qkv(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 8, 4, generator=g, dtype=dtype) for _ in range(3)]


def test_the_ops_pass_schema_fake_and_autograd_checks():
    q, k, v = _qkv()
    out = torch.randn(2, 2, 8, 4, requires_grad=True)
    key = torch.tensor(10**9)  # registered to no watcher: the ops only copy
    torch.library.opcheck(traced.probe, (q, k, v, out, None, None, key, True, None))
    torch.library.opcheck(traced.probe_grad, (torch.randn(2, 2, 8, 4), key, torch.tensor(-1)))


def test_an_unknown_key_copies_and_passes_the_gradient_through():
    q, k, v = _qkv()
    out = torch.randn(2, 2, 8, 4, requires_grad=True)
    got, call = traced.probe(q, k, v, out, None, None, torch.tensor(10**9), True, None)
    assert torch.equal(got, out) and got.data_ptr() != out.data_ptr() and int(call) == -1
    g = torch.randn_like(out)
    got.backward(g)
    assert torch.equal(out.grad, g)


def test_the_registry_forgets_removed_and_collected_watchers():
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32))
    w = fw.watch(model)
    keys = [st.compiled.key for st in w.layer_states]
    assert len(set(keys)) == 2 and all(traced._lookup(k)[0] is w.recorder for k in keys)
    w.remove()
    assert all(k not in traced._SITES for k in keys)
    w2 = fw.watch(model)  # the model's layers hold it: collected with the model
    keys2 = [st.compiled.key for st in w2.layer_states]
    assert not set(keys2) & set(keys)  # keys are never reused
    del w, w2, model  # w (removed) still held the layers, hence w2
    gc.collect()
    assert all(k not in traced._SITES for k in keys2)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(8, 8))
        self.other = nn.Linear(8, 8)


def test_q_path_finds_a_linear_inside_the_module_only():
    m = _Attn()
    assert traced.q_path(m, m.proj[0]) == "proj.0"
    assert traced.q_path(m.proj[0], m.proj[0]) == ""
    assert traced.q_path(m, nn.Linear(8, 8)) is None  # not inside
    assert traced.q_path(m, m.proj) is None  # not an nn.Linear
    assert traced.q_path(m, None) is None


def test_sdpa_args_by_name_whatever_was_positional():
    q, k, v = _qkv()
    a = traced.sdpa_args((q, k, v, None, 0.0, True), {"scale": 0.5})
    assert a["query"] is q and a["value"] is v and a["is_causal"] is True
    assert a["scale"] == 0.5 and "enable_gqa" not in a


def test_autocast_qkv_gives_what_sdpa_computes_with():
    q, k, _ = _qkv()
    v = torch.randn(2, 2, 8, 4).bfloat16()  # a rotary model under autocast: FP32 q, k
    assert [t.dtype for t in traced.autocast_qkv(q, k, v)] == [torch.float32,
                                                               torch.float32,
                                                               torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = traced.autocast_qkv(q, k, v)
    assert [t.dtype for t in got] == [torch.bfloat16] * 3
    assert torch.equal(got[0], q.bfloat16())


def test_the_interceptor_keeps_x_of_the_q_weight_and_probes_each_sdpa_call(monkeypatch):
    seen = []
    monkeypatch.setattr(traced, "probe", lambda q, k, v, out, x, mask, key, causal, scale:
                        seen.append((x, mask, int(key), causal, scale)) or (out, None))
    lin, other = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 8, 4)
    q, k, v = _qkv()
    with traced.Interceptor(torch.tensor(7), lin.weight):
        other(x + 1)  # another Linear: not X
        lin(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(seen) == 1
    got_x, mask, key, causal, scale = seen[0]
    assert got_x is x and mask is None and key == 7 and causal is True and scale is None
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("wq", [None, "other"])
def test_the_interceptor_without_a_matching_q_weight_hands_no_x(monkeypatch, wq):
    seen = []
    monkeypatch.setattr(traced, "probe",
                        lambda q, k, v, out, x, *rest: seen.append(x) or (out, None))
    lin = nn.Linear(4, 4)
    q, k, v = _qkv()
    with traced.Interceptor(torch.tensor(0), None if wq is None else nn.Linear(4, 4).weight):
        lin(torch.randn(2, 8, 4))
        F.scaled_dot_product_attention(q, k, v)
    assert seen == [None]
