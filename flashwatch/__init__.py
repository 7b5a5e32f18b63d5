"""flashwatch: watch attention numerics while a transformer trains in BF16.

Public API (names fixed by docs/design.md §3): `attention`, `Mode`, `AttentionStats`,
`watch`, `Watcher`, `WatchConfig`, `StepReport` (with `HeadRecord`, `Event`), and the
sinks in `flashwatch.sinks`; `diagnose` measures a saved model's heads offline
(docs/diagnose.md).
"""

from flashwatch import sinks
from flashwatch.config import WatchConfig
from flashwatch.diagnosis.diagnose import diagnose
from flashwatch.kernels.common import AttentionStats, Mode
from flashwatch.kernels.dispatch import attention
from flashwatch.report.records import Event, HeadRecord, StepReport
from flashwatch.sites import AttentionSite, find_sites, make_site
from flashwatch.watcher import Watcher, watch

__version__ = "0.1.0"

__all__ = ["AttentionSite", "AttentionStats", "Event", "HeadRecord", "Mode", "StepReport",
           "WatchConfig", "Watcher", "attention", "diagnose", "find_sites", "make_site", "sinks",
           "watch", "__version__"]
