"""Products of the watcher's small blocks, on the CPU through numpy.

A monitored step multiplies many small matrices: the probe's FP32 recomputation
([32, 8, 32] @ [32, 32, 128] and [32, 8, 128] @ [32, 128, 32] on the benchmark GPT) and
the W^Q Gram powers ([16, 32, 32] squared 18 times). On the CPU numpy's batched matmul
takes about half of torch's time for these (24-38 µs against 41-67 µs; the Gram powers
250 µs against 340-390 µs; benchmarks/RESULTS.md, "Watcher overhead"), and a
monitored step's cost on small models is this kind of fixed overhead. Views of the
same memory go in and come out: no copy. On other devices torch's matmul runs.
"""

from __future__ import annotations

import numpy as np
import torch

NUMPY_CPU = True  # False: torch's matmul everywhere (tests run that path on the CPU too)


def on_numpy(t: torch.Tensor) -> bool:
    """Whether products of `t` go through numpy: a CPU tensor of a dtype numpy has."""
    return NUMPY_CPU and t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b over leading batch dims (no grad: the watcher's own arithmetic)."""
    if on_numpy(a) and b.dtype == a.dtype and b.device.type == "cpu":
        return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))
    return torch.matmul(a, b)
