"""Where a monitored step's cost goes: forward, backward, optimizer and watcher.step().

Usage: python benchmarks/bench_phases.py [--steps 600] [--every 10] [--threads 1] [--parts]

The small CPU GPT of bench_watcher.py (4 layers × 4 heads, d 128, T 128, B 8, bf16
autocast), two identical copies, one watched: each step both train on the same batch,
in alternating order, and each phase is timed. For the watcher's monitored steps (every
--every) the table gives each phase's paired extra (watched minus unwatched, same
step), mean ± standard error and median, and the watcher's own `monitor_seconds`.
Paired differences of the same step cancel the machine's slow drift (step times here
moved 60 → 80 ms within minutes); at --every 10 a monitored step follows nine
unmonitored ones, as in training (caches cold for the watcher's code and data).

--parts: also time the watcher's own functions where they run (in training, caches as
cold as they are there: one call costs up to twice its time in a loop), inclusive, per
monitored step. The wrappers add ≈ 1 µs a call.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "watcher.step()")


def time_parts() -> dict:
    """Wrap the watcher's functions with timers; returns {name: seconds}, filled as they
    run. Indentation in the names: called inside the one above."""
    import functools

    from flashwatch import watcher as W
    from flashwatch.mitigation import policy
    from flashwatch.monitor import capture as C
    from flashwatch.monitor import monitored_step as M
    from flashwatch.monitor import probe, samples
    from flashwatch.parallel import reduce
    from flashwatch.signals import drift as signals

    spent: dict = {}  # in the order below: each name before the ones it calls

    def timed(owner, attr, name):
        f = getattr(owner, attr)

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        setattr(owner, attr, wrapper)
        spent[name] = 0.0

    make_hook = C.Recorder._grad_hook

    def grad_hook(self, *args):  # the hook made per call, timed where autograd runs it
        hook = make_hook(self, *args)

        def timed_hook(grad):
            t0 = time.perf_counter()
            try:
                return hook(grad)
            finally:
                spent["gradient hook (c)"] += time.perf_counter() - t0
        return timed_hook
    C.Recorder._grad_hook = grad_hook
    for owner, attr, name in (
            (C.Recorder, "_probe", "probe (forward)"), (probe, "recompute", "  recompute"),
            (None, None, "gradient hook (c)"),
            (samples, "totals", "samples.totals (backward and step())"),
            (C, "wq_grad_sq", "‖dW^Q‖² hook (backward)"), (W.Watcher, "step", "step()"),
            (M.StepPipeline, "run", "  StepPipeline.run"),
            (M, "spectral_norms", "    W^Q spectral norms"),
            (signals.HeadSignals, "update", "    HeadSignals.update"),
            (policy.Policy, "decide", "    Policy.decide"),
            (reduce, "exchange", "    reduce.exchange")):
        if owner is None:
            spent[name] = 0.0
        else:
            timed(owner, attr, name)  # M.spectral_norms, C.wq_grad_sq: the names they call
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=10, help="the watcher's every_n_steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", action="store_true", help="time the watcher's functions")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spent = time_parts() if args.parts else None
    cfg = GPTConfig(block_size=128, vocab_size=256, n_layer=4, n_head=4, n_embd=128)
    torch.manual_seed(0)
    plain = GPT(cfg)
    watched = copy.deepcopy(plain)
    w = fw.watch(watched, every_n_steps=args.every)
    models = (plain, watched)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    g = torch.Generator().manual_seed(0)
    times = {j: {p: [] for p in PHASES} for j in (0, 1)}
    own = []
    clock = time.perf_counter
    for step in range(args.steps):
        idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
        monitored = w._cadence.monitoring  # this step's report comes from its step()
        if spent is not None and step == args.every:
            spent.update(dict.fromkeys(spent, 0.0))  # as the phases: from the 2nd cycle on
        for j in ((0, 1) if step % 2 else (1, 0)):
            t0 = clock()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = models[j](idx[:, :-1], idx[:, 1:])
            t1 = clock()
            loss.backward()
            t2 = clock()
            opts[j].step()
            opts[j].zero_grad(set_to_none=True)
            t3 = clock()
            report = w.step() if j else None
            t4 = clock()
            if step >= args.every and monitored:  # the first cycle warms up
                for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    times[j][p].append(dt)
                if report is not None:
                    own.append(report.monitor_seconds)
    n = len(own)
    print(f"GPT {cfg.n_layer}L {cfg.n_head}H d={cfg.n_embd} T={cfg.block_size} B=8, bf16 "
          f"autocast, cpu, {torch.get_num_threads()} threads, every_n_steps={args.every}, "
          f"{n} monitored steps")
    print("| phase of a monitored step | unwatched, median | paired extra, mean ± s.e. "
          "| paired extra, median |")
    print("|---|---|---|---|")
    total = []
    for p in PHASES:
        d = [a - b for a, b in zip(times[1][p], times[0][p], strict=True)]
        total = d if not total else [a + b for a, b in zip(total, d, strict=True)]
        print(f"| {p} | {1e3 * statistics.median(times[0][p]):.2f} ms | "
              f"{1e3 * statistics.mean(d):.2f} ± {1e3 * statistics.stdev(d) / n ** 0.5:.2f} ms "
              f"| {1e3 * statistics.median(d):.2f} ms |")
    step_ms = sum(statistics.mean(times[0][p]) for p in PHASES)
    print(f"| whole step | {1e3 * step_ms:.1f} ms (mean) | {1e3 * statistics.mean(total):.2f} ± "
          f"{1e3 * statistics.stdev(total) / n ** 0.5:.2f} ms | "
          f"{1e3 * statistics.median(total):.2f} ms |")
    print(f"| monitor_seconds (the watcher's own time) | | "
          f"{1e3 * statistics.mean(own):.2f} ms | {1e3 * statistics.median(own):.2f} ms |")
    extra = statistics.mean(total)
    print(f"| amortised at every_n_steps={args.every}: 1 + extra / ({args.every} · step) | | "
          f"{1 + extra / (args.every * step_ms):.4f} ± "
          f"{2 * statistics.stdev(total) / n ** 0.5 / (args.every * step_ms):.4f} (2 s.e.) | |")
    if spent is not None:
        print()
        print("| the watcher's function (inclusive; every call from the second cycle on, "
              "÷ monitored steps) | ms per monitored step |")
        print("|---|---|")
        for name, sec in spent.items():
            print(f"| {name.replace('  ', '&nbsp;&nbsp;')} | {1e3 * sec / n:.2f} |")
    w.remove()


if __name__ == "__main__":
    main()
