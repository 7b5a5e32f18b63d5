"""flashwatch/report/sinks.py and flashwatch/report/records.py: JSONL and console output of
reports."""

from __future__ import annotations

import io
import json
import math

import pytest

from flashwatch import Event, HeadRecord, Mode, StepReport
from flashwatch.report.sinks import ConsoleSink, JsonlSink, Sink, read_jsonl


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


def test_console_prints_on_global_rank_zero_only_by_default():
    quiet, loud = io.StringIO(), io.StringIO()
    ConsoleSink(stream=quiet, rank=1).write(_report())
    ConsoleSink(stream=loud, rank=1, rank_zero_only=False).write(_report())
    assert quiet.getvalue() == "" and "worst heads" in loud.getvalue()


def test_report_worst_puts_nan_last():
    assert [h.head for h in _report().worst(3)] == [2, 1, 0]


def test_jsonl_writes_from_global_rank_zero_only_by_default(tmp_path, monkeypatch):
    JsonlSink(tmp_path / "r1.jsonl", rank=1).write(_report())
    monkeypatch.setenv("RANK", "2")
    JsonlSink(tmp_path / "env2.jsonl").write(_report())
    assert not (tmp_path / "r1.jsonl").exists() and not (tmp_path / "env2.jsonl").exists()
    every = JsonlSink(tmp_path / "all.jsonl", rank_zero_only=False)
    every.write(_report())
    every.close()
    assert len(read_jsonl(tmp_path / "all.jsonl")) == 1
    monkeypatch.setenv("RANK", "0")
    zero = JsonlSink(tmp_path / "env0.jsonl")
    zero.write(_report())
    zero.close()
    assert len(read_jsonl(tmp_path / "env0.jsonl")) == 1


def _big_report(step, n_layers=3, n_heads=100, flagged=(), events=()):
    heads = [HeadRecord(layer=f"h.{i}.attn", head=h, tied_rowmax_ratio=0.001 * h,
                        delta_drift_z=0.01 * (i * n_heads + h), wq_spectral_norm=1.0 + i,
                        flagged=(i, h) in flagged)
             for i in range(n_layers) for h in range(n_heads)]
    return StepReport(step=step, heads=heads, events=list(events))


def test_jsonl_is_compact_on_large_models_with_full_records_when_it_matters(tmp_path):
    path = tmp_path / "big.jsonl"
    sink = JsonlSink(path, top=2)  # 300 heads > 256: compact by default, full every 100th
    switch = Event(step=4, layer="h.0.attn", head=5, from_mode=Mode.STANDARD,
                   to_mode=Mode.BETA, reason="test", applied=True)
    sink.write(_big_report(0))  # the first monitored step is full
    sink.write(_big_report(1))
    sink.write(_big_report(2, flagged={(0, 7)}))  # a head becomes flagged: full
    sink.write(_big_report(3, flagged={(0, 7)}))  # still flagged: compact, head listed
    sink.write(_big_report(4, flagged={(0, 7)}, events=[switch]))  # an event: full
    sink.close()
    rows = read_jsonl(path)
    assert [r["full"] for r in rows] == [True, False, True, False, True]
    assert all(len(r["heads"]) == 300 for r in rows if r["full"])
    compact = rows[3]
    assert "heads" not in compact and compact["events"] == []
    assert [(h["layer"], h["head"]) for h in compact["worst_heads"]] == [
        ("h.2.attn", 99), ("h.2.attn", 98), ("h.0.attn", 7)]  # top 2 by drift z + flagged
    layer0 = compact["layers"][0]
    assert layer0["layer"] == "h.0.attn" and layer0["heads"] == 100
    assert layer0["delta_drift_z_max"] == 0.99 and layer0["wq_spectral_norm_max"] == 1.0
    assert layer0["heads_flagged"] == 1 and layer0["attention_max_logit_max"] is None
    sizes = [len(line) for line in path.read_text().splitlines()]
    assert sizes[1] * 10 < sizes[0]
    assert rows[4]["events"][0]["head"] == 5


def test_jsonl_full_every_is_a_knob_and_checked(tmp_path):
    sink = JsonlSink(tmp_path / "a.jsonl", full_every=3)  # small model, compact asked for
    for step in range(4):
        sink.write(_report(step) if step == 0 else StepReport(step=step, heads=_report().heads))
    always = JsonlSink(tmp_path / "b.jsonl", full_every=1)
    for step in range(3):
        always.write(_big_report(step))
    sink.close()
    always.close()
    assert [r["full"] for r in read_jsonl(tmp_path / "a.jsonl")] == [True, False, False, True]
    assert all(r["full"] for r in read_jsonl(tmp_path / "b.jsonl"))
    with pytest.raises(ValueError, match="full_every must be an int ≥ 1, got 0"):
        JsonlSink(tmp_path / "c.jsonl", full_every=0)
    with pytest.raises(ValueError, match="rank must be an int ≥ 0, got -1; or None"):
        JsonlSink(tmp_path / "c.jsonl", rank=-1)


def test_layer_summaries_take_maxima_without_nan_and_count_modes():
    heads = _report().heads
    heads[1].head_mode = Mode.BETA
    heads[2].flagged = True
    s = StepReport(step=0, heads=heads).layer_summaries()["h.0.attn"]
    assert s["delta_drift_z_max"] == 2.0 and s["tied_rowmax_ratio_max"] == 0.02
    assert math.isnan(s["attention_max_logit_max"])
    assert (s["heads"], s["heads_not_standard"], s["heads_flagged"]) == (3, 1, 1)


def _gloo_sink_worker(rank, world, init_file, path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    sink = JsonlSink(path)  # no rank given, no RANK env var: torch.distributed's rank
    sink.write(_report(rank))
    sink.close()
    dist.destroy_process_group()


def test_jsonl_under_torch_distributed_only_rank_zero_writes(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "shared.jsonl"
    mp.spawn(_gloo_sink_worker, args=(2, str(tmp_path / "init"), str(path)), nprocs=2,
             join=True)
    assert [r["step"] for r in read_jsonl(path)] == [0]


def test_jsonl_keeps_decisions_and_confirmed_events_apart(tmp_path):
    """A decision is in "events"; only a switch seen run is in "confirmed" (what counters
    count): a decided-then-withdrawn mode never appears there."""
    decided = Event(step=1, layer="h.0.attn", head=0, from_mode=Mode.STANDARD,
                    to_mode=Mode.FP32_O, reason="test", applied=True)
    withdrawn = Event(step=2, layer="h.0.attn", head=0, from_mode=Mode.STANDARD,
                      to_mode=Mode.FP32_O, reason="test; not applied: attn_mask", applied=False)
    ran = Event(step=3, layer="h.0.attn", head=1, from_mode=Mode.STANDARD,
                to_mode=Mode.BETA, reason="test", applied=True)
    sink = JsonlSink(tmp_path / "c.jsonl")
    heads = _report().heads
    for step, events, confirmed in ((1, [decided], []), (2, [withdrawn], []),
                                    (3, [ran], []), (4, [], [ran])):
        sink.write(StepReport(step=step, heads=heads, events=events, confirmed=confirmed))
    sink.close()
    rows = read_jsonl(tmp_path / "c.jsonl")
    assert [len(r["confirmed"]) for r in rows] == [0, 0, 0, 1]
    assert [Event.from_dict(d) for r in rows for d in r["confirmed"]] == [ran]
    assert [Event.from_dict(d) for r in rows for d in r["events"]] == [decided, withdrawn, ran]
