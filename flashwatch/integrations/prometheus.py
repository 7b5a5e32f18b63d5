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
- The page is rendered once per report by `render` (flashwatch/integrations/prometheus_render.py:
  prometheus_client's text format,
  byte for byte, 3–6× faster than generate_latest: 5,120 heads, 67k samples, took
  0.5–0.95 s of GIL-holding Python with generate_latest), on the HTTP thread at the
  first scrape after a write, then served from a cache (gzip too when
  the scraper accepts it). prometheus_client's own start_http_server renders on every
  scrape: for GPT-2 Small's 144 heads that is 11 ms of Python per scrape (23 ms with
  HTTP) holding the GIL; at 50 scrapes/s a CPU training step of a 12×12-head GPT took
  2.2× as long (first run of benchmarks/bench_prometheus.py, 2-core machine). So the
  server here is a small stdlib HTTPServer serving the cached page.
- The server (flashwatch/integrations/prometheus_server.py) serves connections on a bounded pool
  of reused threads (`max_threads`, default 8) with a per-connection `timeout` (default
  5 s) and a listen backlog of 128, so idle connections and bursts never delay a scrape.
- Per-head series come from global rank 0 only (by default): after the watcher's
  cross-rank reduction every rank holds the same per-head numbers, and serving them from
  every rank would multiply the series by the world size (5,120 heads × 13 series ×
  1,024 ranks ≈ 68M series). Other ranks serve what is theirs: flashwatch_monitor_step,
  flashwatch_monitor_seconds and flashwatch_monitor_errors_total.
- One fresh CollectorRegistry per sink (`sink.registry`, holding only this collector):
  two sinks in one process (tests, two models) never clash, and the default registry's
  process metrics are not mixed in. Mount it elsewhere with
  prometheus_client.make_wsgi_app(sink.registry) and start_server=False.
- Names, types and HELP texts come from the metrics table (flashwatch/report/metrics.py):
  `flashwatch_` + the report field name, base units (seconds, ratios, nats of scaled
  score, plain numbers), `_total` for counters, labels `layer` and `head` (+ `mode` on
  flashwatch_mitigations_total), never a step label: the step is its own gauge, so the
  number of series is fixed by the model (heads × metrics).
- Counters count what ran: flashwatch_mitigations_total and flashwatch_qk_clip_total
  count the events of `report.confirmed` (a switch or clip whose effect a measurement
  saw), never a decision; a mode decided and then withdrawn (the layer could not route)
  is never counted.
- NaN: a metric that was not measured on the latest monitored step (e.g. the δ error
  of a layer with no backward pass) is exposed as NaN,
  which the Prometheus text format allows. NaN compares false in PromQL, so alert rules
  such as `flashwatch_delta_drift_z > 4` stay silent on it, and the series does not
  vanish and reappear (which would break `rate()` and "absent" alerts).
"""

from __future__ import annotations

import gzip
import os
import threading
from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from flashwatch._checks import check_bool, check_float, check_int
from flashwatch.integrations.prometheus_render import (
    HEAD_COUNTERS,
    HEAD_GAUGES,
    STEP_SERIES,
    Snapshot,
    families,
    render,
)
from flashwatch.integrations.prometheus_server import MetricsServer, bind_error, tls_context
from flashwatch.kernels.common import Mode
from flashwatch.report.metrics import METRIC_NAMES
from flashwatch.report.records import StepReport

__all__ = ["DEFAULT_PORT", "METRIC_NAMES", "PrometheusSink", "render"]

DEFAULT_PORT = 9745  # an arbitrary unprivileged port; rank r of a node uses 9745 + r
# Counted per head from the first report on, so that rate()/increase() see the first
# switch (a series born at 1 hides it); STANDARD only once a switch back happens.
ZERO_MODES = (Mode.BETA.name, Mode.FP32_O.name)


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
    per_head_all_ranks  False (default): per-head series and their counters only from
                     global rank 0; other ranks serve the rank-local flashwatch_monitor_*
                     series only (the per-head families without samples). True: every
                     rank serves everything (world_size copies).
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

    Before the first report every metric family is served without samples. `server` is
    the MetricsServer (flashwatch/integrations/prometheus_server.py) serving the page, None when
    this process serves nothing; its `refused` counts connections closed because every
    thread was busy.
    """

    def __init__(self, port: int = DEFAULT_PORT, *, addr: str = "127.0.0.1",
                 rank_zero_only: bool = False, certfile: str | None = None,
                 keyfile: str | None = None, client_cafile: str | None = None,
                 start_server: bool = True, local_rank: int | None = None,
                 rank: int | None = None, per_head_all_ranks: bool = False,
                 max_threads: int = 8, timeout: float = 5.0):
        check_int("port", port, min=0, max=65535,
                  hint=f"pass e.g. port={DEFAULT_PORT}, or 0 for any free port")
        if (certfile is None) != (keyfile is None):
            raise ValueError(f"TLS needs both certfile and keyfile, got certfile={certfile!r} "
                             f"and keyfile={keyfile!r}; pass both or neither")
        if client_cafile is not None and certfile is None:
            raise ValueError("client_cafile (client certificate check) needs TLS; pass "
                             "certfile and keyfile too")
        check_int("max_threads", max_threads, min=1,
                  hint="the default 8 serves several scrapers at once")
        check_float("timeout", timeout, above=0, hint="seconds, the default is 5.0")
        for name, flag in (("rank_zero_only", rank_zero_only), ("start_server", start_server),
                           ("per_head_all_ranks", per_head_all_ranks)):
            check_bool(name, flag)
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        # per HEAD_COUNTERS row: (layer, head[, mode]) -> count since this sink started
        self._counts = {m.name: Counter() for m in HEAD_COUNTERS}
        self._page: tuple | None = None  # (snapshot, page text, gzipped page text)
        self._render_lock = threading.Lock()  # one thread renders a new page, others wait
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.server: MetricsServer | None = None
        self.addr, self.port, self._tls = addr, None, certfile is not None
        local_rank = _env_int("LOCAL_RANK") if local_rank is None else local_rank
        rank = _env_int("RANK") if rank is None else rank
        self.serves_heads = rank == 0 or per_head_all_ranks
        if start_server and not (rank_zero_only and rank != 0):
            ctx = None if certfile is None else tls_context(certfile, keyfile, client_cafile)
            self._start(port, local_rank, max_threads, float(timeout), ctx)

    # ------------------------------------------------------------------- sink protocol

    def write(self, report: StepReport) -> None:
        """Swap in a snapshot of `report` (called from the training thread)."""
        heads = report.heads if self.serves_heads else []
        for m in HEAD_COUNTERS:
            counts = self._counts[m.name]
            if m.counts is None:  # a head field, summed over reports
                for h in heads:
                    counts[(h.layer, str(h.head))] += int(getattr(h, m.name))
                continue
            for h in heads:  # zero-initialised per head (and mitigating mode)
                for key in _keys(m.counts, h.layer, str(h.head)):
                    counts.setdefault(key, 0)
            for e in report.confirmed if self.serves_heads else ():
                if e.applied and e.kind == m.counts:
                    counts[_event_key(e)] += 1
        snap = Snapshot(
            step_values=tuple(getattr(report, m.field or m.name) for m in STEP_SERIES),
            heads=tuple((h.layer, str(h.head), tuple(float(getattr(h, m.name))
                                                     for m in HEAD_GAUGES)) for h in heads),
            counters=tuple(tuple(sorted(self._counts[m.name].items())) for m in HEAD_COUNTERS))
        with self._lock:
            self._snapshot = snap

    def close(self) -> None:
        """Stop the HTTP server and free its port (idempotent)."""
        server, self.server = self.server, None
        if server is not None:
            server.close()

    @property
    def url(self) -> str | None:
        """The scrape URL, or None when this process serves nothing."""
        if self.port is None:
            return None
        scheme = "https" if self._tls else "http"
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{scheme}://{host}:{self.port}/metrics"

    # ------------------------------------------------------------------------ internals

    def _start(self, base: int, local_rank: int, max_threads: int, timeout: float,
               ctx) -> None:
        port = base + local_rank if base else 0
        if port > 65535:
            raise ValueError(f"port {base} + LOCAL_RANK {local_rank} = {port} exceeds 65535; "
                             f"pass a lower port")
        try:
            self.server = MetricsServer(self.addr, port, self._page_for,
                                        max_threads=max_threads, timeout=timeout,
                                        ssl_context=ctx)
        except OSError as e:
            raise bind_error(e, self.addr, port, base, local_rank) from e
        self.server.start()
        self.port = self.server.port

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


def _keys(kind: str, layer: str, head: str) -> list[tuple]:
    """The zero-initialised counter keys of one head for events of `kind`."""
    return [(layer, head, mode) for mode in ZERO_MODES] if kind == "mode" else [(layer, head)]


def _event_key(e) -> tuple:
    key = (e.layer, str(e.head))
    return (*key, Mode(e.to_mode).name) if e.kind == "mode" else key


class _Collector(Collector):
    def __init__(self, sink: PrometheusSink):
        self._sink = sink

    def collect(self):
        with self._sink._lock:
            snap = self._sink._snapshot
        return families(snap)

    def describe(self):
        # Names only, so register() can check for clashes without a snapshot.
        return families(None)


def _env_int(name: str) -> int:
    raw = os.environ.get(name, "0") or "0"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; unset it "
                         f"or set it to this process's rank") from None
