"""The attention op: `flashwatch.attention` (dispatch.py) over the PyTorch reference
(CPU, the oracle), the paper's arithmetic and, on CUDA, the Triton kernels, with per-head
modes and counters; registered with torch.library (ops.py) so torch.compile keeps it.

May import: torch, triton, flashwatch._checks. Nothing else of flashwatch.
"""

from .common import AttentionStats, Mode
from .reference import attention as reference_attention

__all__ = ["AttentionStats", "Mode", "reference_attention"]
