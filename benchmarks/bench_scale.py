"""flashwatch at the shape of a 70B model (80 layers × 64 heads), simulated on one CPU.

Usage: python benchmarks/bench_scale.py [--steps 5] [--d-head 8] [--seq 64] [--threads 1]

1. A watcher over synthetic Llama-named models of 1×16, 16×64 and 80×64 heads (d_head
   and the sequence small, see the flags): per monitored step (every_n_steps=1, median
   of --steps), the time of the probe (forward + gradient hooks, the watcher's own
   count), of watcher.step() and inside it the W^Q norms (flashwatch/signals/spectral.py's
   Gram-matrix norm: these weights are whole, not sharded), the cross-rank
   reduction (one process: the packing only), signals + policy and the rest (the
   per-head records); the exporter's write and page render (PrometheusSink without a
   server), the JSONL line (full and compact), Python memory allocated at peak in
   step() (tracemalloc), and the size of watcher.state_dict(). Time per head shows
   whether a cost grows faster than the model.
2. Output sizes for 16, 1,024 and 5,120 heads: Prometheus page and series, JSONL bytes
   per monitored step (full record, compact line, the default mix).
3. Collective bytes per rank and monitored step: the old all_gather against the
   SUM + MAX all_reduce, for 1 to 1,024 ranks.
Scaling of each cost to d_model 8,192, d_head 128, N 8,192 is in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import pathlib
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch
import torch.nn.functional as F
from prometheus_client import generate_latest
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
import flashwatch.monitor.monitored_step as fw_step  # noqa: E402
from flashwatch import HeadRecord, Mode, StepReport  # noqa: E402
from flashwatch.integrations.prometheus import PrometheusSink  # noqa: E402
from flashwatch.report.sinks import DEFAULT_FULL_EVERY, JsonlSink  # noqa: E402


class Attention(nn.Module):
    """nanoGPT-style attention (fused c_attn), no output projection: only what is watched."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = (t.view(B, N, self.n_head, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) \
            .reshape(B, N, C)


class Layer(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.self_attn = Attention(d_model, n_head)


class Model(nn.Module):
    """Llama's module names (model.layers.<i>.self_attn), residual attention layers only."""

    def __init__(self, n_layer: int, n_head: int, d_head: int):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer(n_head * d_head, n_head)
                                          for _ in range(n_layer))

    def forward(self, x):
        for layer in self.model.layers:
            x = x + layer.self_attn(x)
        return x


class Timer:
    """Wraps a function attribute and sums its wall time."""

    def __init__(self, owner, name):
        self.owner, self.name, self.seconds = owner, name, 0.0
        self.inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(owner, name, timed)

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def restore(self):
        setattr(self.owner, self.name, self.inner)


def measure(n_layer, n_head, d_head, seq, steps) -> dict:
    torch.manual_seed(0)
    model = Model(n_layer, n_head, d_head)
    w = fw.watch(model, every_n_steps=1)
    timers = dict(power=Timer(fw_step, "spectral_norms"),
                  reduce=Timer(fw_step.reduce, "exchange"),
                  signals=Timer(type(w._pipeline.signals), "update"),
                  policy=Timer(type(w._pipeline.policy), "decide"))
    prom = PrometheusSink(start_server=False)
    tmp = tempfile.TemporaryDirectory()
    jsonl_full = JsonlSink(pathlib.Path(tmp.name) / "full.jsonl", full_every=1)
    jsonl_compact = JsonlSink(pathlib.Path(tmp.name) / "compact.jsonl",
                              full_every=DEFAULT_FULL_EVERY)
    rows = {k: [] for k in ("train", "probe", "step", "power", "reduce", "signals_policy",
                            "records", "prom_write", "prom_render", "client_render",
                            "jsonl_full", "jsonl_compact")}
    x = torch.randn(1, seq, n_head * d_head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # W^Q moves between steps
    for i in range(steps + 1):  # the first monitored step (warm-up) is dropped
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        train = time.perf_counter() - t0
        probe = w._ledger.seconds
        for t in timers.values():
            t.take()
        t0 = time.perf_counter()
        report = w.step()
        step = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        parts = {k: t.take() for k, t in timers.items()}
        sinks = {}
        for key, fn, arg in (("prom_write", prom.write, report),
                             ("prom_render", prom._page_for, ""),
                             # prometheus_client's renderer on the same page, side by side
                             ("client_render", generate_latest, prom.registry),
                             ("jsonl_full", jsonl_full.write, report),
                             # the first line is full: only the later ones are compact
                             ("jsonl_compact", jsonl_compact.write, report)):
            t0 = time.perf_counter()
            fn(arg)
            sinks[key] = time.perf_counter() - t0
        if i == 0:
            continue
        for k, v in (("train", train - probe), ("probe", probe), ("step", step),
                     ("power", parts["power"]), ("reduce", parts["reduce"]),
                     ("signals_policy", parts["signals"] + parts["policy"]),
                     ("records", step - sum(parts.values())),
                     *sinks.items()):
            rows[k].append(v)
    # Python memory at peak in one more step(), apart: tracemalloc slows Python down
    model(x).square().mean().backward()
    tracemalloc.start()
    w.step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    buf = io.BytesIO()
    torch.save(w.state_dict(), buf)
    for t in timers.values():
        t.restore()
    w.remove()
    jsonl_full.close()
    jsonl_compact.close()
    tmp.cleanup()
    out = {k: statistics.median(v) for k, v in rows.items()}
    out.update(heads=n_layer * n_head, page_bytes=len(prom._page_for("")[0]),
               state_bytes=buf.tell(),
               step_peak_mb=peak / 2**20)
    return out


# HeadRecord's float fields: what a report carries per head besides names and modes
FLOAT_FIELDS = [f.name for f in dataclasses.fields(HeadRecord) if f.type == "float"]


def synthetic_report(n_layer: int, n_head: int) -> StepReport:
    g = torch.Generator().manual_seed(0)
    vals = torch.randn(n_layer * n_head, len(FLOAT_FIELDS), generator=g,
                       dtype=torch.float64).tolist()
    heads = [HeadRecord(layer=f"model.layers.{i}.self_attn", head=h,
                        **dict(zip(FLOAT_FIELDS, vals[i * n_head + h], strict=True)),
                        head_mode=Mode.STANDARD)
             for i in range(n_layer) for h in range(n_head)]
    return StepReport(step=123_450, heads=heads, monitor_seconds=0.0123)


def output_sizes(n_layer: int, n_head: int) -> dict:
    report = synthetic_report(n_layer, n_head)
    prom = PrometheusSink(start_server=False)
    prom.write(report)
    plain, _ = prom._page_for("")
    gz, _ = prom._page_for("gzip")
    series = sum(1 for line in plain.decode().splitlines() if line and line[0] != "#")
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "x.jsonl"
        sink = JsonlSink(path)
        sink.write(report)
        sink.write(report)  # default: compact from the second line on large models
        sink.close()
        full, second = (len(line) + 1 for line in path.read_text().splitlines())
    compact = second
    if second == full:  # small model: every line is full by default
        with tempfile.TemporaryDirectory() as d:
            path = pathlib.Path(d) / "x.jsonl"
            sink = JsonlSink(path, full_every=DEFAULT_FULL_EVERY)
            sink.write(report)
            sink.write(report)
            sink.close()
            compact = len(path.read_text().splitlines()[1]) + 1
        default_avg = full
    else:
        default_avg = (full + (DEFAULT_FULL_EVERY - 1) * compact) / DEFAULT_FULL_EVERY
    return dict(heads=n_layer * n_head, page=len(plain), page_gz=len(gz), series=series,
                full=full, compact=compact, default_avg=default_avg)


def records_side_by_side(n: int = 5120, reps: int = 5) -> tuple[float, float]:
    """HeadRecords from float64 [n] tensors: a tensor index per head and field (as
    watcher.step() did) vs one tolist() per field (as it does); median seconds."""
    cols = {f: torch.randn(n, dtype=torch.float64) for f in FLOAT_FIELDS}
    modes = torch.zeros(n, dtype=torch.int64)

    def indexed():
        return [HeadRecord(layer="l", head=i, **{f: float(c[i]) for f, c in cols.items()},
                           head_mode=Mode(int(modes[i]))) for i in range(n)]

    def listed():
        lists = {f: c.tolist() for f, c in cols.items()}
        m = modes.tolist()
        return [HeadRecord(layer="l", head=i, **{f: v[i] for f, v in lists.items()},
                           head_mode=Mode(m[i])) for i in range(n)]

    times: dict = {indexed: [], listed: []}
    for _ in range(reps):
        for fn in times:  # alternated, so machine noise hits both
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    return statistics.median(times[indexed]), statistics.median(times[listed])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5, help="monitored steps measured")
    ap.add_argument("--d-head", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), d_head {args.d_head}, "
          f"N {args.seq}, B 1, rows_per_head 64, sketch_dim 8, {args.steps} monitored steps")

    print("\n1. Per monitored step (median, ms; µs/head in brackets for step() and sinks)")
    shapes = [(1, 16), (16, 64), (80, 64)]
    res = [measure(L, H, args.d_head, args.seq, args.steps) for L, H in shapes]
    print("| measure | " + " | ".join(f"{L}×{H} = {L * H} heads" for L, H in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    names = [("train", "model fwd+bwd without the probe"), ("probe", "probe (fwd + grad hooks)"),
             ("step", "watcher.step() (no sinks)"), ("power", "  W^Q norms (Gram)"),
             ("reduce", "  reduction (packing; 1 process)"),
             ("signals_policy", "  signals + policy"), ("records", "  per-head records, rest"),
             ("prom_write", "PrometheusSink.write"),
             ("prom_render", "exporter page render (+ gzip)"),
             ("client_render", "  prometheus_client generate_latest, same page"),
             ("jsonl_full", "JSONL line, full"), ("jsonl_compact", "JSONL line, compact")]
    for key, label in names:
        cells = []
        for r in res:
            ms = 1e3 * r[key]
            per_head = "" if key in ("train", "probe") else f" ({1e6 * r[key] / r['heads']:.1f})"
            cells.append(f"{ms:.2f}{per_head}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| Python memory peak in step() (MB) | "
          + " | ".join(f"{r['step_peak_mb']:.1f}" for r in res) + " |")
    print("| watcher.state_dict() (torch.save bytes) | "
          + " | ".join(f"{r['state_bytes']:,}" for r in res) + " |")
    print("| exporter page (bytes) | " + " | ".join(f"{r['page_bytes']:,}" for r in res) + " |")

    old, new = records_side_by_side()
    print(f"\nper-head records at 5,120 heads: tensor index per field {1e3 * old:.1f} ms, "
          f"tolist per field {1e3 * new:.1f} ms, ratio {old / new:.1f}")

    print("\n2. Output sizes per monitored step (synthetic reports, Llama layer names)")
    print("| heads | Prometheus page | gzip | series | JSONL full line | compact line | "
          "JSONL default, mean per line | GB per 10,000 lines (100k steps / 10) |")
    print("|---|---|---|---|---|---|---|---|")
    for L, H in ((1, 16), (16, 64), (80, 64)):
        s = output_sizes(L, H)
        print(f"| {s['heads']:,} | {s['page']:,} | {s['page_gz']:,} | {s['series']:,} | "
              f"{s['full']:,} | {s['compact']:,} | {s['default_avg']:,.0f} | "
              f"{s['default_avg'] * 1e4 / 1e9:.3f} |")

    print("\n3. Collective bytes per rank and monitored step (float64; n = 5,120, k = 8)")
    n, k = 5120, 8
    S = 8 * n * (12 + k * k)  # the packed payload of one rank (flashwatch/parallel/reduce.py)
    print(f"payload S = 8·n·(12+k²) = {S:,} bytes")
    print("| ranks | all_gather (old): received (W−1)·S | SUM+MAX all_reduce: ≈ 2(W−1)/W·S "
          "each way |")
    print("|---|---|---|")
    for W in (1, 8, 64, 1024):
        old = (W - 1) * S
        new = 2 * (W - 1) / W * S
        print(f"| {W:,} | {old / 1e6:,.1f} MB | {new / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
