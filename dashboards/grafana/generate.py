"""Write the Grafana dashboard and the Grafana-managed alert rules of flashwatch.

    python dashboards/grafana/generate.py      # rewrites the two files below

Outputs (committed; tests/test_dashboards.py fails when they differ from this script),
in the package data that `flashwatch dashboards` writes for users:
  flashwatch/dashboards/grafana/flashwatch.json
  flashwatch/dashboards/grafana/provisioning/alerting/flashwatch-alerts.yaml
then it copies all of flashwatch/dashboards/ over the repository's dashboards/ (the same
files, for readers of the repository; tests/test_dashboard_files.py compares them).

Why a generator: the dashboard JSON is ~1000 lines of Grafana boilerplate in which a
typo in one panel is easy to miss; here every panel is one call with its query and its
one-sentence explanation, ids and grid positions are computed, and the text panel at
the top is built from the same sentences, so it cannot fall out of date. The Grafana
alert rules are derived from flashwatch/dashboards/prometheus/flashwatch-rules.yml (same expr,
`for`, labels and annotations), so the two alerting paths cannot disagree.

Metric names, HELP texts and the healthy limits drawn as threshold lines come from the
metrics table (flashwatch/report/metrics.py): a query naming a metric the table does not
export fails here, and an exported metric no panel shows gets a panel of its own in the
last row, described by its HELP text, so adding a metric to the table adds it here.

Edit this file, run it, commit both outputs. Needs PyYAML and flashwatch (installed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from flashwatch.report import metrics

REPO = Path(__file__).resolve().parent.parent.parent
DATA = REPO / "flashwatch" / "dashboards"  # the one source: package data
DASHBOARD_PATH = DATA / "grafana" / "flashwatch.json"
ALERTS_PATH = DATA / "grafana" / "provisioning" / "alerting" / "flashwatch-alerts.yaml"
RULES_PATH = DATA / "prometheus" / "flashwatch-rules.yml"

DASHBOARD_UID = "flashwatch-attention"  # fixed: alert rules and links point at it
DS = {"type": "prometheus", "uid": "${datasource}"}  # every panel queries the variable
SEL = 'job=~"$job", layer=~"$layer", head=~"$head"'  # per-head series
JOB = 'job=~"$job"'  # job-level series (no layer/head labels)
TOPK = 5  # "worst heads" panels show this many

# Head modes (flashwatch/kernels/common.py Mode; values are stable, stored in checkpoints).
MODE_MAPPING = [{"type": "value", "options": {
    "0": {"text": "STANDARD", "color": "green", "index": 0},
    "1": {"text": "BETA", "color": "yellow", "index": 1},
    "2": {"text": "FP32_O", "color": "orange", "index": 2},
}}]


# ----------------------------------------------------------------------- panel helpers


def _limit(name: str) -> float:
    """The metrics table's healthy limit of `name` (the alert threshold drawn as a line)."""
    limit = metrics.BY_NAME[name].limit
    if limit is None:
        raise KeyError(f"{name} has no healthy limit in flashwatch/report/metrics.py")
    return limit


def _target(expr: str, legend: str = "", ref: str = "A", **extra) -> dict:
    return {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend,
            "editorMode": "code", "range": True, "instant": False, **extra}


def _thresholds(*steps) -> dict:
    """steps: (value, color) after the base green."""
    return {"mode": "absolute", "steps": [{"color": "green", "value": None}]
            + [{"color": c, "value": v} for v, c in steps]}


def _timeseries(title, desc, targets, unit="none", thresholds=None, **custom) -> dict:
    defaults = {"unit": unit, "custom": {"drawStyle": "line", "lineWidth": 1,
                                         "fillOpacity": 0, "showPoints": "never",
                                         "spanNulls": False, **custom}}
    if thresholds:
        defaults["thresholds"] = thresholds
        defaults["custom"]["thresholdsStyle"] = {"mode": "line+area"}
    return {"type": "timeseries", "title": title, "description": desc, "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "right",
                                   "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


# ----------------------------------------------------------------------------- panels
# (title, one-sentence explanation, panel) per row; the explanation becomes the panel's
# description (the (i) tooltip) and a line of the guide at the top.

def _rows() -> list[tuple[str, list[dict]]]:
    ties = [
        {"type": "table", "title": "Tied-rowmax ratio, latest (layer × head)",
         "description": "Fraction of attention rows whose maximum score is tied (≥ 2 "
                        "scores within eps) on the latest monitored step, one cell per "
                        "layer and head; yellow ≥ 2 % (the alert threshold), red ≥ 5 %.",
         # an instant table regrouped into a layer × head matrix, cells coloured by value
         "targets": [_target(f"flashwatch_tied_rowmax_ratio{{{SEL}}}", format="table",
                             range=False, instant=True)],
         "transformations": [{"id": "groupingToMatrix", "options": {
             "columnField": "head", "rowField": "layer", "valueField": "Value"}}],
         "fieldConfig": {"defaults": {
             "unit": "percentunit", "decimals": 1,
             "thresholds": _thresholds((_limit("tied_rowmax_ratio"), "yellow"), (0.05, "red")),
             "custom": {"align": "center", "cellOptions": {"type": "color-background",
                                                           "mode": "basic"}}},
             "overrides": []},
         "options": {"showHeader": True, "cellHeight": "sm"}},
        {"type": "heatmap", "title": "Tied-rowmax ratio over time (per head)",
         "description": "The same ratio over time, one heatmap row per layer/head, so a "
                        "head whose ties keep growing shows up as a darkening band.",
         # calculate=false: every series is one row of cells (no bucketing)
         "targets": [_target(f"flashwatch_tied_rowmax_ratio{{{SEL}}}", "{{layer}}/{{head}}",
                             format="time_series")],
         "fieldConfig": {"defaults": {"unit": "percentunit"}, "overrides": []},
         "options": {"calculate": False, "cellGap": 1,
                     "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential",
                               "exponent": 0.5, "steps": 64, "fill": "dark-orange",
                               "reverse": False},
                     "yAxis": {"axisPlacement": "left"}, "rowsFrame": {"layout": "auto"},
                     "cellValues": {"unit": "percentunit"}, "showValue": "never",
                     "legend": {"show": True},
                     "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
                     "exemplars": {"color": "rgba(255,0,255,0.7)"}}},
        _timeseries("Tied-rowmax ratio, worst head per layer",
                    "The highest tie ratio among the heads of each layer (recording rule "
                    "layer:flashwatch_tied_rowmax_ratio:max); the line is the 2 % alert "
                    "threshold.",
                    [_target(f'layer:flashwatch_tied_rowmax_ratio:max{{{JOB}, layer=~"$layer"}}',
                             "{{layer}}")],
                    unit="percentunit",
                    thresholds=_thresholds((_limit("tied_rowmax_ratio"), "red"))),
        _timeseries("Max attention logit per layer",
                    "Largest scaled attention score in each layer (the QK-clip signal): "
                    "larger logits mean coarser BF16 spacing and more ties.",
                    [_target(f'layer:flashwatch_attention_max_logit:max{{{JOB}, layer=~"$layer"}}',
                             "{{layer}}")]),
    ]
    drift = [
        _timeseries(f"δ-error drift z, worst {TOPK} heads",
                    "Drift z of each head's backward δ error along its running direction: "
                    "≈ N(0,1) when the rounding error is zero-mean, growing like sqrt(steps) "
                    "when it keeps one sign; the line is the alert threshold 4.",
                    [_target(f"topk({TOPK}, flashwatch_delta_drift_z{{{SEL}}})",
                             "{{layer}} h{{head}}")],
                    thresholds=_thresholds((_limit("delta_drift_z"), "red"))),
        _timeseries(f"δ-error coherence of the worst {TOPK} drift heads",
                    "Coherence (0..1) of the W^Q gradient-error sketches of the same heads: "
                    "≥ 0.15 together with z ≥ 4 means the error piles up along one "
                    "direction (the sustained-drift alert).",
                    [_target(f"flashwatch_delta_coherence{{{SEL}}} and on (job, instance, layer, "
                             f"head) topk({TOPK}, flashwatch_delta_drift_z{{{SEL}}})",
                             "{{layer}} h{{head}}")],
                    thresholds=_thresholds((_limit("delta_coherence"), "red"))),
        _timeseries(f"Cumulative R projection, worst {TOPK} heads",
                    "Running sum of the W^Q gradient error projected on its dominant "
                    "direction: a steady ramp is error accumulating in W^Q, a random walk "
                    "is noise.",
                    [_target(f"topk({TOPK}, abs(flashwatch_r_projection_cumulative{{{SEL}}}))",
                             "{{layer}} h{{head}}")]),
        _timeseries(f"δ error sum, worst {TOPK} heads",
                    "Sum of the δ error c[T] over every row (flashwatch's kernel) or the "
                    "sampled rows (another kernel) on the latest monitored step "
                    "(the paper's coefficient sum); its sign staying the same step after "
                    "step is what drives the drift.",
                    [_target(f"topk({TOPK}, abs(flashwatch_delta_error_rowsum{{{SEL}}}))",
                             "{{layer}} h{{head}}")]),
        _timeseries(f"δ-error share of the W^Q gradient, worst {TOPK} heads",
                    "Estimated ‖E‖/‖dW^Q‖: the part of each head's W^Q gradient that is δ "
                    "rounding error (the paper's Eq. 3, this layer's term), per monitored "
                    "step. Healthy ≪ 0.05 (the line, the alert threshold on its 15-minute "
                    "median); tens of percent in the BF16 arithmetic at logits in the thousands.",
                    [_target(f"topk({TOPK}, flashwatch_delta_error_share{{{SEL}}})",
                             "{{layer}} h{{head}}")],
                    unit="percentunit",
                    thresholds=_thresholds((_limit("delta_error_share"), "red"))),
        _timeseries("BETA rows at the underflow guard",
                    "BETA rows per interval whose shift hit the underflow guard (logits in "
                    "the thousands): the fix then uses a row-dependent shift.",
                    [_target("sum by (layer, head) (increase(flashwatch_guarded_rows_total"
                             f"{{{SEL}}}[$__rate_interval]))", "{{layer}} h{{head}}")],
                    drawStyle="bars", fillOpacity=80),
    ]
    wq = [
        _timeseries("W^Q spectral norm per head",
                    "Largest singular value of each head's query projection; the failure "
                    "shows as a few heads of one layer pulling away from the rest.",
                    [_target(f"flashwatch_wq_spectral_norm{{{SEL}}}", "{{layer}} h{{head}}")]),
        _timeseries("W^Q spectral-norm growth over 30 min vs layer median",
                    "Relative growth of each head's norm from its 30-minute minimum "
                    f"(top {TOPK} heads) and the median head of each layer (dashed); the "
                    "alert fires at ≥ 20 % and > 3 × the median while the head's max logit "
                    "is ≥ 100 (below it the growth is ordinary learning).",
                    [_target(f"topk({TOPK}, head:flashwatch_wq_spectral_norm:growth30m{{{SEL}}})",
                             "{{layer}} h{{head}}"),
                     _target(f'layer:flashwatch_wq_spectral_norm_growth30m:median{{{JOB}, '
                             f'layer=~"$layer"}}', "median {{layer}}", ref="B")],
                    unit="percentunit"),
    ]
    wq[1]["fieldConfig"]["overrides"] = [{
        "matcher": {"id": "byFrameRefID", "options": "B"},
        "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]}]
    mitigation = [
        {"type": "state-timeline", "title": "Head modes over time",
         "description": "Attention mode of every head over time: STANDARD (green), BETA "
                        "fix (yellow), FP32 O (orange); a change is a mitigation by "
                        "flashwatch's policy or by hand.",
         "targets": [_target(f"flashwatch_head_mode{{{SEL}}}", "{{layer}} h{{head}}")],
         "fieldConfig": {"defaults": {"mappings": MODE_MAPPING, "color": {"mode": "thresholds"},
                                      "thresholds": _thresholds((1, "yellow"), (2, "orange")),
                                      "custom": {"fillOpacity": 80, "lineWidth": 0}},
                         "overrides": []},
         "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.9,
                     "alignValue": "left", "legend": {"showLegend": True,
                                                      "displayMode": "list",
                                                      "placement": "bottom"},
                     "tooltip": {"mode": "single", "sort": "none"}}},
        _timeseries("Mitigations applied",
                    "Mode switches applied by the policy per interval, by head and target "
                    "mode (also drawn as red annotations on every panel).",
                    [_target("sum by (layer, head, mode) (increase(flashwatch_mitigations_total"
                             f"{{{SEL}}}[$__rate_interval]))", "{{layer}} h{{head}} → {{mode}}")],
                    drawStyle="bars", fillOpacity=80),
        _timeseries("QK-clips applied",
                    "W^Q/W^K rescalings of heads whose max logit exceeded qk_clip_threshold "
                    "(opt-in, mitigation auto) per interval; unlike a mode switch they "
                    "change the model.",
                    [_target("sum by (layer, head) (increase(flashwatch_qk_clip_total"
                             f"{{{SEL}}}[$__rate_interval]))", "{{layer}} h{{head}}")],
                    drawStyle="bars", fillOpacity=80),
    ]
    monitor = [
        _timeseries("Monitor overhead per monitored step",
                    "Wall time flashwatch spent measuring the latest monitored step; compare "
                    "it with your step time to see what watching costs.",
                    [_target(f"flashwatch_monitor_seconds{{{JOB}}}", "{{instance}}")], unit="s"),
        _timeseries("Monitor errors",
                    "Failures inside flashwatch per interval (never raised into training); "
                    "any non-zero value means some numbers above are missing.",
                    [_target(f"increase(flashwatch_monitor_errors_total{{{JOB}}}"
                             "[$__rate_interval])", "{{instance}}")],
                    thresholds=_thresholds((0.5, "red")), drawStyle="bars", fillOpacity=80),
        _timeseries("Exporter up and monitored step",
                    "Whether Prometheus reaches each exporter (1 = up) and the optimizer "
                    "step it last reported; a flat step line means training stalled.",
                    [_target(f"up{{{JOB}}}", "up {{instance}}"),
                     _target(f"flashwatch_monitor_step{{{JOB}}}", "step {{instance}}", ref="B")]),
    ]
    monitor[2]["fieldConfig"]["overrides"] = [{
        "matcher": {"id": "byFrameRefID", "options": "B"},
        "properties": [{"id": "custom.axisPlacement", "value": "right"}]}]
    rows = [("Ties and logits (step 1: where rounding becomes biased)", ties),
            ("δ-error drift (step 2: the error keeps its sign)", drift),
            ("W^Q spectral norm (step 3: the error piles up)", wq),
            ("Mitigation", mitigation),
            ("Monitor health", monitor)]
    rules = [r["expr"] for g in yaml.safe_load(RULES_PATH.read_text())["groups"]
             for r in g["rules"]]  # a metric shown through a recording rule is shown
    shown = _checked_names([t["expr"] for _, panels in rows for p in panels
                            for t in p["targets"]] + rules)
    others = [_table_panel(m) for m in metrics.EXPORTED if m.prometheus_name not in shown]
    return rows + ([("Other metrics (from the metrics table)", others)] if others else [])


# A metric name in a query; recording rules (layer:flashwatch_...:max) are not.
_NAME = re.compile(r"(?<![\w:])flashwatch_\w+(?![\w:])")


def _checked_names(exprs: list[str]) -> set[str]:
    """The flashwatch metric names the queries (and rules) use; ValueError for one the
    metrics table does not export (a typo, or a renamed metric)."""
    used = {n for e in exprs for n in _NAME.findall(e)}
    unknown = used - set(metrics.METRIC_NAMES)
    if unknown:
        raise ValueError(f"dashboard queries use {sorted(unknown)}, not exported by "
                         f"flashwatch/report/metrics.py; fix the query or add the row")
    return used


def _table_panel(m: metrics.Metric) -> dict:
    """A plain panel for a metric of the table that no hand-made panel shows."""
    name = m.prometheus_name
    if m.scope == "step":
        expr, legend = f"{name}{{{JOB}}}", "{{instance}}"
    elif m.prometheus == "counter":
        expr = (f"sum by ({', '.join(m.labels[::-1])}) (increase({name}{{{SEL}}}"
                f"[$__rate_interval]))")
        legend = "{{layer}} h{{head}}"
    else:
        expr, legend = f"topk({TOPK}, {name}{{{SEL}}})", "{{layer}} h{{head}}"
    unit = {"ratio": "percentunit", "seconds": "s"}.get(m.unit, "none")
    return _timeseries(name, m.help, [_target(expr, legend)], unit=unit)


# Panel widths/heights per row: two per line, except the timeline (full width) and the
# monitor row (three per line).
def _layout(row_title: str, i: int) -> tuple[int, int]:
    if row_title == "Mitigation" and i == 0:  # other rows, table rows included: 12 × 8
        return 24, 10
    if row_title == "Monitor health":
        return 8, 7
    return 12, 8


def _variables() -> list[dict]:
    def query_var(name, label, definition, multi):
        return {"type": "query", "name": name, "label": label, "datasource": DS,
                "definition": definition,
                "query": {"query": definition, "refId": f"PrometheusVariableQueryEditor-{name}"},
                "refresh": 2,  # on time-range change: new runs/layers appear
                "sort": 3,  # numerical/alphabetical ascending
                "multi": multi, "includeAll": multi,
                "allValue": ".*" if multi else None,  # one regex, not a huge alternation
                "current": {}, "options": [], "hide": 0, "regex": ""}
    return [
        {"type": "datasource", "name": "datasource", "label": "Prometheus",
         "query": "prometheus", "current": {}, "options": [], "hide": 0, "refresh": 1,
         "regex": ""},
        query_var("job", "Job", "label_values(flashwatch_monitor_step, job)", False),
        query_var("layer", "Layer",
                  'label_values(flashwatch_tied_rowmax_ratio{job=~"$job"}, layer)', True),
        query_var("head", "Head",
                  'label_values(flashwatch_tied_rowmax_ratio{job=~"$job", layer=~"$layer"}, head)',
                  True),
    ]


def _annotations() -> list[dict]:
    expr = ("sum by (layer, head, mode) (increase(flashwatch_mitigations_total"
            f"{{{SEL}}}[2m])) > 0")
    return [
        # Grafana's own annotations (manual notes); present in every saved dashboard.
        {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
         "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
         "name": "Annotations & Alerts", "type": "dashboard"},
        # A mitigation = an increase of the counter; an event wherever the 2m increase is
        # positive (step 1m, so one switch marks a short region, not a single pixel).
        {"name": "Mitigations", "datasource": DS, "enable": True, "hide": False,
         "iconColor": "red", "expr": expr, "step": "1m",
         "titleFormat": "flashwatch mitigation",
         "textFormat": "{{layer}} head {{head}} switched to {{mode}}",
         "tagKeys": "layer,head,mode", "useValueForTime": False,
         "target": {"refId": "Anno", "expr": expr, "interval": "1m"}},
    ]


def build_dashboard() -> dict:
    panels, guide = [], []
    next_id, y = 1, 0

    def add(panel, x, w, h):
        nonlocal next_id
        panel = {"id": next_id, "gridPos": {"x": x, "y": y, "w": w, "h": h}, **panel}
        next_id += 1
        panels.append(panel)
        return panel

    rows = _rows()
    guide_row = add({"type": "row", "title": "How to read this dashboard", "collapsed": False,
                     "panels": []}, 0, 24, 1)
    y += 1
    text = add({"type": "text", "title": "What each panel shows", "options": {
        "mode": "markdown", "content": ""}}, 0, 24, 12)
    y += 12
    for row_title, row_panels in rows:
        add({"type": "row", "title": row_title, "collapsed": False, "panels": []}, 0, 24, 1)
        y += 1
        guide.append(f"\n**{row_title}**\n")
        x = line_h = 0  # left edge and height of the current line of panels
        for i, p in enumerate(row_panels):
            w, h = _layout(row_title, i)
            if x + w > 24:  # wrap below the tallest panel of the line
                x, y, line_h = 0, y + line_h, 0
            p = add({"datasource": DS, **p}, x, w, h)
            x, line_h = x + w, max(line_h, h)
            guide.append(f"- *{p['title']}*: {p['description']}")
        y += line_h
    text["options"]["content"] = (
        "flashwatch watches the BF16 flash-attention failure chain (ties → biased δ error → "
        "W^Q growth → loss explosion); rows follow that chain. Red marks on every panel are "
        "mitigations. Runbooks: see the README section of each alert.\n" + "\n".join(guide))
    del guide_row
    return {
        "id": None, "uid": DASHBOARD_UID, "title": "flashwatch — attention numerics",
        "description": "Per-layer, per-head BF16 flash-attention numerics from flashwatch's "
                       "Prometheus exporter.",
        "tags": ["flashwatch", "training"], "schemaVersion": 39, "version": 1,
        "editable": True, "graphTooltip": 1, "timezone": "browser", "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timepicker": {}, "liveNow": False,
        "fiscalYearStartMonth": 0, "weekStart": "", "links": [],
        "templating": {"list": _variables()},
        "annotations": {"list": _annotations()},
        "panels": panels,
    }


# ------------------------------------------------------------------------ alert rules

# Grafana rule uid and the dashboard panel its alert links to (by title).
ALERT_META = {
    "FlashwatchDeltaDriftSustained": ("fw-delta-drift", f"δ-error drift z, worst {TOPK} heads"),
    "FlashwatchDeltaErrorShareHigh": ("fw-delta-share",
                                      f"δ-error share of the W^Q gradient, worst {TOPK} heads"),
    "FlashwatchTiedRowmaxRising": ("fw-tied-rowmax", "Tied-rowmax ratio over time (per head)"),
    "FlashwatchWqSpectralNormGrowth": ("fw-wq-growth",
                                       "W^Q spectral-norm growth over 30 min vs layer median"),
    "FlashwatchMitigationApplied": ("fw-mitigation", "Head modes over time"),
    "FlashwatchMonitorErrors": ("fw-monitor-errors", "Monitor errors"),
    "FlashwatchExporterDown": ("fw-exporter-down", "Exporter up and monitored step"),
    "FlashwatchExporterAbsent": ("fw-exporter-absent", "Exporter up and monitored step"),
    "FlashwatchQkClipApplied": ("fw-qk-clip", "QK-clips applied"),
}


def _grafana_template(text: str) -> str:
    """Prometheus alert template -> Grafana alert template.

    Grafana's template data are .Labels and .Values (one entry per query refId); $labels
    and $value are Prometheus-only spellings ($value is a string in Grafana). Writing
    .Labels/.Values also keeps the text free of `$`, which Grafana's provisioning would
    otherwise try to expand as an environment variable in some fields and versions.
    """
    text = text.replace("$labels.", ".Labels.").replace("$value", ".Values.A.Value")
    assert "$" not in text, text
    return text


def _duration(d: str | None) -> str:
    return d or "0s"


def build_alerts(rules_path: Path = RULES_PATH, dashboard: dict | None = None) -> dict:
    dashboard = dashboard or build_dashboard()
    panel_ids = {p["title"]: p["id"] for p in dashboard["panels"]}
    prom = yaml.safe_load(rules_path.read_text())
    out = []
    for group in prom["groups"]:
        for r in group["rules"]:
            if "alert" not in r:
                continue  # recording rules: Grafana queries the recorded series directly
            uid, panel = ALERT_META[r["alert"]]
            annotations = {k: _grafana_template(v) for k, v in r["annotations"].items()}
            annotations.update({"__dashboardUid__": DASHBOARD_UID,
                                "__panelId__": str(panel_ids[panel])})
            out.append({
                "uid": uid, "title": r["alert"], "condition": "B",
                "data": [
                    # A: the Prometheus rule's expression as is, evaluated instantly:
                    # it returns exactly the series the Prometheus alert would fire on.
                    {"refId": "A", "relativeTimeRange": {"from": 600, "to": 0},
                     "datasourceUid": "$FLASHWATCH_PROMETHEUS_UID",
                     "model": {"refId": "A", "expr": r["expr"].strip(), "instant": True,
                               "range": False, "editorMode": "code", "intervalMs": 15000,
                               "maxDataPoints": 43200, "legendFormat": ""}},
                    # B: 1 for every series A returns (any value, even 0 as in up == 0;
                    # NaN == NaN is false but A never returns NaN after its filter).
                    # Grafana fires per series whose condition value is non-zero.
                    {"refId": "B", "relativeTimeRange": {"from": 0, "to": 0},
                     "datasourceUid": "__expr__",
                     "model": {"refId": "B", "type": "math", "expression": "$A == $A",
                               "datasource": {"type": "__expr__", "uid": "__expr__"}}},
                ],
                # No series = nothing matches = healthy (that is how the PromQL is written,
                # absent() included); a failing query is an error, not silence.
                "noDataState": "OK", "execErrState": "Error",
                "for": _duration(r.get("for")),
                "labels": dict(r["labels"]), "annotations": annotations, "isPaused": False,
            })
    return {"apiVersion": 1, "groups": [{
        "orgId": 1, "name": "flashwatch", "folder": "flashwatch", "interval": "1m",
        "rules": out}]}


ALERTS_HEADER = """\
# Grafana-managed alert rules for flashwatch (file provisioning, Grafana 10+).
# GENERATED by dashboards/grafana/generate.py from dashboards/prometheus/flashwatch-rules.yml:
# edit those, not this file. Same expressions, `for`, labels and annotations as the
# Prometheus rules; use these OR the Prometheus rules + Alertmanager, not both (double pages).
#
# Set FLASHWATCH_PROMETHEUS_UID in Grafana's environment to the uid of your Prometheus
# data source (Connections > Data sources > your Prometheus: the uid is the last part of
# the URL); Grafana expands it when it reads this file. See docs/dashboards.md.
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, as a person would write them."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def render() -> dict[Path, str]:
    dashboard = build_dashboard()
    alerts = build_alerts(dashboard=dashboard)
    return {
        DASHBOARD_PATH: json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n",
        ALERTS_PATH: ALERTS_HEADER + yaml.dump(alerts, Dumper=_Dumper, sort_keys=False,
                                               allow_unicode=True, width=1 << 16),
    }


if __name__ == "__main__":
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    from flashwatch.cli import write_dashboards

    for path in write_dashboards(REPO / "dashboards"):
        print(f"copied to {path}")
