"""A watched model under torch.compile: no graph break while unwatched, measured and
mitigated whether the watcher came before or after the first compiled step."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode
from flashwatch import dispatch as fw_dispatch

SMALL = dict(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**SMALL))


def _batch(seed=0):
    idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1], idx[:, 1:]


def _step(model, watcher, seed=0):
    x, y = _batch(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    return watcher.step()


def _measured(report):
    """Per-head measurements that do not depend on compiled-vs-eager rounding order."""
    return [(h.layer, h.head, h.tied_rowmax_ratio, h.attention_max_logit)
            for h in report.heads]


def test_unmonitored_steps_trace_without_a_graph_break_and_fullgraph_holds():
    model = _gpt()
    w = fw.watch(model, every_n_steps=2)
    x, y = _batch()
    _step(model, w)  # step 0 (monitored) done: step 1 is unmonitored
    assert not w._measuring
    explained = torch._dynamo.explain(model)(x, y)
    assert explained.graph_break_count == 0, explained.break_reasons
    # fullgraph=True raises on any graph break
    counter = CompileCounter()
    logits, _ = torch.compile(model, backend=counter, fullgraph=True)(x, y)
    assert counter.frame_count == 1 and torch.isfinite(logits).all()
    w.remove()


def test_monitored_steps_run_the_compiled_model_eagerly_and_leave_its_graph_whole():
    """Measured steps run under Dynamo's force_eager stance: nothing is compiled or
    broken there. A graph break instead would sit in GPT.forward's layer loop, where
    Dynamo gives up on the whole frame for good (the unmonitored steps after it then ran
    the loop eagerly, 2.7 % slower). Afterwards: one full graph, the user's stance back."""
    model = _gpt()
    w = fw.watch(model, every_n_steps=2)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    report = _step(compiled, w)  # step 0, monitored
    assert counter.frame_count == 0 and all(math.isfinite(h.tied_rowmax_ratio)
                                            for h in report.heads)
    for seed in range(1, 6):  # unmonitored, monitored, ...
        _step(compiled, w, seed=seed)
    assert counter.frame_count == 1  # GPT.forward as one graph, compiled once
    w.remove()
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_a_measured_step_restores_the_users_own_stance():
    model = _gpt()
    torch.compiler.set_stance("eager_on_recompile")
    try:
        w = fw.watch(model, every_n_steps=2)
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"
        _step(model, w)  # step 1 is unmonitored: the user's stance again
        assert torch._dynamo.eval_frame._stance.stance == "eager_on_recompile"
        w.pause()
        w.step()  # step 2: monitored but paused (validation): compiled as usual
        assert torch._dynamo.eval_frame._stance.stance == "eager_on_recompile"
        w.resume()
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"
        w.remove()
        assert torch._dynamo.eval_frame._stance.stance == "eager_on_recompile"
    finally:
        torch.compiler.set_stance("default")


@pytest.mark.parametrize("attach", ["before", "after"])
def test_compiled_steps_measure_like_eager_attached_before_or_after(attach):
    eager_model = _gpt()
    model = copy.deepcopy(eager_model)
    compiled = torch.compile(model, backend="aot_eager")
    if attach == "after":  # a compiled step ran before the watcher existed
        x, y = _batch(seed=5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as _step: the same guards
            compiled(x, y)[1].backward()
        model.zero_grad(set_to_none=True)
    w = fw.watch(model, rows_per_head="all")
    w_eager = fw.watch(eager_model, rows_per_head="all")
    got, want = _step(compiled, w), _step(eager_model, w_eager)
    assert all(math.isfinite(h.tied_rowmax_ratio) for h in got.heads)
    assert all(math.isfinite(h.delta_error_sum) for h in got.heads)
    for g, e in zip(_measured(got), _measured(want), strict=True):
        assert g[:2] == e[:2]
        assert g[2:] == pytest.approx(e[2:], rel=0.05, abs=0.02)
    assert w.monitor_errors_total == 0
    w.remove()
    w_eager.remove()


def test_modes_reach_compiled_code_and_changes_do_not_recompile(monkeypatch):
    model = _gpt()
    w = fw.watch(model, every_n_steps=1000)  # only step 0 is monitored
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    _step(compiled, w)
    calls = []
    real = fw_dispatch._dispatch

    def spy(*a, **kw):
        calls.append(kw["head_modes"].clone())
        return real(*a, **kw)

    monkeypatch.setattr(fw_dispatch, "_dispatch", spy)
    _step(compiled, w)
    assert calls == []  # unrouted, unmonitored: SDPA as compiled
    w.set_head_modes("transformer.h.0.attn", [Mode.BETA, Mode.STANDARD])
    _step(compiled, w)
    assert [m.tolist() for m in calls] == [[int(Mode.BETA), 0]]
    frames = counter.frame_count
    w.set_head_modes("transformer.h.0.attn", [Mode.FP32_O, Mode.BETA])
    _step(compiled, w)
    assert [m.tolist() for m in calls[1:]] == [[int(Mode.FP32_O), int(Mode.BETA)]]
    assert counter.frame_count == frames, "a mode change must not recompile"
    w.remove()


class OwnCallAttention(nn.Module):
    """Calls flashwatch.attention itself (nanoGPT layout: c_attn, n_head)."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(32, 96)
        self.n_head = 2

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in (q, k, v))
        return fw.attention(q, k, v, causal=True).transpose(1, 2).reshape(B, T, C)


class ManualAttention(OwnCallAttention):
    """Softmax written out: no call flashwatch can route."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in (q, k, v))
        p = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return (p @ v).transpose(1, 2).reshape(B, T, C)


def test_a_compiled_model_calling_flashwatch_attention_is_measured_and_mitigated():
    torch.manual_seed(0)
    model = nn.Sequential(OwnCallAttention())
    w = fw.watch(model, rows_per_head="all")
    w.set_head_modes("0", [Mode.BETA, Mode.BETA])
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8, 32)
    compiled(x).square().sum().backward()
    report = w.step()
    st = w._states[0]
    assert report.unmitigable == {}
    assert all(math.isfinite(h.tied_rowmax_ratio) for h in report.heads)
    # routed through the watcher: exact counts over every row (2 × 8 per head)
    assert [h.delta_error_rows for h in report.heads] == [16, 16]
    assert st.modes.tolist() == [int(Mode.BETA)] * 2
    w.remove()


def test_modes_on_a_layer_without_a_routable_call_are_reported_unmitigable():
    torch.manual_seed(0)
    model = nn.Sequential(ManualAttention())
    w = fw.watch(model)
    w.set_head_modes("0", [Mode.FP32_O, Mode.STANDARD])
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(2, 8, 32)).sum().backward()
    report = w.step()
    assert "no attention call" in report.unmitigable["0"]
    assert w.monitor_errors_total == 1
    # the user event is withdrawn, the heads report the mode that ran
    assert [(e.to_mode, e.applied) for e in report.events] == [(Mode.FP32_O, False)]
    assert [e.applied for e in w.events] == [False]
    assert [h.head_mode for h in report.heads] == [Mode.STANDARD, Mode.STANDARD]
    w.remove()


def test_a_hugging_face_llama_traces_unmonitored_steps_without_a_graph_break():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa"))
    w = fw.watch(model, every_n_steps=2)
    w.step()  # step 1: unmonitored
    x = torch.randint(0, 64, (2, 16))
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    w.remove()
    attn = model.model.layers[0].self_attn
    assert type(attn) is transformers.models.llama.modeling_llama.LlamaAttention


def test_a_deep_copy_of_a_watched_model_computes_with_its_own_weights():
    """The wrapped forward is the module's class's, so `self` is the copy (an EMA copy,
    a DataParallel replica), not the module the watcher was attached to."""
    model = _gpt()
    w = fw.watch(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    x, _ = _batch()
    w.remove()  # forwards now pass straight through
    reference = copy.deepcopy(twin)
    for m in reference.modules():  # the copy keeps the watched class: compare unwatched
        if type(m).__name__ == "CausalSelfAttention":
            m.__class__ = type(m).__mro__[1]
    assert torch.equal(twin(x)[0], reference(x)[0])
    assert not torch.equal(twin(x)[0], model(x)[0])


def test_blocks_compiled_one_by_one_share_their_graphs():
    """Regional compilation: every block's attention has the same watched class, so
    Dynamo compiles Block.forward for the monitored and the unmonitored step only, not
    once per layer (10 layers: past Dynamo's recompile limit of 8 if it did)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL, "n_layer": 10}))
    w = fw.watch(model, every_n_steps=2)
    counter = CompileCounter()
    for block in model.transformer.h:
        block.compile(backend=counter)
    x, _ = _batch()
    for _ in range(4):  # monitored, unmonitored, monitored, unmonitored
        model(x)[0].sum().backward()
        w.step()
    assert counter.frame_count <= 3  # pre-attention graph + one per step kind
    assert len({type(b.attn) for b in model.transformer.h}) == 1
    w.remove()
