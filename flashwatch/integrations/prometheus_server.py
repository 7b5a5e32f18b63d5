"""The exporter's HTTP(S) server: a stdlib HTTPServer with a bounded pool of threads.

    server = MetricsServer("127.0.0.1", 0, page, max_threads=8, timeout=5.0)
    server.start()  # serves page(accept_encoding) -> (body, gzipped) on /metrics
    server.close()

- Connections are served concurrently by at most `max_threads` reused threads (started
  on demand, so a quiet exporter holds one or two). A client that connects and sends
  nothing holds one thread for at most `timeout` seconds and never delays a scrape on
  another connection: served one at a time, four idle connections once held a scrape
  for 20 s, twice Prometheus' default scrape timeout. When every thread is busy a new
  connection is closed at once (a failed scrape, never a hung one), so a flood of
  connections costs at most `max_threads` threads. A thread per request
  (ThreadingHTTPServer) would be unbounded and cost 0.35 ms of CPU each.
- The listening socket queues BACKLOG (128) connections. The stdlib default is 5: while
  the accept loop waits for the GIL (a training step holds it for tens of ms), a burst
  of more than 6 connections overflows the kernel's queue, further SYNs are dropped and
  those clients retry after TCP's 1 s retransmit, so a scrape took ≥ 1 s with a few
  idle connections open. The kernel caps the backlog at net.core.somaxconn (4,096 on
  current Linux); 128 covers many scrapers and their retries at a few kB each.
"""

from __future__ import annotations

import errno
import queue
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

BACKLOG = 128  # connections the kernel holds for the accept loop (stdlib default: 5)


class MetricsServer:
    """Binds and listens at construction (so the port is known and taken), serves from
    `start()` on, on a daemon thread; `close()` stops it and frees the port.

    page          called on a pool thread per GET /metrics with the request's
                  Accept-Encoding; returns (body bytes, whether the body is gzipped).
    max_threads   connections served at once; more are closed at once (`refused`).
    timeout       seconds a client may take to send its request or read the page.
    ssl_context   serve HTTPS with this server-side context (see `tls_context`).
    """

    def __init__(self, addr: str, port: int, page, *, max_threads: int, timeout: float,
                 ssl_context: ssl.SSLContext | None = None):
        server_class = _Server6 if ":" in addr else _Server
        self._httpd = server_class((addr, port), _Handler, max_threads=max_threads,
                                   timeout=timeout)
        self._httpd.page = page
        if ssl_context is not None:
            # Handshake on the handler's first read, in a pool thread under the timeout,
            # not inside accept() where a silent client would stall the accept loop.
            self._httpd.socket = ssl_context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False)
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def address(self) -> str:
        """The address the socket is bound to."""
        return self._httpd.socket.getsockname()[0]

    @property
    def refused(self) -> int:
        """Connections closed at once because every thread was busy."""
        return self._httpd.refused

    @property
    def busy(self) -> int:
        """Connections handed to a thread and not yet closed."""
        return self._httpd.busy

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="flashwatch-prometheus")
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        httpd, thread = self._httpd, self._thread
        if thread is not None:
            httpd.shutdown()  # returns once serve_forever has left its loop (≤ 0.5 s poll)
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)
        httpd.stop_workers()


def bind_error(e: OSError, addr: str, port: int, base: int, local_rank: int) -> Exception:
    """The error to raise when binding (addr, port) failed: a RuntimeError that says what
    to do for a taken port, else `e` itself."""
    if e.errno != errno.EADDRINUSE:
        return e
    return RuntimeError(
        f"flashwatch Prometheus exporter: port {port} on {addr} is already in use (base "
        f"port {base} + LOCAL_RANK {local_rank}); pass another base port "
        f"(PrometheusSink(port=...) or FlashWatchCallback(prometheus_port=...)), or 0 for "
        f"any free port")


def tls_context(certfile: str, keyfile: str, client_cafile: str | None) -> ssl.SSLContext:
    """A server context with this certificate and key; with client_cafile, clients must
    present a certificate signed by it. ValueError naming the files when they do not
    load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile=certfile, keyfile=keyfile)
        if client_cafile is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=client_cafile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load TLS files certfile={certfile!r}, keyfile="
                         f"{keyfile!r}, client_cafile={client_cafile!r}: {e}") from e
    return ctx


class _Server(HTTPServer):
    """HTTPServer whose connections run on at most `max_threads` reused daemon threads.

    The accept loop (serve_forever's thread) only hands sockets over; when every thread
    is busy it closes the new connection at once (a failed scrape, never a hung one).
    """

    request_queue_size = BACKLOG  # HTTPServer passes it to listen()

    def __init__(self, address, handler, *, max_threads: int, timeout: float):
        super().__init__(address, handler)
        self.max_threads = max_threads
        self.timeout_s = timeout  # per connection: for the request and for the page
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self.busy = 0  # connections handed over and not yet closed
        self._workers: list[threading.Thread] = []
        self.refused = 0  # connections closed because every thread was busy

    def process_request(self, request, client_address):
        with self._count_lock:
            if self.busy >= self.max_threads:
                self.refused += 1
                self.shutdown_request(request)
                return
            self.busy += 1
            if len(self._workers) < self.busy:  # start threads on demand, keep them
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
                    self.busy -= 1

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
        body, gzipped = self.server.page(self.headers.get("Accept-Encoding", ""))
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (stdlib's signature)
        pass  # one stderr line per scrape would flood the training log
