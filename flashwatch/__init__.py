"""flashwatch: watch attention numerics while a transformer trains in BF16.

Public API (names fixed by DESIGN.md §3): `attention`, `Mode`, `AttentionStats`,
`watch`, `Watcher`, `WatchConfig`, `StepReport`.
"""

from flashwatch.attention import attention
from flashwatch.config import WatchConfig
from flashwatch.kernels.common import AttentionStats, Mode
from flashwatch.report import Event, HeadRecord, StepReport

__version__ = "0.1.0"


def __getattr__(name):
    # watch/Watcher import the signal, policy and discovery modules: load them on first use
    # so that `import flashwatch` for the attention op alone stays light.
    if name in ("watch", "Watcher"):
        from flashwatch import watcher

        return getattr(watcher, name)
    raise AttributeError(f"module 'flashwatch' has no attribute {name!r}")


__all__ = ["AttentionStats", "Event", "HeadRecord", "Mode", "StepReport", "WatchConfig",
           "Watcher", "attention", "watch", "__version__"]
