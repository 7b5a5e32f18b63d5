"""Would-be CUDA device ops (kernel launches) a monitored step adds, per stage, counted on CPU.

Usage: python benchmarks/bench_ops.py [--layers 4 12] [--paths default route_all] [--detail]

flashwatch/synccount.py's SyncCounter marks the model, the optimizer and the batch as
GPU-resident and counts each aten op that would launch on CUDA (its docstring has the
rule: views, allocations, collectives and flashwatch's own torch.library ops launch
nothing here). One optimizer step of flashwatch.nanogpt's GPT (4 heads, d 64, B 2 × T 32,
BF16 autocast, AdamW), split in stages: forward, backward, optimizer (AdamW step and
zero_grad), watcher.step(). Three runs from the same seed: a model never watched, and a
watched one (every_n_steps=2: steps 0 and 1 warm up, step 2 is monitored, step 3 not).
"Extra" is a stage's ops in the monitored step minus the same stage unwatched; issue 40's
budget: forward + backward extra growing by ≤ 20 ops per layer, plus a bounded constant
(the micro-batch's totals, step()) that does not grow (tests/monitor/test_op_budget.py).
--detail lists the extra ops by name.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections import Counter

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
from flashwatch.nanogpt import GPT, GPTConfig  # noqa: E402
from flashwatch.synccount import SyncCounter  # noqa: E402

STAGES = ("forward", "backward", "optimizer", "step")
PATHS = ("default", "route_all")  # WatchConfig() / WatchConfig(route_all=True)
BATCH, T, HEADS, EMBD = 2, 32, 4, 64


def count_stages(n_layer: int, path: str | None, steps: int = 4) -> list[dict[str, Counter]]:
    """Per optimizer step, each stage's device ops by name (path None: never watched;
    else every_n_steps=2, so steps 0 and 2 are monitored)."""
    cfg = GPTConfig(block_size=T, vocab_size=64, n_layer=n_layer, n_head=HEADS, n_embd=EMBD)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, T + 1), generator=g)
    x, y = idx[:, :-1].clone(), idx[:, 1:].clone()
    per_step = []
    with SyncCounter(device=[model, opt, x, y]) as sc:
        w = None
        if path is not None:
            w = fw.watch(model, config=fw.WatchConfig(every_n_steps=2,
                                                      route_all=path == "route_all"))
        for _ in range(steps):
            stages: dict[str, Counter] = {}

            def stage(name, fn, stages=stages):
                sc.reset()
                out = fn()
                stages[name] = Counter(sc.ops)
                return out

            def forward():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(x, y)[1]

            loss = stage("forward", forward)
            stage("backward", loss.backward)
            stage("optimizer", lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
            stage("step", (lambda: None) if w is None else w.step)
            per_step.append(stages)
        if w is not None:
            if w.monitor_errors_total:
                raise RuntimeError(f"the watcher logged {w.monitor_errors_total} errors")
            w.remove()
    return per_step


def extra_ops(n_layer: int, path: str = "default") -> dict[str, Counter]:
    """Per stage, the device ops a monitored step adds over a never-watched model's
    step (Counter subtraction keeps the positive part: ops the watcher adds), and the
    totals as ints under "<stage>_total" (watched minus unwatched, may be negative)."""
    plain = count_stages(n_layer, None, steps=3)[2]
    watched = count_stages(n_layer, path)
    out: dict = {}
    for label, s in (("monitored", watched[2]), ("unmonitored", watched[3])):
        for st in STAGES:
            out[f"{label}_{st}"] = s[st] - plain[st]
            out[f"{label}_{st}_total"] = sum(s[st].values()) - sum(plain[st].values())
    out["plain"] = plain
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    ap.add_argument("--paths", nargs="+", default=["default"], choices=PATHS)
    ap.add_argument("--detail", action="store_true", help="the extra ops of each stage by name")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"flashwatch.nanogpt GPT, {HEADS} heads, d {EMBD}, B {BATCH} × T {T}, bf16 "
          f"autocast, AdamW; would-be CUDA device ops (flashwatch/synccount.py)")
    print("| L | path | unwatched step | + forward | + backward | + step() | unmonitored + |")
    print("|---|---|---|---|---|---|---|")
    details, fwd_bwd = [], {}
    for n_layer in args.layers:
        for path in args.paths:
            e = extra_ops(n_layer, path)
            fwd, bwd, stp = (e[f"monitored_{s}_total"] for s in ("forward", "backward", "step"))
            unmon = sum(e[f"unmonitored_{s}_total"] for s in STAGES)
            plain = sum(sum(c.values()) for c in e["plain"].values())
            fwd_bwd.setdefault(path, []).append((n_layer, fwd + bwd, stp))
            print(f"| {n_layer} | {path} | {plain} | {fwd} | {bwd} | {stp} | {unmon} |",
                  flush=True)
            details.append((n_layer, path, e))
    # The budget (tests/monitor/test_op_budget.py): forward + backward grow by ≤ 20 ops a
    # layer; what does not grow (the micro-batch's totals and step()) is a bounded constant.
    for path, runs in fwd_bwd.items():
        if len(runs) > 1:
            (l0, a0, s0), (l1, a1, s1) = runs[0], runs[-1]
            slope = (a1 - a0) / (l1 - l0)
            print(f"\n{path}: forward + backward {slope:.1f} ops per layer (budget 20: "
                  f"{'holds' if slope <= 20 else 'exceeded'}); constant {a0 - slope * l0:.0f} "
                  f"+ step() {s0} at {l0} layers, step() {s1} at {l1}")
    if args.detail:
        for n_layer, path, e in details:
            print(f"\n## L={n_layer} {path}: extra ops of the monitored step")
            for st in STAGES:
                ops = ", ".join(f"{op} {n}" for op, n in e[f"monitored_{st}"].most_common())
                print(f"- {st} ({e[f'monitored_{st}_total']:+d}): {ops or '-'}")


if __name__ == "__main__":
    main()
