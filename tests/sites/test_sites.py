"""flashwatch/sites/site.py: finding attention layers and their W^Q per head, and the checks
every site passes (overlap, canonical names; orientation in tests/sites/test_orientation.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import capture_q_and_x
from torch import nn

import flashwatch as fw
from examples.gpt import GPT, CausalSelfAttention, GPTConfig
from flashwatch.sites import find_sites
from standins import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, TinyViTish

GPT_CFG = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32, bias=True)


def _gpt():
    return GPT(GPT_CFG)


# (factory, expected names, kind, heads, kv heads, head_dim, d_model, q_module child name,
#  the exact W^Q slice as [H*head_dim, d_model] read straight from the weight)
MODELS = {
    "nanogpt": (
        _gpt, ["transformer.h.0.attn", "transformer.h.1.attn"], "nanogpt", 4, 4, 8, 32,
        "c_attn", lambda site: site.module.c_attn.weight[:32],
    ),
    "hf_llama_gqa": (
        lambda: TinyLlama(LlamaConfig()), ["model.layers.0.self_attn", "model.layers.1.self_attn"],
        "hf", 4, 2, 16, 32, "q_proj", lambda site: site.module.q_proj.weight,
    ),
    "gpt2_conv1d": (
        lambda: TinyGPT2(GPT2Config()), ["transformer.h.0.attn", "transformer.h.1.attn"],
        "gpt2_conv1d", 4, 4, 8, 32, "c_attn", lambda site: site.module.c_attn.weight[:, :32].T,
    ),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_finds_exactly_the_attention_modules(family):
    make, names, kind, H, Hkv, D, C, q_child, _ = MODELS[family]
    torch.manual_seed(0)
    model = make()
    sites = find_sites(model)
    assert [s.name for s in sites] == names
    for s in sites:
        assert s.module is model.get_submodule(s.name)
        assert (s.kind, s.num_heads, s.num_kv_heads, s.head_dim, s.d_model) == (kind, H, Hkv, D, C)
        assert s.q_module is getattr(s.module, q_child)
        assert s.q_slice_of_output == (0, H * D)


@pytest.mark.parametrize("family", list(MODELS))
def test_wq_is_a_view_of_the_right_slice(family):
    make, *_, H, _, D, C, _, raw_slice = MODELS[family]
    torch.manual_seed(0)
    for site in find_sites(make()):
        w, raw = site.wq(), raw_slice(site)
        assert w.shape == (H, D, C)
        assert not w.requires_grad
        torch.testing.assert_close(w, raw.reshape(H, D, C), rtol=0, atol=0)
        # No copy: the view shares the parameter's storage.
        assert w.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", list(MODELS))
def test_wq_reproduces_the_q_that_attention_receives(family, monkeypatch):
    """The orientation is the point: q at the SDPA call == X W^Q_h^T + b_h for every head."""
    make, *_ = MODELS[family]
    torch.manual_seed(0)
    model = make()
    for p in model.parameters():  # biases start at zero in some models; make them count
        if p.dim() == 1:
            nn.init.normal_(p, std=0.5)
    sites = find_sites(model)
    idx = torch.randint(0, 64, (2, 7))
    xs, qs = capture_q_and_x(model, sites, monkeypatch, idx)
    for site in sites:
        start, stop = site.q_slice_of_output
        bias = getattr(site.q_module, "bias", None)
        b = torch.zeros(stop - start) if bias is None else bias.detach()[start:stop]
        want = torch.einsum("btc,hdc->bhtd", xs[site.name], site.wq())
        want = want + b.view(site.num_heads, 1, site.head_dim)
        torch.testing.assert_close(qs[site.name], want, rtol=1e-5, atol=1e-5)


def test_wq_follows_optimizer_steps():
    torch.manual_seed(0)
    model = _gpt()
    site = find_sites(model)[0]
    before = site.wq().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (2, 8))
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    after = site.wq()
    assert (after - before).abs().max() > 1e-3  # AdamW moves every weight by ~lr
    torch.testing.assert_close(after, site.module.c_attn.weight[:32].view(4, 8, 32),
                               rtol=0, atol=0)


def test_a_module_inside_a_site_is_not_a_second_site():
    outer = CausalSelfAttention(GPT_CFG)
    outer.inner = CausalSelfAttention(GPT_CFG)  # would match on its own
    sites = find_sites(nn.ModuleDict({"attn": outer}))
    assert [s.name for s in sites] == ["attn"]
    # The root itself may be the attention module.
    assert [s.name for s in find_sites(TinyLlama().model.layers[0].self_attn)] == [""]


def test_nothing_found_says_what_was_looked_for_and_how_to_pass_sites():
    with pytest.raises(ValueError) as err:
        find_sites(TinyViTish())
    msg = str(err.value)
    for words in ["c_attn", "q_proj", "k_proj", "v_proj", "Conv1D", "n_head",
                  "num_attention_heads", "sites=", "q_module"]:
        assert words in msg, words


def test_near_misses_are_named():
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.c_attn = nn.Linear(8, 16)  # not 3 * 8
    model.attn.n_head = 2
    with pytest.raises(ValueError, match=r"'attn'.*8 -> 16"):
        find_sites(model)


def test_projections_without_a_head_count_are_an_error():
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(8, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"no head count.*num_heads.*sites="):
        find_sites(nn.ModuleDict({"attn": attn}))


def test_canonical_names_drop_wrapper_segments_only():
    from flashwatch.sites.site import canonical_name

    class DistributedDataParallel(nn.Module):  # DDP's name and layout: `.module`
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    class Holder(nn.Module):  # an ordinary child that happens to be called `module`
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    for wrap in (DistributedDataParallel, torch.compile):
        model = wrap(_gpt())
        assert [s.name for s in find_sites(model)] == MODELS["nanogpt"][1]
    held = Holder(_gpt())
    assert [s.name for s in find_sites(held)] == ["module." + n for n in MODELS["nanogpt"][1]]
    assert canonical_name(held, "module.transformer.h.0") == "module.transformer.h.0"
    # A list of sites found on the wrapped model (canonical names) is accepted back.
    compiled = torch.compile(_gpt())
    assert [s.name for s in find_sites(compiled, find_sites(compiled))] == MODELS["nanogpt"][1]


class _TitanAttention(nn.Module):
    """torchtitan's Llama attention, as its models/llama3 code lays it out: wq/wk/wv/wo,
    n_heads/n_kv_heads/head_dim on the module, K and V repeated to n_heads (repeat_kv)
    before an SDPA module (`self.sdpa`)."""

    class _SDPA(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def __init__(self, dim=32, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.sdpa = self._SDPA()

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)  # -1: the local heads under TP
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        rep = self.n_heads // self.n_kv_heads
        k, v = (u.repeat_interleave(rep, dim=2) for u in (k, v))
        o = self.sdpa(*(u.transpose(1, 2) for u in (q, k, v)))
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class _TitanLlama(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(64, 32)
        self.layers = nn.ModuleDict({str(i): nn.ModuleDict(dict(attention=_TitanAttention()))
                                     for i in range(2)})
        with torch.no_grad():  # each head's W^Q its own scale: a swapped head shows
            for i, blk in self.layers.items():
                w = blk["attention"].wq.weight.view(4, -1, 32)
                for h in range(4):
                    w[h] *= 1 + int(i) * 4 + h

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for blk in self.layers.values():
            x = x + blk["attention"](x)
        return x


def test_torchtitan_llama_attention_is_discovered_and_measured_per_head():
    """torchtitan's names (attention.wq/wk/wv, n_heads, n_kv_heads) are found like Hugging
    Face's: W^Q per head from wq's rows, K grouped, and the watcher measures every head
    (max logit against an FP64 recomputation from the layer's own weights)."""
    model = _TitanLlama()
    sites = find_sites(model)
    assert [(s.name, s.num_heads, s.num_kv_heads, s.head_dim) for s in sites] == [
        ("layers.0.attention", 4, 2, 8), ("layers.1.attention", 4, 2, 8)]
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    w = fw.watch(model, config=fw.WatchConfig(every_n_steps=1, rows_per_head="all"))
    model(tokens).square().mean().backward()
    report = w.step()
    w.remove()
    with torch.no_grad():
        _check_titan_heads(model, tokens, report)


def _check_titan_heads(model, tokens, report):
    x = model.tok_embeddings.weight.double()[tokens]
    for i, blk in model.layers.items():
        att = blk["attention"]
        q = (x @ att.wq.weight.double().T).view(2, 10, 4, 8).transpose(1, 2)
        k = (x @ att.wk.weight.double().T).view(2, 10, 2, 8).repeat_interleave(2, dim=2)
        s = q @ k.transpose(1, 2).transpose(-1, -2) / 8 ** 0.5
        s = s.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), -torch.inf)
        for h in range(4):
            rec = next(r for r in report.heads
                       if (r.layer, r.head) == (f"layers.{i}.attention", h))
            assert rec.attention_max_logit == pytest.approx(float(s[:, h].amax()), rel=1e-5)
            sigma = torch.linalg.matrix_norm(att.wq.weight.double().view(4, 8, 32)[h], ord=2)
            assert rec.wq_spectral_norm == pytest.approx(float(sigma), rel=1e-4)
        x = x + att(x.float()).double()
