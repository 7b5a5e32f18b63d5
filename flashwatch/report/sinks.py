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

from flashwatch._checks import check_bool, check_int
from flashwatch.report.records import StepReport, _json_float


@runtime_checkable
class Sink(Protocol):
    """Receives every StepReport. `close()` is called by `Watcher.remove()`."""

    def write(self, report: StepReport) -> None: ...

    def close(self) -> None: ...


# Above this many heads a report line is compact by default: a full per-head record is
# ≈ 715 bytes per head (183 kB per line at 256 heads, 3.7 MB at 5,120).
COMPACT_ABOVE_HEADS = 256
DEFAULT_FULL_EVERY = 100  # full record every 100th monitored step when compact


class JsonlSink:
    """Appends one JSON object per monitored step to `path` and flushes it.

    A crash loses at most the line being written; readers should skip a final partial
    line (`read_jsonl` does). `fsync=True` also forces the line to disk (slower).

    rank_zero_only  write from global rank 0 only (default True): after the watcher's
                    cross-rank reduction every rank holds the same per-head numbers.
                    The rank is `rank`, else torch.distributed's when initialized at
                    the first write, else env RANK (0 when unset). False: every rank
                    writes (give each its own path).
    full_every      write the full per-head record ("heads": one dict per head) on
                    every full_every-th monitored step, and on any step with an event or
                    a change in which heads are flagged; the other steps get the compact
                    form: "layers" (per-layer maxima and counts, see
                    StepReport.layer_summaries) and "worst_heads" (the `top` heads by
                    drift z plus every flagged head), with "full": false. None (default):
                    1 (always full) for reports of ≤ COMPACT_ABOVE_HEADS (256) heads,
                    else DEFAULT_FULL_EVERY (100): 5,120 heads then average ≈ 71 kB per
                    line instead of 3.7 MB. Pass 1 to always keep the full record.
    top             worst heads in a compact line (default 8).
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False,
                 rank_zero_only: bool = True, rank: int | None = None,
                 full_every: int | None = None, top: int = 8):
        if full_every is not None:
            check_int("full_every", full_every, min=1,
                      hint="or None for the default by model size")
        check_int("top", top, min=1)
        check_bool("fsync", fsync)
        check_bool("rank_zero_only", rank_zero_only)
        _check_rank(rank)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None  # opened at the first write on a writing rank
        self._fsync = fsync
        self._rank_zero_only, self._rank = rank_zero_only, rank
        self.full_every, self.top = full_every, top
        self._count = 0  # monitored steps seen
        self._flagged: frozenset = frozenset()

    def write(self, report: StepReport) -> None:
        if not _writes_here(self._rank_zero_only, self._rank):
            return
        if self._file is None or self._file.closed:  # first write, or a second fit()
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._file.write(json.dumps(self._line(report), allow_nan=False) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()

    def _line(self, report: StepReport) -> dict:
        every = self.full_every
        if every is None:
            every = 1 if len(report.heads) <= COMPACT_ABOVE_HEADS else DEFAULT_FULL_EVERY
        flagged = frozenset((h.layer, h.head) for h in report.heads if h.flagged)
        full = self._count % every == 0 or bool(report.events) or flagged != self._flagged
        self._count += 1
        self._flagged = flagged
        if full:
            return {**report.to_dict(), "full": True}
        worst = report.worst(self.top)
        chosen = {(h.layer, h.head) for h in worst}
        worst += [h for h in report.heads if h.flagged and (h.layer, h.head) not in chosen]
        d = report.to_dict(heads=False)
        d["full"] = False
        d["layers"] = [{"layer": layer, **{k: _json_float(v) for k, v in s.items()}}
                       for layer, s in report.layer_summaries().items()]
        d["worst_heads"] = [h.to_dict() for h in worst]
        return d


def _check_rank(rank) -> None:
    if rank is not None:
        check_int("rank", rank, min=0, hint="or None (detect it)")


def _writes_here(rank_zero_only: bool, rank: int | None) -> bool:
    """Whether a sink writes in this process: always, or only on global rank 0 (`rank`,
    else torch.distributed's when initialized, else env RANK, 0 when unset)."""
    if not rank_zero_only:
        return True
    if rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        else:
            raw = os.environ.get("RANK", "0") or "0"
            rank = int(raw) if raw.isdigit() else 0
    return rank == 0


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
    """Prints the worst heads (by drift z) and every event, every `every` reports.

    rank_zero_only and rank as JsonlSink's: by default only global rank 0 prints (the
    reduced numbers are the same on every rank; 1,024 ranks would print 1,024 copies).
    """

    def __init__(self, *, top: int = 5, every: int = 1, stream: IO[str] | None = None,
                 rank_zero_only: bool = True, rank: int | None = None):
        check_int("top", top, min=1)
        check_int("every", every, min=1)
        check_bool("rank_zero_only", rank_zero_only)
        _check_rank(rank)
        self.top, self.every = top, every
        self.stream = stream or sys.stdout
        self._rank_zero_only, self._rank = rank_zero_only, rank
        self._count = 0

    def write(self, report: StepReport) -> None:
        if not _writes_here(self._rank_zero_only, self._rank):
            return
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
