"""flashwatch.integrations.prometheus_server: the bounded HTTP(S) server: cached and
gzipped pages, ports, loopback by default, idle connections and floods, TLS."""

from __future__ import annotations

import gzip
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from _helpers import by_name, scrape

from flashwatch import HeadRecord, StepReport
from flashwatch.integrations.prometheus import PrometheusSink
from flashwatch.integrations.prometheus_server import BACKLOG, MetricsServer


def test_page_follows_new_reports_gzip_and_unknown_paths():
    sink = PrometheusSink(port=0)
    try:
        sink.write(StepReport(step=1))
        assert by_name(scrape(sink.url))["flashwatch_monitor_step"][0].value == 1
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


def test_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"port {port} .*already in use.*port="):
            PrometheusSink(port=port)


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


def _idle_connections(port: int, n: int) -> list[socket.socket]:
    """n clients that connect and send nothing."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def test_idle_connections_do_not_delay_a_scrape():
    sink = PrometheusSink(port=0)  # timeout 5 s: served in turn, 4 idle would cost 20 s
    idle = []
    try:
        sink.write(StepReport(step=7, heads=[HeadRecord(layer="l", head=0)]))
        scrape(sink.url)  # the page is rendered and cached
        idle = _idle_connections(sink.port, 4)
        t0 = time.monotonic()
        samples = by_name(scrape(sink.url))
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
        assert by_name(scrape(sink.url))["flashwatch_monitor_step"][0].value == 1
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
    with pytest.raises(ValueError, match="timeout must be .* got inf; seconds"):
        PrometheusSink(port=0, timeout=float("inf"))
    with pytest.raises(TypeError, match=r"timeout must be .* got '5' \(str\)"):
        PrometheusSink(port=0, timeout="5")


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
        samples = by_name(scrape(sink.url, context=ctx))
        assert samples["flashwatch_monitor_step"][0].value == 3
        with pytest.raises(OSError):  # plain HTTP is refused
            urllib.request.urlopen(sink.url.replace("https", "http"), timeout=2).read()
    finally:
        sink.close()


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
