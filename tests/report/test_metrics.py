"""flashwatch/report/metrics.py: the one metrics table, and that HeadRecord, the JSONL lines,
the Prometheus families, the callbacks' keys and the Grafana dashboard agree with it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from _helpers import dashboard_exprs, dashboard_json, prometheus_rules, promql_metric_names

from flashwatch import HeadRecord, Mode, StepReport
from flashwatch.integrations import shared
from flashwatch.integrations.prometheus import METRIC_NAMES, PrometheusSink
from flashwatch.report import metrics
from flashwatch.report.sinks import JsonlSink, read_jsonl

ROOT = Path(__file__).resolve().parents[2]

# The public contract, written out by hand: dashboards, alert rules and users' queries
# name these series and labels. Removing or renaming one breaks them.
CONTRACT = {
    "flashwatch_tied_rowmax_ratio": ("gauge", ("head", "layer")),
    "flashwatch_attention_max_logit": ("gauge", ("head", "layer")),
    "flashwatch_delta_error_rowsum": ("gauge", ("head", "layer")),
    "flashwatch_delta_error_share": ("gauge", ("head", "layer")),
    "flashwatch_wq_grad_norm": ("gauge", ("head", "layer")),
    "flashwatch_delta_drift_z": ("gauge", ("head", "layer")),
    "flashwatch_delta_coherence": ("gauge", ("head", "layer")),
    "flashwatch_r_projection_cumulative": ("gauge", ("head", "layer")),
    "flashwatch_wq_spectral_norm": ("gauge", ("head", "layer")),
    "flashwatch_head_mode": ("gauge", ("head", "layer")),
    "flashwatch_mitigations_total": ("counter", ("head", "layer", "mode")),
    "flashwatch_guarded_rows_total": ("counter", ("head", "layer")),
    "flashwatch_qk_clip_total": ("counter", ("head", "layer")),
    "flashwatch_monitor_step": ("gauge", ()),
    "flashwatch_monitor_seconds": ("gauge", ()),
    "flashwatch_monitor_errors_total": ("counter", ()),
}
# HeadRecord's fields (the watcher builds records with these keywords).
HEAD_RECORD = ("layer", "head", "tied_rowmax_ratio", "attention_max_logit", "delta_error_sum",
               "r_projection", "r_projection_cumulative", "delta_drift_z", "delta_coherence",
               "wq_spectral_norm", "delta_error_rows", "delta_error_all_rows", "delta_sign_z",
               "delta_error_share", "wq_grad_norm", "delta_error_share_mean",
               "delta_error_share_std", "guarded_rows", "head_mode", "recommended_mode", "flagged")
# Their defaults, by hand (HeadRecord takes them from the table, so checking one against
# the other alone would pass whatever the table says): NaN until measured, zero rows,
# STANDARD, not flagged.
HEAD_RECORD_DEFAULTS = {**dict.fromkeys(HEAD_RECORD[2:], math.nan), "delta_error_rows": 0.0,
                        "delta_error_all_rows": False, "guarded_rows": 0,
                        "head_mode": Mode.STANDARD, "recommended_mode": Mode.STANDARD,
                        "flagged": False}


def test_the_table_is_well_formed():
    names = [m.name for m in metrics.METRICS]
    assert len(set(names)) == len(names)
    for m in metrics.METRICS:
        assert m.scope in ("head", "step") and m.help.strip() and m.unit, m.name
        assert m.prometheus in (None, "gauge", "counter"), m.name
        assert m.counts in (None, "mode", "qk_clip"), m.name
        assert m.counts is None or (m.prometheus == "counter" and m.scope == "head"), m.name
        assert m.limit is None or math.isfinite(m.limit), m.name
        assert not (m.layer_max or m.logged) or m.in_head_record, m.name
        if m.field is not None:
            assert m.scope == "step" and m.field in StepReport.__dataclass_fields__, m.name


def test_head_record_is_the_tables_head_rows_with_their_types_and_defaults():
    fields = dataclasses.fields(HeadRecord)
    assert tuple(f.name for f in fields) == HEAD_RECORD
    rows = {m.name: m for m in metrics.HEAD_FIELDS}
    assert tuple(rows) == HEAD_RECORD[2:]
    record = HeadRecord(layer="l", head=0)
    for f in fields[2:]:
        want = HEAD_RECORD_DEFAULTS[f.name]
        assert f.type is type(want), f.name
        for got in (getattr(record, f.name), rows[f.name].default):
            assert math.isnan(got) if isinstance(want, float) and math.isnan(want) else \
                got == want and type(got) is type(want), f.name
    # the watcher's construction: layer, head, columns and the three decision fields
    r = HeadRecord(layer="a", head=3, tied_rowmax_ratio=0.5, head_mode=Mode.BETA,
                   recommended_mode=Mode.FP32_O, flagged=True)
    assert (r.tied_rowmax_ratio, r.head_mode, r.flagged) == (0.5, Mode.BETA, True)


def test_prometheus_serves_exactly_the_contract_from_the_table():
    assert dict(zip(METRIC_NAMES, ((m.prometheus, m.labels) for m in metrics.EXPORTED),
                    strict=True)) == CONTRACT
    sink = PrometheusSink(start_server=False)
    sink.write(StepReport(step=2, heads=[HeadRecord(layer="l", head=h) for h in range(2)]))
    served = {}
    for family in sink.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {tuple(sorted(s.labels)) for s in family.samples}
        served[name] = (family.type, family.documentation, labels)
    help_ = {m.prometheus_name: m.help for m in metrics.EXPORTED}
    assert {n: (t, h) for n, (t, h, _) in served.items()} == {
        n: (CONTRACT[n][0], help_[n]) for n in CONTRACT}
    for name, (_, _, labels) in served.items():
        assert labels == {CONTRACT[name][1]}, name


def test_jsonl_lines_carry_the_head_record_fields_and_the_layer_maxima(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl", full_every=2)
    heads = [HeadRecord(layer="l", head=h, delta_drift_z=float(h)) for h in range(3)]
    for step in range(2):
        sink.write(StepReport(step=step, heads=heads))
    sink.close()
    full, compact = read_jsonl(tmp_path / "m.jsonl")
    assert tuple(full["heads"][0]) == HEAD_RECORD
    (layer,) = compact["layers"]
    assert set(layer) == {"layer", "heads", "heads_not_standard", "heads_flagged",
                          *(f"{f}_max" for f in metrics.LAYER_MAX)}
    assert layer["delta_drift_z_max"] == 2.0
    json.dumps(full, allow_nan=False)


def test_callback_keys_are_the_tables_logged_and_layer_max_rows():
    heads = [HeadRecord(layer="l", head=h, **{f: 1.0 for f in metrics.LOGGED},
                        delta_error_share=0.01) for h in range(2)]
    report = StepReport(step=1, heads=heads)
    m = shared.logged_metrics(report, SimpleNamespace(monitor_errors_total=0),
                              shared.Reports(), top_k=1, log_per_head=True)
    per_head = {k.rsplit("/", 1)[1] for k in m if k.startswith("flashwatch/l/head_0/")}
    assert per_head == {*metrics.LOGGED, "head_mode"}
    worst = {k.rsplit("/", 1)[1] for k in m if k.startswith("flashwatch/worst_1/")}
    assert worst == {*metrics.LOGGED, "layer_index", "head"}
    per_layer = {k.rsplit("/", 1)[1] for k in m if k.count("/") == 2 and "/l/" in k}
    assert per_layer == {*(f"{f}_max" for f in metrics.LAYER_MAX), "heads_not_standard",
                         "heads_flagged"}


def _generator():
    spec = importlib.util.spec_from_file_location("fw_dash_generate_m",
                                                  ROOT / "dashboards" / "grafana" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dashboard_and_rules_use_only_table_metrics_and_show_every_one():
    exprs = dashboard_exprs(dashboard_json()) + [r["expr"] for r in prometheus_rules()]
    recorded = {r["record"] for r in prometheus_rules() if "record" in r}
    used = set().union(*(promql_metric_names(e) for e in exprs)) - recorded - {"up"}
    assert used == set(METRIC_NAMES)


def test_a_new_table_row_gets_a_dashboard_panel_and_a_wrong_name_fails(monkeypatch):
    gen = _generator()
    row = metrics.Metric("new_head_metric", "ratio", "head", "A metric added as one row.",
                         prometheus="gauge")
    monkeypatch.setattr(metrics, "EXPORTED", (*metrics.EXPORTED, row))
    monkeypatch.setattr(metrics, "METRIC_NAMES", (*metrics.METRIC_NAMES,
                                                  "flashwatch_new_head_metric"))
    panels = [p for p in gen.build_dashboard()["panels"]
              if p.get("title") == "flashwatch_new_head_metric"]
    assert len(panels) == 1 and panels[0]["description"] == "A metric added as one row."
    assert "flashwatch_new_head_metric{" in panels[0]["targets"][0]["expr"]
    monkeypatch.setattr(metrics, "METRIC_NAMES", tuple(
        n for n in metrics.METRIC_NAMES if n != "flashwatch_delta_drift_z"))
    with pytest.raises(ValueError, match=r"\['flashwatch_delta_drift_z'\], not exported"):
        gen.build_dashboard()


def test_the_docs_metric_table_lists_exactly_the_exported_metrics():
    text = (ROOT / "docs" / "integrations.md").read_text()
    listed = re.findall(r"^\| `(flashwatch_\w+)` \|", text, re.M)
    assert sorted(listed) == sorted(METRIC_NAMES)
