"""Watcher overhead on a tiny GPT training on CPU, and the watcher's state size.

Usage: python benchmarks/bench_watcher.py [--steps 200] [--threads 2] [--state-steps 10000]
                                         [--compile] [--compile-mode MODE] [--every 10]
                                         [--device cpu|cuda] [--gpt2-small]
                                         [--n-layer 4] [--n-head 4] [--n-embd 128]
                                         [--block-size 128]

1. Training step time, watched (every 10th step monitored, WatchConfig's default, or
   --every) vs not watched: three identical models (not watched, a second one not
   watched as the A/A noise floor, watched) trained step by step in a rotating order,
   so machine noise and running first or last hit each alike; medians and means of the
   per-step times.
2. Within the watched run: median monitored step vs median unmonitored step, and the
   unmonitored-step ratio (median unmonitored watched / median not watched).
   Paired: each step's watched time minus the mean of the two unwatched models' times
   on the same step and batch (slow machine drift cancels), averaged over monitored,
   unmonitored and all steps, with a standard error; the paired amortised ratio is
   1 + mean extra / mean unwatched step, ± 2 standard errors.
   --compile: both models torch.compile'd (inductor; --compile-mode e.g.
   reduce-overhead), the watcher attached after compiling; the first 25 steps
   (compilation of both graphs) are not timed. --device cuda (benchmarks/gpu_check.py)
   synchronises around every timed step; --gpt2-small: 12 layers × 12 heads, d 768,
   T 1024, B 8 (the paper's setting) instead of the tiny GPT; --n-layer, --n-head,
   --n-embd and --block-size set another size (how the overhead falls as the model
   grows: the monitored step's extra is mostly a fixed count of small tensor ops).
3. torch.save size of watcher.state_dict() after 100 and after --state-steps monitored
   steps (every_n_steps=1) of a one-layer model: it must not grow.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import pathlib
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def overhead(steps: int, compiled: bool = False, every: int = 10, device: str = "cpu",
             compile_mode: str | None = None, gpt2_small: bool = False,
             size: dict | None = None) -> None:
    cfg = (GPTConfig(block_size=1024, vocab_size=256, n_layer=12, n_head=12, n_embd=768)
           if gpt2_small else GPTConfig(vocab_size=256, **(size or TINY)))
    torch.manual_seed(0)
    plain = GPT(cfg).to(device)
    control = copy.deepcopy(plain)  # a second unwatched model: the noise floor (A/A)
    watched = copy.deepcopy(plain)
    models = [plain, control, watched]
    if compiled:
        models = [torch.compile(m, mode=compile_mode) for m in models]
    w = fw.watch(watched, every_n_steps=every)  # rows_per_head=64 (default)
    warmup = 25 if compiled else 5
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    g = torch.Generator().manual_seed(0)
    times = {0: [], 1: [], "mon": [], "unmon": []}
    paired = {"mon": [], "unmon": []}  # watched minus the unwatched mean, same step
    for step in range(steps + warmup):
        idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
        x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
        monitored = step % every == 0
        now = {}
        # The three models in a rotating order: none always runs first (caches, turbo).
        for i in [(step + j) % 3 for j in range(3)]:
            sync(device)
            t0 = time.perf_counter()
            train_step(models[i], opts[i], x, y)
            if i == 2:
                w.step()
            sync(device)
            dt = time.perf_counter() - t0
            now[i] = dt
            if step >= warmup:
                times[("mon" if monitored else "unmon") if i == 2 else i].append(dt)
        if step >= warmup:
            paired["mon" if monitored else "unmon"].append(now[2] - (now[0] + now[1]) / 2)
    t_plain, t_mon, t_unmon = times[0], times["mon"], times["unmon"]
    t_watched = t_mon + t_unmon
    med = statistics.median
    print(f"GPT {cfg.n_layer}L {cfg.n_head}H d={cfg.n_embd} T={cfg.block_size} B=8, bf16 "
          f"autocast, {device}, {torch.get_num_threads()} threads, {steps} steps each, "
          f"every_n_steps={every}" + (f", torch.compile (inductor, mode={compile_mode})"
                                      if compiled else ", eager"))
    print("| measure | value |")
    print("|---|---|")
    print(f"| median step, not watched | {1e3 * med(t_plain):.1f} ms |")
    print(f"| median step, watched | {1e3 * med(t_watched):.1f} ms |")
    print(f"| A/A: median second unwatched model / not watched | "
          f"{med(times[1]) / med(t_plain):.3f} |")
    print(f"| A/A: mean second unwatched model / not watched | "
          f"{statistics.mean(times[1]) / statistics.mean(t_plain):.3f} |")
    print(f"| mean step ratio watched / not watched (amortised) | "
          f"{statistics.mean(t_watched) / statistics.mean(t_plain):.3f} |")
    print(f"| median step ratio watched / not watched | {med(t_watched) / med(t_plain):.3f} |")
    print(f"| median monitored step / median unmonitored step | "
          f"{med(t_mon) / med(t_unmon):.3f} |")
    print(f"| median unmonitored watched step / median not watched | "
          f"{med(t_unmon) / med(t_plain):.3f} |")
    base = statistics.mean(t_plain + times[1])
    for name, xs in (("monitored", paired["mon"]), ("unmonitored", paired["unmon"]),
                     ("all", paired["mon"] + paired["unmon"])):
        print(f"| paired extra, {name} steps (n={len(xs)}) | {1e3 * statistics.mean(xs):.2f} "
              f"± {1e3 * _stderr(xs):.2f} ms |")
    # Amortised at this cadence from the two paired means, weighted by their step counts.
    every_extra = paired["mon"] + paired["unmon"]
    print(f"| paired amortised ratio (± 2 s.e.) | {1 + statistics.mean(every_extra) / base:.4f} "
          f"± {2 * _stderr(every_extra) / base:.4f} |")
    # The same from the monitored steps alone: an unmonitored step runs no flashwatch
    # code in the model (tests/monitor/test_attach.py counts it), so its true extra is 0 and
    # its paired mean above is noise (±1 ms a step here).
    print(f"| amortised from the monitored extra, 1 + extra / (every · step) (± 2 s.e.) | "
          f"{1 + statistics.mean(paired['mon']) / (every * base):.4f} ± "
          f"{2 * _stderr(paired['mon']) / (every * base):.4f} |")
    w.remove()


TINY = dict(block_size=128, n_layer=4, n_head=4, n_embd=128)


def _stderr(xs: list[float]) -> float:
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")


def state_size(n_steps: int) -> None:
    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    w = fw.watch(model, every_n_steps=1, window=64)
    g = torch.Generator().manual_seed(0)
    sizes = {}
    for step in range(1, n_steps + 1):
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        model.zero_grad(set_to_none=True)
        w.step()
        if step in (100, n_steps):
            buf = io.BytesIO()
            torch.save(w.state_dict(), buf)
            sizes[step] = buf.tell()
    print(f"| state_dict bytes after 100 monitored steps | {sizes[100]} |")
    print(f"| state_dict bytes after {n_steps} monitored steps | {sizes[n_steps]} |")


GPT2_SMALL = dict(block_size=1024, vocab_size=50_257, n_layer=12, n_head=12, n_embd=768)
PHASES = ("not_watched", "watched_sdpa", "watched_routed")


@contextlib.contextmanager
def sync_warnings():
    """Syncs CUDA flags while the block runs (torch.cuda.set_sync_debug_mode("warn")):
    yields a list that holds one entry per synchronising call once the block exits."""
    found: list = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            yield found
    finally:
        torch.cuda.set_sync_debug_mode(0)
    found += [str(r.message)[:120] for r in rec if "synchroniz" in str(r.message)]


def _dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}


def _counter_diff(before: dict, after: dict) -> dict:
    out = {}
    for sec, vals in after.items():
        d = {str(k)[:160]: v - before.get(sec, {}).get(k, 0) for k, v in vals.items()
             if isinstance(v, int) and v != before.get(sec, {}).get(k, 0)}
        if d:
            out[sec] = d
    return out


def phases(cfg: GPTConfig, device: str, compile_kw: dict | None, steps: int = 20,
           every: int = 5, warmup: int = 3, batch: int = 8) -> dict:
    """One model through PHASES (not watched; watch() attached, SDPA; heads 0 and 1 of
    every layer FP32_O and BETA), `warmup` + `steps` optimizer steps each. Per phase:
    median monitored / unmonitored step ms, syncs per monitored / unmonitored step (the
    most seen), peak memory (CUDA), the torch._dynamo counters it moved (graph breaks,
    CUDA-graph skips and partitions) and the amortised step ratio to the unwatched
    phase at this cadence. benchmarks/gpu_check.py stage (c)."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    run = model if compile_kw is None else torch.compile(model, **compile_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    data = (model, run, opt, idx[:, :-1].to(device), idx[:, 1:].to(device))
    w, out = None, {}
    for phase in PHASES:
        if phase == "watched_sdpa":
            w = fw.watch(model, every_n_steps=every)
        elif phase == "watched_routed":
            for site in w.sites:
                w.set_head_modes(site.name, [fw.Mode.FP32_O, fw.Mode.BETA] +
                                 [fw.Mode.STANDARD] * (site.num_heads - 2))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = _dynamo_counters()
        ms, syncs = _phase_steps(data, w, device, compile_kw is None, warmup + steps, warmup,
                                 every)
        out[phase] = {
            "ms": {k: statistics.median(v) for k, v in ms.items() if v},
            "syncs": {k: None if None in v else max(v) for k, v in syncs.items() if v},
            "peak_mem_gb": (torch.cuda.max_memory_allocated() / 2**30 if device == "cuda"
                            else None),
            "dynamo_counters": _counter_diff(before, _dynamo_counters()),
            "monitor_errors_total": None if w is None else w.monitor_errors_total}
    w.remove()
    base = out["not_watched"]["ms"]["unmon"]
    for phase in PHASES[1:]:
        t = out[phase]["ms"]
        if "mon" in t and "unmon" in t:
            out[phase]["amortised_ratio"] = ((every - 1) * t["unmon"] + t["mon"]) / (every * base)
    return out


def overhead_modes(device: str, mode: str, dry: bool = False) -> dict:
    """phases() on GPT-2 Small in one torch.compile mode ("eager", "compiled",
    "reduce_overhead"); dry: a 2-layer GPT on the CPU, compiled with backend="eager"
    (no inductor, no CUDA graphs there). benchmarks/gpu_check.py stage (c)."""
    size = (dict(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32) if dry
            else GPT2_SMALL)
    kw = {"eager": None, "compiled": {}, "reduce_overhead": {"mode": "reduce-overhead"}}[mode]
    if dry and kw is not None:
        kw = {"backend": "eager"}
    if kw is not None:  # GPT's code objects keep the last check's compiled entries
        torch._dynamo.reset()  # (recompile limit 8): start each mode clean
    steps, every = (4, 2) if dry else (20, 5)
    # warm-up: two monitored steps (the traced probe compiles at the second) and one more
    res = phases(GPTConfig(**size), device, kw, steps=steps, every=every,
                 warmup=2 * every + 1, batch=2 if dry else 8)
    errors = [p["monitor_errors_total"] for p in res.values() if p["monitor_errors_total"]]
    return {"ok": not errors, "model": size, "every_n_steps": every, "phases": res}


def _phase_steps(data, w, device: str, eager: bool, n: int, warmup: int, every: int):
    """Step times (ms) and syncs per step, by monitored ("mon") / unmonitored ("unmon").
    Syncs: CUDA's sync debug mode; on the CPU flashwatch/synccount.py (eager only, one
    counter over the phase so that what earlier steps put on the "device" stays there)."""
    from flashwatch.synccount import SyncCounter

    model, run, opt, x, y = data
    ms, syncs = {"mon": [], "unmon": []}, {"mon": [], "unmon": []}
    cpu_eager = device != "cuda" and eager
    with SyncCounter(device=[model, opt, x, y]) if cpu_eager else \
            contextlib.nullcontext() as sc:
        for i in range(n):
            kind = "mon" if w is not None and w.step_count % every == 0 else "unmon"
            if sc is not None:
                sc.reset()
            sync(device)
            t0 = time.perf_counter()
            with sync_warnings() if device == "cuda" else contextlib.nullcontext() as found:
                train_step(run, opt, x, y)
                if w is not None:
                    w.step()
            sync(device)
            if i >= warmup:
                ms[kind].append(1e3 * (time.perf_counter() - t0))
                syncs[kind].append(len(found) if found is not None else
                                   None if sc is None else sc.total)
    return ms, syncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--state-steps", type=int, default=10_000)
    ap.add_argument("--compile", action="store_true", help="torch.compile every model")
    ap.add_argument("--compile-mode", default=None, help="torch.compile's mode (with --compile)")
    ap.add_argument("--every", type=int, default=10, help="the watcher's every_n_steps")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--gpt2-small", action="store_true", help="12 layers, d 768, T 1024")
    for name, value in TINY.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    overhead(args.steps, args.compile, args.every, args.device, args.compile_mode,
             args.gpt2_small, {name: getattr(args, name) for name in TINY})
    if args.state_steps:
        state_size(args.state_steps)


if __name__ == "__main__":
    main()
