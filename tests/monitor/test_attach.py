"""flashwatch/monitor/attach.py: the forward swap, the step hooks armed on monitored steps only,
recompute detection, and a module's own instance attribute `forward` wrapped, whether
set before watch or after."""

from __future__ import annotations

import copy
import functools
import math
import types

import pytest
import torch
from _helpers import TINY, compile_gpt, measured
from torch._dynamo.testing import CompileCounter

import flashwatch as fw
from examples.gpt import CausalSelfAttention
from flashwatch import Mode
from flashwatch.monitor import attach

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _step(model, watcher, seed=0):
    idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(seed))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    model.zero_grad(set_to_none=False)  # keep .grad tensors: hooks must not depend on it
    return watcher.step()


def _hook_counts(model):
    """(forward pre-hooks on every c_attn, post-accumulate-grad hooks on its weight)."""
    pre = sum(len(b.attn.c_attn._forward_pre_hooks) for b in model.transformer.h)
    grad = sum(len(getattr(b.attn.c_attn.weight, "_post_accumulate_grad_hooks", None) or {})
               for b in model.transformer.h)
    return pre, grad


def test_step_hooks_are_registered_on_monitored_steps_only():
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=3)
    n = TINY["n_layer"]
    seen = []
    for step in range(7):
        seen.append(_hook_counts(model))
        report = _step(model, w, seed=step)
        if step % 3 == 0:  # the monitored step still measured its share of dW^Q
            assert all(math.isfinite(h.delta_error_share) for h in report.heads)
    assert seen == [(n, n) if s % 3 == 0 else (0, 0) for s in range(7)]
    w.remove()
    assert _hook_counts(model) == (0, 0)


def _flashwatch_calls_and_ops(fn):
    """(Python functions of flashwatch's own files called, tensor ops dispatched) in fn()."""
    import collections
    import os
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    roots = (os.path.dirname(fw.__file__) + os.sep,)  # the package and its subpackages
    calls = collections.Counter()

    model_file = os.path.join(os.path.dirname(fw.__file__), "nanogpt.py")  # the model's

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(roots) and name != model_file:
            calls[frame.f_code.co_name] += 1

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    sys.setprofile(profile)
    try:
        with Ops():
            fn()
    finally:
        sys.setprofile(None)
    return calls, Ops.n


def test_an_unmonitored_step_runs_only_the_forward_wrapper():
    """What an unmonitored step pays in the model (benchmarks/bench_watcher.py reads its
    cost as 0): one call of the swapped forward per layer, forward and backward, and not
    one tensor op more than the unwatched model."""
    plain, watched = compile_gpt(), compile_gpt()
    w = fw.watch(watched, every_n_steps=2)
    _step(watched, w)  # the monitored step 0; step 1 is not monitored

    def train(model):
        idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()

    calls, ops = _flashwatch_calls_and_ops(lambda: train(watched))
    assert dict(calls) == {"forward": TINY["n_layer"]}
    assert ops == _flashwatch_calls_and_ops(lambda: train(plain))[1]
    w.step()  # step 2 is monitored: the same count sees the probe
    calls, more_ops = _flashwatch_calls_and_ops(lambda: train(watched))
    assert calls["_probe"] == TINY["n_layer"] and more_ops > ops
    w.remove()


def test_paused_steps_and_resumed_state_arm_the_hooks_of_the_step_they_are_at():
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=2)
    _step(model, w)
    state = w.state_dict()  # taken at step 1: unmonitored
    w.remove()
    w2 = fw.watch(model, every_n_steps=2)
    assert _hook_counts(model) == (2, 2)  # a new watcher starts at a monitored step 0
    w2.load_state_dict(state)
    assert _hook_counts(model) == (0, 0)
    w2.remove()


def test_compiled_unmonitored_steps_do_not_recompile_when_hooks_come_and_go():
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=2)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    for step in range(4):  # two monitored/unmonitored cycles: every graph variant exists
        _step(compiled, w, seed=step)
    frames = counter.frame_count
    for step in range(4, 10):
        report = _step(compiled, w, seed=step)
        if report is not None:
            assert all(math.isfinite(h.delta_error_share) for h in report.heads)
    assert counter.frame_count == frames
    w.remove()


def test_a_watched_module_gets_one_shared_subclass_and_gets_its_class_back():
    model = compile_gpt()
    base = type(model.transformer.h[0].attn)
    w = fw.watch(model)
    classes = {type(b.attn) for b in model.transformer.h}
    assert len(classes) == 1 and issubclass(classes.pop(), base)
    assert all(attach.LINK in b.attn.__dict__ for b in model.transformer.h)
    w.remove()
    assert all(type(b.attn) is base and attach.LINK not in b.attn.__dict__
               for b in model.transformer.h)


def _compiles() -> bool:
    """Whether torch.compile makes a graph now: a fresh function (a new code object, so
    no cache entry) through a counting backend. Under the force_eager stance it runs
    eagerly and the backend never sees a frame."""
    counter = CompileCounter()
    namespace: dict = {}
    exec("def f(x):\n    return x.sin() * 2", namespace)  # noqa: S102 (a new code object)
    torch.compile(namespace["f"], backend=counter)(torch.randn(3))
    return counter.frame_count == 1 and counter.op_count > 0


def test_the_eager_stance_holds_while_any_watcher_measures():
    a, b = compile_gpt(0), compile_gpt(1)
    # route_all: routed layers run eagerly, so their measured steps use force_eager
    wa = fw.watch(a, every_n_steps=2, route_all=True)
    wb = fw.watch(b, every_n_steps=3, route_all=True)
    compiles = []
    for step in range(6):
        compiles.append(_compiles())
        _step(a, wa, seed=step)
        _step(b, wb, seed=step)
    # measured steps (eager): a at 0, 2, 4; b at 0, 3
    assert compiles == [False, True, False, False, False, True]
    wa.remove()
    assert not _compiles()  # b measures step 6
    wb.remove()
    assert _compiles()


def test_a_watcher_dropped_while_measuring_gives_the_stance_back():
    """A watcher never removed, collected with its model while the next step is to be
    measured, must not leave every later torch.compile in the process running eagerly."""
    import gc

    model = compile_gpt()
    w = fw.watch(model, every_n_steps=1, route_all=True)
    _step(model, w)
    assert not _compiles()  # measuring: a new compile runs eagerly (force_eager)
    del model, w
    gc.collect()
    assert _compiles()  # a later compile still produces a graph


# --------------------------------------------------------- a module's own forward

def _attns(model):
    return [b.attn for b in model.transformer.h]


def _own_forward(kind, attn, base):
    """An instance attribute `forward` for `attn`, as user code and trainers set them.
    method: calls the class forward it finds at call time (the watched one, once
    watched); bound: a closure over the `attn.forward` found when it was set (torchtitan's
    Module.parallelize); partial: `base.forward`, the class's own function, so it never
    reaches a watched class's forward."""
    if kind == "method":
        return types.MethodType(lambda self, *a, **k: type(self).forward(self, *a, **k), attn)
    if kind == "bound":
        bound = attn.forward

        def forward(*args, **kwargs):
            return bound(*args, **kwargs)
        return forward
    return functools.partial(base.forward, attn)


def _set_forwards(model, kind):
    for a in _attns(model):
        a.forward = _own_forward(kind, a, CausalSelfAttention)


def _heads(report):
    return [(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio, h.delta_error_sum)
            for h in report.heads]


def _reports(model, steps=6, every=2, at=None, then=None):
    """The heads of each monitored step's report (steps 0, 2, 4) of `model` watched every
    `every` steps, and the watcher's error count; then(model) runs before step `at`'s
    forward (0: right after watch)."""
    w = fw.watch(model, every_n_steps=every)
    out = []
    for step in range(steps):
        if step == at:
            then(model)
        report = _step(model, w, seed=step)
        if report is not None:
            out.append(_heads(report))
    w.remove()
    return out, w.monitor_errors_total


KINDS = ["method", "bound", "partial"]


@pytest.fixture(scope="module")
def unowned():
    """The reports of the model without an instance forward: what each test must match."""
    out, errors = _reports(compile_gpt())
    assert errors == 0 and all(math.isfinite(h[2]) for heads in out for h in heads)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_an_instance_forward_set_before_watch_is_measured_as_the_class_forward(kind, unowned):
    model = compile_gpt()
    _set_forwards(model, kind)
    assert _reports(model) == (unowned, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_an_instance_forward_set_after_some_steps_is_measured_from_the_next_one(kind,
                                                                                unowned):
    """Set at the unmonitored step 3: found when monitored step 4 is armed."""
    assert _reports(compile_gpt(), at=3, then=lambda m: _set_forwards(m, kind)) == (unowned, 0)


@pytest.mark.parametrize("kind", ["method", "bound"])
def test_an_instance_forward_set_right_after_watch_that_calls_the_class_forward(kind,
                                                                                unowned):
    """Set before the first monitored step's forward, after watch armed it: the class
    forward it calls measures step 0, the wrapper from the end of step 0 on; never
    both (a call measured twice would double delta_error_sum)."""
    assert _reports(compile_gpt(), at=0, then=lambda m: _set_forwards(m, kind)) == (unowned, 0)


def test_an_instance_forward_that_escapes_the_step_it_was_set_in_is_counted(unowned):
    """Set after watch armed monitored step 0, calling the class's own function: step 0
    cannot see the layers (NaN) and counts one monitor error per layer; wrapped at the
    end of step 0, steps 2 and 4 are measured."""
    out, errors = _reports(compile_gpt(), at=0, then=lambda m: _set_forwards(m, "partial"))
    assert errors == TINY["n_layer"]
    assert all(math.isnan(h[2]) for h in out[0]) and out[1:] == unowned[1:]


@pytest.mark.parametrize("at", [None, 1], ids=["before_watch", "after_watch"])
def test_remove_gives_the_module_its_own_forward_object_back(at):
    model = compile_gpt()
    owns = []

    def set_forwards(m):
        owns.extend(_own_forward("partial", a, CausalSelfAttention) for a in _attns(m))
        for a, own in zip(_attns(m), owns, strict=True):
            a.forward = own
    if at is None:
        set_forwards(model)
    w = fw.watch(model, every_n_steps=2)
    for step in range(3):
        if step == at:
            set_forwards(model)
        _step(model, w, seed=step)
    assert all(isinstance(a.__dict__["forward"], attach.OwnForward) for a in _attns(model))
    w.remove()
    for a, own in zip(_attns(model), owns, strict=True):
        assert a.__dict__["forward"] is own and type(a) is CausalSelfAttention
        assert attach.LINK not in a.__dict__ and attach.OWN_LINK not in a.__dict__
    plain = compile_gpt()
    w = fw.watch(plain)
    w.remove()
    assert all("forward" not in a.__dict__ for a in _attns(plain))  # nothing of ours left


def test_accelerate_hooks_added_and_removed_while_watched(unowned):
    """accelerate's add_hook_to_module keeps `module.forward` (flashwatch's wrapper of
    the module's own forward) and calls it from its own; wrapped in turn, the call is
    measured once and never loops; remove_hook_from_module puts the kept one back."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = compile_gpt()
    _set_forwards(model, "partial")
    owns = [a.forward for a in _attns(model)]
    w = fw.watch(model, every_n_steps=2)
    out = []
    for step in range(6):
        if step == 1:
            for a in _attns(model):
                hooks.add_hook_to_module(a, hooks.ModelHook())
        if step == 3:
            for a in _attns(model):
                hooks.remove_hook_from_module(a)
        report = _step(model, w, seed=step)
        if report is not None:
            out.append(_heads(report))
    w.remove()
    assert (out, w.monitor_errors_total) == (unowned, 0)
    assert all(a.forward is own for a, own in zip(_attns(model), owns, strict=True))


def test_a_deep_copy_runs_its_own_weights_through_its_own_forward():
    """copy.deepcopy rebinds flashwatch's wrapper and a bound own forward to the copy."""
    model = compile_gpt()
    _set_forwards(model, "method")
    w = fw.watch(model)
    twin = copy.deepcopy(model)
    for a, b in zip(_attns(model), _attns(twin), strict=True):
        ours = b.__dict__["forward"]
        assert isinstance(ours, attach.OwnForward) and ours.module is b
        assert ours.own.__self__ is b and b.__dict__[attach.OWN_LINK] is a.__dict__[
            attach.OWN_LINK]  # the Link is shared: the copy is measured as the layer
    x = torch.randn(1, 4, TINY["n_embd"])
    with torch.no_grad():
        _attns(twin)[0].c_proj.weight.zero_()
        _attns(twin)[0].c_proj.bias.zero_()
        assert _attns(twin)[0](x).abs().max() == 0 and _attns(model)[0](x).abs().max() > 0
    w.remove()


def test_an_unmonitored_step_runs_only_the_wrapper_of_an_instance_forward():
    """An own forward that never reaches the class forward: one call of its wrapper per
    layer and no tensor op more than the unwatched model, as for the class forward."""
    plain, watched = compile_gpt(), compile_gpt()
    _set_forwards(watched, "partial")
    w = fw.watch(watched, every_n_steps=2)
    _step(watched, w)

    def train(model):
        idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()

    calls, ops = _flashwatch_calls_and_ops(lambda: train(watched))
    assert dict(calls) == {"__call__": TINY["n_layer"]}
    assert ops == _flashwatch_calls_and_ops(lambda: train(plain))[1]
    w.remove()


@pytest.mark.parametrize("kind", ["method", "partial"])
def test_compiled_with_instance_forwards_as_without(kind):
    """torch.compile(fullgraph=True) traces flashwatch's wrapper of a layer's own
    forward: no graph break, as many graphs as without it, the same numbers."""
    def run(model):
        torch._dynamo.reset()
        w = fw.watch(model, every_n_steps=2)
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        out = [measured(r) for step in range(6)
               if (r := _step(compiled, w, seed=step)) is not None]
        w.remove()
        return out, w.monitor_errors_total, counter.frame_count

    model = compile_gpt()
    _set_forwards(model, kind)
    assert run(model) == run(compile_gpt())


def test_module_compile_of_a_layer_with_its_own_forward(unowned):
    """nn.Module.compile() compiles _call_impl, which calls the instance forward."""
    model = compile_gpt()
    _set_forwards(model, "partial")
    for a in _attns(model):
        a.compile(backend="eager", fullgraph=True)
    assert _reports(model) == (unowned, 0)


def test_routing_turned_on_wraps_a_forward_set_since_the_last_arm():
    """Head modes set at unmonitored step 1, after the layer got its own forward: its
    routed forwards are seen from that step on, not from the next monitored step."""
    model = compile_gpt()
    w = fw.watch(model, every_n_steps=4)
    _step(model, w)
    _set_forwards(model, "partial")
    w.set_head_modes("transformer.h.0.attn", [Mode.FP32_O, Mode.STANDARD])
    _step(model, w, seed=1)
    assert [st.module_calls for st in w.layer_states] == [1, 0]
    w.remove()


def test_a_forward_that_cannot_be_wrapped_counts_an_error_at_every_measured_step():
    model = compile_gpt()
    a = _attns(model)[0]
    a.forward = "not callable"
    w = fw.watch(model, every_n_steps=2)
    for _ in range(4):  # measured steps 0 and 2 (the model cannot run)
        w.step()
    assert w.layer_states[0].shadowed and w.monitor_errors_total == 2
    del a.forward  # nothing of its own: the class forward runs, and measures
    report = _step(model, w, seed=4)
    w.remove()
    assert not w.layer_states[0].shadowed and w.monitor_errors_total == 2
    assert all(math.isfinite(h.attention_max_logit) for h in report.heads)
