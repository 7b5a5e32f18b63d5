"""flashwatch/watcher.py, the façade: attach, cadence, pause, hand-set modes, resume,
remove, never crash. What each room computes is tested in its own file (test_capture,
test_probing, test_aggregate, test_monitored_step)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from _helpers import (
    SMALL,
    TwoLayers,
    batch,
    biased_kernel,
    checkpointed,
    comparable,
    drive,
    planted_watch,
    train,
)
from torch import nn

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode


def test_gpt_bf16_training_reports_every_head_with_finite_metrics():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    with fw.watch(model, every_n_steps=2) as w:
        reports, _ = train(model, w, 6)
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


def test_every_n_steps_skips_unmonitored_steps_entirely():
    torch.manual_seed(4)
    model = GPT(GPTConfig(**SMALL))
    calls = []
    w = fw.watch(model, every_n_steps=3, sinks=[type("S", (), {
        "write": lambda self, r: calls.append(r.step), "close": lambda self: None})()])
    train(model, w, 7)
    assert calls == [0, 3, 6]
    assert w.step_count == 7


def test_paused_forward_passes_are_not_measured():
    torch.manual_seed(5)
    model = GPT(GPTConfig(**SMALL))
    x, y = batch(torch.Generator().manual_seed(5))
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
    x, y = batch(torch.Generator().manual_seed(5))
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


def test_a_hand_set_mode_restarts_that_heads_verification(monkeypatch):
    # "advise" then the user applies BETA: its verification must see only what follows.
    model, w = planted_watch(monkeypatch, "advise")
    drive(model, w, 22)
    assert w.events and w.head_modes()["tied"] == [Mode.STANDARD] * 2
    w.set_head_modes("tied", [Mode.BETA] * 2)
    sd = w.state_dict()
    assert sd["signals"]["fill"][:2].tolist() == [0, 0]  # window emptied
    assert sd["signals"]["fill"][2:].min() > 0  # the other layer keeps its history
    assert sd["policy"]["since_switch"][:2].tolist() == [0, 0]
    assert w.events[-1].reason == "set by user"
    r = drive(model, w, 1)[0]  # the hand-set changes go out with the next report
    assert [(e.layer, e.head, e.reason) for e in r.events[:2]] == [
        ("tied", 0, "set by user"), ("tied", 1, "set by user")]
    assert all(e.reason != "set by user" for e in drive(model, w, 1)[0].events)


def test_resume_gives_identical_reports_and_modes(monkeypatch, tmp_path):
    biased_kernel(monkeypatch)

    def fresh():
        torch.manual_seed(8)
        model = TwoLayers().bfloat16()
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
        return [comparable(r) for r in out]

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
    w1 = fw.watch(TwoLayers())
    w2 = fw.watch(GPT(GPTConfig(**SMALL)))
    with pytest.raises(ValueError, match="same model"):
        w2.load_state_dict(w1.state_dict())


def test_state_moves_between_the_plain_compiled_and_checkpoint_wrapped_model(monkeypatch):
    """Layer names are canonical: no `_orig_mod.` (torch.compile) and no
    `_checkpoint_wrapped_module.` (checkpoint_wrapper), so the state loads across them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, every_n_steps=1)
    train(model, w, 2)
    w.set_head_modes("transformer.h.1.attn", [Mode.BETA, 0, 0, Mode.FP32_O])
    state = w.state_dict()
    w.remove()
    for wrapped in (torch.compile(model), checkpointed(model, "wrapper")):
        w2 = fw.watch(wrapped, every_n_steps=1)
        w2.load_state_dict(state)
        assert w2.head_modes() == w.head_modes()
        assert [s.name for s in w2.sites] == ["transformer.h.0.attn", "transformer.h.1.attn"]
        w2.remove()


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
        reports, _ = train(model, w, 3)
        assert len(reports) == 3 and w.monitor_errors_total == 3
        from flashwatch.monitor import probe

        def boom(*a, **k):
            raise RuntimeError("odd input")

        monkeypatch.setattr(probe, "recompute", boom)
        more, _ = train(model, w, 2)
    assert len(more) == 2
    assert w.monitor_errors_total == 3 + 2 + 2 * 2  # 5 sink writes, 2 layers × 2 probes
    logged = [r for r in caplog.records if r.name == "flashwatch"]
    assert len(logged) == 3  # once for the sink, once per layer's probe
    assert reports[-1].monitor_errors_total == 3
    w.remove()  # the logged errors' tracebacks keep the test's frame (and w) alive
