"""A watched model under torch.compile (flashwatch/monitor/attach.py's forward swap and stance):
no graph break while unwatched, measured and mitigated whether the watcher came before
or after the first compiled step; flashwatch.attention, Hugging Face, checkpointed,
copied and block-wise compiled models. The traced probe: tests/monitor/test_traced.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo
from _helpers import (
    TINY,
    compile_batch,
    compile_gpt,
    compile_step,
    dynamo_stance,
    measured,
    report_fields,
)
from torch import nn
from torch._dynamo.testing import CompileCounter

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode
from flashwatch.kernels import dispatch as fw_dispatch

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_unmonitored_steps_trace_without_a_graph_break_and_fullgraph_holds():
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=2)
    x, y = compile_batch()
    compile_step(model, w)  # step 0 (monitored) done: step 1 is unmonitored
    assert not w.recorder.cadence.measuring
    explained = torch._dynamo.explain(model)(x, y)
    assert explained.graph_break_count == 0, explained.break_reasons
    # fullgraph=True raises on any graph break
    counter = CompileCounter()
    logits, _ = torch.compile(model, backend=counter, fullgraph=True)(x, y)
    assert counter.frame_count == 1 and torch.isfinite(logits).all()
    w.remove()


def test_a_measured_step_restores_the_users_own_stance():
    model = compile_gpt()
    torch.compiler.set_stance("eager_on_recompile")
    try:  # route_all: routed layers run eagerly, so measured steps use force_eager
        w = fw.watch(model, every_n_steps=2, route_all=True)
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"
        compile_step(model, w)  # step 1 is unmonitored: the user's stance again
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
    eager_model = compile_gpt()
    model = copy.deepcopy(eager_model)
    compiled = torch.compile(model, backend="aot_eager")
    if attach == "after":  # a compiled step ran before the watcher existed
        x, y = compile_batch(seed=5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as compile_step: the same guards
            compiled(x, y)[1].backward()
        model.zero_grad(set_to_none=True)
    w = fw.watch(model, rows_per_head="all")
    w_eager = fw.watch(eager_model, rows_per_head="all")
    got, want = compile_step(compiled, w), compile_step(eager_model, w_eager)
    assert all(math.isfinite(h.tied_rowmax_ratio) for h in got.heads)
    assert all(math.isfinite(h.delta_error_sum) for h in got.heads)
    for g, e in zip(measured(got), measured(want), strict=True):
        assert g[:2] == e[:2]
        assert g[2:] == pytest.approx(e[2:], rel=0.05, abs=0.02)
    assert w.monitor_errors_total == 0
    w.remove()
    w_eager.remove()


def test_modes_reach_compiled_code_and_changes_do_not_recompile(monkeypatch):
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=1000)  # only step 0 is monitored
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    compile_step(compiled, w)
    calls = []
    real = fw_dispatch.call_kernel

    def spy(*a, **kw):
        calls.append(kw["head_modes"].clone())
        return real(*a, **kw)

    monkeypatch.setattr(fw_dispatch, "call_kernel", spy)
    compile_step(compiled, w)
    assert calls == []  # unrouted, unmonitored: SDPA as compiled
    w.set_head_modes("transformer.h.0.attn", [Mode.BETA, Mode.STANDARD])
    compile_step(compiled, w)
    assert [m.tolist() for m in calls] == [[int(Mode.BETA), 0]]
    frames = counter.frame_count
    w.set_head_modes("transformer.h.0.attn", [Mode.FP32_O, Mode.BETA])
    compile_step(compiled, w)
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


class MatmulLinear(nn.Linear):
    """A Q projection whose forward is no F.linear call (its pre-hook still fires)."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class SdpaAttention(OwnCallAttention):
    def __init__(self):
        super().__init__()
        self.c_attn = MatmulLinear(32, 96)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, C)


def test_a_traced_layer_whose_q_input_is_not_seen_says_so(caplog):
    """The traced probe takes X from the F.linear call on W^Q; a Q projection computed
    otherwise leaves it without X: logged, and the share is NaN, not a guess."""
    torch.manual_seed(0)
    model = nn.Sequential(SdpaAttention())
    w = fw.watch(model, every_n_steps=1)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8, 32)
    compiled(x).square().sum().backward()
    eager_report = w.step()  # eager: X from the pre-hook
    assert math.isfinite(eager_report.heads[0].delta_error_share)
    with caplog.at_level("WARNING", logger="flashwatch"):
        compiled(x).square().sum().backward()
        report = w.step()
    assert dynamo_stance() == "default" and w.layer_states[0].compiled.traced
    assert "no F.linear call on the Q projection" in caplog.text
    assert all(math.isnan(h.delta_error_share) and math.isfinite(h.delta_error_sum)
               for h in report.heads)
    w.remove()


def test_a_compiled_model_calling_flashwatch_attention_is_measured_and_mitigated():
    torch.manual_seed(0)
    model = nn.Sequential(OwnCallAttention())
    w = fw.watch(model, rows_per_head="all")
    w.set_head_modes("0", [Mode.BETA, Mode.BETA])
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8, 32)
    compiled(x).square().sum().backward()
    report = w.step()
    st = w.layer_states[0]
    assert report.unmitigable == {}
    assert all(math.isfinite(h.tied_rowmax_ratio) for h in report.heads)
    # routed through the watcher: exact counts over every row (2 × 8 per head)
    assert [h.delta_error_rows for h in report.heads] == [16, 16]
    assert st.modes.tolist() == [int(Mode.BETA)] * 2
    w.remove()


def test_a_compiled_layer_calling_flashwatch_attention_keeps_the_eager_path():
    """Inside compiled code flashwatch.attention cannot reach the watcher (no ContextVar
    lookup in a graph), so a layer seen calling it keeps measured steps on force_eager:
    measured on every measured step, never silently skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(OwnCallAttention())
    w = fw.watch(model, every_n_steps=1)
    compiled = torch.compile(model, backend="aot_eager")
    for seed in range(3):
        assert dynamo_stance() == "force_eager"
        compiled(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(seed))
                 ).square().sum().backward()
        report = w.step()
        assert [h.delta_error_rows for h in report.heads] == [16, 16]
    assert w.layer_states[0].compiled.fw_seen and not w.layer_states[0].compiled.traced
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


def _llama(transformers):
    """A tiny rotary GQA Llama on SDPA."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa"))


def test_a_hugging_face_llama_traces_unmonitored_steps_without_a_graph_break():
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    w = fw.watch(model, every_n_steps=2)
    w.step()  # step 1: unmonitored
    x = torch.randint(0, 64, (2, 16))
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    w.remove()
    attn = model.model.layers[0].self_attn
    assert type(attn) is transformers.models.llama.modeling_llama.LlamaAttention


def test_a_compiled_autocast_llama_is_measured_in_graph_like_eager():
    """Rotary GQA Llama under autocast (SDPA gets FP32 q, k and a BF16 v): the traced probe
    measures the BF16 tensors SDPA computes with, as the eager one, with fullgraph=True on
    unmonitored and monitored steps."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    eager = copy.deepcopy(model)
    w = fw.watch(model, every_n_steps=2, rows_per_head="all")
    w_eager = fw.watch(eager, every_n_steps=2, rows_per_head="all")
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    def step(m, watcher, seed):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x, labels=x).loss.backward()
        return watcher.step()

    for seed in range(5):
        got, want = step(compiled, w, seed), step(eager, w_eager, seed)
    assert dynamo_stance() == "default" and counter.frame_count == 2
    for g, e in zip(report_fields(got), report_fields(want), strict=True):  # step 4: traced
        assert g[:2] == e[:2] and all(math.isfinite(x) for x in g[2:-1])
        assert g[2:] == pytest.approx(e[2:], rel=1e-6, abs=1e-12)
    assert w.monitor_errors_total == 0
    w.remove()
    w_eager.remove()


@pytest.mark.parametrize("how", ["non_reentrant", "wrapper"])
def test_a_compiled_checkpointed_model_counts_each_forward_once(how):
    """Activation checkpointing inside a compiled model: every report is the plain eager
    model's, and the compiled graph keeps running on unmonitored steps. A checkpointed
    layer keeps the force_eager path on monitored steps: entering the traced probe's
    mode inside a checkpoint region is a graph break in the layer loop, after which
    Dynamo would run that frame eagerly on every step."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    model = compile_gpt()
    eager = copy.deepcopy(model)
    if how == "wrapper":
        model.transformer.h = nn.ModuleList(checkpoint_wrapper(b) for b in model.transformer.h)
    else:
        for block in model.transformer.h:
            block.forward = functools.partial(checkpoint, type(block).forward.__get__(block),
                                              use_reentrant=False)
    w = fw.watch(model, every_n_steps=2, rows_per_head=8)
    w_eager = fw.watch(eager, every_n_steps=2, rows_per_head=8)
    calls = []

    def backend(gm, inputs):  # counts runs of the compiled graph
        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run

    compiled = torch.compile(model, backend=backend)
    graph_runs = []
    for seed in range(6):  # monitored at 0, 2, 4: eager (force_eager); 1, 3, 5 compiled
        before = len(calls)
        got, want = compile_step(compiled, w, seed=seed), compile_step(eager, w_eager, seed=seed)
        graph_runs.append(len(calls) - before)
        if got is None:
            continue
        for g, e in zip(report_fields(got), report_fields(want), strict=True):
            assert g[:2] == e[:2] and g[-1] == e[-1] == 8  # rows with c: counted once
            assert g[2:] == pytest.approx(e[2:], rel=1e-5, abs=1e-10)
        assert dynamo_stance() == "default"  # the next step is unmonitored
    assert graph_runs == [0, 1, 0, 1, 0, 1]  # the graph survives the monitored steps
    assert all(st.compiled.checkpointed and not st.compiled.traced for st in w.layer_states)
    assert w.monitor_errors_total == 0
    w.remove()
    w_eager.remove()


def test_a_deep_copy_of_a_watched_model_computes_with_its_own_weights():
    """The wrapped forward is the module's class's, so `self` is the copy (an EMA copy,
    a DataParallel replica), not the module the watcher was attached to."""
    model = compile_gpt()
    w = fw.watch(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    x, _ = compile_batch()
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
    model = GPT(GPTConfig(**{**TINY, "n_layer": 10}))
    w = fw.watch(model, every_n_steps=2)
    counter = CompileCounter()
    for block in model.transformer.h:
        block.compile(backend=counter)
    x, _ = compile_batch()
    reports = []
    for _ in range(6):  # monitored (eager), unmonitored, monitored (traced), ...
        model(x)[0].sum().backward()
        reports.append(w.step())
    assert counter.frame_count <= 3  # pre-attention graph + one per step kind
    assert all(math.isfinite(h.tied_rowmax_ratio) for h in reports[4].heads)
    assert len({type(b.attn) for b in model.transformer.h}) == 1
    w.remove()
