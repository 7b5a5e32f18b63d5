"""flashwatch/watcher.py: attach, measure, mitigate, resume, distribute, never crash."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode
from flashwatch import dispatch as fw_dispatch
from oracle import math_attention
from standins import TiedAttention, leaning_dispatch

SMALL = dict(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=64)


def _batch(g, B=4, T=32, vocab=64):
    idx = torch.randint(0, vocab, (B, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _train(model, watcher, steps, *, seed=0, accum=1, lr=3e-3, autocast=True):
    """AdamW training loop on seeded random tokens; returns the non-None reports."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    reports = []
    for _ in range(steps):
        for _ in range(accum):
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _, loss = model(x, y)
            (loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        r = watcher.step()
        if r is not None:
            reports.append(r)
    return reports, opt


def _comparable(report):
    d = report.to_dict()
    d.pop("monitor_seconds")
    return d


class SmallAttention(nn.Module):
    """A nanoGPT-style layer (C = 32, 2 heads) whose attention is `attend(q, k, v, **kw)`."""

    def __init__(self, attend):
        super().__init__()
        self.c_attn = nn.Linear(32, 96)
        self.n_head = 2
        self.attend = attend

    def forward(self, x, **kw):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in (q, k, v))
        return self.attend(q, k, v, **kw)


# ---------------------------------------------------------------------------- basics


def test_gpt_bf16_training_reports_every_head_with_finite_metrics():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    with fw.watch(model, every_n_steps=2) as w:
        reports, _ = _train(model, w, 6)
    assert [r.step for r in reports] == [0, 2, 4]
    for r in reports:
        assert [(h.layer, h.head) for h in r.heads] == [
            (f"transformer.h.{i}.attn", h) for i in range(2) for h in range(4)]
        for h in r.heads:
            for name in ("tied_rowmax_ratio", "attention_max_logit", "delta_error_sum",
                         "r_projection_cumulative", "delta_drift_z", "delta_coherence",
                         "wq_spectral_norm"):
                assert math.isfinite(getattr(h, name)), (name, h)
            assert h.head_mode == Mode.STANDARD
    # the bf16 SDPA output really differs from its FP32 recomputation
    assert any(h.delta_error_sum != 0.0 for r in reports for h in r.heads)
    assert w.monitor_errors_total == 0


def test_spectral_norm_in_reports_equals_matrix_norm():
    torch.manual_seed(1)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, every_n_steps=1)
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        x, y = _batch(g)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        r = w.step()
        for site in w.sites:
            exact = torch.linalg.matrix_norm(site.wq().double(), ord=2)
            got = torch.tensor([h.wq_spectral_norm for h in r.heads if h.layer == site.name],
                               dtype=torch.float64)
            assert torch.allclose(got, exact, rtol=1e-3), (site.name, got, exact)
    w.remove()


def test_delta_error_sum_equals_fp64_over_all_rows():
    # rows_per_head ≥ B·T samples every row, so the report's Σ c[T] is the whole layer's.
    torch.manual_seed(2)
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg).to(torch.bfloat16)
    attn = model.transformer.h[0].attn
    g = torch.Generator().manual_seed(2)
    x, y = _batch(g)
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


def test_gradient_accumulation_gives_one_monitor_step_with_all_micro_batches():
    torch.manual_seed(3)
    model = GPT(GPTConfig(**SMALL))
    g = torch.Generator().manual_seed(3)
    batches = [_batch(g) for _ in range(2)]

    def run(micro):
        w = fw.watch(model, rows_per_head=4 * 32, route_all=True)
        for x, y in micro:
            model(x, y)[1].backward()
        model.zero_grad()
        r = w.step()
        w.remove()
        return r

    both = run(batches)
    a, b = run(batches[:1]), run(batches[1:])
    for hb, ha, hbb in zip(both.heads, a.heads, b.heads, strict=True):
        assert hb.delta_error_sum == pytest.approx(ha.delta_error_sum + hbb.delta_error_sum,
                                                   rel=1e-9, abs=1e-12)
        assert hb.tied_rowmax_ratio == pytest.approx(
            (ha.tied_rowmax_ratio + hbb.tied_rowmax_ratio) / 2)


@pytest.mark.parametrize("route_all", [False, True])
def test_samples_of_many_micro_batches_are_reduced_as_they_complete(route_all, monkeypatch):
    """Eight micro-batches in one optimizer step: the probe's per-call samples are
    reduced once a micro-batch's worth has its gradient, so at most one micro-batch of
    them is held, and the report equals the one reduced all at once at step()."""
    def run(reduce_early):
        torch.manual_seed(3)
        model = GPT(GPTConfig(**SMALL))
        w = fw.watch(model, rows_per_head=16, route_all=route_all)
        if not reduce_early:
            monkeypatch.setattr(w._recorder, "_sample_done", lambda: None)
        g = torch.Generator().manual_seed(4)
        held = []
        for _ in range(8):
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / 8).backward()
            held.append(sum(len(st.buf.samples) for st in w.layer_states))
        report = w.step()
        w.remove()
        return report, held

    early, held_early = run(True)
    late, held_late = run(False)
    assert held_late == [2 * i for i in range(1, 9)]  # 2 layers: 2 samples a micro-batch
    assert held_early == [0] * 8
    for a, b in zip(_comparable(early)["heads"], _comparable(late)["heads"], strict=True):
        assert math.isfinite(a["delta_error_sum"]) and a["delta_error_rows"] > 0
        for key, va in a.items():
            if isinstance(va, float):
                assert va == pytest.approx(b[key], rel=1e-9, abs=1e-15, nan_ok=True), key
            else:
                assert va == b[key], key


@pytest.mark.parametrize("route_all", [False, True])
def test_a_second_backward_through_one_forward_counts_its_own_gradient(route_all):
    """loss.backward(retain_graph=True) twice: W^Q's gradient holds both, so the δ error
    must too: every sum and count doubles, per head, against one backward."""
    def run(backwards):
        torch.manual_seed(3)
        model = GPT(GPTConfig(**SMALL))
        w = fw.watch(model, rows_per_head=16, route_all=route_all)
        x, y = _batch(torch.Generator().manual_seed(4))
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


def test_every_n_steps_skips_unmonitored_steps_entirely():
    torch.manual_seed(4)
    model = GPT(GPTConfig(**SMALL))
    calls = []
    w = fw.watch(model, every_n_steps=3, sinks=[type("S", (), {
        "write": lambda self, r: calls.append(r.step), "close": lambda self: None})()])
    _train(model, w, 7)
    assert calls == [0, 3, 6]
    assert w.step_count == 7


def test_paused_forward_passes_are_not_measured():
    torch.manual_seed(5)
    model = GPT(GPTConfig(**SMALL))
    x, y = _batch(torch.Generator().manual_seed(5))
    w = fw.watch(model, every_n_steps=1)
    w.pause()
    model(x, y)[1].backward()  # e.g. a validation pass with gradients: not measured
    w.resume()
    r = w.step()
    assert all(math.isnan(h.delta_error_sum) and math.isnan(h.tied_rowmax_ratio)
               for h in r.heads)
    model(x, y)[1].backward()
    r = w.step()
    assert all(math.isfinite(h.delta_error_sum) for h in r.heads)


def test_remove_restores_the_model_exactly():
    torch.manual_seed(5)
    model = GPT(GPTConfig(**SMALL))
    x, y = _batch(torch.Generator().manual_seed(5))
    before = model(x, y)[0]
    w = fw.watch(model, mitigation="auto")
    w.set_head_modes("transformer.h.0.attn", [Mode.BETA] * 4)
    watched = model(x, y)[0]
    w.remove()
    after = model(x, y)[0]
    assert torch.equal(before, after)
    assert watched.shape == before.shape
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    with pytest.raises(RuntimeError, match="removed"):
        w.step()


def test_nothing_to_watch_is_a_clear_error():
    with pytest.raises(ValueError, match="sites"):
        fw.watch(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="not both"):
        fw.watch(GPT(GPTConfig(**SMALL)), config=fw.WatchConfig(), window=8)


# ------------------------------------------------------------- other model layouts


@pytest.mark.parametrize("factory", ["llama", "gpt2"])
def test_hugging_face_shaped_models(factory):
    import standins

    torch.manual_seed(6)
    if factory == "llama":
        model = standins.TinyLlama(standins.LlamaConfig())
    else:
        model = standins.TinyGPT2(standins.GPT2Config())
    w = fw.watch(model, route_all=True)
    g = torch.Generator().manual_seed(6)
    vocab = model.config.vocab_size
    idx = torch.randint(0, vocab, (2, 17), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    r = w.step()
    w.remove()
    heads = {(h.layer, h.head) for h in r.heads}
    assert len(heads) == sum(s.num_heads for s in w.sites) and len(w.sites) >= 2
    for h in r.heads:
        assert math.isfinite(h.delta_error_sum) and math.isfinite(h.wq_spectral_norm)
        assert 0.0 <= h.tied_rowmax_ratio <= 1.0


# -------------------------------------------------------------- policy end to end


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.tied = TiedAttention(tie=True)
        self.plain = TiedAttention()

    def forward(self, x):
        return self.plain(x + self.tied(x))


def _biased_kernel(monkeypatch, bias=1e-2):
    monkeypatch.setattr(fw_dispatch, "_dispatch", leaning_dispatch(fw_dispatch._dispatch, bias))


def _drive(model, w, steps, seed=0, vary=False):
    # Fixed input, loss = sum: dO keeps its sign, so c[T] keeps its sign: the planted
    # persistent error of docs/design.md §1 step 3. vary=True draws a new input every step.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 32, generator=g).bfloat16()
    model = model.bfloat16()
    reports = []
    for _ in range(steps):
        if vary:
            x = torch.randn(2, 16, 32, generator=g).bfloat16()
        model(x).float().sum().backward()
        model.zero_grad()
        reports.append(w.step())
    return reports


def _planted_watch(monkeypatch, mitigation):
    """The tied/plain two-layer model on a leaning kernel, watched every step. Identical
    inputs give identical G each step, so z = sqrt(steps in window): it passes 4 after
    17 steps, and again 17 steps after a switch resets the window. The leaning kernel's
    δ error is ≈ 3.5× the W^Q gradient, so rule (a) is switched off here: these tests
    are about the drift rule (rule (a) has its own test)."""
    _biased_kernel(monkeypatch)
    torch.manual_seed(7)
    model = _TwoLayers()
    cfg = fw.WatchConfig(every_n_steps=1, mitigation=mitigation, min_history=8, patience=2,
                         verify_steps=8, window=32, delta_share_threshold=1e9)
    return model, fw.watch(model, config=cfg)


def test_auto_flags_only_the_tied_layer_switches_it_and_escalates(monkeypatch):
    model, w = _planted_watch(monkeypatch, "auto")
    reports = _drive(model, w, 45)
    events = w.events
    assert events, "no event"
    assert {e.layer for e in events} == {"tied"}  # ties only there: only it is flagged
    first = [e for e in events if e.to_mode == Mode.BETA]
    escal = [e for e in events if e.to_mode == Mode.FP32_O]
    assert len(first) == 2 and len(escal) == 2 and all(e.applied for e in events)
    assert min(e.step for e in escal) > max(e.step for e in first)
    assert w.head_modes() == {"tied": [Mode.FP32_O] * 2, "plain": [Mode.STANDARD] * 2}
    # BETA did not stop this kernel's lean; FP32_O removed the δ error at its source.
    last = {(h.layer, h.head): h for h in reports[-1].heads}
    assert last[("tied", 0)].delta_error_sum == 0.0
    assert last[("plain", 0)].delta_error_sum != 0.0
    # every row but each sequence's first (one visible key) is tied: 15/16
    assert reports[-1].heads[0].tied_rowmax_ratio == 15 / 16


def test_advise_recommends_without_switching(monkeypatch):
    model, w = _planted_watch(monkeypatch, "advise")
    reports = _drive(model, w, 22)
    assert w.events and not any(e.applied for e in w.events)
    assert w.head_modes()["tied"] == [Mode.STANDARD] * 2
    assert [h.recommended_mode for h in reports[-1].heads[:2]] == [Mode.BETA] * 2


def test_a_hand_set_mode_restarts_that_heads_verification(monkeypatch):
    # "advise" then the user applies BETA: its verification must see only what follows.
    model, w = _planted_watch(monkeypatch, "advise")
    _drive(model, w, 22)
    assert w.events and w.head_modes()["tied"] == [Mode.STANDARD] * 2
    w.set_head_modes("tied", [Mode.BETA] * 2)
    sd = w.state_dict()
    assert sd["signals"]["fill"][:2].tolist() == [0, 0]  # window emptied
    assert sd["signals"]["fill"][2:].min() > 0  # the other layer keeps its history
    assert sd["policy"]["since_switch"][:2].tolist() == [0, 0]
    assert w.events[-1].reason == "set by user"
    r = _drive(model, w, 1)[0]  # the hand-set changes go out with the next report
    assert [(e.layer, e.head, e.reason) for e in r.events[:2]] == [
        ("tied", 0, "set by user"), ("tied", 1, "set by user")]
    assert all(e.reason != "set by user" for e in _drive(model, w, 1)[0].events)


def test_mask_layers_cannot_be_mitigated_warn_once_and_are_still_measured(caplog):
    def masked(q, k, v):
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    model = nn.Sequential(SmallAttention(masked))
    # the Triton kernels run no mask (the reference does: tests/test_capture.py)
    w = fw.watch(model, every_n_steps=1, backend="triton")
    w.set_head_modes("0", [Mode.BETA, Mode.STANDARD])
    x = torch.randn(2, 8, 32)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        for _ in range(3):
            model(x).backward()
            r = w.step()
    warnings = [rec for rec in caplog.records if "cannot apply head modes" in rec.message]
    assert len(warnings) == 1 and "attn_mask" in warnings[0].message
    assert list(r.unmitigable) == ["0"]
    assert r.unmitigable["0"].startswith("it passes attn_mask, which its backend cannot run")
    assert all(math.isfinite(h.delta_error_sum) for h in r.heads)
    w.remove()


def test_modes_that_never_ran_are_withdrawn_and_reported_as_what_ran():
    """A report is a promise: the mask keeps the layer on SDPA, so its user event turns
    applied=False (in watcher.events and as a copy in the report), the heads report the
    STANDARD mode they ran, and the error is counted, once per report."""
    def masked(q, k, v):
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    model = nn.Sequential(SmallAttention(masked))
    w = fw.watch(model, every_n_steps=1, backend="triton")  # runs no mask
    x = torch.randn(2, 8, 32)
    model(x).backward()
    w.step()
    w.set_head_modes("0", [Mode.FP32_O, Mode.STANDARD])
    r0 = w.step()  # no forward since the change: not judged, still pending
    assert r0 is not None and r0.unmitigable == {} and w.monitor_errors_total == 0
    assert [e.applied for e in r0.events] == [True]
    model(x).backward()
    r1 = w.step()
    assert r1.unmitigable["0"].startswith("it passes attn_mask")
    assert [(e.head, e.to_mode, e.applied) for e in r1.events] == [(0, Mode.FP32_O, False)]
    assert "not applied: it passes attn_mask" in r1.events[0].reason
    assert [e.applied for e in w.events] == [False]
    assert [h.head_mode for h in r1.heads] == [Mode.STANDARD, Mode.STANDARD]
    assert [h.recommended_mode for h in r1.heads][0] == Mode.FP32_O
    assert w.monitor_errors_total == 1
    model(x).backward()
    r2 = w.step()  # still failing: counted again, nothing left to withdraw
    assert r2.events == [] and w.monitor_errors_total == 2 and "0" in r2.unmitigable


def test_modes_that_ran_keep_their_events_applied():
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    model = nn.Sequential(SmallAttention(sdpa))
    w = fw.watch(model, every_n_steps=1)
    x = torch.randn(2, 8, 32)
    model(x).backward()  # a monitored forward with STANDARD modes...
    w.set_head_modes("0", [Mode.BETA, Mode.STANDARD])  # ...then modes, then step()
    r0 = w.step()
    assert r0.unmitigable == {} and w.monitor_errors_total == 0  # not judged on that call
    for _ in range(2):
        model(x).backward()
        r = w.step()
        assert r.unmitigable == {} and r.heads[0].head_mode == Mode.BETA
    assert [e.applied for e in w.events] == [True] and w.monitor_errors_total == 0


def test_a_layer_whose_routing_fails_is_unmitigable_and_its_policy_event_withdrawn(
        monkeypatch):
    """An "auto" switch whose kernel raises: the call falls back to SDPA (training goes
    on), the policy's event is withdrawn and the layer reported with the failure."""
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    def broken(*a, **kw):
        raise RuntimeError("kernel exploded")

    model = nn.Sequential(SmallAttention(sdpa))
    w = fw.watch(model, every_n_steps=1, mitigation="auto")
    x = torch.randn(2, 8, 32)
    model(x).backward()
    w.step()
    monkeypatch.setattr(fw_dispatch, "_dispatch", broken)
    w._set_modes(w.layer_states[0], torch.tensor([int(Mode.BETA), 0], dtype=torch.int32))
    from flashwatch.report import Event  # as the policy would record it
    event = Event(step=1, layer="0", head=0, from_mode=Mode.STANDARD, to_mode=Mode.BETA,
                  reason="policy", applied=True)
    w._pipeline.events.append(event)
    w.layer_states[0].pending.append(event)
    out = model(x)
    out.backward()
    assert torch.isfinite(out)
    r = w.step()
    assert "routing failed (RuntimeError: kernel exploded)" in r.unmitigable["0"]
    assert not event.applied and [e.applied for e in r.events if e.reason.startswith(
        "policy")] == [False]
    assert r.heads[0].head_mode == Mode.STANDARD
    w.remove()  # the logged error's traceback keeps the test's frame (and w) alive


def test_autocast_rotary_style_mixed_dtypes_are_routed_in_the_autocast_dtype():
    def rotaryish(q, k, v):  # like HF Llama under autocast: FP32 q, k (rotary), BF16 v
        return F.scaled_dot_product_attention(q.float(), k.float(), v, is_causal=True)

    torch.manual_seed(0)
    model = nn.Sequential(SmallAttention(rotaryish))
    w = fw.watch(model, every_n_steps=1)
    w.set_head_modes("0", [Mode.BETA, Mode.FP32_O])
    x = torch.randn(2, 8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        q, k, v = (t.view(2, 8, 2, -1).transpose(1, 2) for t in model[0].c_attn(x).split(32, 2))
    want = fw.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                        head_modes=[Mode.BETA, Mode.FP32_O])
    out.float().sum().backward()
    r = w.step()
    assert w.monitor_errors_total == 0 and r.unmitigable == {}
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert all(math.isfinite(h.delta_error_sum) for h in r.heads)


def test_watchconfig_beta_and_eps_win_over_the_callers_inside_a_watched_layer(
        monkeypatch, caplog):
    def calls_with_beta(q, k, v, beta):  # a model that passes its own β and eps
        return fw.attention(q, k, v, causal=True, head_modes=[Mode.BETA] * 2, beta=beta,
                            eps=1e-2)

    seen = []
    real = fw_dispatch._dispatch
    monkeypatch.setattr(fw_dispatch, "_dispatch", lambda *a, **kw: (
        seen.append((kw["beta"], kw["eps"])), real(*a, **kw))[1])
    model = nn.Sequential(SmallAttention(calls_with_beta))
    x = torch.randn(2, 8, 32)
    model[0](x, beta=8.0)
    assert seen == [(8.0, 1e-2)]  # unwatched: the caller's values
    w = fw.watch(model, every_n_steps=1, beta=3.0, eps=2e-3)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        for _ in range(2):
            model[0](x, beta=8.0)
    assert seen[1:] == [(3.0, 2e-3)] * 2
    warnings = [r.message for r in caplog.records if "beta=8.0" in r.message]
    assert len(warnings) == 1 and "beta=3.0" in warnings[0]
    w.remove()
    model[0](x, beta=8.0)
    assert seen[-1] == (8.0, 1e-2)


# ------------------------------------------------------------------- resume, ranks


def test_resume_gives_identical_reports_and_modes(monkeypatch, tmp_path):
    _biased_kernel(monkeypatch)

    def fresh():
        torch.manual_seed(8)
        model = _TwoLayers().bfloat16()
        # 8 of 32 rows sampled per step: the row-sampling RNG must resume exactly too.
        cfg = fw.WatchConfig(every_n_steps=1, mitigation="auto", min_history=8, patience=2,
                             verify_steps=8, window=32, rows_per_head=8,
                             delta_share_threshold=1e9)  # the drift rule decides here
        return model, fw.watch(model, config=cfg)

    def drive(model, w, steps):
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
        out = []
        for _ in range(steps):
            model(x).float().sum().backward()
            model.zero_grad()
            out.append(w.step())
        return [_comparable(r) for r in out]

    model, w_straight = fresh()
    straight = drive(model, w_straight, 90)
    model, w = fresh()
    first = drive(model, w, 40)
    torch.save(w.state_dict(), tmp_path / "w.pt")
    model2, w2 = fresh()  # a new process would rebuild the model and its watcher
    w2.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=False))
    resumed = first + drive(model2, w2, 50)
    assert resumed == straight
    assert w2.head_modes() == w_straight.head_modes()
    assert w2.events == w_straight.events
    steps = [e.step for e in w_straight.events]
    assert min(steps) < 40 < max(steps), steps  # decisions on both sides of the resume


def test_load_state_dict_rejects_another_model():
    w1 = fw.watch(_TwoLayers())
    w2 = fw.watch(GPT(GPTConfig(**SMALL)))
    with pytest.raises(ValueError, match="same model"):
        w2.load_state_dict(w1.state_dict())


class _Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _rank_run(rank):
    """Rank 0: a leaning kernel and a fixed input (a persistent error). Rank 1: a plain
    kernel and a new input each step (no persistence): alone, rank 1 never acts."""
    if rank == 0:
        _biased_kernel(_Patch(), bias=2e-2)
    torch.manual_seed(7)
    model = _TwoLayers()
    cfg = fw.WatchConfig(every_n_steps=1, mitigation="auto", min_history=8, patience=2,
                         verify_steps=8, window=32, delta_share_threshold=1e9)  # drift rule
    w = fw.watch(model, config=cfg)
    _drive(model, w, 30, seed=rank, vary=rank == 1)
    return w


def _gloo_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)

    def forbidden(*args, **kwargs):  # its payload grows with the world size
        raise AssertionError("all_gather")

    dist.all_gather = forbidden
    w = _rank_run(rank)
    assert w.monitor_errors_total == 0
    torch.save({"modes": w.head_modes(), "events": [e.to_dict() for e in w.events]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_gloo_ranks_end_with_identical_modes(tmp_path):
    import torch.multiprocessing as mp

    alone = _rank_run(1)  # the control: rank 1's own numbers never trigger a switch
    assert alone.events == []
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0 == r1
    assert r0["modes"]["tied"] != [Mode.STANDARD] * 2  # the reduced numbers moved both


# ------------------------------------------------------------------------ isolation


def test_a_raising_sink_or_probe_never_stops_training(monkeypatch, caplog):
    class Broken:
        def write(self, report):
            raise OSError("disk full")

        def close(self):
            pass

    torch.manual_seed(9)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, every_n_steps=1, sinks=[Broken()])
    with caplog.at_level(logging.ERROR, logger="flashwatch"):
        reports, _ = _train(model, w, 3)
        assert len(reports) == 3 and w.monitor_errors_total == 3
        from flashwatch import probe

        def boom(*a, **k):
            raise RuntimeError("odd input")

        monkeypatch.setattr(probe, "recompute", boom)
        more, _ = _train(model, w, 2)
    assert len(more) == 2
    assert w.monitor_errors_total == 3 + 2 + 2 * 2  # 5 sink writes, 2 layers × 2 probes
    logged = [r for r in caplog.records if r.name == "flashwatch"]
    assert len(logged) == 3  # once for the sink, once per layer's probe
    assert reports[-1].monitor_errors_total == 3
    w.remove()  # the logged errors' tracebacks keep the test's frame (and w) alive


def test_the_policy_sees_each_heads_max_logit(monkeypatch):
    """The planted drift of _planted_watch, with BETA allowed only below 0.01 nats of
    shift: every switch must go to FP32_O, its reason quoting the reported max logit."""
    _biased_kernel(monkeypatch)
    torch.manual_seed(0)
    model = _TwoLayers()
    w = fw.watch(model, every_n_steps=1, mitigation="auto", min_history=8, patience=2,
                 verify_steps=8, window=32, beta_max_excess=0.01,
                 delta_share_threshold=1e9)  # the planted kernel leans: share ≈ 3.5
    reports = _drive(model, w, 30)
    events = [e for e in w.events if e.kind == "mode"]
    assert events and all(e.to_mode == Mode.FP32_O for e in events)
    e = events[0]
    (rep,) = [r for r in reports if r is not None and r.step == e.step]
    logit = next(h.attention_max_logit for h in rep.heads if (h.layer, h.head) ==
                 (e.layer, e.head))
    assert f"BETA unsafe at max logit {logit:.3g}" in e.reason


def test_the_policy_sees_each_heads_delta_error_share():
    """Rule (a) on the watcher's own numbers: with a threshold every measured share
    exceeds, each head goes to FP32_O after delta_share_steps monitored steps, with the
    reported share in its reason; heads already in FP32_O stay there."""
    torch.manual_seed(0)
    model = _TwoLayers()
    w = fw.watch(model, every_n_steps=1, mitigation="auto", delta_share_threshold=1e-9,
                 delta_share_steps=2)
    reports = [r for r in _drive(model, w, 4) if r is not None]
    w.remove()
    events = [e for e in w.events if e.kind == "mode"]
    assert {(e.layer, e.head) for e in events} == {(h.layer, h.head) for h in reports[0].heads}
    for e in events:
        assert e.to_mode == Mode.FP32_O and e.reason.startswith("[delta_share]")
        assert e.step == reports[1].step  # the second consecutive step over the threshold
        share = next(h.delta_error_share for h in reports[1].heads
                     if (h.layer, h.head) == (e.layer, e.head))
        assert share > 0 and f"W^Q gradient {share:.3g}" in e.reason


# ------------------------------------------------------- δ error on every row, share


def _fused_o_fp64(q, k, v, scale):
    """O before the final rounding in the fused arithmetic, in FP64, causal, one key block:
    P̄ = exp(s - rowmax) rounded to bf16 before P̄V, l = Σ P̄ unrounded (docs/design.md §4)."""
    q, k, v = q.double(), k.double(), v.double()
    s = (q @ k.transpose(-1, -2)) * scale
    T = q.shape[2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p.to(torch.bfloat16).double() @ v) / p.sum(-1, keepdim=True)


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
    c = (do * (o_used.double() - _fused_o_fp64(q, k, v, scale))).sum(-1)  # [B, H, T]
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
    model = _QKV(C, H).bfloat16()
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
    x, y = _batch(torch.Generator().manual_seed(12))
    for rows, all_rows in (("all", True), (16, False)):
        w = fw.watch(model, every_n_steps=1, rows_per_head=rows)
        model(x, y)[1].backward()
        r = w.step()
        w.remove()
        model.zero_grad()
        assert all(h.delta_error_all_rows == all_rows for h in r.heads)
        assert all(h.delta_error_rows == (4 * 32 if all_rows else 16) for h in r.heads)


class _QKV(nn.Module):
    """Separate Q/K/V projections and SDPA (a foreign kernel), width C, H heads."""

    def __init__(self, C, H):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(C, C, bias=False) for _ in "qkv")
        self.num_heads = H

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) \
            .reshape(B, T, C)


def _share_case(seed, C=128, H=2, B=4, T=32, rows="all", watch_seed=0, routed=False):
    """One bf16 step of _QKV; returns (report, per-head FP64 ‖E‖², Σ‖e_T‖², ‖dW^Q‖²).
    routed: SDPA runs flashwatch's reference kernel (route_all), whose own FP32 O (P̄
    rounded to BF16 before P̄V, l unrounded) is what c is measured against."""
    torch.manual_seed(seed)
    model = _QKV(C, H).bfloat16()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).bfloat16()
    wgt = torch.randn(B, T, C, generator=g)
    w = fw.watch(model, sites={"": dict(num_heads=H, q_module="q_proj")}, every_n_steps=1,
                 rows_per_head=rows, seed=watch_seed, route_all=routed, backend="reference")
    (model(x).float() * wgt).sum().backward()
    report = w.step()
    w.remove()
    D = C // H
    with torch.no_grad():
        q, k, v = (p(x).view(B, T, H, D).transpose(1, 2)
                   for p in (model.q_proj, model.k_proj, model.v_proj))
        o_used = (fw.attention(q, k, v, causal=True, backend="reference") if routed
                  else F.scaled_dot_product_attention(q, k, v, is_causal=True))
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, -1)
    pk = p @ k.double()  # [B, H, T, D]
    do = wgt.bfloat16().double().view(B, T, H, D).transpose(1, 2)
    o_fp32 = _fused_o_fp64(q, k, v, D ** -0.5) if routed else p @ v.double()
    c = (do * (o_used.double() - o_fp32)).sum(-1)  # [B, H, T]
    X = x.double()  # [B, T, C]
    E = D ** -0.5 * torch.einsum("bht,bhtd,btc->hdc", c, pk, X)  # Eq. 3, this layer
    diag = D ** -0.5 * c.abs() * pk.norm(dim=-1) * X.norm(dim=-1).unsqueeze(1)
    gq = model.q_proj.weight.grad.double().view(H, D, C)
    return (report, E.square().sum((1, 2)), diag.square().sum((0, 2)),
            gq.square().sum((1, 2)))


def test_delta_error_share_is_sum_of_row_terms_over_the_gradient_fp64():
    # Every row sampled: the estimate is exactly sqrt(Σ_T ‖e_T‖²) / ‖dW^Q_h‖ in FP64.
    report, _, diag, gq = _share_case(21)
    got = torch.tensor([h.delta_error_share for h in report.heads], dtype=torch.float64)
    assert torch.allclose(got, (diag / gq).sqrt(), rtol=2e-2), (got, (diag / gq).sqrt())


def test_routed_share_measures_c_against_the_kernels_own_fp32_o():
    # flashwatch's kernel: c = δ_used - δ(kernel's FP32 O), the error FP32_O removes; the
    # exact-softmax recomputation would also count P̄'s BF16 rounding (a larger c).
    report, _, diag, gq = _share_case(22, rows=16, routed=True)
    report_all, _, diag_all, _ = _share_case(22, routed=True)
    got = torch.tensor([h.delta_error_share for h in report_all.heads], dtype=torch.float64)
    assert torch.allclose(got, (diag_all / gq).sqrt(), rtol=2e-2), (got, diag_all, gq)
    assert all(h.delta_error_all_rows for h in report.heads)  # every row for Σc, 16 for E
    _, _, diag_sdpa, _ = _share_case(22)  # the same step measured as a foreign kernel
    assert not torch.allclose(diag_all, diag_sdpa, rtol=0.05)


def test_delta_error_share_estimates_the_exact_eq3_norm():
    # Row errors of random data add incoherently: Σ‖e_T‖² estimates ‖Σ e_T‖² = ‖E‖²;
    # with 128 rows in d_model = 128 the cross terms leave ~5 % per case, so the mean
    # ratio over 6 cases is within 15 %.
    ratios = []
    for seed in range(6):
        report, exact, _, gq = _share_case(30 + seed)
        est = torch.tensor([h.delta_error_share for h in report.heads], dtype=torch.float64)
        ratios.append(est / (exact / gq).sqrt())
    ratio = torch.stack(ratios).mean(0)
    assert ((ratio > 0.85) & (ratio < 1.15)).all(), torch.stack(ratios)


def test_sampled_share_squared_is_unbiased_over_row_samples():
    # R = 16 of M = 128 rows, scaled by M/R: E[share²] over row samples = the all-row
    # Σ‖e_T‖²/‖dW^Q‖². ‖PK_T‖ of early causal rows is large, so single samples are skewed
    # low (median ≈ 0.5 of the truth here) while the mean of squares is right: measured
    # 0.95 and 1.12 over 32 samples (standard error 0.15); the bound is ~3 standard errors.
    # The naive ‖(M/R) Σ_sampled e_T‖² would be ≈ M/R = 8 times too large.
    full, _, _, _ = _share_case(5)
    full = torch.tensor([h.delta_error_share for h in full.heads], dtype=torch.float64)
    samples = []
    for seed in range(32):
        r, _, _, _ = _share_case(5, rows=16, watch_seed=seed)
        samples.append(torch.tensor([h.delta_error_share for h in r.heads],
                                    dtype=torch.float64))
    mean_sq = torch.stack(samples).square().mean(0) / full.square()
    assert ((mean_sq > 0.55) & (mean_sq < 1.45)).all(), mean_sq


def test_guarded_rows_reach_the_report_exactly():
    # All keys equal (tie=True), q scaled so the row max r_m spreads over ±150: BETA's
    # excess, (β-1)·r_m = r_m above 0 and -r_m below, passes the 60-nat guard in the
    # rows with |r_m| > 60.
    torch.manual_seed(13)
    model = TiedAttention(C=32, H=2, tie=True)
    with torch.no_grad():
        model.c_attn.weight[:32] *= 300.0
    model = model.bfloat16()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(13)).bfloat16()
    w = fw.watch(model, every_n_steps=1)
    w.set_head_modes(w.sites[0].name, [Mode.BETA, Mode.STANDARD])
    model(x).float().sum().backward()
    report = w.step()
    w.remove()
    with torch.no_grad():
        q, k, _ = (t.view(2, 16, 2, -1).transpose(1, 2) for t in model.c_attn(x).split(32, 2))
        s = (q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5
        s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), -math.inf)
        m = s.amax(-1)
        tied = ((s >= (m - 1e-3).unsqueeze(-1)).sum(-1) >= 2)
        want = (tied & (m.abs() > 60.0)).sum((0, 2))
    assert 0 < want[0] < tied[:, 0].sum()
    assert [h.guarded_rows for h in report.heads] == [int(want[0]), 0]


def test_share_uses_the_whole_accumulated_gradient_even_after_zero_grad():
    # Two micro-batches, zero_grad() before watcher.step(): the hook kept ‖g_a + g_b‖²,
    # and ‖E‖² estimates add, so share² = (s_a² ‖g_a‖² + s_b² ‖g_b‖²) / ‖g_a + g_b‖².
    torch.manual_seed(14)
    C, H, B, T = 64, 2, 2, 16
    model = _QKV(C, H).bfloat16()
    g = torch.Generator().manual_seed(14)
    xs = [torch.randn(B, T, C, generator=g).bfloat16() for _ in range(2)]
    ws = [torch.randn(B, T, C, generator=g) for _ in range(2)]
    site = {"": dict(num_heads=H, q_module="q_proj")}

    def run(pairs):
        w = fw.watch(model, sites=site, every_n_steps=1, rows_per_head="all")
        for x, wgt in pairs:
            (model(x).float() * wgt).sum().backward()
        grad = model.q_proj.weight.grad.double().view(H, C // H, C).square().sum((1, 2))
        model.zero_grad(set_to_none=True)
        share = torch.tensor([h.delta_error_share for h in w.step().heads],
                             dtype=torch.float64)
        w.remove()
        return share, grad

    pairs = list(zip(xs, ws, strict=True))
    s_ab, g_ab = run(pairs)
    (s_a, g_a), (s_b, g_b) = run(pairs[:1]), run(pairs[1:])
    want = ((s_a ** 2 * g_a + s_b ** 2 * g_b) / g_ab).sqrt()
    assert torch.allclose(s_ab, want, rtol=1e-6), (s_ab, want)
    assert not torch.allclose(g_ab, g_a + g_b, rtol=1e-2)  # the cross term matters


# -------------------------------------------------------- activation checkpointing


def _checkpointed(model, how):
    """model's blocks recomputed in the backward: torch.utils.checkpoint (reentrant or
    not) on each block's forward, or checkpoint_wrapper around each block."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if how == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )
        model.transformer.h = nn.ModuleList(checkpoint_wrapper(b) for b in model.transformer.h)
        return model
    for block in model.transformer.h:
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block),
                                          use_reentrant=how == "reentrant")
    return model


def _counts(w):
    """Rows counted so far in the step being accumulated, per layer: exact (routed
    kernel), probed and with a gradient. Reports show only ratios of these, in which a
    doubled count would hide, so they are read where they accumulate."""
    return [(int(st.buf.stats.rows[0]), st.buf.probe_rows, st.buf.grad_rows)  # head 0
            for st in w.layer_states]


@pytest.mark.parametrize("rows", [8, 4 * 32])
@pytest.mark.parametrize("route_all", [False, True])
@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "wrapper"])
def test_activation_checkpointing_counts_each_forward_once(how, route_all, rows):
    """The checkpointed run reports exactly what the plain run reports, step after step:
    a recompute that sampled again would move the sampling generator (other rows on the
    next steps), a reentrant recompute's δ would come from another sample, and every
    count would double. 4·32 rows: every row sampled."""
    cfg = dict(every_n_steps=1, rows_per_head=rows, route_all=route_all)
    runs, counts = [], []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        if ckpt:
            model = _checkpointed(model, how)
        w = fw.watch(model, **cfg)
        reports, _ = _train(model, w, 3)
        x, y = _batch(torch.Generator().manual_seed(9))
        _, loss = model(x, y)
        loss.backward()
        counts.append(_counts(w))
        assert w.monitor_errors_total == 0
        runs.append([_comparable(r) for r in reports])
    assert counts[0] == counts[1]
    assert counts[0][0] == (4 * 32 if route_all else 0, rows, rows)
    plain, ckpt = runs
    assert len(plain) == len(ckpt) == 3
    for a, b in zip(plain, ckpt, strict=True):
        for ha, hb in zip(a["heads"], b["heads"], strict=True):
            assert ha["layer"] == hb["layer"]  # canonical names through the wrapper
            for key, va in ha.items():
                if isinstance(va, float):
                    assert va == pytest.approx(hb[key], rel=1e-6, abs=1e-12, nan_ok=True), key
                else:
                    assert va == hb[key], key
            assert math.isfinite(ha["delta_error_sum"])


@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "wrapper"])
def test_modes_under_activation_checkpointing_run_and_their_events_stand(how):
    torch.manual_seed(0)
    model = _checkpointed(GPT(GPTConfig(**SMALL)), how)
    w = fw.watch(model, every_n_steps=1)
    layer = w.sites[0].name
    w.set_head_modes(layer, [Mode.BETA] * SMALL["n_head"])
    reports, _ = _train(model, w, 2)
    assert [r.unmitigable for r in reports] == [{}, {}] and w.monitor_errors_total == 0
    assert len(w.events) == SMALL["n_head"] and all(e.applied for e in w.events)
    assert [h.head_mode for h in reports[-1].heads if h.layer == layer] == [Mode.BETA] * 4
    assert all(st.module_calls == 0 for st in w.layer_states)  # reset by each report


def test_hugging_face_gradient_checkpointing_counts_each_forward_once():
    transformers = pytest.importorskip("transformers")

    def run(ckpt):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        if ckpt:
            model.gradient_checkpointing_enable()
        model.train()
        w = fw.watch(model, every_n_steps=1, rows_per_head=8, route_all=True)
        g = torch.Generator().manual_seed(0)
        reports = []
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 16), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            counts = _counts(w)
            reports.append(_comparable(w.step())["heads"])
        assert w.monitor_errors_total == 0
        return reports, counts

    (plain, n_plain), (ckpt, n_ckpt) = run(False), run(True)
    assert n_plain == n_ckpt == [(2 * 16, 8, 8)] * 2
    for a, b in zip(plain, ckpt, strict=True):
        for ha, hb in zip(a, b, strict=True):
            for key in ("tied_rowmax_ratio", "attention_max_logit", "delta_error_sum"):
                assert ha[key] == pytest.approx(hb[key], rel=1e-6, abs=1e-12), key
            assert math.isfinite(ha["delta_error_sum"])


def test_state_moves_between_the_plain_compiled_and_checkpoint_wrapped_model(monkeypatch):
    """Layer names are canonical: no `_orig_mod.` (torch.compile) and no
    `_checkpoint_wrapped_module.` (checkpoint_wrapper), so the state loads across them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, every_n_steps=1)
    _train(model, w, 2)
    w.set_head_modes("transformer.h.1.attn", [Mode.BETA, 0, 0, Mode.FP32_O])
    state = w.state_dict()
    w.remove()
    for wrapped in (torch.compile(model), _checkpointed(model, "wrapper")):
        w2 = fw.watch(wrapped, every_n_steps=1)
        w2.load_state_dict(state)
        assert w2.head_modes() == w.head_modes()
        assert [s.name for s in w2.sites] == ["transformer.h.0.attn", "transformer.h.1.attn"]
        w2.remove()


def test_attention_dropout_leaves_delta_unmeasured_and_says_so(caplog):
    """With dropout the O the backward used is dropped out and the FP32 recomputation is
    not: c would be the dropout, not rounding. Ties and max logit (from the scores) are
    still measured; δ is NaN with no gradient rows, and the log says why."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL, "dropout": 0.5}))
    w = fw.watch(model, every_n_steps=1)
    x, y = _batch(torch.Generator().manual_seed(0))
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
