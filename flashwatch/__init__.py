"""flashwatch: watch attention numerics while a transformer trains in BF16.

See README.md and DESIGN.md. Public API (names fixed by DESIGN.md §3):
`attention`, `Mode`, `AttentionStats`.
"""

from flashwatch.attention import attention
from flashwatch.kernels.common import AttentionStats, Mode

__version__ = "0.1.0"
__all__ = ["AttentionStats", "Mode", "attention", "__version__"]
