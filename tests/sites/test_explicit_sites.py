"""flashwatch/sites/explicit.py: sites given by hand, as a dict of make_site arguments or a
list of AttentionSite, and the errors that explain a bad one."""

from __future__ import annotations

import pytest
import torch
from _helpers import capture_q_and_x
from torch import nn

from flashwatch.sites import AttentionSite, find_sites
from flashwatch.sites.explicit import make_site
from standins import TinyViTish


def test_explicit_sites_as_dict(monkeypatch):
    torch.manual_seed(0)
    model = TinyViTish()
    spec = dict(num_heads=4, q_module="qkv")  # fused [q | k | v]: Q is the first 32 channels
    sites = find_sites(model, sites={"blocks.0.attn": spec, "blocks.1.attn": spec})
    assert [(s.name, s.kind, s.num_heads, s.num_kv_heads, s.head_dim, s.d_model)
            for s in sites] == [("blocks.0.attn", "explicit", 4, 4, 8, 32),
                                ("blocks.1.attn", "explicit", 4, 4, 8, 32)]
    assert sites[0].q_module is model.blocks[0].attn.qkv
    xs, qs = capture_q_and_x(model, sites, monkeypatch, torch.randint(0, 64, (1, 5)))
    for site in sites:
        b = site.q_module.bias.detach()[:32].view(4, 1, 8)
        want = torch.einsum("btc,hdc->bhtd", xs[site.name], site.wq()) + b
        torch.testing.assert_close(qs[site.name], want, rtol=1e-5, atol=1e-5)


def test_explicit_sites_as_list_and_explicit_wq():
    torch.manual_seed(0)
    model = TinyViTish()
    qkv = model.blocks[1].attn.qkv
    sites = find_sites(model, sites=[
        make_site(model, "blocks.0.attn", num_heads=4, q_module="blocks.0.attn.qkv"),
        make_site(model, "blocks.1.attn", num_heads=2, head_dim=16, q_module=qkv,
                  wq=lambda: qkv.weight[:32].view(2, 16, 32)),
    ])
    assert [s.num_heads for s in sites] == [4, 2]
    assert sites[1].wq().shape == (2, 16, 32)
    # Without a q_module there is no X and nothing to check, but W^Q is still known.
    site = make_site(model, "blocks.0.attn", num_heads=4, wq=model.blocks[0].attn.qkv.weight[:32])
    assert site.q_module is None and site.q_slice_of_output is None
    assert find_sites(model, sites=[site])[0].wq().shape == (4, 8, 32)


BAD_SPECS = [
    # (sites, exception, words the message must contain)
    ({"blocks.9.attn": dict(num_heads=4, q_module="qkv")}, ValueError, ["blocks.9.attn"]),
    ({"blocks.0.attn": dict(num_heads=4, q_module="nope")}, ValueError, ["nope", "qkv"]),
    ({"blocks.0.attn": dict(num_heads=4, q="qkv")}, ValueError, ["'q'", "q_module"]),
    ({"blocks.0.attn": dict(num_heads=3, q_module="qkv")}, ValueError, ["32", "head_dim"]),
    ({"blocks.0.attn": dict(num_heads=4, q_module="qkv", q_slice_of_output=(0, 16))},
     ValueError, ["(0, 16)", "32"]),
    ({"blocks.0.attn": dict(num_heads=4, num_kv_heads=3, q_module="qkv")}, ValueError,
     ["num_kv_heads=3"]),
    ({"blocks.0.attn": dict(num_heads=4, q_module="blocks.0.norm")}, ValueError,
     ["LayerNorm", "wq="]),
    ({"blocks.0": dict(num_heads=4, q_module="attn.qkv"),
      "blocks.0.attn": dict(num_heads=4, q_module="qkv")}, ValueError, ["overlap"]),
    ({"blocks.0.attn": dict(num_heads=0, q_module="qkv")}, ValueError, ["num_heads", "0"]),
    ({"blocks.0.attn": dict(num_heads=4, q_module="qkv", wq="w")}, TypeError, ["wq", "str"]),
    ({"blocks.0.attn": 4}, TypeError, ["sites['blocks.0.attn']", "dict"]),
    (["blocks.0.attn"], TypeError, ["sites[0]", "AttentionSite"]),
    ("blocks.0.attn", TypeError, ["sites", "str"]),
    ({}, ValueError, ["empty"]),
]


@pytest.mark.parametrize("sites,exc,words", BAD_SPECS)
def test_bad_explicit_sites_are_explained(sites, exc, words):
    model = TinyViTish()
    with pytest.raises(exc) as err:
        find_sites(model, sites=sites)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_listed_site_must_belong_to_the_model():
    site = find_sites(TinyViTish(), sites={"blocks.0.attn": dict(num_heads=4, q_module="qkv")})[0]
    with pytest.raises(ValueError, match="not site.module"):
        find_sites(TinyViTish(), sites=[site])
    with pytest.raises(TypeError, match="nn.Module"):
        find_sites("model")
    with pytest.raises(ValueError, match="num_heads"):
        AttentionSite(name="x", module=nn.Linear(2, 2), num_heads=0, num_kv_heads=1,
                      head_dim=1, d_model=2, q_module=None, kind="explicit",
                      q_slice_of_output=None, wq_source=lambda: torch.zeros(1, 1, 2))


@pytest.mark.parametrize("num_heads,exc,text", [
    (0, ValueError, r"site 'blocks.0.attn': num_heads must be an int ≥ 1, got 0"),
    (4.0, TypeError, r"num_heads must be an int ≥ 1, got 4.0 \(float\)"),
    (True, TypeError, r"num_heads must be an int ≥ 1, got True \(bool\)"),
])
def test_a_head_count_is_a_positive_int_in_make_site_and_attention_site(num_heads, exc, text):
    with pytest.raises(exc, match=text):
        make_site(TinyViTish(), "blocks.0.attn", num_heads=num_heads, q_module="qkv")
    with pytest.raises(exc, match=r"AttentionSite 'x': head_dim must be an int ≥ 1, got "):
        AttentionSite(name="x", module=nn.Linear(2, 2), num_heads=1, num_kv_heads=1,
                      head_dim=num_heads, d_model=2, q_module=None, kind="explicit",
                      q_slice_of_output=None, wq_source=lambda: torch.zeros(1, 1, 2))
