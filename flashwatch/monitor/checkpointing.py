"""Activation checkpointing, seen from inside a watched layer.

`recomputing()`: is this forward checkpointing's recompute (counted already)?

`outside_selective_checkpoint()`: flashwatch's own ops, hidden from selective activation
checkpointing (torch's `create_selective_checkpoint_contexts`, which torchtitan's
SelectiveAC and OLMo-core's op-list policies build on). SAC runs a region's forward under
a dispatch mode that asks the policy about every op and caches the chosen outputs by
(op, index of that op in the region); the recompute replays the region under another mode
that hands each op the cached output of the same index. An op of ours in the first
forward, and not in the recompute (the probe measures once), shifts every later index of
its kind: torchtitan's debug model then gets a cached linear output of the wrong shape
("shape '[2, 32, 768]' is invalid for input of size 16384") and the training step
fails. Its policy also counts matmuls to save every second one, so even ops run in both
passes would change what is saved. So our ops run with SAC's modes lifted off the
dispatch-mode stack (every other mode, e.g. a FLOP counter or flashwatch's own host-sync
counter, stays, in its order), and the model's region sees exactly the ops it would see
without flashwatch.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils import checkpoint as _checkpoint
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

# torch's two SAC modes: caching (first forward) and cached (recompute). Subclasses
# (xformers') are SAC modes too.
SAC_MODES = tuple(getattr(_checkpoint, name) for name in (
    "_CachingTorchDispatchMode", "_CachedTorchDispatchMode") if hasattr(_checkpoint, name))


def recomputing() -> bool:
    """True in a forward that runs while autograd executes a backward pass: activation
    checkpointing's recompute (torch.utils.checkpoint, reentrant or not, checkpoint_wrapper,
    Hugging Face gradient checkpointing), whose first forward was already counted. A
    plain forward runs outside any graph task (id -1)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@contextlib.contextmanager
def outside_selective_checkpoint():
    """Run the block with torch's SAC dispatch modes off the stack (module docstring);
    costs one stack read where no SAC region is running."""
    stack = _get_current_dispatch_mode_stack()
    deepest = next((i for i, m in enumerate(stack) if isinstance(m, SAC_MODES)), None)
    if deepest is None:
        yield
        return
    above = [_pop_mode() for _ in range(len(stack) - deepest)][::-1]  # bottom first
    kept = [m for m in above if not isinstance(m, SAC_MODES)]
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in above:
            _push_mode(m)
