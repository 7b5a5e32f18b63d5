"""Attention kernels: the PyTorch reference (CPU, oracle) and, on CUDA, Triton.

Depends on torch (and triton for the GPU kernels) only.
"""

from .common import AttentionStats, Mode
from .reference import attention as reference_attention

__all__ = ["AttentionStats", "Mode", "reference_attention"]
