"""flashwatch/monitor/monitored_step.py: a watched model's monitored steps end to end: W^Q norms,
the policy deciding on the reported numbers, modes judged on what ran (unmitigable layers,
withdrawn events) and ranks that decide the same."""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F
from _helpers import (
    SMALL,
    SmallAttention,
    TwoLayers,
    batch,
    biased_kernel,
    drive,
    planted_watch,
)
from torch import nn

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode
from flashwatch.kernels import dispatch as fw_dispatch


def test_spectral_norm_in_reports_equals_matrix_norm():
    torch.manual_seed(1)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, every_n_steps=1)
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        x, y = batch(g)
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


def test_auto_flags_only_the_tied_layer_switches_it_and_escalates(monkeypatch):
    model, w = planted_watch(monkeypatch, "auto")
    reports = drive(model, w, 45)
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
    model, w = planted_watch(monkeypatch, "advise")
    reports = drive(model, w, 22)
    assert w.events and not any(e.applied for e in w.events)
    assert w.head_modes()["tied"] == [Mode.STANDARD] * 2
    assert [h.recommended_mode for h in reports[-1].heads[:2]] == [Mode.BETA] * 2


def test_the_policy_sees_each_heads_max_logit(monkeypatch):
    """The planted drift of planted_watch, with BETA allowed only below 0.01 nats of
    shift: every switch must go to FP32_O, its reason quoting the reported max logit."""
    biased_kernel(monkeypatch)
    torch.manual_seed(0)
    model = TwoLayers()
    w = fw.watch(model, every_n_steps=1, mitigation="auto", min_history=8, patience=2,
                 verify_steps=8, window=32, beta_max_excess=0.01,
                 delta_share_threshold=1e9)  # the planted kernel leans: share ≈ 3.5
    reports = drive(model, w, 30)
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
    model = TwoLayers()
    w = fw.watch(model, every_n_steps=1, mitigation="auto", delta_share_threshold=1e-9,
                 delta_share_steps=2)
    reports = [r for r in drive(model, w, 4) if r is not None]
    w.remove()
    events = [e for e in w.events if e.kind == "mode"]
    assert {(e.layer, e.head) for e in events} == {(h.layer, h.head) for h in reports[0].heads}
    for e in events:
        assert e.to_mode == Mode.FP32_O and e.reason.startswith("[delta_share]")
        assert e.step == reports[1].step  # the second consecutive step over the threshold
        share = next(h.delta_error_share for h in reports[1].heads
                     if (h.layer, h.head) == (e.layer, e.head))
        assert share > 0 and f"W^Q gradient {share:.3g}" in e.reason


def learned_bias(q, k, v):
    """Causal attention with an additive mask that requires grad (a learned bias, as T5's
    relative position bias): the one mask the Triton kernels refuse (NotInKernel)."""
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    bias = torch.zeros(n, n).masked_fill(~causal, float("-inf")).requires_grad_()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum()


def test_mask_layers_cannot_be_mitigated_warn_once_and_are_still_measured(caplog):
    model = nn.Sequential(SmallAttention(learned_bias))
    # the Triton kernels give a mask no gradient (the reference does: tests/monitor/test_capture.py)
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
    model = nn.Sequential(SmallAttention(learned_bias))
    w = fw.watch(model, every_n_steps=1, backend="triton")  # gives the mask no gradient
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
    # every measured share is over the threshold: the first report switches both heads
    w = fw.watch(model, every_n_steps=1, mitigation="auto", delta_share_threshold=1e-9,
                 delta_share_steps=1)
    x = torch.randn(2, 8, 32)
    model(x).backward()
    r0 = w.step()
    assert [(e.head, e.to_mode, e.applied) for e in r0.events] == [
        (0, Mode.FP32_O, True), (1, Mode.FP32_O, True)]
    monkeypatch.setattr(fw_dispatch, "call_kernel", broken)
    out = model(x)
    out.backward()
    assert torch.isfinite(out)
    r = w.step()
    assert "routing failed (RuntimeError: kernel exploded)" in r.unmitigable["0"]
    assert [e.applied for e in w.events[:2]] == [False, False]
    assert [(e.head, e.applied) for e in r.events] == [(0, False), (1, False)]
    assert all("not applied: routing failed" in e.reason for e in r.events)
    assert [h.head_mode for h in r.heads] == [Mode.STANDARD] * 2
    w.remove()  # the logged error's traceback keeps the test's frame (and w) alive


class _Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _rank_run(rank):
    """Rank 0: a leaning kernel and a fixed input (a persistent error). Rank 1: a plain
    kernel and a new input each step (no persistence): alone, rank 1 never acts."""
    if rank == 0:
        biased_kernel(_Patch(), bias=2e-2)
    torch.manual_seed(7)
    model = TwoLayers()
    cfg = fw.WatchConfig(every_n_steps=1, mitigation="auto", min_history=8, patience=2,
                         verify_steps=8, window=32, delta_share_threshold=1e9)  # drift rule
    w = fw.watch(model, config=cfg)
    drive(model, w, 30, seed=rank, vary=rank == 1)
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
