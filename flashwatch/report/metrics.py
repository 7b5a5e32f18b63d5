"""The metrics flashwatch reports, in one table (what each means: docs/design.md §5).

Every consumer reads `METRICS`: HeadRecord's fields and their defaults
(flashwatch/report/records.py), the JSONL lines and StepReport.layer_summaries, the Prometheus
families (flashwatch.integrations.prometheus), the Lightning and Hugging Face callbacks'
keys (flashwatch.integrations.shared) and the Grafana dashboard
(dashboards/grafana/generate.py). Adding a metric is one row here, plus computing it in
the watcher. Names are a public contract: dashboards, alert rules and users' queries
use them, so a row is never renamed.

Columns:
  name        HeadRecord field (scope "head") or StepReport field (`field`, scope
              "step"); the JSONL key; the Prometheus name is "flashwatch_" + name
              (+ "_total" for a counter whose name lacks it), or + `exported` where set.
  unit        base units: "ratio", "score" (scaled attention score, nats), "count",
              "seconds", "step", "mode" (Mode value), "z", "norm", "flag", "1".
  scope       "head": one value per layer and head (Prometheus labels head, layer);
              "step": one per report, rank-local (no labels).
  help        one sentence: the Prometheus HELP text.
  healthy     the healthy range in words ("" where none applies).
  limit       the healthy range's upper bound where an alert and the dashboard draw
              one (the same number as dashboards/prometheus/flashwatch-rules.yml), else
              None.
  default     the value before it is measured; its type is the field's type.
  layer_max   StepReport.layer_summaries and the callbacks' per-layer keys carry
              "<name>_max", the max over the layer's heads.
  prometheus  "gauge", "counter" (a head field summed over reports, or `counts`), or
              None (not exported: JSONL and the report only).
  logged      a per-head key of the Lightning and Hugging Face callbacks.
  exported    the Prometheus name's stem where `name` breaks Prometheus' naming rules
              (a gauge may not end in "_sum", the suffix of summaries and histograms:
              `promtool check metrics` rejects it), else None.
  counts      for counters of events: the Event.kind counted, from report.confirmed
              (mode events also get the label `mode`: the mode switched to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashwatch.kernels.common import Mode

NAN = math.nan


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    scope: str
    help: str
    healthy: str = ""
    limit: float | None = None
    default: object = NAN
    layer_max: bool = False
    prometheus: str | None = None
    logged: bool = False
    field: str | None = None  # scope "step": the StepReport field, when not `name`
    counts: str | None = None
    exported: str | None = None

    @property
    def prometheus_name(self) -> str:
        name = "flashwatch_" + (self.exported or self.name)
        return name + "_total" if self.prometheus == "counter" and \
            not name.endswith("_total") else name

    @property
    def labels(self) -> tuple[str, ...]:
        if self.scope == "step":
            return ()
        return ("head", "layer", "mode") if self.counts == "mode" else ("head", "layer")

    @property
    def in_head_record(self) -> bool:
        return self.scope == "head" and self.counts is None


_MODES = ", ".join(f"{m.value}={m.name}" for m in Mode)
_SINCE = " (counted by this exporter since it started)"

METRICS = (
    # ---- per head: the HeadRecord fields, in this order
    Metric("tied_rowmax_ratio", "ratio", "head",
           "Fraction of attention rows whose max score is tied within eps: every real "
           "query row of the step (padding left out), whatever kernel ran.",
           healthy="< 0.02 (i.i.d. Gaussian logits, N = 1024: ≈ 0.004)", limit=0.02,
           layer_max=True, prometheus="gauge", logged=True),
    Metric("attention_max_logit", "score", "head",
           "Largest scaled attention score (softmax scale applied), exact over every real "
           "query row of the step (padding left out).",
           healthy="15–18 at ordinary settings; hundreds and more is the hazard",
           layer_max=True, prometheus="gauge", logged=True),
    Metric("delta_error_sum", "1", "head",
           "Sum over the real query rows (every row when flashwatch's kernel ran or with "
           "rows_per_head=\"all\", else rows_per_head sampled rows) "
           "of the backward delta error c[T] = rowsum(dO*O_used) - rowsum(dO*O_fp32), "
           "latest monitored step.",
           healthy="changes sign from step to step", prometheus="gauge", logged=True,
           exported="delta_error_rowsum"),
    Metric("r_projection", "1", "head",
           "Projection of this step's W^Q gradient-error sketch on the running top "
           "singular direction of the past ones."),
    Metric("r_projection_cumulative", "1", "head",
           "Cumulative projection of the W^Q gradient-error sketch on its running top "
           "singular direction.",
           healthy="a random walk; a steady ramp is error piling up",
           prometheus="gauge", logged=True),
    Metric("delta_drift_z", "z", "head",
           "Drift z of the delta error projected on its running direction, over the "
           "window: about N(0,1) when zero-mean, grows with persistence.",
           healthy="< 4 (largest seen in 200 zero-mean streams × 1000 steps: 3.8)",
           limit=4, layer_max=True, prometheus="gauge", logged=True),
    Metric("delta_coherence", "ratio", "head",
           "Coherence of the W^Q gradient-error sketches over the window, in [0, 1]; 1 "
           "means every step's error points the same way.",
           healthy="no fixed bound: ≈ 1/sqrt(window) = 0.125 when zero-mean; the healthy "
                   "demo's heads reach 0.4 (median 0.14, 99 % 0.34 once the window is "
                   "full); ≥ 0.15 counts only with drift z ≥ 4", limit=0.15,
           layer_max=True, prometheus="gauge", logged=True),
    Metric("wq_spectral_norm", "norm", "head",
           "Largest singular value of the head's query projection W^Q.",
           healthy="grows < 20 % over the window, or < 3 × the layer's median head",
           layer_max=True, prometheus="gauge", logged=True),
    Metric("delta_error_rows", "count", "head",
           "Rows whose delta error c[T] entered delta_error_sum this step.", default=0.0),
    Metric("delta_error_all_rows", "flag", "head",
           "Whether those were all the rows of every call (flashwatch's kernel, or "
           "rows_per_head=\"all\") rather than a sample.", default=False),
    Metric("delta_sign_z", "z", "head",
           "Sum of the per-step delta error sums over the window / sqrt(sum of their "
           "squares); reported, not used by the policy.", healthy="about N(0,1)"),
    Metric("delta_error_share", "ratio", "head",
           "Estimated share of the head's W^Q gradient that is delta rounding error, "
           "||E||_F / ||dW^Q||_F (Eq. 3, this layer's term), latest monitored step; "
           "healthy << 0.05.",
           healthy="≪ 0.05", limit=0.05, layer_max=True, prometheus="gauge"),
    Metric("wq_grad_norm", "norm", "head",
           "Frobenius norm of the head's W^Q gradient over the latest monitored step "
           "(delta_error_share's denominator); a share counts for the policy and the "
           "alert only while this is at least 0.1 x the layer's median head and 0.03 x "
           "its own recent peak.",
           prometheus="gauge"),
    Metric("delta_error_share_mean", "ratio", "head",
           "sqrt(sum ||E||^2 / sum ||dW^Q||^2) over the window.", healthy="≪ 0.05"),
    Metric("delta_error_share_std", "ratio", "head",
           "Spread of the per-step delta_error_share values in the window."),
    Metric("guarded_rows", "count", "head",
           "BETA rows whose shift hit the underflow guard (logits in the thousands), "
           "summed over monitored steps" + _SINCE + ".",
           healthy="0", default=0, prometheus="counter"),
    Metric("head_mode", "mode", "head", f"Attention mode applied to the head: {_MODES}.",
           healthy="0 (STANDARD) unless a hazard was found", default=Mode.STANDARD,
           prometheus="gauge"),
    Metric("recommended_mode", "mode", "head",
           f"Mode the policy recommends for the head: {_MODES}.", default=Mode.STANDARD),
    Metric("flagged", "flag", "head", "Whether the policy flags the head this step.",
           default=False),
    # ---- per head, counted from report.confirmed (effects seen run, never decisions)
    Metric("mitigations_total", "count", "head",
           "Mode switches seen running in a monitored step's measurement (by the policy "
           "or by hand), by the mode switched to" + _SINCE + ".",
           prometheus="counter", counts="mode"),
    Metric("qk_clip_total", "count", "head",
           "QK-clips of the head's W^Q and W^K whose effect was seen in a measurement "
           "(opt-in qk_clip_threshold, mitigation auto)" + _SINCE + ".",
           prometheus="counter", counts="qk_clip"),
    # ---- per report, rank-local
    Metric("monitor_step", "step", "step", "Optimizer step of the latest monitored step.",
           default=0, prometheus="gauge", field="step"),
    Metric("monitor_seconds", "seconds", "step",
           "Wall time flashwatch spent monitoring the latest monitored step, in seconds.",
           healthy="a few % of a step, once divided by every_n_steps", default=0.0,
           prometheus="gauge"),
    Metric("monitor_errors_total", "count", "step",
           "Failures inside flashwatch (never raised into training) over the run; "
           "resumes with the watcher.", healthy="0", limit=0.0, default=0,
           prometheus="counter"),
)

BY_NAME = {m.name: m for m in METRICS}
HEAD_FIELDS = tuple(m for m in METRICS if m.in_head_record)  # HeadRecord, in order
LAYER_MAX = tuple(m.name for m in METRICS if m.layer_max)
LOGGED = tuple(m.name for m in METRICS if m.logged)
EXPORTED = tuple(m for m in METRICS if m.prometheus)
METRIC_NAMES = tuple(m.prometheus_name for m in EXPORTED)


def prometheus_name(name: str) -> str:
    """The Prometheus name of the row `name` (KeyError for a name not in the table, so a
    dashboard query cannot name a metric that does not exist)."""
    m = BY_NAME[name]
    if m.prometheus is None:
        raise KeyError(f"{name} is not exported to Prometheus")
    return m.prometheus_name
