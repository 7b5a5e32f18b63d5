"""Where StepReports go: the `Sink` protocol, a JSONL file and a console summary.

Integrations (Lightning loggers, Prometheus) live in flashwatch.integrations and
implement the same protocol.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

from flashwatch.report import StepReport


@runtime_checkable
class Sink(Protocol):
    """Receives every StepReport. `close()` is called by `Watcher.remove()`."""

    def write(self, report: StepReport) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per monitored step to `path` and flushes it.

    A crash loses at most the line being written; readers should skip a final partial
    line (`read_jsonl` does). `fsync=True` also forces the line to disk (slower).
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._fsync = fsync

    def write(self, report: StepReport) -> None:
        if self._file.closed:  # reused after close(), e.g. by a second Lightning fit()
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._file.write(json.dumps(report.to_dict(), allow_nan=False) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JsonlSink file, skipping a truncated last line left by a crash."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if line.endswith("\n"):  # a damaged line in the middle is an error
                    raise
    return out


class ConsoleSink:
    """Prints the worst heads (by drift z) and every event, every `every` reports."""

    def __init__(self, *, top: int = 5, every: int = 1, stream: IO[str] | None = None):
        if top < 1 or every < 1:
            raise ValueError(f"top and every must be ≥ 1, got top={top}, every={every}")
        self.top, self.every = top, every
        self.stream = stream or sys.stdout
        self._count = 0

    def write(self, report: StepReport) -> None:
        self._count += 1
        for e in report.events:
            if e.kind == "qk_clip":
                verb = "QK-clipped" if e.applied else "recommend QK-clipping"
                print(f"[flashwatch] step {e.step}: {verb} {e.layer} head {e.head} "
                      f"({e.reason})", file=self.stream)
                continue
            verb = "switched" if e.applied else "recommend switching"
            print(f"[flashwatch] step {e.step}: {verb} {e.layer} head {e.head} "
                  f"{e.from_mode.name} -> {e.to_mode.name} ({e.reason})", file=self.stream)
        if (self._count - 1) % self.every:
            return
        print(f"[flashwatch] step {report.step}: worst heads by drift z "
              f"(monitor {1e3 * report.monitor_seconds:.1f} ms)", file=self.stream)
        print(f"  {'layer':<24} {'head':>4} {'ties':>7} {'max_logit':>9} {'drift_z':>8} "
              f"{'coher':>6} {'|W_Q|_2':>8} {'mode':>8}", file=self.stream)
        for h in report.worst(self.top):
            print(f"  {h.layer[-24:]:<24} {h.head:>4} {_f(h.tied_rowmax_ratio, 7, 4)} "
                  f"{_f(h.attention_max_logit, 9, 2)} {_f(h.delta_drift_z, 8, 2)} "
                  f"{_f(h.delta_coherence, 6, 3)} {_f(h.wq_spectral_norm, 8, 3)} "
                  f"{h.head_mode.name:>8}", file=self.stream)

    def close(self) -> None:
        self.stream.flush()


def _f(v: float, width: int, digits: int) -> str:
    return f"{'nan':>{width}}" if math.isnan(v) else f"{v:>{width}.{digits}f}"
