"""flashwatch/mitigation/qkclip.py: per-head QK-clip on nanoGPT, HF (GQA, q/k biases) and GPT-2
Conv1D layouts brings planted heads to τ and leaves the others alone; advise and off;
failures counted; the confirm rule; 2 gloo ranks; state_dict resume; events in the sinks
and the run report. Which rows each layout scales: test_qkclip_layouts.py."""

from __future__ import annotations

import math
import os

import pytest
import torch
from _helpers import llama_with_qk_bias, qk_gpt, token_batch
from sdpa_calls import SdpaCalls, scores

import flashwatch as fw
from flashwatch.mitigation import qkclip
from flashwatch.sites import find_sites
from standins import LlamaConfig, TinyGPT2, TinyLlama

pytestmark = pytest.mark.usefixtures("one_thread")
TAU = 4.0


def site_max_logits(sites, inputs) -> list[torch.Tensor]:
    """Max logit per head of each site's attention module run on the given input."""
    out = []
    for site, inp in zip(sites, inputs, strict=True):
        with torch.no_grad(), SdpaCalls() as m:
            site.module(inp)
        out.append(scores(m.calls[0]).amax((0, 2, 3)))
    return out


def site_inputs(model, sites, x) -> list[torch.Tensor]:
    """The input of every site's module in one forward pass of `model` on x."""
    got = {}
    hooks = [s.module.register_forward_pre_hook(
        lambda mod, args, i=i: got.__setitem__(i, args[0].detach())) for i, s in
        enumerate(sites)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return [got[i] for i in range(len(sites))]


MODELS = {"nanogpt": qk_gpt, "hf_gqa_bias": llama_with_qk_bias, "gpt2_conv1d": TinyGPT2}


def _qk_params(site):
    """The live tensors QK-clip may touch: (name, tensor) pairs."""
    mods = ([site.module.q_proj, site.module.k_proj] if site.kind == "hf"
            else [site.module.c_attn])
    return [(f"{i}.{n}", p) for i, m in enumerate(mods) for n, p in m.named_parameters()]


BOOSTED = ([0], [0, 3])  # heads driven over τ in layers 0 and 1


def _boost(model, x):
    """Scale W^Q so that layer 0 head 0 and layer 1 heads 0 and 3 have max logits of
    about 6 τ on x and every other head about τ / 2. Returns (sites, their inputs)."""
    sites = find_sites(model)
    for _ in range(3):  # biases and the layers below make one rescale approximate
        inputs = site_inputs(model, sites, x)
        with torch.no_grad():
            for site, m, heads in zip(sites, site_max_logits(sites, inputs), BOOSTED,
                                      strict=True):
                w = site.wq()  # a view of the live weight
                for h in range(site.num_heads):
                    target = 6 * TAU + 2 * h if h in heads else 0.5 * TAU
                    w[h].mul_(target / abs(float(m[h])))
    inputs = site_inputs(model, sites, x)
    for m, heads in zip(site_max_logits(sites, inputs), BOOSTED, strict=True):
        over = torch.zeros_like(m, dtype=torch.bool)
        over[heads] = True
        assert ((m > TAU) == over).all(), m
    return sites, inputs


def _one_step(model, w, x):
    _, loss = model(x, x)
    loss.backward()
    return w.step()


def _channels_touched(p, old, site) -> torch.Tensor:
    """Per head-sized block of output channels: did any element change?"""
    dim = 1 if site.kind == "gpt2_conv1d" and p.dim() == 2 else 0
    changed = (p != old).movedim(dim, 0).reshape(p.shape[dim], -1).any(1)
    return changed.view(-1, site.head_dim).any(1)


@pytest.mark.parametrize("kind", MODELS)
def test_clip_brings_the_max_logit_to_tau_and_leaves_other_heads_alone(kind):
    torch.manual_seed(0)
    model = MODELS[kind]()
    x = token_batch(model)
    sites, inputs = _boost(model, x)
    m0 = site_max_logits(sites, inputs)
    saved = {(s.name, n): p.detach().clone() for s in sites for n, p in _qk_params(s)}
    w = fw.watch(model, every_n_steps=1, route_all=True, mitigation="auto",
                 qk_clip_threshold=TAU)
    report = _one_step(model, w, x)
    clipped_state = {k: v.clone() for k, v in model.state_dict().items()}
    confirming = _one_step(model, w, x)  # the next measurement sees the clips
    w.remove()
    model.load_state_dict(clipped_state)
    m1 = site_max_logits(sites, inputs)  # each layer on the same input as before
    for site, a, b in zip(sites, m0, m1, strict=True):
        H, group = site.num_heads, site.num_heads // site.num_kv_heads
        over = a > TAU
        k_over = over.view(site.num_kv_heads, group).any(1)
        # Over τ: now τ up to FP32 rounding (GQA: a group-mate's smaller η may push it lower).
        assert (b[over] <= TAU * (1 + 1e-5)).all(), (site.name, a, b)
        if group == 1:
            torch.testing.assert_close(b[over], torch.full_like(b[over], TAU), rtol=1e-5,
                                       atol=0)
        untouched = ~over & ~k_over.repeat_interleave(group)
        assert torch.equal(b[untouched], a[untouched])
        for name, p in _qk_params(site):
            touched = _channels_touched(p.detach(), saved[(site.name, name)], site)
            if site.kind == "hf":
                want = over if name.startswith("0.") else k_over
            else:  # fused [q | k | v]: v never
                want = torch.cat([over, k_over, torch.zeros(H, dtype=torch.bool)])
            assert torch.equal(touched, want), (site.name, name, touched, want)
    events = [e for e in report.events if e.kind == "qk_clip"]
    clipped = {(s.name, h) for s, heads in zip(sites, BOOSTED, strict=True) for h in heads}
    assert len(events) == 3 and report.qk_clips_total == 0  # applied, not yet confirmed
    assert {(e.layer, e.head) for e in events} == clipped
    assert all(e.applied and "τ 4" in e.reason and "η = " in e.reason for e in events)
    confirmed = [e for e in confirming.events if e.reason.startswith("[qk_clip confirmed]")]
    assert {(e.layer, e.head) for e in confirmed} == clipped and all(e.applied for e in confirmed)
    assert confirming.qk_clips_total == 3


def test_factors():
    m = torch.tensor([2.0, 8.0, math.nan, math.inf, -50.0, 4.0])
    assert qkclip.clip_factors(m, 4.0).tolist() == [1.0, 0.5, 1.0, 1.0, 1.0, 1.0]
    eta = torch.tensor([1.0, 0.5, 0.9, 1.0], dtype=torch.float64)
    assert qkclip.kv_factors(eta, 2).tolist() == [0.5, 0.9]
    assert qkclip.kv_factors(eta, 1).tolist() == [0.5]


@pytest.mark.parametrize("mitigation", ["advise", "off"])
def test_advise_reports_the_factor_and_off_does_nothing(mitigation):
    torch.manual_seed(0)
    model = qk_gpt()
    x = token_batch(model)
    _boost(model, x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    w = fw.watch(model, every_n_steps=1, route_all=True, mitigation=mitigation,
                 qk_clip_threshold=TAU)
    report = _one_step(model, w, x)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    events = [e for e in report.events if e.kind == "qk_clip"]
    assert report.qk_clips_total == 0
    if mitigation == "off":
        assert events == []
        return
    assert len(events) == 3 and not any(e.applied for e in events)
    m = {(e.layer, e.head): e for e in events}
    rec = {(h.layer, h.head): h.attention_max_logit for h in report.heads}
    for key, e in m.items():
        eta = TAU / rec[key]
        assert f"η = {eta:.3g}" in e.reason and f"W^Q × η^0.5 = {math.sqrt(eta):.3g}" in e.reason


def test_off_by_default_and_validated():
    assert fw.WatchConfig().qk_clip_threshold is None
    with pytest.raises(ValueError, match="qk_clip_threshold"):
        fw.WatchConfig(qk_clip_threshold=0.0)
    with pytest.raises(ValueError, match="qk_clip_alpha"):
        fw.WatchConfig(qk_clip_alpha=1.5)


def test_explicit_sites_are_refused_when_clipping():
    from standins import TinyViTish

    model = TinyViTish()
    sites = {f"blocks.{i}.attn": dict(num_heads=4, q_module="qkv") for i in range(2)}
    fw.watch(model, sites=sites).remove()  # fine without QK-clip
    with pytest.raises(ValueError, match="explicit"):
        fw.watch(model, sites=sites, qk_clip_threshold=TAU)


def test_a_failing_clip_is_counted_not_raised(monkeypatch):
    torch.manual_seed(0)
    model = qk_gpt()
    x = token_batch(model)
    _boost(model, x)
    w = fw.watch(model, every_n_steps=1, mitigation="auto", qk_clip_threshold=TAU)

    def boom(*a, **k):
        raise RuntimeError("odd weight")

    monkeypatch.setattr(qkclip, "plan_scaling", boom)
    before = [p.detach().clone() for p in model.parameters()]
    report = _one_step(model, w, x)
    assert report is not None and w.monitor_errors_total == 1
    # all or nothing: no site is scaled when one fails (replicas keep equal weights)
    assert not [e for e in report.events if e.kind == "qk_clip"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    w.remove()  # the logged error's traceback keeps the test's frame (and w) alive


def _train(model, w, opt, steps, seed):
    for i in range(steps):
        x = token_batch(model, seed=seed + i)
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step()


def test_state_dict_resume_is_exact():
    # τ low enough that heads are clipped at most monitored steps of an ordinary run.
    def fresh():
        torch.manual_seed(3)
        model = qk_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        w = fw.watch(model, every_n_steps=2, mitigation="auto", qk_clip_threshold=0.3)
        return model, opt, w

    model, opt, w = fresh()
    _train(model, w, opt, 12, seed=0)
    assert sum(e.applied and e.reason.startswith("[qk_clip] max") for e in w.events) > 5
    assert w.state_dict()["qk_clip"]["clips"].sum() > 2
    a, oa, wa = fresh()
    _train(a, wa, oa, 5, seed=0)
    ckpt = {"model": a.state_dict(), "opt": oa.state_dict(), "fw": wa.state_dict()}
    b, ob, wb = fresh()
    b.load_state_dict(ckpt["model"])
    ob.load_state_dict(ckpt["opt"])
    wb.load_state_dict(ckpt["fw"])
    _train(b, wb, ob, 7, seed=5)
    for (n, p), q in zip(model.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert [e.to_dict() for e in wb.events] == [e.to_dict() for e in w.events]
    assert torch.equal(wb.state_dict()["qk_clip"]["clips"], w.state_dict()["qk_clip"]["clips"])


def _gloo_clip_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)  # the same model on both ranks
    model = qk_gpt()
    x = token_batch(model)
    _boost(model, x)
    if rank == 1:  # another batch: other max logits, some larger than rank 0's
        x = token_batch(model, seed=1)
    sites = find_sites(model)
    mine = site_max_logits(sites, site_inputs(model, sites, x))
    w = fw.watch(model, every_n_steps=1, route_all=True, mitigation="auto",
                 qk_clip_threshold=TAU)
    _one_step(model, w, x)
    torch.save({"weights": {n: p.detach() for n, p in model.named_parameters()},
                "events": [e.to_dict() for e in w.events], "mine": mine},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_gloo_ranks_apply_identical_factors(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_gloo_clip_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0["events"] == r1["events"] and r0["events"]
    for n in r0["weights"]:
        assert torch.equal(r0["weights"][n], r1["weights"][n]), n
    # The factors came from the max over both ranks, not from each rank's own batch.
    torch.manual_seed(0)
    model = qk_gpt()
    x0 = token_batch(model)
    _boost(model, x0)
    joint = [torch.maximum(a, b) for a, b in zip(r0["mine"], r1["mine"], strict=True)]
    # rank 1's max is larger on some head rank 0 clips, so rank 0 alone would differ
    assert any(((b > a) & (a > TAU)).any() for a, b in zip(r0["mine"], r1["mine"],
                                                           strict=True))
    sites = find_sites(model)
    for site, m in zip(sites, joint, strict=True):
        qkclip.scale_site(site, qkclip.clip_factors(m, TAU), 0.5)
    for n, p in model.named_parameters():  # FP32 scores in the op against FP64 here
        torch.testing.assert_close(r0["weights"][n], p.detach(), rtol=1e-5, atol=0, msg=n)


def test_clip_events_reach_the_sinks_and_the_run_report(tmp_path):
    import io

    from flashwatch.report import runreport
    from flashwatch.report.sinks import ConsoleSink, JsonlSink

    torch.manual_seed(0)
    model = qk_gpt()
    x = token_batch(model)
    _boost(model, x)
    out = io.StringIO()
    w = fw.watch(model, every_n_steps=1, route_all=True, mitigation="auto",
                 qk_clip_threshold=TAU,
                 sinks=[JsonlSink(tmp_path / "flashwatch.jsonl"), ConsoleSink(stream=out)])
    _one_step(model, w, x)
    w.remove()
    assert out.getvalue().count("QK-clipped") == 3 and "->" not in out.getvalue().split(
        "worst heads")[0]
    md = runreport._markdown(runreport.load_run(tmp_path))
    assert "## QK-clips" in md and "None: no head was flagged" in md  # clips are no modes
    assert md.count("| transformer.h.") == 3


def test_a_clip_without_effect_is_not_counted_and_stops(monkeypatch):
    """A planted clip that changes nothing (it plans no write): the next
    measurement does not confirm it, it is not counted, and the head is not clipped
    again once its clips should have halved its logits."""
    torch.manual_seed(0)
    model = qk_gpt()
    x = token_batch(model)
    _boost(model, x)
    monkeypatch.setattr(qkclip, "plan_scaling", lambda *a, **k: [])
    w = fw.watch(model, every_n_steps=1, route_all=True, mitigation="auto",
                 qk_clip_threshold=TAU)
    reports = [_one_step(model, w, x) for _ in range(3)]
    w.remove()
    kinds = [[e.reason.split("]")[0] + "]" for e in r.events if e.kind == "qk_clip"]
             for r in reports]
    assert kinds[0] == ["[qk_clip]"] * 3  # three clips applied
    assert kinds[1] == ["[qk_clip not confirmed]"] * 3  # η ≈ 1/6: stopped at once
    assert kinds[2] == []  # stopped heads are not clipped again
    assert all(r.qk_clips_total == 0 for r in reports)
    assert all("stops clipping" in e.reason and not e.applied for e in reports[1].events
               if e.kind == "qk_clip")


def test_confirm_rule_pending_and_state():
    torch.manual_seed(0)
    sites = find_sites(TinyLlama(LlamaConfig()))
    clip = qkclip.QKClip(fw.WatchConfig(mitigation="auto", qk_clip_threshold=TAU), sites)
    modes = torch.zeros(8, dtype=torch.int32)
    m0 = torch.tensor([8.0, 2, 2, 2, 10, 2, 2, 12])
    assert len(clip.apply(0, m0, modes)) == 3
    # needed ≤ max(τ, m0 - ½(m0 - τ)): 6 for head 0, 7 for head 4, 8 for head 7
    m1 = torch.tensor([6.0, 2, 2, 2, 7.5, 2, 2, math.nan])
    ok, bad = clip.confirm(m1, step=1)
    assert [(e.layer, e.head, e.step) for e in ok] == [(sites[0].name, 0, 1)]
    assert [(e.layer, e.head) for e in bad] == [(sites[1].name, 0)]
    assert clip.total == 1 and clip.pending[7] == 12  # unmeasured: still pending
    sd = clip.state_dict()
    again = qkclip.QKClip(clip.config, sites)
    again.load_state_dict(sd)
    assert again.total == 1 and again.pending[7] == 12
    ok, bad = again.confirm(torch.tensor([2.0] * 7 + [3.9]), step=2)
    assert [(e.layer, e.head) for e in ok] == [(sites[1].name, 3)] and again.total == 2
    # head 4's clip scaled its logits by 0.4 ≤ ½ and 7.5 > sqrt(0.4)·10: it stops
    assert clip.stopped.nonzero().flatten().tolist() == [4]
    with pytest.raises(ValueError, match="pending"):
        again.load_state_dict({**sd, "pending": torch.zeros(3)})
    old = qkclip.QKClip(clip.config, sites)
    old.load_state_dict({"clips": sd["clips"]})  # a state from before confirmation
    assert old.total == 1 and torch.isnan(old.pending).all()
    events = old.stop_layer(3, sites[1].name, "its W^Q slice failed the Q check")
    assert [(e.head, e.applied) for e in events] == [(h, False) for h in range(4)]
    assert old.stopped.tolist() == [False] * 4 + [True] * 4
    assert old.stop_layer(4, sites[1].name, "again") == []  # once
    events = old.apply(5, torch.full((8,), 100.0), modes)  # every head far over τ
    assert {(e.layer, e.applied) for e in events} == {(sites[0].name, True)}  # 1 not clipped
