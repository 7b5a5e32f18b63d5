"""Test-session setup shared by every test module.

Triton decides at `@triton.jit` time whether a kernel runs compiled or in its CPU
interpreter, from TRITON_INTERPRET. It must therefore be set before any test module
imports flashwatch's Triton kernels; pytest imports this file first. setdefault keeps an
explicit TRITON_INTERPRET=0 (benchmarks/gpu_check.py runs the same tests natively).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the signal and policy tests run many tiny ops,
    several times faster on 1 thread than on 2 of a loaded 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
