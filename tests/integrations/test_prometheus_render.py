"""flashwatch.integrations.prometheus_render: the page is prometheus_client's text format
byte for byte (NaN, ±Inf, escaped labels), NaN series stay exposed."""

from __future__ import annotations

import math
import urllib.request

from _helpers import by_name, mode_switch, scrape
from prometheus_client import generate_latest

from flashwatch import HeadRecord, Mode, StepReport
from flashwatch.integrations.prometheus import PrometheusSink, render
from flashwatch.integrations.prometheus_render import HEAD_GAUGES

_GAUGE_FIELDS = [m.name for m in HEAD_GAUGES if m.name != "head_mode"]


def test_nan_is_exposed_as_nan_and_series_stay():
    sink = PrometheusSink(port=0)
    try:
        sink.write(StepReport(step=0, heads=[HeadRecord(layer="l", head=0)]))  # all NaN
        samples = by_name(scrape(sink.url))
    finally:
        sink.close()
    assert math.isnan(samples["flashwatch_delta_drift_z"][0].value)
    assert samples["flashwatch_head_mode"][0].value == 0


def test_render_is_byte_for_byte_prometheus_clients_text_format():
    odd = 'a"b\\c\nd'  # a quote, a backslash and a newline in a layer name
    values = [math.nan, math.inf, -math.inf, 1e22, 1234567.5, 0.1, -3.0, 7e-9]
    heads = [HeadRecord(layer=layer, head=h, **dict(zip(_GAUGE_FIELDS, values[h:] + values[:h],
                                                        strict=False)))
             for layer in ("model.layers.0.self_attn", odd) for h in range(4)]
    switch = mode_switch(odd, 1, Mode.FP32_O, step=9)
    sink = PrometheusSink(port=0)
    try:
        expected_empty = generate_latest(sink.registry)
        assert render(None) == expected_empty  # before the first report: families only
        assert urllib.request.urlopen(sink.url, timeout=5).read() == expected_empty
        sink.write(StepReport(step=9, heads=heads, events=[switch], confirmed=[switch],
                              monitor_seconds=0.5, monitor_errors_total=3))
        page = urllib.request.urlopen(sink.url, timeout=5).read()
    finally:
        sink.close()
    assert page == generate_latest(sink.registry)
    assert "1.2345675e+06" in page.decode() and "+Inf" in page.decode()
    assert 'flashwatch_mitigations_total{head="1",layer="a\\"b' in page.decode()
