"""The Prometheus page of a snapshot: metric families from the metrics table, and the
text exposition format written by hand, byte for byte prometheus_client's.

`Snapshot` is what PrometheusSink.write builds from a StepReport (training thread) and a
scrape reads (HTTP thread); `series(snap)` lists its families in the table's order,
`render(snap)` writes the page and `families(snap)` gives prometheus_client's objects
(for `sink.registry`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.utils import floatToGoString

from flashwatch.report.metrics import EXPORTED

# Per-head gauges, read from each HeadRecord (value order in Snapshot.heads).
HEAD_GAUGES = tuple(m for m in EXPORTED if m.in_head_record and m.prometheus == "gauge")
# Per-head counters: a HeadRecord field summed over reports, or events counted.
HEAD_COUNTERS = tuple(m for m in EXPORTED if m.scope == "head" and m.prometheus == "counter")
# Rank-local series read from the StepReport (value order in Snapshot.step_values).
STEP_SERIES = tuple(m for m in EXPORTED if m.scope == "step")


class Snapshot(NamedTuple):
    """Immutable view of one report: what a scrape reads."""

    step_values: tuple  # one value per STEP_SERIES row
    heads: tuple  # ((layer, head as str, (values in HEAD_GAUGES order)), ...)
    counters: tuple  # per HEAD_COUNTERS row: (((layer, head[, mode]), count), ...)


def series(snap: Snapshot | None):
    """(name, type, HELP, label names, [(label values, value), ...]) per family, in the
    table's order; families without samples before the first report."""
    gauge = {m.name: i for i, m in enumerate(HEAD_GAUGES)}
    counter = {m.name: i for i, m in enumerate(HEAD_COUNTERS)}
    step = {m.name: i for i, m in enumerate(STEP_SERIES)}
    out = []
    for m in EXPORTED:
        if snap is None:
            samples = []
        elif m.name in gauge:
            i = gauge[m.name]
            samples = [((head, layer), values[i]) for layer, head, values in snap.heads]
        elif m.name in counter:  # keys (layer, head, ...) -> labels (head, layer, ...)
            samples = [((key[1], key[0], *key[2:]), n) for key, n in snap.counters[
                counter[m.name]]]
        else:
            samples = [((), snap.step_values[step[m.name]])]
        out.append((m.prometheus_name, m.prometheus, m.help, m.labels, samples))
    return out


def families(snap: Snapshot | None) -> list:
    """prometheus_client metric families of a snapshot (the registry's collector)."""
    out = []
    for name, kind, doc, labels, samples in series(snap):
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(name.removesuffix("_total"), doc, labels=list(labels))
        for values, v in samples:
            family.add_metric(list(values), v)
        out.append(family)
    return out


def render(snap: Snapshot | None) -> bytes:
    """The text exposition format of a snapshot, byte for byte what prometheus_client's
    generate_latest writes (tests/integrations/test_prometheus_render.py), 3–6× faster: label
    strings are built once per head, not once per sample (5,120 heads: 66,563 samples,
    benchmarks/bench_scale.py)."""
    lines = []
    label_cache: dict = {}
    for name, kind, doc, labels, samples in series(snap):
        lines.append(f"# HELP {name} {_escape_help(doc)}\n# TYPE {name} {kind}\n")
        for values, v in samples:
            key = (labels, values)
            text = label_cache.get(key)
            if text is None:
                text = label_cache[key] = "{" + ",".join(
                    f'{k}="{_escape_label(x)}"' for k, x in zip(labels, values, strict=True)
                ) + "}" if labels else ""
            lines.append(f"{name}{text} {_go_float(v)}\n")
    return "".join(lines).encode()


def _escape_help(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _go_float(v) -> str:
    v = float(v)
    s = repr(v)
    # NaN, ±Inf and large values written with Go's exponent rule: prometheus_client's own.
    if v != v or v in (math.inf, -math.inf) or (v > 0 and s.find(".") > 6):
        return floatToGoString(v)
    return s
