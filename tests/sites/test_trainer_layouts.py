"""The trainers' layouts in flashwatch/sites/ (torchtitan.py, olmo_core.py, megatron.py),
on layout-faithful stand-ins: Megatron-core's `linear_qkv` per query group (its own
modules need Transformer Engine or make no SDPA call on a CPU), explicit sites naming
their K. torchtitan's and OLMo-core's own models are tested with the real packages in
tests/trainers/."""

from __future__ import annotations

import pytest
import torch
from _helpers import batch
from sdpa_calls import SdpaCalls, check_heads

import flashwatch as fw
from flashwatch.mitigation import qkclip
from flashwatch.sites import find_sites
from standins import LlamaConfig, TinyLlama, TinyMegatron


def _megatron_q_and_k(att, x):
    """q [s, b, H, D] and k [s, b, G, D] as the stand-in's forward computes them."""
    c = att.config
    r, D = c.num_attention_heads // c.num_query_groups, c.kv_channels
    mixed = att.linear_qkv(x).view(*x.shape[:2], -1, (r + 2) * D)
    q, k, _ = mixed.split([r * D, D, D], dim=-1)
    return q.reshape(*q.shape[:2], -1, D), k


def test_megatron_linear_qkv_is_found_per_query_group():
    """The site is the attention module, its W^Q the rows the layer computes q from
    (head g·r + j of group g), its K the group's k rows."""
    torch.manual_seed(0)
    model = TinyMegatron()
    sites = find_sites(model)
    assert [s.name for s in sites] == ["decoder.layers.0.self_attention",
                                       "decoder.layers.1.self_attention"]
    site = sites[0]
    assert (site.kind, site.layout, site.num_heads, site.num_kv_heads, site.head_dim) == (
        "fused_qkv", "per_group_qkv", 4, 2, 16)
    x = torch.randn(5, 2, 32, dtype=torch.float64)
    att = site.module.double()
    q, k = _megatron_q_and_k(att, x)
    bias = att.linear_qkv.bias
    q_from_site = torch.einsum("sbc,hdc->sbhd", x, site.wq()) + bias[site.q_index].view(4, 16)
    k_from_site = (x @ att.linear_qkv.weight[site.k_index].T + bias[site.k_index]).view(5, 2,
                                                                                         2, 16)
    torch.testing.assert_close(q_from_site, q, rtol=0, atol=1e-12)
    torch.testing.assert_close(k_from_site, k, rtol=0, atol=1e-12)


@pytest.mark.parametrize("autocast", [False, True])
def test_megatron_layout_is_measured_against_fp64(autocast):
    """Every head's max logit and ties against the FP64 scores of the q, k each SDPA
    call received, over two training steps; the Q check passes (no error)."""
    torch.manual_seed(0)
    model = TinyMegatron()
    w = fw.watch(model, every_n_steps=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = batch(g, B=2, T=12)
        with SdpaCalls() as calls, torch.autocast("cpu", dtype=torch.bfloat16,
                                                  enabled=autocast):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = w.step()
        check_heads(report, calls.calls, [s.name for s in w.sites], rel=1e-5)
    assert w.monitor_errors_total == 0
    w.remove()


def test_megatron_qk_clip_scales_each_heads_q_and_its_groups_k():
    torch.manual_seed(0)
    model = TinyMegatron()
    site = find_sites(model)[0]
    x = torch.randn(5, 2, 32)
    q0, k0 = (t.detach() for t in _megatron_q_and_k(site.module, x))
    eta = torch.tensor([0.25, 1.0, 1.0, 0.64], dtype=torch.float64)
    qkclip.scale_site(site, eta, alpha=0.5)
    q1, k1 = (t.detach() for t in _megatron_q_and_k(site.module, x))
    k_eta = qkclip.kv_factors(eta, 2)  # the smallest η of each group: 0.25, 0.64
    torch.testing.assert_close(q1, q0 * eta.sqrt().float().view(4, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k1, k0 * k_eta.sqrt().float().view(2, 1), rtol=1e-5,
                               atol=1e-6)


def test_an_explicit_site_that_names_its_k_can_be_clipped():
    """QK-clip needs W^K: an explicit site with k_module= gets it (before, every explicit
    site was refused); without it the refusal says how to name it."""
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig())
    spec = dict(num_heads=4, num_kv_heads=2, head_dim=16, q_module="q_proj")
    names = [f"model.layers.{i}.self_attn" for i in range(2)]
    with pytest.raises(ValueError, match="k_module='k_proj'"):
        fw.watch(model, sites={n: spec for n in names}, qk_clip_threshold=1.0)
    sites = find_sites(model, sites={n: dict(spec, k_module="k_proj") for n in names})
    att = sites[0].module
    assert att.k_proj is sites[0].k_module
    x = torch.randn(3, 32)
    k0 = att.k_proj(x).detach()
    eta = torch.tensor([0.25, 1.0, 1.0, 0.64], dtype=torch.float64)
    qkclip.check_site(sites[0])
    qkclip.scale_site(sites[0], eta, alpha=0.5)
    want = k0 * torch.tensor([0.5, 0.8]).repeat_interleave(16)
    torch.testing.assert_close(att.k_proj(x).detach(), want, rtol=1e-6, atol=1e-7)
    w = fw.watch(model, sites={n: dict(spec, k_module="k_proj") for n in names},
                 qk_clip_threshold=1.0)
    w.remove()


def test_a_pipeline_ranks_model_parts_keep_their_whole_model_names():
    """fw.watch(model_parts), as torchtitan's pipeline_llm returns them (each part a copy
    of the model with the other stages' layers deleted): names as in the whole model;
    two parts holding the same layer are refused by name."""
    import copy

    torch.manual_seed(0)
    model = TinyMegatron()
    parts = [copy.deepcopy(model), copy.deepcopy(model)]
    parts[0].decoder.layers[1] = torch.nn.Identity()  # the other stage's layer: gone
    parts[1].decoder.layers[0] = torch.nn.Identity()
    w = fw.watch(parts)
    assert [s.name for s in w.sites] == ["decoder.layers.0.self_attention",
                                         "decoder.layers.1.self_attention"]
    w.remove()
    with pytest.raises(ValueError, match="both named"):
        fw.watch([copy.deepcopy(model), copy.deepcopy(model)])
