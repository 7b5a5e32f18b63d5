"""flashwatch.integrations.prometheus (the sink): every documented metric over HTTP, ports
per rank, the series other ranks serve, counters that count what ran, and a real
Prometheus server (Debian's `prometheus` binary, installed by .ci/run) scraping a
training job. The page: test_prometheus_render.py; the HTTP server:
test_prometheus_server.py."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from types import SimpleNamespace

import pytest
from _helpers import by_name, mode_switch, scrape

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Event, HeadRecord, Mode, StepReport
from flashwatch.integrations.prometheus import METRIC_NAMES, PrometheusSink
from livejob import SMALL, TinyTrainer, free_port, prometheus_server, prometheus_tool

HEADS = {(f"transformer.h.{i}.attn", str(h)) for i in range(2) for h in range(4)}
PER_HEAD = [n for n in METRIC_NAMES if not n.startswith("flashwatch_monitor_")]


def test_scrape_has_every_documented_metric_with_labels():
    sink, seen = PrometheusSink(port=0), []
    recorder = SimpleNamespace(write=seen.append, close=lambda: None)  # the watcher's reports
    t = TinyTrainer([sink, recorder])  # watcher.remove() closes the sink
    try:
        assert sink.url == f"http://127.0.0.1:{sink.port}/metrics"
        before = scrape(sink.url)  # before any report: families, no samples
        assert all(not f.samples for f in before.values())
        t.step()
        t.watcher.set_head_modes("transformer.h.1.attn", [Mode.BETA] * 4)
        report = t.step()  # runs layer 1 in BETA
        # then a switch whose effect a measurement saw, in a report of its own
        confirmed = mode_switch("transformer.h.0.attn", 2, Mode.FP32_O, step=report.step)
        mine = StepReport(step=report.step, heads=report.heads,
                          monitor_seconds=report.monitor_seconds, events=[confirmed],
                          confirmed=[confirmed])
        sink.write(mine)
        families = scrape(sink.url)
    finally:
        t.watcher.remove()
    samples = by_name(families)
    assert sorted(samples) == sorted(METRIC_NAMES)
    for f in families.values():
        assert f.documentation.strip(), f.name  # HELP text
        for s in f.samples:
            assert "step" not in s.labels
    for name in PER_HEAD:
        assert {(s.labels["layer"], s.labels["head"]) for s in samples[name]} == HEADS, name
    mode = {(s.labels["layer"], s.labels["head"]): s.value
            for s in samples["flashwatch_head_mode"]}
    assert mode[("transformer.h.1.attn", "3")] == int(Mode.BETA)
    assert mode[("transformer.h.0.attn", "3")] == int(Mode.STANDARD)
    mitig = {(s.labels["layer"], s.labels["head"], s.labels["mode"]): s.value
             for s in samples["flashwatch_mitigations_total"]}
    # what the watcher confirmed (by its own reports) plus the hand-written switch
    expected = Counter((e.layer, str(e.head), e.to_mode.name)
                       for r in [*seen, mine] for e in r.confirmed
                       if e.kind == "mode" and e.applied)
    assert mitig[("transformer.h.0.attn", "2", "FP32_O")] == 1
    assert {k: v for k, v in mitig.items() if v} == dict(expected)
    assert len(mitig) == 2 * len(HEADS)  # zero-initialised for BETA and FP32_O
    assert families["flashwatch_mitigations"].type == "counter"
    assert families["flashwatch_monitor_errors"].type == "counter"
    assert samples["flashwatch_monitor_step"][0].value == 1
    assert samples["flashwatch_monitor_seconds"][0].value > 0
    for s in samples["flashwatch_wq_spectral_norm"]:
        assert math.isfinite(s.value) and s.value > 0


def test_promtool_check_metrics_passes_on_a_live_scrape():
    """Issue 37: `promtool check metrics` (Prometheus' naming lint) on the page a watched
    job serves after a measured step, a mode switch in it: exit 0, no complaint. It
    exited 3 while delta_error_sum was exported as flashwatch_delta_error_sum (a gauge
    may not end in _sum)."""
    sink = PrometheusSink(port=0)
    t = TinyTrainer([sink])
    try:
        t.step()
        t.watcher.set_head_modes("transformer.h.1.attn", [Mode.FP32_O] * 4)
        t.step()
        t.step()  # the switch seen running: mitigations_total counts it
        with urllib.request.urlopen(sink.url, timeout=10) as r:
            page = r.read()
    finally:
        t.watcher.remove()
    assert b"flashwatch_delta_error_rowsum{" in page and b"flashwatch_wq_grad_norm{" in page
    r = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=page,
                       capture_output=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_remove_closes_the_server_and_frees_the_port():
    sink = PrometheusSink(port=0)
    port = sink.port
    w = fw.watch(GPT(GPTConfig(**SMALL)), sinks=[sink])
    w.remove()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with socket.socket() as s:  # the port can be bound again
        s.bind(("127.0.0.1", port))
    sink.close()  # idempotent


def test_port_is_base_plus_local_rank_and_rank_zero_only(monkeypatch):
    base = free_port() - 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    sink = PrometheusSink(port=base)
    try:
        assert sink.port == base + 1
    finally:
        sink.close()
    monkeypatch.setenv("RANK", "1")
    quiet = PrometheusSink(port=base, rank_zero_only=True)
    assert quiet.port is None and quiet.url is None
    quiet.write(StepReport(step=0))  # accepts reports, serves nothing
    quiet.close()
    explicit = PrometheusSink(port=0, rank_zero_only=True, rank=0, local_rank=3)  # args win
    assert explicit.port is not None
    explicit.close()
    with pytest.raises(ValueError, match="certfile"):
        PrometheusSink(port=0, certfile="cert.pem")


def test_other_ranks_serve_only_their_own_series_by_default():
    heads = [HeadRecord(layer="l", head=h, delta_drift_z=1.0) for h in range(3)]
    switch = Event(step=5, layer="l", head=1, from_mode=Mode.STANDARD, to_mode=Mode.BETA,
                   reason="test", applied=True)
    report = StepReport(step=5, heads=heads, events=[switch], monitor_seconds=0.25,
                        monitor_errors_total=2)
    served = {}
    for rank, all_ranks in ((0, False), (1, False), (1, True)):
        sink = PrometheusSink(port=0, rank=rank, per_head_all_ranks=all_ranks)
        try:
            sink.write(report)
            served[rank, all_ranks] = by_name(scrape(sink.url))
        finally:
            sink.close()
    local = ["flashwatch_monitor_errors_total", "flashwatch_monitor_seconds",
             "flashwatch_monitor_step"]
    assert sorted(served[0, False]) == sorted(served[1, True]) == sorted(METRIC_NAMES)
    assert sorted(served[1, False]) == local  # after the reduction heads are rank 0's
    assert served[1, False]["flashwatch_monitor_seconds"][0].value == 0.25
    assert served[1, False]["flashwatch_monitor_errors_total"][0].value == 2
    assert len(served[1, True]["flashwatch_delta_drift_z"]) == 3


def test_real_prometheus_scrapes_a_training_job(tmp_path):
    sink = PrometheusSink(port=0)
    trainer = TinyTrainer([sink])
    trainer.step()  # the first report is there before the first scrape
    try:
        with prometheus_server(tmp_path, sink.port) as (web, _):
            deadline = time.monotonic() + 45
            found: dict = {}
            while time.monotonic() < deadline:
                trainer.step()  # the job keeps training while Prometheus scrapes it
                found = _query(web, '{__name__=~"flashwatch_.+"}')
                if _complete(found):
                    break
                time.sleep(0.2)
            log = (tmp_path / "prometheus.log").read_text()
            assert _complete(found), (sorted(found), log[-2000:])
            up = _query(web, 'up{job="flashwatch"}')
            assert [float(s["value"][1]) for s in up["up"]] == [1.0]
            steps = [float(s["value"][1]) for s in found["flashwatch_monitor_step"]]
            assert steps and steps[0] >= 1  # a report from the running job, not the first
    finally:
        trainer.watcher.remove()


def _query(web, promql) -> dict:
    """{metric name: [series]} of an instant query; {} while Prometheus is not up."""
    url = f"http://{web}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        body = json.load(urllib.request.urlopen(url, timeout=5))
    except OSError:
        return {}
    out: dict = {}
    for series in body["data"]["result"]:
        out.setdefault(series["metric"].get("__name__", "up"), []).append(series)
    return out


def _complete(found) -> bool:
    if set(found) != set(METRIC_NAMES):
        return False
    return all({(s["metric"]["layer"], s["metric"]["head"]) for s in found[n]} == HEADS
               for n in PER_HEAD)


def _counters(sink) -> dict:
    """{(sample name, labels...): value} of the counters, from the sink's registry."""
    samples = by_name({f.name: f for f in sink.registry.collect()})
    out = {}
    for name in ("flashwatch_mitigations_total", "flashwatch_qk_clip_total"):
        for s in samples.get(name, []):
            out[(name, s.labels["layer"], s.labels["head"], s.labels.get("mode"))] = s.value
    return out


def test_a_decided_then_withdrawn_mode_counts_zero_and_a_confirmed_one_counts_once():
    sink = PrometheusSink(start_server=False)
    heads = [HeadRecord(layer="l", head=h) for h in range(2)]
    decided = mode_switch("l", 0, Mode.FP32_O, step=1)
    withdrawn = mode_switch("l", 0, Mode.FP32_O, applied=False, step=2)
    withdrawn.reason += "; not applied: attn_mask"
    sink.write(StepReport(step=1, heads=heads, events=[decided]))  # a decision only
    sink.write(StepReport(step=2, heads=heads, events=[withdrawn]))  # taken back
    assert sum(_counters(sink).values()) == 0
    ran = mode_switch("l", 1, Mode.BETA, step=3)
    sink.write(StepReport(step=3, heads=heads, events=[ran]))  # decided at step 3 ...
    assert sum(_counters(sink).values()) == 0
    sink.write(StepReport(step=4, heads=heads, confirmed=[ran]))  # ... seen run at step 4
    sink.write(StepReport(step=5, heads=heads))  # later reports do not count it again
    counts = _counters(sink)
    assert counts[("flashwatch_mitigations_total", "l", "1", "BETA")] == 1
    assert sum(counts.values()) == 1
    assert counts[("flashwatch_mitigations_total", "l", "0", "FP32_O")] == 0  # zero-init


def test_qk_clips_are_counted_apart_from_mode_switches():
    sink = PrometheusSink(start_server=False)
    t = TinyTrainer([sink])
    try:
        report = t.step()
        clip = dict(step=report.step, layer="transformer.h.0.attn", head=1,
                    from_mode=Mode.STANDARD, to_mode=Mode.STANDARD, reason="qk_clip: test",
                    kind="qk_clip")
        for applied in (True, True, False):  # advice (applied=False) is not counted
            e = Event(applied=applied, **clip)
            sink.write(StepReport(step=report.step, heads=report.heads, confirmed=[e]))
        sink.write(StepReport(step=report.step, heads=report.heads,  # decided, not seen
                              events=[Event(applied=True, **clip)]))
    finally:
        t.watcher.remove()
    clips = {k[1:3]: v for k, v in _counters(sink).items() if k[0] == "flashwatch_qk_clip_total"}
    assert clips[("transformer.h.0.attn", "1")] == 2
    assert sum(clips.values()) == 2 and set(clips) == HEADS  # zero-initialised
    assert sum(v for k, v in _counters(sink).items()
               if k[0] == "flashwatch_mitigations_total") == 0
