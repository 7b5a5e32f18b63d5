"""Prometheus exporter under scrape load: scrape errors and training step-time ratio.

Usage: python benchmarks/bench_prometheus.py [--seconds 10] [--rate 50] [--threads 1]
                                             [--every 10] [--fp32]
       python benchmarks/bench_prometheus.py --burst 50 [--rounds 10]

A GPT with GPT-2 Small's attention layout (12 layers × 12 heads, so a scrape carries
144 heads × 10 series, 110 kB of text) but narrow (n_embd 96, 32 tokens, batch 4, so a
CPU step is short) trains in bf16 autocast (--fp32: without autocast; ~6× faster
steps on a CPU without native bf16, so Python overhead and the GIL weigh more) with
a watcher. Two arms run
side by side, alternating in blocks of --every steps (so each block holds exactly one
monitored step, whose report the exporter renders) until each has had --seconds:
  off  the watcher with no exporter;
  on   the same watcher with a PrometheusSink, scraped --rate times per second by a
       separate process (as Prometheus would be) for the whole block.
Reported: scrapes done and failed (target 0 failures), the step-time ratio on/off
(target ≤ 1.02) from mean and median step times, and the exporter's own CPU time per
scrape (process CPU time minus the training thread's, in the "on" arm: the server
thread's work, robust to other load on the machine). On a shared machine the ratio
carries that machine's noise; alternating short blocks spreads it over both arms.

--burst N: the listen backlog under a burst. While the same GPT trains (the accept loop
competes for the GIL), a client process opens N connections at once (one thread each,
released together) and scrapes on each; the exporter has max_threads=N so no
connection is refused for want of a thread. Two arms alternate for --rounds rounds: the
stdlib backlog (5) and the exporter's (128). Reported: connections whose connect took
≥ 0.9 s (a dropped SYN comes back after TCP's 1 s retransmit), the slowest connect and
the slowest scrape, per arm.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import pathlib
import statistics
import sys
import time
import urllib.request

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from flashwatch.integrations.prometheus import PrometheusSink  # noqa: E402


def scraper(url: str, rate: float, active, stop, results) -> None:
    """Scrape `url` `rate` times a second while `active` is set; report (ok, errors)."""
    ok = errors = 0
    period = 1.0 / rate
    next_t = time.monotonic()
    while not stop.is_set():
        if not active.wait(timeout=0.05):
            next_t = time.monotonic()
            continue
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                r.read()
            ok += 1
        except Exception:
            errors += 1
        next_t += period
        time.sleep(max(0.0, next_t - time.monotonic()))
    results.put((ok, errors))


def burst_client(ports, results, n: int) -> None:
    """For each port received: n threads connect at once and GET /metrics; puts
    [(connect seconds, scrape seconds, ok), ...]. None ends it."""
    import socket
    import threading

    while (port := ports.get()) is not None:
        gate, out = threading.Barrier(n), []

        def one(gate=gate, out=out):
            gate.wait()
            t0 = time.perf_counter()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                    t1 = time.perf_counter()
                    c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                    body = b"".join(iter(lambda c=c: c.recv(1 << 16), b""))
                    ok = body.startswith(b"HTTP/1.0 200")
                out.append((t1 - t0, time.perf_counter() - t0, ok))
            except OSError:
                out.append((math.inf, math.inf, False))

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.put(out)


def burst_bench(n: int, rounds: int, threads: int) -> None:
    from flashwatch.integrations import prometheus_server

    torch.set_num_threads(threads)
    cfg = GPTConfig(block_size=32, vocab_size=256, n_layer=12, n_head=12, n_embd=96)
    torch.manual_seed(0)
    model = GPT(cfg)
    watcher = fw.watch(model, every_n_steps=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def train_step():
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return watcher.step()

    report = train_step()
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=burst_client, args=(ports, results, n), daemon=True)
    proc.start()
    seen = {5: [], prometheus_server.BACKLOG: []}
    try:
        for _ in range(rounds):
            for backlog in seen:
                prometheus_server._Server.request_queue_size = backlog
                sink = PrometheusSink(port=0, max_threads=n)
                sink.write(report)
                ports.put(sink.port)
                while results.empty():  # the training thread holds the GIL as it would
                    train_step()
                seen[backlog] += results.get()
                sink.close()
    finally:
        prometheus_server._Server.request_queue_size = prometheus_server.BACKLOG
        ports.put(None)
        proc.join(timeout=30)
        watcher.remove()
    print(f"bench_prometheus --burst {n}: {rounds} rounds per arm, training a "
          f"{cfg.n_layer}×{cfg.n_head}-head GPT (bf16 autocast, threads={threads}) "
          f"meanwhile\n")
    print("| backlog | connections | connect ≥ 0.9 s | failed | slowest connect s | "
          "slowest scrape s | median scrape ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for backlog, rows in seen.items():
        slow = sum(c >= 0.9 for c, _, _ in rows)
        failed = sum(not ok for _, _, ok in rows)
        print(f"| {backlog} | {len(rows)} | {slow} | {failed} | "
              f"{max(c for c, _, _ in rows):.3f} | {max(s for _, s, _ in rows):.3f} | "
              f"{1e3 * statistics.median(s for _, s, _ in rows):.1f} |")


def static_server(port_queue, size: int) -> None:
    """Serves `size` bytes on every GET, from its own process (--client-control)."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    body = b"#" * size

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    port_queue.put(httpd.server_address[1])
    httpd.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="time per arm")
    ap.add_argument("--rate", type=float, default=50.0, help="scrapes per second")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--every", type=int, default=10, help="WatchConfig.every_n_steps")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    ap.add_argument("--control", action="store_true",
                    help="A/A run: the 'on' arm gets no exporter and no scrapes, so its "
                         "ratio shows the machine's noise")
    ap.add_argument("--client-control", action="store_true",
                    help="the 'on' arm scrapes a page of the same size served by another "
                         "process, not the exporter: the cost of the scraping client alone")
    ap.add_argument("--burst", type=int, default=0,
                    help="measure N simultaneous connections against backlog 5 and 128")
    ap.add_argument("--rounds", type=int, default=10, help="--burst rounds per arm")
    args = ap.parse_args()
    if args.burst:
        burst_bench(args.burst, args.rounds, args.threads)
        return
    torch.set_num_threads(args.threads)

    cfg = GPTConfig(block_size=32, vocab_size=256, n_layer=12, n_head=12, n_embd=96)
    torch.manual_seed(0)
    model = GPT(cfg)
    watcher = fw.watch(model, every_n_steps=args.every)
    sink = PrometheusSink(port=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    ctx = mp.get_context("spawn")
    active, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    url, static = sink.url, None
    if args.client_control:
        ports = ctx.Queue()
        static = ctx.Process(target=static_server, args=(ports, 110_000), daemon=True)
        static.start()
        url = f"http://127.0.0.1:{ports.get(timeout=60)}/metrics"
    proc = ctx.Process(target=scraper, args=(url, args.rate, active, stop, results))
    proc.start()

    def train_step() -> float:
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watcher.step()
        return time.perf_counter() - t0

    for _ in range(2 * args.every):  # warm-up, both arms' code paths
        train_step()
    sink.write(watcher.step() or fw.StepReport(step=0))  # a full page from the start
    times = {"off": [], "on": []}
    spent = {"off": 0.0, "on": 0.0}
    arm = "off"
    scraped_wall = 0.0  # seconds the scraper was active
    other_cpu = 0.0  # CPU seconds of threads other than this one, "on" arm
    try:
        while min(spent.values()) < args.seconds:
            arm = "on" if arm == "off" else "off"
            if arm == "on" and not args.control:
                if not args.client_control:
                    watcher.sinks.append(sink)
                t_active = time.perf_counter()
                cpu0 = time.process_time() - time.thread_time()
                active.set()
                time.sleep(0.05)  # let the scraper reach its rhythm
            t_start = time.perf_counter()
            for _ in range(args.every):
                times[arm].append(train_step())
            spent[arm] += time.perf_counter() - t_start
            if arm == "on" and not args.control:
                active.clear()
                scraped_wall += time.perf_counter() - t_active
                other_cpu += time.process_time() - time.thread_time() - cpu0
                if not args.client_control:
                    watcher.sinks.remove(sink)
                time.sleep(0.05)  # a scrape in flight finishes before the "off" arm
    finally:
        stop.set()
        ok, errors = results.get(timeout=30)
        proc.join(timeout=10)
        watcher.remove()
        sink.close()
        if static is not None:
            static.terminate()

    mean = {a: statistics.fmean(t) for a, t in times.items()}
    med = {a: statistics.median(t) for a, t in times.items()}
    scrape_s = scraped_wall
    label = (" CONTROL (A/A, no exporter in either arm)" * args.control
             + " CLIENT CONTROL (scrapes hit another process)" * args.client_control)
    print(f"bench_prometheus{label}: "
          f"{cfg.n_layer}×{cfg.n_head} heads, "
          f"{'fp32' if args.fp32 else 'bf16 autocast'}, threads={args.threads}, "
          f"every_n_steps={args.every}, {args.rate:g} scrapes/s, {scrape_s:.1f} s scraped, "
          f"{spent['off']:.1f} s unscraped, alternating every {args.every} steps\n")
    print("| arm | steps | mean step ms | median step ms |")
    print("|---|---:|---:|---:|")
    for a in ("off", "on"):
        print(f"| {a} | {len(times[a])} | {1e3 * mean[a]:.2f} | {1e3 * med[a]:.2f} |")
    print()
    print("| measure | value | target |")
    print("|---|---:|---:|")
    print(f"| scrapes done (achieved rate) | {ok} ({ok / max(scrape_s, 1e-9):.1f}/s) | "
          f"{args.rate * scrape_s:.0f} |")
    print(f"| scrape errors | {errors} | 0 |")
    print(f"| exporter CPU per scrape (server thread) | {1e3 * other_cpu / max(ok, 1):.2f} ms"
          f" | |")
    print(f"| exporter CPU share of one core at {args.rate:g}/s | "
          f"{100 * other_cpu / max(scrape_s, 1e-9):.1f} % | |")
    print(f"| step-time ratio on/off (mean) | {mean['on'] / mean['off']:.3f} | ≤ 1.02 |")
    print(f"| step-time ratio on/off (median) | {med['on'] / med['off']:.3f} | ≤ 1.02 |")


if __name__ == "__main__":
    main()
