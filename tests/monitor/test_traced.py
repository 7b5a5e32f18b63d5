"""flashwatch/monitor/traced.py: the probe ops, their registry and the layer's Interceptor, and
monitored steps of a compiled model that stay compiled: the traced probe measures like
the eager one, its gradients reach their own samples, modes take a layer back to the
eager path. The other compiled recipes are in tests/monitor/test_compile.py."""
from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
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
from flashwatch.monitor import traced

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _qkv(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 8, 4, generator=g, dtype=dtype) for _ in range(3)]


def test_the_ops_pass_schema_fake_and_autograd_checks():
    q, k, v = _qkv()
    out = torch.randn(2, 2, 8, 4, requires_grad=True)
    key = torch.tensor(10**9)  # registered to no watcher: the ops only copy
    torch.library.opcheck(traced.probe, (q, k, v, out, None, None, key, True, None))
    torch.library.opcheck(traced.probe_grad, (torch.randn(2, 2, 8, 4), key, torch.tensor(-1)))


def test_an_unknown_key_copies_and_passes_the_gradient_through():
    q, k, v = _qkv()
    out = torch.randn(2, 2, 8, 4, requires_grad=True)
    got, call = traced.probe(q, k, v, out, None, None, torch.tensor(10**9), True, None)
    assert torch.equal(got, out) and got.data_ptr() != out.data_ptr() and int(call) == -1
    g = torch.randn_like(out)
    got.backward(g)
    assert torch.equal(out.grad, g)


def test_the_registry_forgets_removed_and_collected_watchers():
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32))
    w = fw.watch(model)
    keys = [st.compiled.key for st in w.layer_states]
    assert len(set(keys)) == 2 and all(traced._lookup(k)[0] is w.recorder for k in keys)
    w.remove()
    assert all(k not in traced._SITES for k in keys)
    w2 = fw.watch(model)  # the model's layers hold it: collected with the model
    keys2 = [st.compiled.key for st in w2.layer_states]
    assert not set(keys2) & set(keys)  # keys are never reused
    del w, w2, model  # w (removed) still held the layers, hence w2
    gc.collect()
    assert all(k not in traced._SITES for k in keys2)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(8, 8))
        self.other = nn.Linear(8, 8)


def test_q_path_finds_a_linear_inside_the_module_only():
    m = _Attn()
    assert traced.q_path(m, m.proj[0]) == "proj.0"
    assert traced.q_path(m.proj[0], m.proj[0]) == ""
    assert traced.q_path(m, nn.Linear(8, 8)) is None  # not inside
    assert traced.q_path(m, m.proj) is None  # not an nn.Linear
    assert traced.q_path(m, None) is None


def test_sdpa_args_by_name_whatever_was_positional():
    q, k, v = _qkv()
    a = traced.sdpa_args((q, k, v, None, 0.0, True), {"scale": 0.5})
    assert a["query"] is q and a["value"] is v and a["is_causal"] is True
    assert a["scale"] == 0.5 and "enable_gqa" not in a


def test_autocast_qkv_gives_what_sdpa_computes_with():
    q, k, _ = _qkv()
    v = torch.randn(2, 2, 8, 4).bfloat16()  # a rotary model under autocast: FP32 q, k
    assert [t.dtype for t in traced.autocast_qkv(q, k, v)] == [torch.float32,
                                                               torch.float32,
                                                               torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = traced.autocast_qkv(q, k, v)
    assert [t.dtype for t in got] == [torch.bfloat16] * 3
    assert torch.equal(got[0], q.bfloat16())


def test_the_interceptor_keeps_x_of_the_q_weight_and_probes_each_sdpa_call(monkeypatch):
    seen = []
    monkeypatch.setattr(traced, "probe", lambda q, k, v, out, x, mask, key, causal, scale:
                        seen.append((x, mask, int(key), causal, scale)) or (out, None))
    lin, other = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 8, 4)
    q, k, v = _qkv()
    with traced.Interceptor(torch.tensor(7), lin.weight):
        other(x + 1)  # another Linear: not X
        lin(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(seen) == 1
    got_x, mask, key, causal, scale = seen[0]
    assert got_x is x and mask is None and key == 7 and causal is True and scale is None
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("wq", [None, "other"])
def test_the_interceptor_without_a_matching_q_weight_hands_no_x(monkeypatch, wq):
    seen = []
    monkeypatch.setattr(traced, "probe",
                        lambda q, k, v, out, x, *rest: seen.append(x) or (out, None))
    lin = nn.Linear(4, 4)
    q, k, v = _qkv()
    with traced.Interceptor(torch.tensor(0), None if wq is None else nn.Linear(4, 4).weight):
        lin(torch.randn(2, 8, 4))
        F.scaled_dot_product_attention(q, k, v)
    assert seen == [None]


def test_monitored_steps_stay_compiled_once_each_layer_was_seen_calling_sdpa():
    """The first measured step runs compiled code eagerly (force_eager): the watcher has
    not seen what the layers call. From the next one on, every layer having made plain
    SDPA calls, the probe is traced into the graph (flashwatch/monitor/traced.py): GPT.forward
    is compiled once per step kind with no graph break, the user's stance stays, and
    every reported number is the eager model's."""
    model = compile_gpt()
    eager = copy.deepcopy(model)
    w = fw.watch(model, every_n_steps=2, rows_per_head="all")
    w_eager = fw.watch(eager, every_n_steps=2, rows_per_head="all")
    counter = CompileCounter()
    runs = []

    def backend(gm, inputs):  # CompileCounter's count, and the graph's runs
        counter(gm, inputs)

        def run(*args):
            runs.append(1)
            return gm.forward(*args)
        return run

    compiled = torch.compile(model, backend=backend)
    stances, reports, graph_runs = [], 0, []
    for seed in range(7):  # monitored at 0, 2, 4, 6
        stances.append(dynamo_stance())
        before = len(runs)
        got, want = compile_step(compiled, w, seed=seed), compile_step(eager, w_eager, seed=seed)
        graph_runs.append(len(runs) - before)
        assert (got is None) == (want is None)
        if got is not None:
            reports += 1
            for g, e in zip(report_fields(got), report_fields(want), strict=True):
                assert g[:2] == e[:2]
                assert all(math.isfinite(x) for x in g[2:-1])
                assert g[2:] == pytest.approx(e[2:], rel=1e-6, abs=1e-12)
        if seed == 0:
            assert counter.frame_count == 0  # eager: nothing compiled
    assert reports == 4
    assert stances == ["force_eager"] + ["default"] * 6
    assert counter.frame_count == 2  # unmonitored and monitored graph, each whole
    assert graph_runs == [0] + [1] * 6  # and each step after the first runs one
    assert w.monitor_errors_total == 0
    w.remove()
    w_eager.remove()


def test_a_traced_monitored_step_has_no_graph_break_and_fullgraph_holds():
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=1)
    compile_step(model, w)  # measured eagerly: every layer seen calling SDPA
    assert all(st.compiled.traced for st in w.layer_states) and dynamo_stance() == "default"
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)  # raises on a break
    report = compile_step(compiled, w, seed=1)
    assert counter.frame_count == 1
    assert all(math.isfinite(h.tied_rowmax_ratio) and math.isfinite(h.delta_error_sum)
               for h in report.heads)
    assert all(h.delta_error_rows > 0 for h in report.heads)
    w.remove()


def test_modes_set_on_a_traced_model_take_it_back_to_the_eager_path():
    """A routed layer runs eagerly (its kernel needs the watcher's Python), so head modes
    set once the probe was traced put measured steps back on force_eager at once, and
    the modes run (the report says so, nothing unmitigable)."""
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=1)
    compiled = torch.compile(model, backend="aot_eager")
    compile_step(compiled, w)
    assert dynamo_stance() == "default"  # layers seen: traced from here
    w.set_head_modes("transformer.h.0.attn", [Mode.FP32_O, Mode.STANDARD])
    assert dynamo_stance() == "force_eager" and not w.layer_states[0].compiled.traced
    report = compile_step(compiled, w, seed=1)
    assert report.unmitigable == {} and w.monitor_errors_total == 0
    assert [h.head_mode for h in report.heads[:2]] == [Mode.FP32_O, Mode.STANDARD]
    assert report.heads[0].delta_error_rows == 2 * 16  # the kernel's own rows: all of them
    w.remove()


def test_a_traced_gradient_reaches_its_own_forwards_sample():
    """Two forwards, one backward (a second forward whose output is dropped, e.g. a
    metric computed with grad on): the gradient belongs to the first call's rows. The
    ops carry a call id from forward to backward, so the traced probe pairs them as
    eager autograd hooks do."""
    model = compile_gpt()
    eager = copy.deepcopy(model)
    w, w_eager = (fw.watch(m, every_n_steps=1, rows_per_head=8) for m in (model, eager))
    compiled = torch.compile(model, backend="aot_eager")
    runs = ((compiled, w), (eager, w_eager))
    for m, watcher in runs:  # both learn (the stance is process-wide)
        compile_step(m, watcher)
    assert dynamo_stance() == "default"  # the compiled model's probe is traced from here on
    reports = []
    for m, watcher in runs:
        x, y = compile_batch(seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, y)[1]
            m(*compile_batch(seed=2))  # a second forward, never backpropagated
        loss.backward()
        reports.append(watcher.step())
    assert len(w.layer_states[0].buf.traced_pending) == 0  # cleared by the report
    for g, e in zip(report_fields(reports[0]), report_fields(reports[1]), strict=True):
        assert g[:2] == e[:2] and g[-1] == e[-1] == 8
        assert g[2:] == pytest.approx(e[2:], rel=1e-6, abs=1e-12)
    w.remove()
    w_eager.remove()


def test_a_traced_step_holds_its_samples_one_micro_batch_and_x_not_at_all():
    """Gradient accumulation (4 micro-batches) on a traced monitored step: each
    micro-batch's samples are reduced and let go once its gradients arrived, no layer
    keeps the Q projection's input X, and the report is the eager model's."""
    model = compile_gpt()
    eager = copy.deepcopy(model)
    w, w_eager = (fw.watch(m, every_n_steps=1, rows_per_head=8) for m in (model, eager))
    compiled = torch.compile(model, backend="aot_eager")
    runs = ((compiled, w), (eager, w_eager))
    for m, watcher in runs:
        compile_step(m, watcher)  # both learn; traced from here on
    reports = []
    for m, watcher in runs:
        for seed in range(4):
            x, y = compile_batch(seed=10 + seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m(x, y)[1].backward()
            assert [len(st.buf.traced_pending) for st in watcher.layer_states] == [0, 0]
            assert [len(st.buf.samples) for st in watcher.layer_states] == [0, 0]  # reduced
            assert all(st.buf.x is None for st in watcher.layer_states)
        reports.append(watcher.step())
    assert all(st.compiled.traced for st in w.layer_states) and dynamo_stance() == "default"
    for g, e in zip(report_fields(reports[0]), report_fields(reports[1]), strict=True):
        assert g[:2] == e[:2] and g[-1] == e[-1] == 4 * 8
        assert g[2:] == pytest.approx(e[2:], rel=1e-6, abs=1e-12)
    w.remove()
    w_eager.remove()


def test_a_traced_gradient_without_its_call_is_said(caplog):
    """A backward after step() (the call's sample went with the report): logged, not
    paired with something else."""
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=1)
    compiled = torch.compile(model, backend="aot_eager")
    compile_step(compiled, w)
    x, y = compile_batch(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(x, y)[1]
    w.step()
    with caplog.at_level("WARNING", logger="flashwatch"):
        loss.backward()
    assert "found no probed call to pair with" in caplog.text
    assert all(st.buf.samples == [] and st.buf.grad_rows == 0 for st in w.layer_states)
    w.remove()


def test_a_traced_monitored_step_runs_under_inductor_like_eager():
    """The recipe users run: inductor. Tie ratio and max logit are those of the eager
    model's sampled rows (the same rows: one generator, the same call order)."""
    model = compile_gpt()
    eager = copy.deepcopy(model)
    w, w_eager = fw.watch(model, every_n_steps=2), fw.watch(eager, every_n_steps=2)
    compiled = torch.compile(model)
    for seed in range(3):
        got, want = compile_step(compiled, w, seed=seed), compile_step(eager, w_eager, seed=seed)
    assert dynamo_stance() == "default" and all(st.compiled.traced for st in w.layer_states)
    for g, e in zip(measured(got), measured(want), strict=True):  # step 2: traced
        assert g[:2] == e[:2] and g[2:] == pytest.approx(e[2:], rel=0.02, abs=0.02)
    assert all(math.isfinite(h.delta_error_sum) and h.delta_error_rows == 2 * 16  # B·T
               for h in got.heads)
    assert w.monitor_errors_total == 0
    w.remove()
    w_eager.remove()
