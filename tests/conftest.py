"""Test-session setup shared by every test module.

Triton decides at `@triton.jit` time whether a kernel runs compiled or in its CPU
interpreter, from TRITON_INTERPRET. It must therefore be set before any test module
imports flashwatch's Triton kernels; pytest imports this file first. setdefault keeps an
explicit TRITON_INTERPRET=0 (benchmarks/gpu_check.py runs the same tests natively).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
