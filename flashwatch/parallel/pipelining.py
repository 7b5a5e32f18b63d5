"""torch.distributed.pipelining's metadata inference, which the monitor must not measure.

A PipelineStage without static shapes runs its module once more on the first step of a
schedule, to learn the shapes it sends: the first stage on a detached copy of the first
micro-batch, every later stage on `torch.empty` tensors (uninitialised memory: any
value, NaN included), then a backward through torch.autograd.grad with ones as the
output gradient. Measured, that pass adds a micro-batch of garbage rows to the first
monitored step (4-layer test model, GPipe with 3 micro-batches: tie ratio 41/48 where
every real row gives 31/36; NaN in the W^Q layout check on stage 1). The pass is told
apart by where it is called from: a frame of one of the stage's inference methods on
the stack (torch 2.13; `_shape_inference` in the releases before it).
"""

from __future__ import annotations

import sys

INFERENCE_FRAMES = frozenset({"_forward_metadata_inference", "_backward_metadata_inference",
                              "_shape_inference"})
MAX_DEPTH = 64  # a stage's forward runs ≈ 10 frames below the schedule's step()


def in_metadata_inference() -> bool:
    """Whether this call runs inside a PipelineStage's metadata (shape) inference.
    Walks at most MAX_DEPTH frames: call it on monitored steps only."""
    frame = sys._getframe(1)
    for _ in range(MAX_DEPTH):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name in INFERENCE_FRAMES and "pipelining" in code.co_filename:
            return True
        frame = frame.f_back
    return False
