"""flashwatch/monitor/probing.py on a watched model: Σc[T] against FP64 on every row (own kernel,
paper backend, foreign SDPA), sampled rows, micro-batches reduced as they complete, a
second backward, attention dropout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    QKV,
    SMALL,
    batch,
    fused_o_fp64,
)

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode
from flashwatch.monitor import samples
from oracle import math_attention
from standins import TiedAttention


def test_delta_error_sum_equals_fp64_over_all_rows():
    # rows_per_head ≥ B·T samples every row, so the report's Σ c[T] is the whole layer's.
    torch.manual_seed(2)
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg).to(torch.bfloat16)
    attn = model.transformer.h[0].attn
    g = torch.Generator().manual_seed(2)
    x, y = batch(g)
    captured = {}

    def keep(module, args, out):
        captured["x"] = args[0]

    handle = attn.register_forward_hook(keep)
    w = fw.watch(model, rows_per_head=4 * 32)
    _, loss = model(x, y)
    (1024 * loss).backward()  # a power of 2: dO large enough to see c, rounding unchanged
    report = w.step()
    w.remove()
    handle.remove()
    # Recompute layer 0's attention outside the model, exactly as the module does, to get
    # O_used (the bf16 kernel output) and dO, then c in FP64.
    X = captured["x"].detach()
    B, T, C = X.shape
    q, k, v = attn.c_attn(X).split(C, dim=2)
    q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k, v))
    o_used = F.scaled_dot_product_attention(q, k, v, is_causal=True).detach()
    o = o_used.clone().requires_grad_(True)
    out = attn.c_proj(o.transpose(1, 2).reshape(B, T, C))
    # dO for layer 0 flows back from the loss through the rest of the network; the
    # watcher saw exactly that gradient, so rerun the model with a hook to fetch it.
    grads = {}

    def grab(module, args, output):
        output.register_hook(lambda gr: grads.__setitem__("dy", gr))

    h2 = attn.c_proj.register_forward_hook(grab)
    model.zero_grad()
    (1024 * model(x, y)[1]).backward()
    h2.remove()
    # c_proj's output gradient dy → dO = dy @ W_proj, reshaped to heads
    dO = (grads["dy"].double() @ attn.c_proj.weight.double()).view(B, T, 4, C // 4)
    dO = dO.transpose(1, 2)
    o64 = math_attention(q, k, v, causal=True, scale=(C // 4) ** -0.5, dtype=torch.float64)
    c64 = (dO * (o_used.double() - o64)).sum(-1)  # [B, H, T]
    want = c64.sum((0, 2))
    got = torch.tensor([h.delta_error_sum for h in report.heads
                        if h.layer == "transformer.h.0.attn"], dtype=torch.float64)
    assert want.abs().max() > 1e-3
    # dO here passes through c_proj in FP64 while the model computed it in bf16: allow
    # bf16-level relative differences in dO (2^-8), nothing more.
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()), \
        (got, want)
    del out


@pytest.mark.parametrize("route_all", [False, True])
def test_samples_of_many_micro_batches_are_reduced_as_they_complete(route_all):
    """Eight micro-batches in one optimizer step: the probe's per-call samples are
    reduced once a micro-batch's worth has its gradient, so none is held after a
    micro-batch's backward, and the step's totals equal every sample reduced at once
    (what step() reports from)."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, rows_per_head=16, route_all=route_all)
    g = torch.Generator().manual_seed(4)
    seen, held = [], []
    for _ in range(8):
        x, y = batch(g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        seen += [s for st in w.layer_states for s in st.buf.samples]  # c comes in backward
        (loss / 8).backward()
        held.append(sum(len(st.buf.samples) for st in w.layer_states))
    assert len(seen) == 2 * 8 and all(s.has_grad for s in seen)  # 2 layers
    assert held == [0] * 8
    at_once = samples.totals(seen, w.recorder.n_heads, w.config.sketch_dim)
    for key, want in at_once.items():
        assert torch.allclose(w.recorder.totals[key], want, rtol=1e-9, atol=1e-15), key
    report = w.step()
    w.remove()
    assert all(math.isfinite(h.delta_error_sum) and h.delta_error_rows > 0
               for h in report.heads)


@pytest.mark.parametrize("route_all", [False, True])
def test_a_second_backward_through_one_forward_counts_its_own_gradient(route_all):
    """loss.backward(retain_graph=True) twice: W^Q's gradient holds both, so the δ error
    must too: every sum and count doubles, per head, against one backward."""
    def run(backwards):
        torch.manual_seed(3)
        model = GPT(GPTConfig(**SMALL))
        w = fw.watch(model, rows_per_head=16, route_all=route_all)
        x, y = batch(torch.Generator().manual_seed(4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        for _ in range(backwards):
            loss.backward(retain_graph=True)
        report = w.step()
        w.remove()
        return report

    once, twice = run(1), run(2)
    for a, b in zip(once.heads, twice.heads, strict=True):
        assert abs(a.delta_error_sum) > 0
        assert b.delta_error_sum == pytest.approx(2 * a.delta_error_sum, rel=1e-9)
        assert b.delta_error_rows == 2 * a.delta_error_rows
        assert b.tied_rowmax_ratio == a.tied_rowmax_ratio  # one forward: rows seen once


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_own_kernel_delta_sums_cover_every_row_fp64(backend):
    # rows_per_head=4 of 32: a sampled Σc would differ; the kernel's FP32 O gives all rows.
    # T = 16 keys: one key block for both backends, so the FP64 oracle's shift is theirs.
    torch.manual_seed(11)
    model = TiedAttention(C=32, H=2).bfloat16()
    B, T, C, H = 2, 16, 32, 2
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, C, generator=g).bfloat16()
    wgt = torch.randn(B, T, C, generator=g)
    w = fw.watch(model, every_n_steps=1, rows_per_head=4, backend=backend)
    w.set_head_modes(w.sites[0].name, [Mode.STANDARD, Mode.FP32_O])
    (model(x).float() * wgt).sum().backward()
    report = w.step()
    w.remove()
    with torch.no_grad():
        q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in model.c_attn(x).split(C, 2))
        scale = (C // H) ** -0.5
        o_used = fw.attention(q, k, v, causal=True, backend=backend,
                              head_modes=[Mode.STANDARD, Mode.FP32_O])
    do = wgt.bfloat16().double().view(B, T, H, -1).transpose(1, 2)
    c = (do * (o_used.double() - fused_o_fp64(q, k, v, scale))).sum(-1)  # [B, H, T]
    c[:, 1] = 0.0  # the FP32_O head's δ used the FP32 O: no error
    s1, s2 = c.sum((0, 2)), c.square().sum((0, 2))
    assert s2[0] > 0
    got1 = torch.tensor([h.delta_error_sum for h in report.heads], dtype=torch.float64)
    assert torch.allclose(got1, s1, rtol=1e-3, atol=1e-3 * s2[0].sqrt().item()), (got1, s1)
    h0 = report.heads[0]
    assert h0.delta_error_rows == B * T and h0.delta_error_all_rows
    # one step in the window: the sign statistic is Σc / sqrt(Σc²) of this step
    assert h0.delta_sign_z == pytest.approx(float(s1[0] / s2[0].sqrt()), rel=1e-3)


def test_paper_backend_delta_error_on_every_row_uses_its_bf16_delta():
    """backend="paper" sums δ = rowsum(dO ∘ O) in BF16; c on every row is that δ minus
    rowsum(dO ∘ O_fp32), O_fp32 its own P̄ and α accumulated without rounding (FP64 here).
    SDPA routed (route_all) runs WatchConfig.backend."""
    torch.manual_seed(13)
    B, T, C, H = 2, 16, 32, 2
    model = QKV(C, H).bfloat16()
    g = torch.Generator().manual_seed(13)
    x = torch.randn(B, T, C, generator=g).bfloat16()
    wgt = torch.randn(B, T, C, generator=g)
    w = fw.watch(model, sites={"": dict(num_heads=H, q_module="q_proj")}, every_n_steps=1,
                 rows_per_head=4, backend="paper", route_all=True)
    (model(x).float() * wgt).sum().backward()
    report = w.step()
    w.remove()
    with torch.no_grad():
        q, k, v = (p(x).view(B, T, H, -1).transpose(1, 2)
                   for p in (model.q_proj, model.k_proj, model.v_proj))
        o = fw.attention(q, k, v, causal=True, backend="paper")
    s = ((q @ k.transpose(-1, -2)) * (C // H) ** -0.5).float()  # BF16 scores, rounded twice
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    d = (s - s.amax(-1, keepdim=True)).to(torch.bfloat16).float()  # every BF16 op rounds
    p = torch.exp(d).to(torch.bfloat16).double()  # BF16 P̄
    o32 = (p @ v.double()) / p.sum(-1, keepdim=True)
    do = wgt.bfloat16().view(B, T, H, -1).transpose(1, 2)
    delta = (do.float() * o.float()).to(torch.bfloat16).float().sum(-1).to(torch.bfloat16)
    c = delta.double() - (do.double() * o32).sum(-1)  # [B, H, T]
    got = torch.tensor([h.delta_error_sum for h in report.heads], dtype=torch.float64)
    tol = 1e-3 * c.square().sum().sqrt().item()
    assert torch.allclose(got, c.sum((0, 2)), rtol=1e-3, atol=tol), (got, c.sum((0, 2)))
    # the BF16 rowsum matters: c from the BF16 O alone gives other sums
    c_o = (do.double() * (o.double() - o32)).sum(-1).sum((0, 2))
    assert not torch.allclose(got, c_o, rtol=1e-2, atol=tol)
    assert all(h.delta_error_all_rows and h.delta_error_rows == B * T for h in report.heads)


def test_foreign_kernel_rows_all_versus_sampled_is_visible():
    torch.manual_seed(12)
    model = GPT(GPTConfig(**SMALL))
    x, y = batch(torch.Generator().manual_seed(12))
    for rows, all_rows in (("all", True), (16, False)):
        w = fw.watch(model, every_n_steps=1, rows_per_head=rows)
        model(x, y)[1].backward()
        r = w.step()
        w.remove()
        model.zero_grad()
        assert all(h.delta_error_all_rows == all_rows for h in r.heads)
        assert all(h.delta_error_rows == (4 * 32 if all_rows else 16) for h in r.heads)


def test_attention_dropout_leaves_delta_unmeasured_and_says_so(caplog):
    """With dropout the O the backward used is dropped out and the FP32 recomputation is
    not: c would be the dropout, not rounding. Ties and max logit (from the scores) are
    still measured; δ is NaN with no gradient rows, and the log says why."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL, "dropout": 0.5}))
    w = fw.watch(model, every_n_steps=1)
    x, y = batch(torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING", logger="flashwatch"):
        model(x, y)[1].backward()
        report = w.step()
    assert "uses attention dropout" in caplog.text
    assert all(math.isfinite(h.tied_rowmax_ratio) and math.isfinite(h.attention_max_logit)
               and math.isnan(h.delta_error_sum) and h.delta_error_rows == 0
               for h in report.heads)
    assert w.monitor_errors_total == 0
    model.eval()  # no dropout: measured
    model(x, y)[1].backward()
    assert all(math.isfinite(h.delta_error_sum) for h in w.step().heads)
    w.remove()


class PooledQueries(torch.nn.Module):
    """Every other position asks (a pooled query sequence): q has Nq = N/2 rows while
    the Q projection's input X has N."""

    def __init__(self, C=32, H=4):
        super().__init__()
        self.H = H
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(C, C) for _ in range(3))

    def forward(self, x):
        B, N, C = x.shape

        def heads(t):
            return t.view(B, t.shape[1], self.H, C // self.H).transpose(1, 2)
        q = heads(self.q_proj(x)[:, ::2])
        return F.scaled_dot_product_attention(q, heads(self.k_proj(x)), heads(self.v_proj(x)))


def test_a_q_projection_input_of_another_length_is_named_once(caplog):
    """X [B, N, C] cannot weight q's Nq rows: the watcher says so once, with the shape it
    expected, measures δ in q space (finite sums) and reports no error share."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(PooledQueries())
    w = fw.watch(model, every_n_steps=1, rows_per_head="all",
                 sites={"0": dict(num_heads=4, q_module="q_proj")})
    with caplog.at_level("WARNING", logger="flashwatch"):
        for _ in range(2):
            model(torch.randn(2, 8, 32)).square().sum().backward()
            report = w.step()
    w.remove()
    said = [r.getMessage() for r in caplog.records if "Q projection's input" in r.getMessage()]
    assert len(said) == 1 and "(2, 8, 32)" in said[0] and "[2, 4, 32]" in said[0]
    assert all(math.isfinite(h.delta_error_sum) and h.delta_error_rows > 0
               for h in report.heads)
    assert all(math.isnan(h.delta_error_share) for h in report.heads)
    assert w.monitor_errors_total == 0
