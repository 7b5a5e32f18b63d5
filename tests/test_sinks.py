"""flashwatch/sinks.py and flashwatch/report.py: JSONL and console output of reports."""

from __future__ import annotations

import io
import json
import math

import pytest

from flashwatch import Event, HeadRecord, Mode, StepReport
from flashwatch.sinks import ConsoleSink, JsonlSink, Sink, read_jsonl


def _report(step=3):
    heads = [HeadRecord(layer="h.0.attn", head=h, tied_rowmax_ratio=0.01 * h,
                        delta_drift_z=float(h), wq_spectral_norm=2.0) for h in range(3)]
    heads[0].delta_drift_z = math.nan
    ev = Event(step=step, layer="h.0.attn", head=2, from_mode=Mode.STANDARD,
               to_mode=Mode.BETA, reason="drift z 5.0 ≥ 4", applied=True)
    return StepReport(step=step, heads=heads, events=[ev], monitor_seconds=0.002)


def test_jsonl_appends_one_flushed_line_per_report(tmp_path):
    path = tmp_path / "run" / "flashwatch.jsonl"
    sink = JsonlSink(path)
    assert isinstance(sink, Sink)
    sink.write(_report(1))
    # flushed: readable while the sink is still open, as after a crash
    rows = read_jsonl(path)
    assert len(rows) == 1 and rows[0]["step"] == 1
    sink.write(_report(2))
    sink.close()
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2]
    sink.write(_report(3))  # reused after close (a second fit): appends, loses nothing
    sink.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    head0 = rows[0]["heads"][0]
    assert head0["delta_drift_z"] is None  # NaN written as null, the file stays valid JSON
    assert head0["head_mode"] == "STANDARD"
    assert rows[0]["events"][0]["to_mode"] == "BETA"
    assert Event.from_dict(rows[0]["events"][0]) == _report(1).events[0]


def test_read_jsonl_skips_a_truncated_last_line_only(tmp_path):
    path = tmp_path / "x.jsonl"
    good = json.dumps(_report().to_dict())
    path.write_text(good + "\n" + good[:40])
    assert len(read_jsonl(path)) == 1
    path.write_text(good[:40] + "\n" + good + "\n")
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_console_lists_worst_heads_and_events():
    out = io.StringIO()
    ConsoleSink(top=2, stream=out).write(_report())
    text = out.getvalue()
    assert "switched h.0.attn head 2 STANDARD -> BETA (drift z 5.0 ≥ 4)" in text
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("h.0.attn")]
    assert [ln.split()[1] for ln in lines] == ["2", "1"]  # by drift z, NaN last


def test_report_worst_puts_nan_last():
    assert [h.head for h in _report().worst(3)] == [2, 1, 0]
