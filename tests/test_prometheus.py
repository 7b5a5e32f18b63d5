"""flashwatch.integrations.prometheus (sink), prometheus_render (the page) and
prometheus_server (HTTP): the exporter over HTTP, counters that count what ran, and a
real Prometheus server (Debian's `prometheus` binary, installed by .ci/run) scraping a
training job."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Event, HeadRecord, Mode, StepReport
from flashwatch.integrations.prometheus import METRIC_NAMES, PrometheusSink, render
from flashwatch.integrations.prometheus_render import HEAD_GAUGES
from flashwatch.integrations.prometheus_server import BACKLOG, MetricsServer
from livejob import SMALL, TinyTrainer, free_port, prometheus_server

HEADS = {(f"transformer.h.{i}.attn", str(h)) for i in range(2) for h in range(4)}
_GAUGE_FIELDS = [m.name for m in HEAD_GAUGES if m.name != "head_mode"]
PER_HEAD = [n for n in METRIC_NAMES if not n.startswith("flashwatch_monitor_")]


def _scrape(url, context=None) -> dict:
    """{family name: family} of one scrape; sample names keep their `_total`."""
    body = urllib.request.urlopen(url, timeout=5, context=context).read().decode()
    return {f.name: f for f in text_string_to_metric_families(body)}


def _samples(families) -> dict:
    """{sample name: [samples]}."""
    out: dict = {}
    for f in families.values():
        for s in f.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _switch(layer, head, to_mode, applied=True, step=1, **kw):
    return Event(step=step, layer=layer, head=head, from_mode=Mode.STANDARD, to_mode=to_mode,
                 reason="test", applied=applied, **kw)


def test_scrape_has_every_documented_metric_with_labels():
    sink, seen = PrometheusSink(port=0), []
    recorder = SimpleNamespace(write=seen.append, close=lambda: None)  # the watcher's reports
    t = TinyTrainer([sink, recorder])  # watcher.remove() closes the sink
    try:
        assert sink.url == f"http://127.0.0.1:{sink.port}/metrics"
        before = _scrape(sink.url)  # before any report: families, no samples
        assert all(not f.samples for f in before.values())
        t.step()
        t.watcher.set_head_modes("transformer.h.1.attn", [Mode.BETA] * 4)
        report = t.step()  # runs layer 1 in BETA
        # then a switch whose effect a measurement saw, in a report of its own
        confirmed = _switch("transformer.h.0.attn", 2, Mode.FP32_O, step=report.step)
        mine = StepReport(step=report.step, heads=report.heads,
                          monitor_seconds=report.monitor_seconds, events=[confirmed],
                          confirmed=[confirmed])
        sink.write(mine)
        families = _scrape(sink.url)
    finally:
        t.watcher.remove()
    samples = _samples(families)
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


def test_nan_is_exposed_as_nan_and_series_stay():
    sink = PrometheusSink(port=0)
    try:
        sink.write(StepReport(step=0, heads=[HeadRecord(layer="l", head=0)]))  # all NaN
        samples = _samples(_scrape(sink.url))
    finally:
        sink.close()
    assert math.isnan(samples["flashwatch_delta_drift_z"][0].value)
    assert samples["flashwatch_head_mode"][0].value == 0


def test_page_follows_new_reports_gzip_and_unknown_paths():
    sink = PrometheusSink(port=0)
    try:
        sink.write(StepReport(step=1))
        assert _samples(_scrape(sink.url))["flashwatch_monitor_step"][0].value == 1
        sink.write(StepReport(step=2))  # the cached page is replaced by the next report
        req = urllib.request.Request(sink.url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            text = gzip.decompress(r.read()).decode()
        assert "flashwatch_monitor_step 2.0" in text
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(sink.url.replace("/metrics", "/other"), timeout=5)
    finally:
        sink.close()


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


def test_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"port {port} .*already in use.*port="):
            PrometheusSink(port=port)


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


def test_not_reachable_on_a_non_loopback_address_by_default():
    sink = PrometheusSink(port=0)
    try:
        assert sink.server.address == "127.0.0.1"
        ip = _non_loopback_ip()
        if ip is not None:  # this machine has another address: nothing answers there
            with pytest.raises(OSError):
                socket.create_connection((ip, sink.port), timeout=2).close()
        urllib.request.urlopen(sink.url, timeout=5).read()  # loopback answers
    finally:
        sink.close()


def _non_loopback_ip() -> str | None:
    # A UDP "connect" sends nothing; it only asks the kernel which source address a
    # packet to that destination would leave from.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


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
            served[rank, all_ranks] = _samples(_scrape(sink.url))
        finally:
            sink.close()
    local = ["flashwatch_monitor_errors_total", "flashwatch_monitor_seconds",
             "flashwatch_monitor_step"]
    assert sorted(served[0, False]) == sorted(served[1, True]) == sorted(METRIC_NAMES)
    assert sorted(served[1, False]) == local  # after the reduction heads are rank 0's
    assert served[1, False]["flashwatch_monitor_seconds"][0].value == 0.25
    assert served[1, False]["flashwatch_monitor_errors_total"][0].value == 2
    assert len(served[1, True]["flashwatch_delta_drift_z"]) == 3


def test_render_is_byte_for_byte_prometheus_clients_text_format():
    odd = 'a"b\\c\nd'  # a quote, a backslash and a newline in a layer name
    values = [math.nan, math.inf, -math.inf, 1e22, 1234567.5, 0.1, -3.0, 7e-9]
    heads = [HeadRecord(layer=layer, head=h, **dict(zip(_GAUGE_FIELDS, values[h:] + values[:h],
                                                        strict=False)))
             for layer in ("model.layers.0.self_attn", odd) for h in range(4)]
    switch = _switch(odd, 1, Mode.FP32_O, step=9)
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


def _idle_connections(port: int, n: int) -> list[socket.socket]:
    """n clients that connect and send nothing."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def test_idle_connections_do_not_delay_a_scrape():
    sink = PrometheusSink(port=0)  # timeout 5 s: served in turn, 4 idle would cost 20 s
    idle = []
    try:
        sink.write(StepReport(step=7, heads=[HeadRecord(layer="l", head=0)]))
        _scrape(sink.url)  # the page is rendered and cached
        idle = _idle_connections(sink.port, 4)
        t0 = time.monotonic()
        samples = _samples(_scrape(sink.url))
        elapsed = time.monotonic() - t0
    finally:
        for c in idle:
            c.close()
        sink.close()
    assert samples["flashwatch_monitor_step"][0].value == 7
    assert elapsed < 1.0, f"a scrape waited {elapsed:.2f} s behind idle connections"


def _exporter_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("flashwatch-prometheus-")]


def test_a_flood_of_connections_keeps_threads_bounded_then_scrapes_again():
    sink = PrometheusSink(port=0, max_threads=3)
    flood = []
    try:
        sink.write(StepReport(step=1))
        before = len(threading.enumerate())
        flood = _idle_connections(sink.port, 30)
        deadline = time.monotonic() + 30
        while sink.server.refused < 27 and time.monotonic() < deadline:  # accept loop
            time.sleep(0.05)
        assert sink.server.refused == 27  # closed at once, each costs no thread
        assert len(_exporter_threads()) == 3
        assert len(threading.enumerate()) <= before + 3
        for c in flood:  # the held connections end: their threads are free again
            c.close()
        while sink.server.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _samples(_scrape(sink.url))["flashwatch_monitor_step"][0].value == 1
        assert len(_exporter_threads()) == 3  # reused, not one per connection
    finally:
        for c in flood:
            c.close()
        sink.close()


def test_bad_server_options_are_clear_errors():
    with pytest.raises(ValueError, match="max_threads must be an int ≥ 1, got 0"):
        PrometheusSink(port=0, max_threads=0)
    with pytest.raises(ValueError, match="timeout must be .* got -1"):
        PrometheusSink(port=0, timeout=-1)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make "
                    "a test certificate")
def test_tls_options_serve_https(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    sink = PrometheusSink(port=0, certfile=str(cert), keyfile=str(key))
    try:
        assert sink.url.startswith("https://")
        sink.write(StepReport(step=3))
        ctx = ssl.create_default_context(cafile=str(cert))
        samples = _samples(_scrape(sink.url, context=ctx))
        assert samples["flashwatch_monitor_step"][0].value == 3
        with pytest.raises(OSError):  # plain HTTP is refused
            urllib.request.urlopen(sink.url.replace("https", "http"), timeout=2).read()
    finally:
        sink.close()


# -------------------------------------------------------------- a real Prometheus


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
    samples = _samples({f.name: f for f in sink.registry.collect()})
    out = {}
    for name in ("flashwatch_mitigations_total", "flashwatch_qk_clip_total"):
        for s in samples.get(name, []):
            out[(name, s.labels["layer"], s.labels["head"], s.labels.get("mode"))] = s.value
    return out


def test_a_decided_then_withdrawn_mode_counts_zero_and_a_confirmed_one_counts_once():
    sink = PrometheusSink(start_server=False)
    heads = [HeadRecord(layer="l", head=h) for h in range(2)]
    decided = _switch("l", 0, Mode.FP32_O, step=1)
    withdrawn = _switch("l", 0, Mode.FP32_O, applied=False, step=2)
    withdrawn.reason += "; not applied: attn_mask"
    sink.write(StepReport(step=1, heads=heads, events=[decided]))  # a decision only
    sink.write(StepReport(step=2, heads=heads, events=[withdrawn]))  # taken back
    assert sum(_counters(sink).values()) == 0
    ran = _switch("l", 1, Mode.BETA, step=3)
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


def test_a_burst_of_50_connections_is_queued_by_the_listener_and_all_answered():
    """The listener holds BACKLOG connections while its accept loop is busy: with the
    stdlib's 5, the 7th SYN of a burst was dropped and that client came back only after
    TCP's 1 s retransmit. Here the server accepts nothing until all 50 clients have
    connected, so each connect completes only if the kernel queued it (a dropped SYN
    would time out: 0.9 s is below the first retransmit and far above a loopback
    handshake). Then every client is answered."""
    n = 50
    assert BACKLOG >= n
    body = b"flashwatch_monitor_step 1.0\n"
    server = MetricsServer("127.0.0.1", 0, lambda enc: (body, False), max_threads=n,
                           timeout=5.0)
    clients = []
    try:
        for _ in range(n):  # not started: nothing is accepted yet
            clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=0.9))
        for c in clients:
            c.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        server.start()
        answers = []
        for c in clients:
            c.settimeout(10)
            answers.append(b"".join(iter(lambda c=c: c.recv(65536), b"")))
    finally:
        for c in clients:
            c.close()
        server.close()
    assert len(answers) == n
    assert all(a.startswith(b"HTTP/1.0 200") and a.endswith(body) for a in answers)
    assert server.refused == 0
