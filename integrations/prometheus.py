"""`PrometheusSink`: serve the latest StepReport to Prometheus (docs/design.md §7).

    from flashwatch.integrations.prometheus import PrometheusSink
    watcher = flashwatch.watch(model, sinks=[PrometheusSink(port=9745)])
    # scrape http://127.0.0.1:9745/metrics (rank r of a node listens on 9745 + r)

Design:
- A custom prometheus_client Collector. `write(report)` (training thread) turns the
  report into an immutable tuple of plain numbers and swaps it in under a lock; the
  HTTP thread's `collect()` reads that tuple under the same lock (a pointer read) and
  builds the metric families from it. The training thread never waits for a scrape
  beyond that pointer swap and never does any formatting.
- The page is rendered (prometheus_client's text format) once per report, on the HTTP
  thread at the first scrape after a write, then served from a cache (gzip too when
  the scraper accepts it). prometheus_client's own start_http_server renders on every
  scrape: for GPT-2 Small's 144 heads that is 11 ms of Python per scrape (23 ms with
  HTTP) holding the GIL; at 50 scrapes/s a CPU training step of a 12×12-head GPT took
  2.2× as long (first run of benchmarks/bench_prometheus.py, 2-core machine). So the
  server here is a small stdlib HTTPServer serving the cached page: one thread,
  requests in turn (Prometheus scrapes a target one request at a time; a thread per
  request cost 0.35 ms of CPU each, more than the rest of the request), and a 5 s
  socket timeout so a stuck client cannot hold it.
- One fresh CollectorRegistry per sink (`sink.registry`, holding only this collector):
  two sinks in one process (tests, two models) never clash, and the default registry's
  process metrics are not mixed in. Mount it elsewhere with
  prometheus_client.make_wsgi_app(sink.registry) and start_server=False.
- Names: `flashwatch_` + the StepReport field name, base units (seconds, ratios, nats of
  scaled score, plain numbers), `_total` for counters, labels `layer` and `head`
  (+ `mode` on flashwatch_mitigations_total), never a step label: the step is its own
  gauge, so the number of series is fixed by the model (heads × metrics).
- NaN: a metric that was not measured on the latest monitored step (e.g. the δ error
  of a layer with no backward pass) is exposed as NaN,
  which the Prometheus text format allows. NaN compares false in PromQL, so alert rules
  such as `flashwatch_delta_drift_z > 4` stay silent on it, and the series does not
  vanish and reappear (which would break `rate()` and "absent" alerts).
"""

from __future__ import annotations

import errno
import gzip
import os
import socket
import ssl
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flashwatch.kernels.common import Mode
from flashwatch.report import StepReport

DEFAULT_PORT = 9745  # an arbitrary unprivileged port; rank r of a node uses 9745 + r

# Per-head gauges: (StepReport field, HELP text). The name is "flashwatch_" + field.
HEAD_GAUGES = (
    ("tied_rowmax_ratio", "Fraction of attention rows whose max score is tied within eps "
                          "(all rows when flashwatch's kernel runs, sampled rows otherwise)."),
    ("attention_max_logit", "Largest scaled attention score (softmax scale applied)."),
    ("delta_error_sum", "Sum over the rows (every row when flashwatch's kernel ran, else "
                        "sampled rows) of the backward delta error c[T] = rowsum(dO*O_used) "
                        "- rowsum(dO*O_fp32), latest monitored step."),
    ("delta_error_share", "Estimated share of the head's W^Q gradient that is delta rounding "
                          "error, ||E||_F / ||dW^Q||_F (Eq. 3, this layer's term), latest "
                          "monitored step; healthy << 0.05."),
    ("delta_drift_z", "Drift z of the delta error projected on its running direction, over "
                      "the window: about N(0,1) when zero-mean, grows with persistence."),
    ("delta_coherence", "Coherence of the W^Q gradient-error sketches over the window, "
                        "in [0, 1]; 1 means every step's error points the same way."),
    ("r_projection_cumulative", "Cumulative projection of the W^Q gradient-error sketch on "
                                "its running top singular direction."),
    ("wq_spectral_norm", "Largest singular value of the head's query projection W^Q."),
)
METRIC_NAMES = (
    *(f"flashwatch_{field}" for field, _ in HEAD_GAUGES),
    "flashwatch_head_mode",
    "flashwatch_mitigations_total",
    "flashwatch_guarded_rows_total",
    "flashwatch_monitor_step",
    "flashwatch_monitor_seconds",
    "flashwatch_monitor_errors_total",
    "flashwatch_qk_clip_total",
)


class PrometheusSink:
    """A flashwatch sink that exposes the latest StepReport on an HTTP /metrics endpoint.

    port             base port; this process listens on port + LOCAL_RANK (env var set by
                     torchrun and Lightning, 0 if unset), so every rank of a node has its
                     own endpoint. port=0 picks a free port (read it back from `.port`).
    addr             bind address. Default "127.0.0.1": only this machine can scrape;
                     pass "0.0.0.0" (or an interface address) to expose it on the network.
    rank_zero_only   serve only from global rank 0 (env RANK); other ranks' sinks accept
                     reports and serve nothing. The watcher reduces its numbers across
                     ranks, so rank 0 already reports the whole job.
    certfile/keyfile serve HTTPS with this certificate and key (both or neither);
                     client_cafile additionally requires client certificates signed by it.
    start_server     False: no HTTP server, only the collector in `sink.registry` (for
                     embedding in an existing exporter).
    local_rank/rank  this process's local and global rank; None (default) reads the env
                     vars LOCAL_RANK and RANK (0 when unset). FlashWatchCallback passes
                     the trainer's.

    Before the first report every metric family is served without samples.
    """

    def __init__(self, port: int = DEFAULT_PORT, *, addr: str = "127.0.0.1",
                 rank_zero_only: bool = False, certfile: str | None = None,
                 keyfile: str | None = None, client_cafile: str | None = None,
                 start_server: bool = True, local_rank: int | None = None,
                 rank: int | None = None):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}; pass e.g. "
                             f"port={DEFAULT_PORT}, or 0 for any free port")
        if (certfile is None) != (keyfile is None):
            raise ValueError(f"TLS needs both certfile and keyfile, got certfile={certfile!r} "
                             f"and keyfile={keyfile!r}; pass both or neither")
        if client_cafile is not None and certfile is None:
            raise ValueError("client_cafile (client certificate check) needs TLS; pass "
                             "certfile and keyfile too")
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._mitigations: Counter = Counter()  # (layer, head, mode) -> applied events
        self._clips: Counter = Counter()  # (layer, head) -> applied QK-clips
        self._guarded: Counter = Counter()  # (layer, head) -> BETA rows that hit the guard
        self._page: tuple | None = None  # (snapshot, page text, gzipped page text)
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self._httpd = self._thread = None
        self.addr, self.port, self._tls = addr, None, certfile is not None
        local_rank = _env_int("LOCAL_RANK") if local_rank is None else local_rank
        rank = _env_int("RANK") if rank is None else rank
        if start_server and not (rank_zero_only and rank != 0):
            self._start(port, local_rank, addr, certfile, keyfile, client_cafile)

    # ------------------------------------------------------------------- sink protocol

    def write(self, report: StepReport) -> None:
        """Swap in a snapshot of `report` (called from the training thread)."""
        heads = tuple((h.layer, str(h.head), tuple(float(getattr(h, f)) for f, _ in HEAD_GAUGES),
                       int(h.head_mode)) for h in report.heads)
        for h in report.heads:  # a counter from 0 per head, like the mitigations
            self._guarded[(h.layer, str(h.head))] += int(h.guarded_rows)
        for e in report.events:
            if e.applied and e.kind == "qk_clip":
                self._clips[(e.layer, str(e.head))] += 1
            elif e.applied:
                self._mitigations[(e.layer, str(e.head), Mode(e.to_mode).name)] += 1
        # Zero-initialise a counter per head and mitigating mode so that rate()/increase()
        # see the first switch (a series born at 1 hides it); STANDARD only if it happens.
        for layer, head, _, _ in heads:
            for mode in ("BETA", "FP32_O"):
                self._mitigations.setdefault((layer, head, mode), 0)
            self._clips.setdefault((layer, head), 0)
        snap = _Snapshot(step=int(report.step), seconds=float(report.monitor_seconds),
                         errors=int(report.monitor_errors_total), heads=heads,
                         mitigations=tuple(sorted(self._mitigations.items())),
                         clips=tuple(sorted(self._clips.items())),
                         guarded=tuple(sorted(self._guarded.items())))
        with self._lock:
            self._snapshot = snap

    def close(self) -> None:
        """Stop the HTTP server and free its port (idempotent)."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is not None:
            httpd.shutdown()  # returns once serve_forever has left its loop (≤ 0.5 s poll)
            httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    @property
    def url(self) -> str | None:
        """The scrape URL, or None when this process serves nothing."""
        if self.port is None:
            return None
        scheme = "https" if self._tls else "http"
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{scheme}://{host}:{self.port}/metrics"

    # ------------------------------------------------------------------------ internals

    def _start(self, base: int, local_rank: int, addr, certfile, keyfile,
               client_cafile) -> None:
        port = base + local_rank if base else 0
        if port > 65535:
            raise ValueError(f"port {base} + LOCAL_RANK {local_rank} = {port} exceeds 65535; "
                             f"pass a lower port")
        server_class = _Server6 if ":" in addr else HTTPServer
        try:
            httpd = server_class((addr, port), _Handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(
                    f"flashwatch Prometheus exporter: port {port} on {addr} is already in "
                    f"use (base port {base} + LOCAL_RANK {local_rank}); pass another base "
                    f"port (PrometheusSink(port=...) or FlashWatchCallback("
                    f"prometheus_port=...)), or 0 for any free port") from e
            raise
        httpd.sink = self
        if self._tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                ctx.load_cert_chain(certfile=certfile, keyfile=keyfile)
                if client_cafile is not None:
                    ctx.verify_mode = ssl.CERT_REQUIRED
                    ctx.load_verify_locations(cafile=client_cafile)
            except (OSError, ssl.SSLError) as e:
                httpd.server_close()
                raise ValueError(f"cannot load TLS files certfile={certfile!r}, keyfile="
                                 f"{keyfile!r}, client_cafile={client_cafile!r}: {e}") from e
            # Handshake on the handler's first read, under its 5 s timeout, not inside
            # accept() where a silent client would stall the server thread.
            httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True,
                                           do_handshake_on_connect=False)
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="flashwatch-prometheus",
                                        daemon=True)
        self._thread.start()
        self.port = httpd.server_address[1]

    def _page_for(self, accept_encoding: str) -> tuple[bytes, bool]:
        """The page of the latest snapshot, rendered at most once per snapshot (HTTP
        thread); returns (body, gzipped)."""
        with self._lock:
            snap, page = self._snapshot, self._page
        if page is None or page[0] is not snap:
            text = generate_latest(_Fixed(list(self._families(snap))))
            page = (snap, text, gzip.compress(text, compresslevel=1))
            with self._lock:
                self._page = page
        if "gzip" in accept_encoding:
            return page[2], True
        return page[1], False

    def _families(self, snap: _Snapshot | None):
        gauges = [GaugeMetricFamily(f"flashwatch_{f}", doc, labels=["layer", "head"])
                  for f, doc in HEAD_GAUGES]
        mode = GaugeMetricFamily(
            "flashwatch_head_mode", "Attention mode applied to the head: "
            + ", ".join(f"{m.value}={m.name}" for m in Mode) + ".", labels=["layer", "head"])
        mitig = CounterMetricFamily(
            "flashwatch_mitigations", "Mode switches applied (by the policy or by hand), by the "
            "mode switched to (counted by this exporter since it started).",
            labels=["layer", "head", "mode"])
        guarded = CounterMetricFamily(
            "flashwatch_guarded_rows", "BETA rows whose shift hit the underflow guard (logits "
            "in the thousands), summed over monitored steps (counted by this exporter since "
            "it started).", labels=["layer", "head"])
        step = GaugeMetricFamily("flashwatch_monitor_step",
                                 "Optimizer step of the latest monitored step.")
        secs = GaugeMetricFamily("flashwatch_monitor_seconds",
                                 "Wall time flashwatch spent monitoring the latest monitored "
                                 "step, in seconds.")
        errors = CounterMetricFamily("flashwatch_monitor_errors",
                                     "Failures inside flashwatch (never raised into "
                                     "training) over the run; resumes with the watcher.")
        clips = CounterMetricFamily(
            "flashwatch_qk_clip", "QK-clips applied to the head's W^Q and W^K (opt-in "
            "qk_clip_threshold, mitigation auto; counted by this exporter since it started).",
            labels=["layer", "head"])
        if snap is not None:
            for layer, head, values, m in snap.heads:
                for g, v in zip(gauges, values, strict=True):
                    g.add_metric([layer, head], v)
                mode.add_metric([layer, head], m)
            for (layer, head, to_mode), n in snap.mitigations:
                mitig.add_metric([layer, head, to_mode], n)
            for (layer, head), n in snap.guarded:
                guarded.add_metric([layer, head], n)
            step.add_metric([], snap.step)
            secs.add_metric([], snap.seconds)
            errors.add_metric([], snap.errors)
            for (layer, head), n in snap.clips:
                clips.add_metric([layer, head], n)
        yield from gauges
        yield from (mode, mitig, guarded, step, secs, errors, clips)


class _Snapshot(NamedTuple):
    """Immutable view of one report: what a scrape reads."""

    step: int
    seconds: float
    errors: int
    heads: tuple  # ((layer, head as str, (gauge values in HEAD_GAUGES order), mode), ...)
    mitigations: tuple  # (((layer, head, mode), count), ...)
    guarded: tuple  # (((layer, head), guarded rows so far), ...)
    clips: tuple = ()  # (((layer, head), applied QK-clips), ...)


class _Collector(Collector):
    def __init__(self, sink: PrometheusSink):
        self._sink = sink

    def collect(self):
        with self._sink._lock:
            snap = self._sink._snapshot
        return self._sink._families(snap)

    def describe(self):
        # Names only, so register() can check for clashes without a snapshot.
        return list(self._sink._families(None))


class _Fixed:
    """What generate_latest needs: collect() over families already built."""

    def __init__(self, families):
        self._families = families

    def collect(self):
        return self._families


class _Server6(HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    timeout = 5  # seconds a client may take to send its request or read the page

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path.split("?")[0] not in ("/", "/metrics"):
            self.send_error(404, "flashwatch serves /metrics")
            return
        body, gzipped = self.server.sink._page_for(self.headers.get("Accept-Encoding", ""))
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (stdlib's signature)
        pass  # one stderr line per scrape would flood the training log


def _env_int(name: str) -> int:
    raw = os.environ.get(name, "0") or "0"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; unset it "
                         f"or set it to this process's rank") from None
