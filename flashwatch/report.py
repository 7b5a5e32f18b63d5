"""What one monitored step reports: `StepReport`, `HeadRecord`, `Event` (docs/design.md §3, §5).

Field names are the metric names of docs/design.md §5; Prometheus names add `flashwatch_`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from flashwatch.kernels.common import Mode

# Per-head metrics, in report order. Each is a HeadRecord field.
HEAD_METRICS = (
    "tied_rowmax_ratio",  # tied rows / rows (all rows when routed, sampled rows otherwise)
    "attention_max_logit",  # largest scaled score
    "delta_error_sum",  # Σ_T c[T] over this step's rows (all, or sampled: see below)
    "delta_error_share",  # estimated ‖E‖_F / ‖dW^Q_h‖_F of this step (Eq. 3's own term)
    "r_projection",  # κ_t = uᵀ G_t v, (u, v) from the running sum of past G
    "r_projection_cumulative",  # Σ κ
    "delta_drift_z",  # Σκ / sqrt(Σκ²) over the window
    "delta_coherence",  # ‖Σ_W G‖_F / Σ_W ‖G‖_F
    "wq_spectral_norm",  # largest singular value of W^Q_h
    "guarded_rows",  # BETA rows whose shift hit the underflow guard, this step
)
# Per-layer summaries (StepReport.layer_summaries): the max over a layer's heads of these.
LAYER_MAX = ("tied_rowmax_ratio", "attention_max_logit", "delta_drift_z", "delta_coherence",
             "wq_spectral_norm", "delta_error_share")


@dataclass
class HeadRecord:
    layer: str
    head: int
    tied_rowmax_ratio: float = math.nan
    attention_max_logit: float = math.nan
    delta_error_sum: float = math.nan
    r_projection: float = math.nan
    r_projection_cumulative: float = math.nan
    delta_drift_z: float = math.nan
    delta_coherence: float = math.nan
    wq_spectral_norm: float = math.nan
    # δ error on every row (docs/design.md §5): delta_error_sum and delta_sign_z use c[T] of
    # delta_error_rows rows; delta_error_all_rows says whether those were all the rows of
    # every call (flashwatch's kernel, or rows_per_head="all") or a sample.
    delta_error_rows: float = 0.0
    delta_error_all_rows: bool = False
    delta_sign_z: float = math.nan  # Σ_W Σc / sqrt(Σ_W Σc²) over the window
    # Estimated ‖E‖_F / ‖dW^Q_h‖_F, E = α Σ_T c[T] PK[T] X[T]ᵀ (Eq. 3, this layer's own
    # term), from Σ_T ‖e_T‖² (scaled by rows / sampled rows): unbiased for E[‖E‖²] when
    # row errors add incoherently, low when they line up. Healthy ≪ 0.05.
    delta_error_share: float = math.nan
    delta_error_share_mean: float = math.nan  # sqrt(Σ‖E‖² / Σ‖dW^Q‖²) over the window
    delta_error_share_std: float = math.nan  # spread of the per-step values in the window
    guarded_rows: int = 0  # BETA rows whose shift hit the underflow guard, this step
    head_mode: Mode = Mode.STANDARD
    recommended_mode: Mode = Mode.STANDARD
    flagged: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["head_mode"] = Mode(self.head_mode).name
        d["recommended_mode"] = Mode(self.recommended_mode).name
        return {k: _json_float(v) for k, v in d.items()}


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
        return d

    def layer_summaries(self) -> dict[str, dict]:
        """Per layer, in report order: "<field>_max" over its heads for each LAYER_MAX
        field (NaN heads left out; NaN when all are), "heads", "heads_not_standard" and
        "heads_flagged"."""
        out: dict[str, dict] = {}
        for h in self.heads:
            s = out.get(h.layer)
            if s is None:
                s = out[h.layer] = {f"{f}_max": math.nan for f in LAYER_MAX}
                s.update(heads=0, heads_not_standard=0, heads_flagged=0)
            for f in LAYER_MAX:
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
