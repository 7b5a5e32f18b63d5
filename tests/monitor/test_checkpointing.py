"""flashwatch/monitor/checkpointing.py: a recompute is known as one, and flashwatch's own
ops inside a selectively checkpointed region are invisible to its policy, so the model's
region saves and recomputes exactly what it would without flashwatch."""

from __future__ import annotations

import torch
from _helpers import SMALL, batch, checkpointed
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch.monitor.checkpointing import (
    SAC_MODES,
    outside_selective_checkpoint,
    recomputing,
)


def test_recomputing_is_true_only_inside_a_checkpoint_recompute():
    seen = []

    def f(x):
        seen.append(recomputing())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    checkpoint(f, x, use_reentrant=False).sum().backward()
    checkpoint(f, x, use_reentrant=True).sum().backward()
    assert seen == [False, True, False, True]


class Ops(TorchDispatchMode):
    """Records the ops it sees (a FLOP counter, a profiler: modes that must stay)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_only_the_selective_checkpoint_modes_are_lifted_and_all_come_back():
    """Inside a SAC region, with a user's mode under it and another above it: the block
    runs under both user modes (in their order) and no SAC mode; afterwards the stack is
    exactly what it was."""
    inside, below, above = [], Ops(), Ops()

    def region(x):
        with above:
            before = list(_get_current_dispatch_mode_stack())
            with outside_selective_checkpoint():
                inside.append(list(_get_current_dispatch_mode_stack()))
                torch.mm(x, x)
            assert _get_current_dispatch_mode_stack() == before
            return x.sin()

    from _helpers import sac_policy
    x = torch.randn(3, 3, requires_grad=True)
    with below:
        checkpoint(region, x, use_reentrant=False, context_fn=sac_policy()).sum().backward()
    first, recompute = inside
    for stack in (first, recompute):
        assert not any(isinstance(m, SAC_MODES) for m in stack)
        assert stack.index(below) < stack.index(above)
    assert below.ops.count(torch.ops.aten.mm.default) == 2  # forward and recompute
    with outside_selective_checkpoint():  # no SAC region: nothing moves
        assert _get_current_dispatch_mode_stack() == []


def test_the_policy_sees_the_ops_it_sees_without_a_watcher():
    """torchtitan's SelectiveAC counts matmuls to save every second one: any op of ours
    in the region would move what it saves. Its view of a monitored step's forward (the
    policy decides there; the recompute replays by index) is the same op for op as an
    unwatched step's. Routed layers are tested in test_capture.py: flashwatch's kernel
    then stands where SDPA stood, in both passes."""
    views = []
    for watched in (False, True):
        seen = []
        torch.manual_seed(0)
        model = checkpointed(GPT(GPTConfig(**SMALL)), "selective", seen)
        w = fw.watch(model, every_n_steps=1) if watched else None
        x, y = batch(torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        if w is not None:
            report = w.step()
            assert w.monitor_errors_total == 0 and report.heads[0].attention_max_logit > 0
            w.remove()
        views.append(seen)
    plain, watched = views
    assert len(plain) > 50 and watched == plain
