"""flashwatch/monitor/attach.py: the forward swap, the step hooks armed on monitored steps only,
and recompute detection."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import TINY, compile_gpt
from torch._dynamo.testing import CompileCounter

import flashwatch as fw
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
