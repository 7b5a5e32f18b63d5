"""flashwatch/sites/layouts.py and the fused/gated discovery in flashwatch/sites/site.py, on tiny
Hugging Face models built from their config classes (random init, no download).

The truth is read outside flashwatch: q as the model hands it to SDPA (or to its q
norm, for QK-norm models), captured by our own hooks, against X at the projection."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flashwatch as fw
from flashwatch.sites import find_sites, make_site
from flashwatch.sites.layouts import LAYOUTS, QCheck, k_index, q_index
from standins import hf_inputs, hf_tiny

FUSED = ["gpt_neox", "falcon", "falcon_mq", "falcon_new", "phi3", "qwen3_next"]
LAYOUT_OF = {"gpt_neox": "per_head_qkv", "falcon": "per_head_qkv", "falcon_mq": "q",
             "falcon_new": "per_group_qkv", "phi3": "q", "qwen3_next": "per_head_q_gate"}


def capture(model, sites, inputs, monkeypatch):
    """Per site: (X at q_module's input, q at SDPA [B, H, N, D], q norm's input or None)
    of the first call, from hooks that are not flashwatch's."""
    current, got, handles = [None], {}, []
    real = F.scaled_dot_product_attention

    def sdpa(q, *args, **kwargs):
        got.setdefault(current[0], {}).setdefault("q", q.detach().clone())
        return real(q, *args, **kwargs)

    def keep(key, name):
        def hook(module, args):  # returns None: the input goes on unchanged
            got.setdefault(name, {}).setdefault(key, args[0].detach().clone())
        return hook

    for s in sites:
        handles.append(s.module.register_forward_pre_hook(
            lambda m, a, name=s.name: current.__setitem__(0, name)))
        handles.append(s.q_module.register_forward_pre_hook(keep("x", s.name)))
        if getattr(s.module, "q_norm", None) is not None:
            handles.append(s.module.q_norm.register_forward_pre_hook(keep("pre", s.name)))
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return got


def _true_q(c, site):
    """[B, N, H, D] q before rotary and norm where the model exposes it, else the q at
    SDPA at position 0 only (rotary is the identity there)."""
    if "pre" in c:
        B, N = c["x"].shape[:2]
        return c["pre"].reshape(B, N, site.num_heads, site.head_dim)
    return c["q"].transpose(1, 2)[:, :1]


@pytest.mark.parametrize("arch", FUSED)
def test_fused_and_gated_projections_give_the_true_w_q_per_head(arch, monkeypatch):
    model, kind = hf_tiny(arch)
    sites = find_sites(model)
    got = capture(model, sites, hf_inputs(kind, B=8, N=6), monkeypatch)
    for site in sites:
        assert site.layout == LAYOUT_OF[arch]
        c = got[site.name]
        q = _true_q(c, site).double()
        x = c["x"][:, :q.shape[1]].double()
        # Differences between batch elements cancel the bias: Δq = ΔX · W^Q_hᵀ per head.
        want = torch.einsum("btc,hdc->bthd", x[1:] - x[:1], site.wq().double())
        torch.testing.assert_close(q[1:] - q[:1], want, rtol=1e-4, atol=1e-5)


def test_bloom_slice_is_per_head_and_bloom_is_refused_by_name():
    from flashwatch.sites.discovery import _match

    model, kind = hf_tiny("bloom")
    attn = model.transformer.h[0].self_attention
    site = _match("h0", attn, [])
    assert site.layout == "per_head_qkv" and site.kind == "fused_qkv"
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        q, _, _ = attn._reshape(attn.query_key_value.double()(x))  # Bloom's own split
        zero, _, _ = attn._reshape(attn.query_key_value(torch.zeros_like(x)))
    want = torch.einsum("btc,hdc->bhtd", x, site.wq())  # _reshape gives [B, H, N, D]
    torch.testing.assert_close(q - zero, want)
    with pytest.raises(ValueError, match=r"BloomAttention.*never SDPA"):
        find_sites(model)


def test_layout_indices_match_the_modeling_code_views():
    H, Hkv, D = 4, 2, 3
    out = torch.arange((H + 2 * Hkv) * D)
    # Falcon new architecture: view(Hkv, H/Hkv + 2, D), q = [:, :-2], k = [:, -2]
    v = out.view(Hkv, H // Hkv + 2, D)
    assert torch.equal(q_index("per_group_qkv", H, Hkv, D), v[:, :-2].flatten())
    assert torch.equal(k_index("per_group_qkv", H, Hkv, D), v[:, -2].flatten())
    v = torch.arange(3 * H * D).view(H, 3, D)  # NeoX, Bloom: view(H, 3, D)
    assert torch.equal(q_index("per_head_qkv", H, H, D), v[:, 0].flatten())
    assert torch.equal(k_index("per_head_qkv", H, H, D), v[:, 1].flatten())
    v = torch.arange(2 * H * D).view(H, 2 * D)  # Qwen3-Next: view(H, 2D).chunk(2)
    assert torch.equal(q_index("per_head_q_gate", H, Hkv, D), v[:, :D].flatten())
    with pytest.raises(ValueError, match="q_layout must be one of"):
        q_index("neox", H, Hkv, D)


@pytest.mark.parametrize("arch,layout", [("gpt_neox", "per_head_qkv"),
                                         ("qwen3_next", "per_head_q_gate")])
def test_an_explicit_wrong_slice_is_refused_against_the_q_sdpa_gets(arch, layout,
                                                                     monkeypatch):
    """The issue's case: a [Q | ...] slice (0, H·D) of a per-head interleaved projection
    passes the orientation check (it is a consistent slice of the projection) and is
    refused by the check against the actual q; the right q_layout passes, and is what
    an explicit site of a known class gets by default."""
    model, kind = hf_tiny(arch)
    found = find_sites(model)
    name = found[0].name
    q_child = "query_key_value" if arch == "gpt_neox" else "q_proj"
    spec = dict(num_heads=4, num_kv_heads=found[0].num_kv_heads, head_dim=8, q_module=q_child)
    wrong = find_sites(model, sites={name: dict(spec, q_slice_of_output=(0, 32))})[0]
    right = find_sites(model, sites={name: dict(spec, q_layout=layout)})[0]
    default = find_sites(model, sites={name: spec})[0]
    assert default.layout == layout and torch.equal(default.q_index, right.q_index)
    checks = [QCheck(s) for s in (wrong, right)]
    handles = [h for c in checks for h in c.arm()]
    c = capture(model, [right], hf_inputs(kind, B=2, N=6), monkeypatch)[name]
    for h in handles:
        h.remove()
    with pytest.raises(RuntimeError, match=rf"{name}.*q layout.*q_layout=") as err:
        checks[0](c["x"], c["q"])
    assert "q_layout" in str(err.value) and all(n in str(err.value) for n in LAYOUTS[1:])
    assert checks[0].failed and checks[0](c["x"], c["q"]) is False  # refused once only
    assert checks[1](c["x"], c["q"]) and checks[1].done


@pytest.mark.parametrize("arch,layout", [("gpt_neox", "per_head_qkv"),
                                         ("qwen3_next", "per_head_q_gate")])
def test_a_watched_wrong_slice_reports_no_w_q_norm_and_counts_one_error(arch, layout, caplog):
    """The same refusal through fw.watch: the wrongly sliced layer reports NaN W^Q norms
    (never K's or the gate's rows) with its max logit still measured, the error is
    logged naming the slice given and counted once over two steps; the right q_layout
    reports each head's true σ (the modeling code's split, written here) and no error."""
    model, kind = hf_tiny(arch)
    site = find_sites(model)[0]
    q_child = "query_key_value" if arch == "gpt_neox" else "q_proj"
    spec = dict(num_heads=4, num_kv_heads=site.num_kv_heads, head_dim=8, q_module=q_child)
    w_qkv = getattr(site.module, q_child).weight.detach().double()
    true_wq = (w_qkv.view(4, 3, 8, -1)[:, 0] if arch == "gpt_neox"
               else w_qkv.view(4, 16, -1)[:, :8])
    sigma = torch.linalg.matrix_norm(true_wq, ord=2)
    inputs = hf_inputs(kind)
    for given, errors in ((dict(q_slice_of_output=(0, 32)), 1), (dict(q_layout=layout), 0)):
        w = fw.watch(model, every_n_steps=1, sites={site.name: dict(spec, **given)})
        with caplog.at_level("ERROR", logger="flashwatch"):
            for _ in range(2):
                model(**inputs).logits.float().square().mean().backward()
                report = w.step()
                model.zero_grad()
        w.remove()
        norms = torch.tensor([h.wq_spectral_norm for h in report.heads], dtype=torch.float64)
        assert all(math.isfinite(h.attention_max_logit) for h in report.heads)
        assert w.monitor_errors_total == errors
        if errors:
            assert norms.isnan().all()
            assert any("q_slice_of_output=(0, 32)" in r.getMessage() + str(r.exc_info)
                       for r in caplog.records)
        else:
            torch.testing.assert_close(norms, sigma, rtol=1e-3, atol=0)


def test_qcheck_waits_for_a_call_it_can_compare(monkeypatch):
    model, kind = hf_tiny("gpt_neox")
    site = find_sites(model)[0]
    c = capture(model, [site], hf_inputs(kind, B=2, N=6), monkeypatch)[site.name]
    check = QCheck(site)
    seen = []
    site.q_module.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    assert check(None, c["q"]) is False  # no X
    assert check(c["x"][:, :1], c["q"]) is False  # a decode call: N_q differs from X's
    assert check(c["x"], c["q"]) is True
    assert seen == []  # q_module's hooks (the watcher's X hook) do not see the check


def test_explicit_layout_arguments_are_validated():
    model, _ = hf_tiny("gpt_neox")
    name = find_sites(model)[0].name
    for spec, words in [
        (dict(q_layout="neox"), "q_layout must be one of"),
        (dict(q_layout="per_head_qkv", q_slice_of_output=(0, 32)), "at most one"),
        (dict(q_channels=[0, 1, 2]), "32 distinct"),
        (dict(q_channels=list(range(90, 122))), "past the 96 outputs"),
    ]:
        with pytest.raises(ValueError, match=words):
            make_site(model, name, num_heads=4, q_module="query_key_value", **spec)
    site = make_site(model, name, num_heads=4, q_module="query_key_value",
                     q_channels=q_index("per_head_qkv", 4, 4, 8))
    assert site.q_slice_of_output is None and site.layout == "q"
    torch.testing.assert_close(site.wq(), find_sites(model)[0].wq())


@pytest.mark.parametrize("arch,child", [("bert", "query"), ("t5", "q")])
def test_other_separate_projection_names_are_found(arch, child):
    model, _ = hf_tiny(arch)
    sites = find_sites(model)
    assert sites and all(s.q_module is getattr(s.module, child) for s in sites)
    assert all((s.num_heads, s.head_dim, s.q_slice_of_output) == (4, 8, (0, 32)) for s in sites)
