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
- The page is rendered once per report by `render` (prometheus_client's text format,
  byte for byte, 3–6× faster than generate_latest: 5,120 heads, 67k samples, took
  0.5–0.95 s of GIL-holding Python with generate_latest), on the HTTP thread at the
  first scrape after a write, then served from a cache (gzip too when
  the scraper accepts it). prometheus_client's own start_http_server renders on every
  scrape: for GPT-2 Small's 144 heads that is 11 ms of Python per scrape (23 ms with
  HTTP) holding the GIL; at 50 scrapes/s a CPU training step of a 12×12-head GPT took
  2.2× as long (first run of benchmarks/bench_prometheus.py, 2-core machine). So the
  server here is a small stdlib HTTPServer serving the cached page.
- Connections are served concurrently by a bounded pool of reused threads (`max_threads`,
  default 8; started on demand, so a quiet exporter holds one or two). A client that
  connects and sends nothing holds one thread for at most `timeout` seconds (default
  5) and never delays a scrape on another connection: served one at a time, four idle
  connections once held a scrape for 20 s, twice Prometheus' default scrape timeout.
  When every thread is busy a new connection is closed at once (a failed scrape, never
  a hung one), so a flood of connections costs at most `max_threads` threads. A thread
  per request (ThreadingHTTPServer) would be unbounded and cost 0.35 ms of CPU each.
- Per-head series come from global rank 0 only (by default): after the watcher's
  cross-rank reduction every rank holds the same per-head numbers, and serving them from
  every rank would multiply the series by the world size (5,120 heads × 13 series ×
  1,024 ranks ≈ 68M series). Other ranks serve what is theirs: flashwatch_monitor_step,
  flashwatch_monitor_seconds and flashwatch_monitor_errors_total.
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
import math
import os
import queue
import socket
import ssl
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
MODE_HELP = ("Attention mode applied to the head: "
             + ", ".join(f"{m.value}={m.name}" for m in Mode) + ".")
MITIGATIONS_HELP = ("Mode switches applied (by the policy or by hand), by the mode switched "
                    "to (counted by this exporter since it started).")
GUARDED_HELP = ("BETA rows whose shift hit the underflow guard (logits in the thousands), "
                "summed over monitored steps (counted by this exporter since it started).")
QK_CLIP_HELP = ("QK-clips applied to the head's W^Q and W^K (opt-in qk_clip_threshold, "
                "mitigation auto; counted by this exporter since it started).")
# Rank-local series (served by every rank): (name, type, HELP text).
MONITOR_SERIES = (
    ("flashwatch_monitor_step", "gauge", "Optimizer step of the latest monitored step."),
    ("flashwatch_monitor_seconds", "gauge", "Wall time flashwatch spent monitoring the latest "
                                            "monitored step, in seconds."),
    ("flashwatch_monitor_errors_total", "counter", "Failures inside flashwatch (never raised "
                                                   "into training) over the run; resumes with "
                                                   "the watcher."),
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
    per_head_all_ranks  False (default): per-head series and flashwatch_mitigations_total
                     only from global rank 0; other ranks serve the rank-local
                     flashwatch_monitor_* series only (the per-head families without
                     samples). True: every rank serves everything (world_size copies).
    max_threads      connections served at once (default 8); more are closed at once.
    timeout          seconds a client may take to send its request or read the page
                     (default 5.0); an idle connection holds one thread that long.
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
                 rank: int | None = None, per_head_all_ranks: bool = False,
                 max_threads: int = 8, timeout: float = 5.0):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}; pass e.g. "
                             f"port={DEFAULT_PORT}, or 0 for any free port")
        if (certfile is None) != (keyfile is None):
            raise ValueError(f"TLS needs both certfile and keyfile, got certfile={certfile!r} "
                             f"and keyfile={keyfile!r}; pass both or neither")
        if client_cafile is not None and certfile is None:
            raise ValueError("client_cafile (client certificate check) needs TLS; pass "
                             "certfile and keyfile too")
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or \
                max_threads < 1:
            raise ValueError(f"max_threads must be an int ≥ 1, got {max_threads!r}; "
                             f"the default 8 serves several scrapers at once")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 < timeout < float("inf"):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got "
                             f"{timeout!r}; the default is 5.0")
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._mitigations: Counter = Counter()  # (layer, head, mode) -> applied events
        self._clips: Counter = Counter()  # (layer, head) -> applied QK-clips
        self._guarded: Counter = Counter()  # (layer, head) -> BETA rows that hit the guard
        self._page: tuple | None = None  # (snapshot, page text, gzipped page text)
        self._render_lock = threading.Lock()  # one thread renders a new page, others wait
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self._httpd = self._thread = None
        self.addr, self.port, self._tls = addr, None, certfile is not None
        local_rank = _env_int("LOCAL_RANK") if local_rank is None else local_rank
        rank = _env_int("RANK") if rank is None else rank
        self.serves_heads = rank == 0 or bool(per_head_all_ranks)
        self._max_threads, self._timeout = max_threads, float(timeout)
        if start_server and not (rank_zero_only and rank != 0):
            self._start(port, local_rank, addr, certfile, keyfile, client_cafile)

    # ------------------------------------------------------------------- sink protocol

    def write(self, report: StepReport) -> None:
        """Swap in a snapshot of `report` (called from the training thread)."""
        heads = tuple((h.layer, str(h.head), tuple(float(getattr(h, f)) for f, _ in HEAD_GAUGES),
                       int(h.head_mode)) for h in report.heads) if self.serves_heads else ()
        for h in report.heads if self.serves_heads else ():  # from 0 per head, like mitigations
            self._guarded[(h.layer, str(h.head))] += int(h.guarded_rows)
        for e in report.events:
            if not (e.applied and self.serves_heads):
                continue
            if e.kind == "qk_clip":
                self._clips[(e.layer, str(e.head))] += 1
            else:
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
        if httpd is not None:
            httpd.stop_workers()

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
        server_class = _Server6 if ":" in addr else _Server
        try:
            httpd = server_class((addr, port), _Handler, max_threads=self._max_threads,
                                 timeout=self._timeout)
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
            # Handshake on the handler's first read, in a pool thread under the timeout,
            # not inside accept() where a silent client would stall the accept loop.
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
            with self._render_lock:
                with self._lock:
                    snap, page = self._snapshot, self._page
                if page is None or page[0] is not snap:
                    text = render(snap)
                    page = (snap, text, gzip.compress(text, compresslevel=1))
                    with self._lock:
                        self._page = page
        if "gzip" in accept_encoding:
            return page[2], True
        return page[1], False

    def _families(self, snap: _Snapshot | None):
        """prometheus_client metric families of a snapshot (the registry's collector)."""
        families = []
        for name, kind, doc, labels, samples in _series(snap):
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name.removesuffix("_total"), doc, labels=list(labels))
            for values, v in samples:
                family.add_metric(list(values), v)
            families.append(family)
        return families


def _series(snap: _Snapshot | None):
    """(name, type, HELP, label names, [(label values, value), ...]) per family, in page
    order; families without samples before the first report."""
    heads = () if snap is None else snap.heads
    out = [(f"flashwatch_{f}", "gauge", doc, ("head", "layer"),
            [((head, layer), values[i]) for layer, head, values, _ in heads])
           for i, (f, doc) in enumerate(HEAD_GAUGES)]
    out.append(("flashwatch_head_mode", "gauge", MODE_HELP, ("head", "layer"),
                [((head, layer), m) for layer, head, _, m in heads]))
    out.append(("flashwatch_mitigations_total", "counter", MITIGATIONS_HELP,
                ("head", "layer", "mode"),
                [] if snap is None else [((head, layer, mode), n) for (layer, head, mode), n
                                         in snap.mitigations]))
    out.append(("flashwatch_guarded_rows_total", "counter", GUARDED_HELP, ("head", "layer"),
                [] if snap is None else [((head, layer), n) for (layer, head), n
                                         in snap.guarded]))
    for name, kind, doc in MONITOR_SERIES:
        value = None if snap is None else dict(
            flashwatch_monitor_step=snap.step, flashwatch_monitor_seconds=snap.seconds,
            flashwatch_monitor_errors_total=snap.errors)[name]
        out.append((name, kind, doc, (), [] if value is None else [((), value)]))
    out.append(("flashwatch_qk_clip_total", "counter", QK_CLIP_HELP, ("head", "layer"),
                [] if snap is None else [((head, layer), n) for (layer, head), n
                                         in snap.clips]))
    return out


def render(snap: _Snapshot | None) -> bytes:
    """The text exposition format of a snapshot, byte for byte what prometheus_client's
    generate_latest writes (tests/test_prometheus.py), 3–6× faster: label strings are
    built once per head, not once per sample (5,120 heads: 66,563 samples,
    benchmarks/bench_scale.py)."""
    lines = []
    label_cache: dict = {}
    for name, kind, doc, labels, samples in _series(snap):
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


class _Server(HTTPServer):
    """HTTPServer whose connections run on at most `max_threads` reused daemon threads.

    The accept loop (serve_forever's thread) only hands sockets over; when every thread
    is busy it closes the new connection at once (a failed scrape, never a hung one).
    """

    def __init__(self, address, handler, *, max_threads: int, timeout: float):
        super().__init__(address, handler)
        self.max_threads = max_threads
        self.timeout_s = timeout  # per connection: for the request and for the page
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self._busy = 0  # connections handed over and not yet closed
        self._workers: list[threading.Thread] = []
        self.refused = 0  # connections closed because every thread was busy

    def process_request(self, request, client_address):
        with self._count_lock:
            if self._busy >= self.max_threads:
                self.refused += 1
                self.shutdown_request(request)
                return
            self._busy += 1
            if len(self._workers) < self._busy:  # start threads on demand, keep them
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"flashwatch-prometheus-{len(self._workers)}")
                self._workers.append(t)
                t.start()
        self._jobs.put((request, client_address))

    def _work(self):
        while (job := self._jobs.get()) is not None:
            request, client_address = job
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                with self._count_lock:
                    self._busy -= 1

    def stop_workers(self):
        """Let idle threads exit; one inside a request exits after it (≤ timeout)."""
        for _ in self._workers:
            self._jobs.put(None)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    def setup(self):
        self.timeout = self.server.timeout_s
        super().setup()

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
