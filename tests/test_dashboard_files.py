"""One source for the dashboards: flashwatch/dashboards/ (package data, what
`flashwatch dashboards` writes) and the repository's dashboards/ hold the same files; the
installed wheel ships them; docs/dashboards.md's numbers and snippet are those files'."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from _installed import env as installed_env

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "flashwatch" / "dashboards"
COPY = ROOT / "dashboards"
REPO_ONLY = {"grafana/generate.py"}  # the generator itself does not ship
DOC = ROOT / "docs" / "dashboards.md"
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
           "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_repository_dashboards_are_the_package_data():
    data, copy = tree(DATA), tree(COPY)
    for rel in REPO_ONLY:
        copy.pop(rel)
    assert len(data) >= 6
    differ = sorted(rel for rel in data.keys() | copy.keys() if data.get(rel) != copy.get(rel))
    assert not differ, (f"dashboards/ and flashwatch/dashboards/ differ in {differ}: edit "
                        f"flashwatch/dashboards/ (or generate.py), then run "
                        f"`python dashboards/grafana/generate.py`, which copies it over")


def test_installed_wheel_writes_the_dashboards(installed, tmp_path):
    """The console script of the installed wheel, from an empty directory."""
    done = subprocess.run([installed.venv / "bin" / "flashwatch", "dashboards"], cwd=tmp_path,
                          env=installed_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert tree(tmp_path / "dashboards") == tree(DATA)


def _alert_rules() -> list[dict]:
    groups = yaml.safe_load((DATA / "prometheus" / "flashwatch-rules.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_dashboards_doc_counts_the_grafana_rules():
    grafana = yaml.safe_load(
        (DATA / "grafana" / "provisioning" / "alerting" / "flashwatch-alerts.yaml").read_text())
    n = sum(len(g["rules"]) for g in grafana["groups"])
    assert n == len(_alert_rules())  # the same alerts on both paths
    said = re.findall(r'folder "flashwatch" with\s+(\w+) rules', DOC.read_text())
    assert said and all(NUMBERS.get(w, w) in (n, str(n)) for w in said), (said, n)


def test_dashboards_doc_scrape_job_is_the_shipped_one():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    jobs = [yaml.safe_load(re.sub(r"(?m)^ {3}", "", b)) for b in blocks if "scrape_configs" in b]
    shipped = yaml.safe_load((DATA / "prometheus" / "flashwatch-scrape.yml").read_text())
    assert jobs == [shipped]
