"""dashboards/: the metric names every query uses exist, the Grafana dashboard JSON and
the Grafana alert rules checked offline, and every dashboard query run against a real
Prometheus that scrapes a training job (docs/design.md §7). The Prometheus rules under
promtool: tests/test_dashboards_rules.py.

promtool and prometheus come with Debian's `prometheus` package (`make test` installs it).
When they are missing these tests FAIL (never skip): CI must not go green without them.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from _helpers import (
    all_panels,
    dashboard_exprs,
    dashboard_json,
    label_values_args,
    panels_with_queries,
    prometheus_rules,
    promql_metric_names,
)

from flashwatch import Event, Mode
from flashwatch.integrations.prometheus import METRIC_NAMES, PrometheusSink
from livejob import TinyTrainer, prometheus_server, prometheus_tool

ROOT = Path(__file__).resolve().parent.parent
DASH = ROOT / "flashwatch" / "dashboards"  # what ships; dashboards/ is its copy
RULES = DASH / "prometheus" / "flashwatch-rules.yml"
RULES_TEST = DASH / "prometheus" / "flashwatch-rules.test.yml"
DASHBOARD = DASH / "grafana" / "flashwatch.json"
GRAFANA_ALERTS = DASH / "grafana" / "provisioning" / "alerting" / "flashwatch-alerts.yaml"
DASHBOARD_PROVISIONING = DASH / "grafana" / "provisioning" / "dashboards" / "flashwatch.yaml"
DOCS = ROOT / "docs" / "dashboards.md"
DS_REF = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("fw_dash_generate",
                                                  ROOT / "dashboards" / "grafana" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _alerts() -> list[dict]:
    return [r for r in prometheus_rules() if "alert" in r]


def _grafana_rules() -> list[dict]:
    return [r for g in yaml.safe_load(GRAFANA_ALERTS.read_text())["groups"] for r in g["rules"]]


def test_metric_name_parser_finds_names_and_catches_typos():
    assert promql_metric_names(
        'sum by (layer, head) (increase(flashwatch_mitigations_total{job=~"$job"}'
        '[$__rate_interval])) > 0') == {"flashwatch_mitigations_total"}
    assert promql_metric_names(
        "a:b:c >= 0.2 and a:b:c > on (job, layer) group_left () (3 * x_y offset 30m)"
        " + 1e-9") == {"a:b:c", "x_y"}
    assert promql_metric_names('topk(5, abs(flashwatch_delta_error_sum{layer=~"up"}))') == {
        "flashwatch_delta_error_sum"}
    typo = promql_metric_names('flashwatch_mitigation_total{job="x"}')
    assert typo - _known_names() == {"flashwatch_mitigation_total"}


def _known_names() -> set[str]:
    recorded = {r["record"] for r in prometheus_rules() if "record" in r}
    return set(METRIC_NAMES) | recorded | {"up"}


def test_every_metric_name_exists_in_the_exporter_or_the_recording_rules():
    sources = {"dashboard": dashboard_exprs(dashboard_json()),
               "prometheus rules": [r["expr"] for r in prometheus_rules()],
               "grafana alerts": [q["model"]["expr"] for r in _grafana_rules()
                                  for q in r["data"] if "expr" in q["model"]]}
    used = set()
    for where, exprs in sources.items():
        assert exprs, where
        for expr in exprs:
            names = promql_metric_names(expr)
            assert names, f"{where}: no metric name found in {expr!r}"
            unknown = names - _known_names()
            assert not unknown, (f"{where}: {sorted(unknown)} in {expr!r} is neither in the "
                                 f"exporter's METRIC_NAMES nor a recording rule")
            used |= names
    # and the other way round: every exported metric is shown or alerted on somewhere
    assert set(METRIC_NAMES) - used == set()


def test_grafana_alert_rules_are_equivalent_to_the_prometheus_alerts():
    prom = {r["alert"]: r for r in _alerts()}
    graf = {r["title"]: r for r in _grafana_rules()}
    assert sorted(graf) == sorted(prom)
    uids = [r["uid"] for r in graf.values()]
    assert len(set(uids)) == len(uids)
    panel_ids = {p["id"] for p in all_panels(dashboard_json()["panels"])}
    for name, g in graf.items():
        p = prom[name]
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", g["uid"]), g["uid"]
        refs = {q["refId"]: q for q in g["data"]}
        assert g["condition"] in refs
        query = refs["A"]
        assert query["datasourceUid"] == "$FLASHWATCH_PROMETHEUS_UID"
        assert query["model"]["expr"].strip() == p["expr"].strip(), name
        assert query["model"]["instant"] is True
        cond = refs[g["condition"]]
        assert cond["datasourceUid"] == "__expr__" and cond["model"]["type"] == "math"
        assert g["for"] == p.get("for", "0s"), name
        assert g["labels"] == p["labels"], name
        for key, text in p["annotations"].items():
            expected = text.replace("$labels.", ".Labels.").replace("$value", ".Values.A.Value")
            assert g["annotations"][key] == expected, (name, key)
        # no `$` in annotations: provisioning must not be able to expand anything there
        assert not any("$" in v for v in g["annotations"].values()), name
        assert g["annotations"]["__dashboardUid__"] == dashboard_json()["uid"]
        assert int(g["annotations"]["__panelId__"]) in panel_ids
        assert g["noDataState"] == "OK" and g["execErrState"] in ("Error", "Alerting", "OK")


def test_generated_files_match_the_generator():
    gen = _load_generator()
    files = gen.render()
    assert set(files) == {DASHBOARD, GRAFANA_ALERTS}  # both generated files are compared
    for path, text in files.items():
        assert path.read_text() == text, (f"{path} differs from dashboards/grafana/"
                                          f"generate.py: run it and commit the output")


def test_dashboard_provisioning_file():
    doc = yaml.safe_load(DASHBOARD_PROVISIONING.read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


def test_dashboard_structure_grafana_needs():
    d = dashboard_json()
    assert d["uid"] == "flashwatch-attention" and d["title"]
    assert d["schemaVersion"] >= 36 and d["id"] is None  # importable into any instance
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert len(variables) == len(d["templating"]["list"]), "duplicate variable names"
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "layer", "head"} <= set(variables)

    # variables: label_values queries on the datasource variable, each only using
    # variables defined before it (Grafana resolves them in order)
    defined = set(GRAFANA_BUILTINS)
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == DS_REF, v["name"]
            selector, label = label_values_args(v)
            assert v["definition"] == v["query"]["query"]
            assert _var_refs(selector) <= defined, v["name"]
            assert v["multi"] == v["includeAll"]
            if v["includeAll"]:
                assert v["allValue"] == ".*"
        defined.add(v["name"])

    ids, rects = set(), []
    panels = list(all_panels(d["panels"]))
    for p in panels:
        assert isinstance(p["id"], int) and p["id"] not in ids, p.get("title")
        ids.add(p["id"])
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["w"] > 0 and g["h"] > 0
        assert g["x"] + g["w"] <= 24, p["title"]
        for other, r in rects:  # panels must not overlap
            overlap = (g["x"] < r["x"] + r["w"] and r["x"] < g["x"] + g["w"]
                       and g["y"] < r["y"] + r["h"] and r["y"] < g["y"] + g["h"])
            assert not overlap, (p["title"], other)
        rects.append((p["title"], g))

    query_panels = panels_with_queries(d)
    assert {p["type"] for p in query_panels} >= {"timeseries", "heatmap", "state-timeline",
                                                 "table"}
    for p in query_panels:
        assert p["datasource"] == DS_REF, p["title"]
        assert p["description"].strip(), p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t.get("datasource", DS_REF) == DS_REF, p["title"]
            assert t["expr"].strip(), p["title"]
            assert _var_refs(t["expr"]) <= set(variables) | GRAFANA_BUILTINS, t["expr"]

    # the guide (a text panel) explains every panel, with its description
    (guide,) = [p for p in panels if p["type"] == "text"]
    for p in query_panels:
        assert f"*{p['title']}*: {p['description']}" in guide["options"]["content"]

    annotations = [a for a in d["annotations"]["list"] if not a.get("builtIn")]
    assert annotations, "mitigation annotations missing"
    for a in annotations:
        assert a["datasource"] == DS_REF and a["expr"] == a["target"]["expr"]
        assert "flashwatch_mitigations_total" in promql_metric_names(a["expr"])
        assert _var_refs(a["expr"]) <= set(variables) | GRAFANA_BUILTINS


def _var_refs(expr: str) -> set[str]:
    return set(re.findall(r"\$\{?(\w+)", expr))


SMALL = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
SCRAPE_JOB = "flashwatch"


class _PromqlError(Exception):
    pass


def _api(web: str, path: str, **params):
    url = f"http://{web}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
    try:
        body = json.load(urllib.request.urlopen(url, timeout=5))
    except urllib.error.HTTPError as e:  # 400/422: a bad query -- fail, don't retry
        if e.code == 503:  # still starting (seen on a loaded machine): an OSError, retried
            raise
        raise _PromqlError(f"{params}: {e.read().decode()[:500]}") from None
    return body["data"]


def _regex_escape(value: str) -> str:
    """What Grafana does to a multi-value variable's value inside =~"..." (PromQL
    string): regex metacharacters get a backslash, itself escaped for the string."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


def _substitute(expr: str, values: dict[str, str]) -> str:
    out = expr.replace("$__rate_interval", "5s").replace("$__interval", "2s")
    for name, value in values.items():
        out = out.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in out, f"unsubstituted variable in {out!r}"
    return out


def test_every_dashboard_query_returns_series_from_a_live_prometheus(tmp_path):
    prometheus_tool("prometheus")  # fail early, with the install hint, if it is missing
    d = dashboard_json()
    exprs = dashboard_exprs(d)
    variables = [v for v in d["templating"]["list"] if v["type"] == "query"]

    sink = PrometheusSink(port=0)
    trainer = TinyTrainer([sink])
    trainer.step()  # a report is there before the first scrape
    planted = False
    empty: list = ["not run"]
    try:
        # recording rules feed some panels
        with prometheus_server(tmp_path, sink.port, job=SCRAPE_JOB,
                               rule_files=[RULES]) as (web, proc):
            deadline = time.monotonic() + 50
            while time.monotonic() < deadline and empty:
                trainer.step()  # the job keeps training while Prometheus scrapes it
                if proc.poll() is not None:
                    break
                try:
                    if not planted:
                        # Plant one mitigation (as the watcher reports a switch seen run)
                        # once the zero-initialised counter has been scraped, so
                        # increase() and the annotation query see a real 0 -> 1 step.
                        # Layer 0 head 0: the "one head" substitution below uses the
                        # first layer and head, and its annotation query must find it.
                        if _api(web, "query",
                                query="flashwatch_mitigations_total")["result"]:
                            report = trainer.step()
                            switch = Event(
                                step=report.step, layer="transformer.h.0.attn", head=0,
                                from_mode=Mode.STANDARD, to_mode=Mode.BETA, reason="test",
                                applied=True)  # seen run: counters count confirmed events
                            report.events.append(switch)
                            report.confirmed.append(switch)
                            sink.write(report)
                            planted = True
                        continue
                    values = _variable_values(web, variables)
                    if values is None:
                        continue
                    empty = [(label, e) for label, vals in values.items() for e in exprs
                             if not _api(web, "query", query=_substitute(e, vals))["result"]]
                except OSError:
                    pass  # Prometheus not listening yet
                time.sleep(0.3)
            alive = proc.poll() is None
    finally:
        trainer.watcher.remove()
    tail = (tmp_path / "prometheus.log").read_text()[-2000:]
    assert alive, f"prometheus exited: {tail}"
    assert planted, f"no flashwatch series ever scraped: {tail}"
    assert not empty, f"dashboard queries without any series: {empty}"


def _variable_values(web, variables):
    """Two sets of variable values to substitute: "All" (.*) for layer/head, and the
    first real value of each, escaped like Grafana does. None until all variables
    have values in Prometheus (each variable query is checked this way too)."""
    first = {}
    for v in variables:  # in order: later selectors use earlier values
        selector, label = label_values_args(v)
        sel = _substitute(selector, {**{k: ".*" for k in ("layer", "head")}, **first})
        vals = _api(web, f"label/{label}/values", **{"match[]": sel})
        if not vals:
            return None
        first[v["name"]] = vals[0]
    assert first["job"] == SCRAPE_JOB
    single = {k: (_regex_escape(x) if k in ("layer", "head") else x) for k, x in first.items()}
    return {"all layers/heads": {**first, "layer": ".*", "head": ".*"}, "one head": single}
