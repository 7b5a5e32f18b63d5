"""What one monitored step reports: `StepReport`, `HeadRecord`, `Event` (docs/design.md §3, §5).

HeadRecord's fields are the per-head rows of the metrics table (flashwatch/report/metrics.py);
Prometheus names add `flashwatch_`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, make_dataclass

from flashwatch.kernels.common import Mode
from flashwatch.report import metrics

_MODE_FIELDS = tuple(m.name for m in metrics.HEAD_FIELDS if isinstance(m.default, Mode))


def _head_to_dict(self) -> dict:
    """JSON-ready: modes by name, NaN as null (see _json_float)."""
    d = asdict(self)
    for k in _MODE_FIELDS:
        d[k] = Mode(d[k]).name
    return {k: _json_float(v) for k, v in d.items()}


# One field per row of flashwatch.report.metrics with scope "head" (its type and default from
# the row), after `layer` and `head`: adding a metric there adds it here.
HeadRecord = make_dataclass(
    "HeadRecord",
    [("layer", str), ("head", int),
     *((m.name, type(m.default), field(default=m.default)) for m in metrics.HEAD_FIELDS)],
    namespace={"to_dict": _head_to_dict, "__doc__": (
        "One head's numbers on one monitored step: `layer`, `head` and one field per "
        "per-head row of flashwatch.report.metrics.METRICS (NaN until measured).")})
HeadRecord.__module__ = __name__  # pickles and prints as flashwatch.report.records.HeadRecord


@dataclass
class Event:
    """A mode change (applied in "auto", recommended in "advise"), or with
    kind="qk_clip" a QK-clip of the head's W^Q/W^K (from_mode = to_mode = its mode)."""

    step: int
    layer: str
    head: int
    from_mode: Mode
    to_mode: Mode
    reason: str
    applied: bool
    kind: str = "mode"  # "mode" | "qk_clip"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["from_mode"] = Mode(self.from_mode).name
        d["to_mode"] = Mode(self.to_mode).name
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Event:
        return cls(step=int(d["step"]), layer=str(d["layer"]), head=int(d["head"]),
                   from_mode=Mode[d["from_mode"]], to_mode=Mode[d["to_mode"]],
                   reason=str(d["reason"]), applied=bool(d["applied"]),
                   kind=str(d.get("kind", "mode")))


@dataclass
class StepReport:
    step: int  # optimizer step this report describes
    heads: list[HeadRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    monitor_seconds: float = 0.0  # wall time flashwatch spent on this step's monitoring
    monitor_errors_total: int = 0  # failures inside flashwatch so far (never raised)
    # layers whose non-STANDARD modes could not be applied, and why (e.g. attn_mask)
    unmitigable: dict[str, str] = field(default_factory=dict)
    qk_clips_total: int = 0  # QK-clips applied over the run (resumes with the watcher)
    # Mode events whose effect was seen run in this step's measurement (and QK-clip
    # events whose effect was seen); counters count these, never a decision: a mode
    # decided and then withdrawn (the layer could not route) is in `events`, never here.
    confirmed: list[Event] = field(default_factory=list)

    def to_dict(self, heads: bool = True) -> dict:
        """JSON-ready; heads=False leaves out the per-head records (key "heads")."""
        d = {
            "step": self.step,
            "monitor_seconds": self.monitor_seconds,
            "monitor_errors_total": self.monitor_errors_total,
            "unmitigable": dict(self.unmitigable),
            "qk_clips_total": self.qk_clips_total,
        }
        if heads:
            d["heads"] = [h.to_dict() for h in self.heads]
        d["events"] = [e.to_dict() for e in self.events]
        d["confirmed"] = [e.to_dict() for e in self.confirmed]
        return d

    def layer_summaries(self) -> dict[str, dict]:
        """Per layer, in report order: "<field>_max" over its heads for each
        metrics.LAYER_MAX field (NaN heads left out; NaN when all are), "heads",
        "heads_not_standard" and "heads_flagged"."""
        out: dict[str, dict] = {}
        for h in self.heads:
            s = out.get(h.layer)
            if s is None:
                s = out[h.layer] = {f"{f}_max": math.nan for f in metrics.LAYER_MAX}
                s.update(heads=0, heads_not_standard=0, heads_flagged=0)
            for f in metrics.LAYER_MAX:
                v, key = getattr(h, f), f"{f}_max"
                if not math.isnan(v) and not v <= s[key]:  # NaN max: the first value wins
                    s[key] = v
            s["heads"] += 1
            s["heads_not_standard"] += h.head_mode != Mode.STANDARD
            s["heads_flagged"] += bool(h.flagged)
        return out

    def worst(self, n: int = 5, key: str = "delta_drift_z") -> list[HeadRecord]:
        """The n heads with the largest `key` (NaN last)."""
        def score(h: HeadRecord) -> float:
            v = getattr(h, key)
            return -math.inf if math.isnan(v) else v
        return sorted(self.heads, key=score, reverse=True)[:n]


def _json_float(v):
    # JSON has no NaN/Inf; write them as null / strings a reader can map back.
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v
