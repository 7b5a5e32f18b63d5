"""dashboards/prometheus/flashwatch-rules.yml: promtool checks the rules and runs their
unit tests, which must fail when an alert cannot fire or loses its `for:`; every alert has
a severity, summary, description and a runbook section that exists (docs/design.md §7)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from _helpers import promql_metric_names

from livejob import prometheus_tool

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "flashwatch" / "dashboards" / "prometheus" / "flashwatch-rules.yml"
RULES_TEST = RULES.with_name("flashwatch-rules.test.yml")
RUNBOOKS = ROOT / "README.md"  # runbook_url anchors point at README sections
SEVERITIES = {"critical", "warning", "info"}


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_promtool_check_rules():
    r = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(RULES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_test_rules():
    r = subprocess.run([prometheus_tool("promtool"), "test", "rules", str(RULES_TEST)],
                       capture_output=True, text=True, timeout=60, cwd=RULES_TEST.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def _promtool_test_with(tmp_path, rules: dict) -> subprocess.CompletedProcess:
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    return subprocess.run([prometheus_tool("promtool"), "test", "rules", RULES_TEST.name],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize("alert", [r["alert"] for r in _alerts()])
def test_rule_tests_catch_an_alert_that_never_fires(tmp_path, alert):
    """The unit tests are able to fail: a rule that cannot fire must break them."""
    rules = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            if r.get("alert") == alert:
                r["expr"] = "vector(1) == 0"
    r = _promtool_test_with(tmp_path, rules)
    assert r.returncode != 0 and alert in r.stdout + r.stderr


@pytest.mark.parametrize("alert", [r["alert"] for r in _alerts() if "for" in r])
def test_rule_tests_check_the_for_duration(tmp_path, alert):
    """Dropping an alert's `for:` must break its "not yet firing" check."""
    rules = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            if r.get("alert") == alert:
                del r["for"]
    r = _promtool_test_with(tmp_path, rules)
    assert r.returncode != 0 and alert in r.stdout + r.stderr


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_alerts_have_severity_summary_description_and_a_runbook_that_exists():
    doc_anchors = {_anchor(m.group(1)) for m in
                   re.finditer(r"^#{1,6}\s+(.+)$", RUNBOOKS.read_text(), re.M)}
    seen = set()
    assert _alerts(), RULES  # a rules file without alerts would pass every check below
    for r in _alerts():
        name, ann = r["alert"], r["annotations"]
        assert r["labels"]["severity"] in SEVERITIES, name
        assert ann["summary"].strip() and ann["description"].strip(), name
        url = ann["runbook_url"]
        assert url == f"https://github.com/flashwatch/flashwatch#alert-{name.lower()}", url
        anchor = url.split("#", 1)[1]
        assert anchor in doc_anchors, f"{name}: no heading with anchor #{anchor} in {RUNBOOKS}"
        assert anchor not in seen
        seen.add(anchor)
        per_head = promql_metric_names(r["expr"]) - {"up", "flashwatch_monitor_step",
                                                      "flashwatch_monitor_seconds",
                                                      "flashwatch_monitor_errors_total"}
        if per_head:  # an alert about a head must say which one
            for label in ("$labels.layer", "$labels.head"):
                assert label in ann["description"] and label in ann["summary"], (name, label)
