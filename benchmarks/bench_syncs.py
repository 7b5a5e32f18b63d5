"""Would-be CUDA host syncs of one training step of examples/gpt.py's GPT, counted on CPU.

Usage: python benchmarks/bench_syncs.py [--layers 4 12] [--micro 1 4] [--detail]

flashwatch/synccount.py's SyncCounter marks the model, the optimizer and the batch as
GPU-resident and counts what each op would do on CUDA (its docstring has the rules).
One optimizer step = M micro-batches (forward + backward under bf16 autocast, gradient
accumulation), AdamW's step and watcher.step(). Per row: a step not watched at all, an
unmonitored and a monitored step of a watched model (every_n_steps=2; steps 0 and 1
warm up inside the counter, steps 2 and 3 are counted), for L layers, M micro-batches
and three attention paths: "sdpa" (F.scaled_dot_product_attention), "routed" (head 0
FP32_O and head 1 BETA in every layer, set with watcher.set_head_modes, so those layers
run flashwatch's kernel) and "route_all" (WatchConfig(route_all=True), every head
STANDARD through flashwatch's kernel). --detail prints where the monitored step's syncs
come from (file:line in flashwatch, count).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from flashwatch.synccount import KINDS, SyncCounter  # noqa: E402

PATHS = ("sdpa", "routed", "route_all")
BATCH, T = 2, 32


def optimizer_step(model, opt, batches, watcher=None) -> None:
    for x, y in batches:  # gradient accumulation over the micro-batches
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        (loss / len(batches)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if watcher is not None:
        watcher.step()


def count(n_layer: int, micro: int, path: str | None, steps: int = 4) -> list[SyncCounter]:
    """Counts of each of `steps` optimizer steps (path None: the model is not watched)."""
    cfg = GPTConfig(block_size=T, vocab_size=64, n_layer=n_layer, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (micro, BATCH, T + 1), generator=g)
    batches = [(b[:, :-1].clone(), b[:, 1:].clone()) for b in idx]
    per_step = []
    with SyncCounter(device=[model, opt, batches]) as sc:
        w = None
        if path is not None:
            config = fw.WatchConfig(every_n_steps=2, route_all=path == "route_all")
            w = fw.watch(model, config=config)
            if path == "routed":
                for site in w.sites:
                    modes = [fw.Mode.FP32_O, fw.Mode.BETA] + [fw.Mode.STANDARD] * (cfg.n_head - 2)
                    w.set_head_modes(site.name, modes)
        for _ in range(steps):
            sc.reset()
            optimizer_step(model, opt, batches, w)
            snap = SyncCounter()
            snap.counts.update(sc.counts)
            snap.events = list(sc.events)
            snap.mismatches = list(sc.mismatches)
            per_step.append(snap)
        if w is not None:
            if w.monitor_errors_total:
                raise RuntimeError(f"the watcher logged {w.monitor_errors_total} errors")
            w.remove()
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--detail", action="store_true", help="where the monitored syncs come from")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"GPT 4 heads, d 64, T {T}, B {BATCH} per micro-batch, bf16 autocast, AdamW; "
          f"would-be CUDA syncs per optimizer step (flashwatch/synccount.py)")
    print("| L | M | path | not watched | unmonitored | monitored | monitored by kind |")
    print("|---|---|---|---|---|---|---|")
    details = []
    for n_layer in args.layers:
        for micro in args.micro:
            plain = count(n_layer, micro, None, steps=2)[1].total
            for path in args.paths:
                steps = count(n_layer, micro, path)
                mon, unmon = steps[2], steps[3]
                kinds = ", ".join(f"{k} {mon.counts[k]}" for k in KINDS if mon.counts[k])
                print(f"| {n_layer} | {micro} | {path} | {plain} | {unmon.total} | "
                      f"{mon.total} | {kinds or '-'} |", flush=True)
                if mon.mismatches or unmon.mismatches:
                    print(f"  device/host mismatches: {(mon.mismatches + unmon.mismatches)[:5]}")
                details.append((n_layer, micro, path, mon))
    if args.detail:
        for n_layer, micro, path, mon in details:
            print(f"\n## L={n_layer} M={micro} {path}: monitored step\n{mon.table()}")


if __name__ == "__main__":
    main()
