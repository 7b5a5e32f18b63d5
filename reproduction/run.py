"""Train one configuration of the reproduction study (docs/REPRODUCTION.md) and record it.

    python -m reproduction.run --config nope-grammar --arm unmitigated --seed 0 \
        --out runs/repro/nope-grammar/unmitigated-s0

Every configuration tried in the study is in CONFIGS, so each table row of the
document names the command that reruns it. Arms:
  unmitigated  all heads STANDARD; the policy only advises (its first advice = the alert)
  auto         mitigation="auto": flagged heads move to BETA, then FP32_O if needed
  fp32_o       every head FP32_O from step 0 (δ from O kept in FP32)
  beta         every head BETA from step 0 (the paper's fix)
  fp32_delta   the paper's diagnosis: the same forward as unmitigated, but the backward
               takes δ from the FP32 accumulation of O (reproduction/fp32_delta.py);
               paper backend only. The watcher measures SDPA's output here, so its δ
               metrics describe the forward's O, not the δ training used.
  fused        unmitigated, but on the fused FlashAttention-2 arithmetic (backend
               "reference") whatever the configuration's backend: the kernel twin
  qk_clip      per-head QK-clip at τ = 100 after every step (every_n_steps=1, exact max
               logits from the routed kernel), head modes left alone: QK-clip only acts in
               mitigation="auto", so the mode rules are given thresholds they never reach.
Attention runs through the watcher with route_all=True on the configuration's backend
("paper": the BF16 arithmetic of the paper's implementation; "reference": a fused
FlashAttention-2 kernel's arithmetic), so the arms use the same kernel and differ only
in head modes (fp32_delta: only in δ).

The run directory: train.jsonl (step, loss, grad norm, seconds, monitored), the
watcher's flashwatch.jsonl, summary.json (settings, outcome, alert, heads), model.pt
(the final weights).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch.demo import make_corpus
from flashwatch.report.sinks import JsonlSink
from reproduction.fp32_delta import Fp32DeltaAttention, RouteSDPA

ARMS = ("unmitigated", "auto", "fp32_o", "beta", "fp32_delta", "qk_clip", "fused")
QK_CLIP_TAU = 100.0  # Megatron-LM's --qk-clip-threshold default

# Defaults shared by every configuration; a configuration overrides some of them.
BASE = dict(n_layer=4, n_head=4, n_embd=64, block=64, batch=8, position_embedding=False,
            data="grammar", vocab=256, lr=3e-3, min_lr_frac=0.1, warmup=50,
            weight_decay=0.1, betas=(0.9, 0.95), clip=1.0, steps=1500, backend="paper",
            every=5)

# Every configuration tried, in the order tried (docs/REPRODUCTION.md, table 1).
CONFIGS = {
    # The demo's model and data, paper arithmetic.
    "nope-grammar": dict(),
    # Same, fused arithmetic (what a FlashAttention-2 kernel does).
    "nope-grammar-fused": dict(backend="reference"),
    # Hotter: lr 1e-2, no weight decay (nothing pulls W^Q back).
    "nope-grammar-hot": dict(lr=1e-2, weight_decay=0.0),
    # i.i.d. tokens over 16 symbols: once the unigram is learnt the true gradient is
    # zero-mean noise, so a persistent numerical bias is all Adam has to follow.
    "uniform-v16": dict(data="uniform", vocab=16, lr=1e-2, weight_decay=0.0),
    # Repeated random segments over 32 symbols: sharp copy attention onto earlier
    # occurrences, which in a NoPE model have identical keys (exact ties).
    "repeat-v32": dict(data="repeat", vocab=32, lr=1e-2, weight_decay=0.0),
    "repeat-v32-fused": dict(data="repeat", vocab=32, lr=1e-2, weight_decay=0.0,
                             backend="reference"),
    # 256-token rows (4× the keys per row: more ties, larger BF16 running sums in the
    # paper arithmetic), batch 4 to keep the step time near 1 s on one core.
    "long-grammar": dict(block=256, batch=4, steps=1200),
    "long-uniform-v16": dict(block=256, batch=4, steps=1200, data="uniform", vocab=16,
                             lr=1e-2, weight_decay=0.0),
    "long-repeat-v32-hot": dict(block=256, batch=4, steps=1200, data="repeat", vocab=32,
                                lr=1e-2, weight_decay=0.0),
    # As uniform-v16 in the fused arithmetic: is the W^Q growth there numerical?
    "uniform-v16-fused": dict(data="uniform", vocab=16, lr=1e-2, weight_decay=0.0,
                              backend="reference"),
    # 4 symbols: ~16 copies of each token per 64-token row, so most rows are exactly tied.
    "uniform-v4": dict(data="uniform", vocab=4, lr=1e-2, weight_decay=0.0),
    # Pushed towards instability: lr 3e-2, no weight decay, no gradient clipping.
    "nope-grammar-hotter": dict(lr=3e-2, weight_decay=0.0, clip=1e9),
    # Same, fused arithmetic: does the kernel's arithmetic matter for its spikes?
    "nope-grammar-hotter-fused": dict(lr=3e-2, weight_decay=0.0, clip=1e9,
                                      backend="reference"),
    # The paper's models have position embeddings: the same hot setting with them.
    "pe-grammar-hotter": dict(lr=3e-2, weight_decay=0.0, clip=1e9, position_embedding=True),
    "pe-grammar-hotter-fused": dict(lr=3e-2, weight_decay=0.0, clip=1e9,
                                    position_embedding=True, backend="reference"),
    # The fused twin of nope-grammar-hot (lr 1e-2): a milder setting for the gap.
    "nope-grammar-hot-fused": dict(lr=1e-2, weight_decay=0.0, backend="reference"),
    # Benchmark pilot (issue: detection benchmark): between hot (lr 1e-2, clipped: no
    # gap to fused) and hotter (lr 3e-2, unclipped: every seed worse than fused).
    # Fused twins are the arm "fused" from here on.
    "nope-grammar-warm": dict(lr=2e-2, weight_decay=0.0, clip=1e9),
    "nope-grammar-hotter-clip": dict(lr=3e-2, weight_decay=0.0, clip=1.0),
    "pe-grammar-warm": dict(lr=2e-2, weight_decay=0.0, clip=1e9, position_embedding=True),
}

SPIKE_NATS = 1.0  # a spike: the loss EMA rises this far above its best value so far
EMA = 0.95


def settings_for(name: str, overrides: dict | None = None) -> dict:
    if name not in CONFIGS:
        raise ValueError(f"--config {name!r} is not one of {sorted(CONFIGS)}")
    s = dict(BASE)
    s.update(CONFIGS[name])
    s.update(overrides or {})
    return s


def make_data(s: dict, seed: int) -> torch.Tensor:
    """A token stream for the configuration's `data`."""
    if s["data"] == "grammar":  # the demo's byte-level template text (vocab 256)
        return make_corpus(400_000, seed)
    if s["data"] == "uniform":  # i.i.d. tokens: nothing to learn beyond the unigram
        g = torch.Generator().manual_seed(seed)
        return torch.randint(s["vocab"], (400_000,), generator=g)
    if s["data"] == "repeat":  # random segments of 4..16 tokens, each said 2..6 times
        rng = random.Random(seed)
        out: list[int] = []
        while len(out) < 400_000:
            seg = [rng.randrange(s["vocab"]) for _ in range(rng.randint(4, 16))]
            out += seg * rng.randint(2, 6)
        return torch.tensor(out[:400_000], dtype=torch.long)
    raise ValueError(f"data {s['data']!r} is not one of grammar, uniform, repeat")


def lr_at(step: int, s: dict) -> float:
    """Linear warmup, then cosine to min_lr_frac·lr (the paper's schedule, shortened)."""
    if step < s["warmup"]:
        return s["lr"] * (step + 1) / s["warmup"]
    frac = (step - s["warmup"]) / max(1, s["steps"] - s["warmup"])
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return s["lr"] * (s["min_lr_frac"] + (1 - s["min_lr_frac"]) * cos)


def get_batch(data: torch.Tensor, s: dict, gen: torch.Generator):
    """`batch` random windows of `block` tokens and their next-token targets."""
    T = s["block"]
    ix = torch.randint(len(data) - T - 1, (s["batch"],), generator=gen)
    return (torch.stack([data[i:i + T] for i in ix]),
            torch.stack([data[i + 1:i + T + 1] for i in ix]))


def loss_ema(losses: list[float]) -> list[float]:
    """The loss EMA (factor EMA), up to the first non-finite loss (excluded)."""
    out, ema = [], None
    for x in losses:
        if not math.isfinite(x):
            break
        ema = x if ema is None else EMA * ema + (1 - EMA) * x
        out.append(ema)
    return out


def first_spike(losses: list[float], warmup: int) -> int | None:
    """First step after warmup at which the loss is not finite or its EMA is
    SPIKE_NATS above the best EMA so far; None if it never happens."""
    ema, best = loss_ema(losses), math.inf
    for i, e in enumerate(ema):
        if i >= warmup and e > best + SPIKE_NATS:
            return i
        best = min(best, e)
    return len(ema) if len(ema) < len(losses) else None


def run(config: str, arm: str, seed: int, out: Path, overrides: dict | None = None,
        threads: int = 1, stream=sys.stdout, save_every: int = 0,
        stop_after: int | None = None) -> dict:
    """Train one run into `out`; returns its summary. save_every: also save the weights
    every that many steps (model_step{N}.pt); stop_after: stop after that many steps
    without changing the schedule (to look closely at the run before a spike)."""
    if arm not in ARMS:
        raise ValueError(f"--arm {arm!r} is not one of {ARMS}")
    s = settings_for(config, overrides)
    if arm == "fused":
        s["backend"] = "reference"
    if arm == "fp32_delta" and s["backend"] != "paper":
        raise ValueError(f"arm 'fp32_delta' needs the paper backend; configuration "
                         f"{config!r} uses backend {s['backend']!r}")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    gcfg = GPTConfig(block_size=s["block"], vocab_size=s["vocab"], n_layer=s["n_layer"],
                     n_head=s["n_head"], n_embd=s["n_embd"],
                     position_embedding=s["position_embedding"])
    model = GPT(gcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=tuple(s["betas"]),
                            weight_decay=s["weight_decay"])
    data = make_data(s, seed)
    gen = torch.Generator().manual_seed(seed)
    mitigation = "auto" if arm in ("auto", "qk_clip") else "advise"
    clip = dict(qk_clip_threshold=QK_CLIP_TAU, delta_share_threshold=1e9,
                drift_z_threshold=1e9, spectral_growth_threshold=1e9) if arm == "qk_clip" else {}
    watcher = fw.watch(model, sinks=[JsonlSink(out / "flashwatch.jsonl")],
                       mitigation=mitigation, every_n_steps=1 if clip else s["every"],
                       seed=seed, backend=s["backend"], route_all=arm != "fp32_delta", **clip)
    route = RouteSDPA() if arm == "fp32_delta" else contextlib.nullcontext()
    Fp32DeltaAttention.fp32_delta = arm == "fp32_delta"
    if arm in ("fp32_o", "beta"):
        mode = fw.Mode.FP32_O if arm == "fp32_o" else fw.Mode.BETA
        for layer, modes in watcher.head_modes().items():
            watcher.set_head_modes(layer, [mode] * len(modes))
    losses: list[float] = []
    first_alert = None
    spectral: dict[str, list] = {}
    t_start = time.perf_counter()
    times = {"monitored": [], "plain": []}
    with open(out / "train.jsonl", "w", encoding="utf-8") as log:
        for step in range(s["steps"] if stop_after is None else min(stop_after, s["steps"])):
            if save_every and step % save_every == 0:
                torch.save(model.state_dict(), out / f"model_step{step}.pt")
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, s)
            x, y = get_batch(data, s, gen)
            with route, torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            monitored = step % s["every"] == 0
            report = watcher.step()
            dt = time.perf_counter() - t0
            times["monitored" if monitored else "plain"].append(dt)
            if report is not None:
                for h in report.heads:
                    spectral.setdefault(f"{h.layer}/{h.head}", []).append(
                        (report.step, h.wq_spectral_norm))
                advice = [e for e in report.events
                          if e.kind == "mode" and e.reason != "set by user"]
                if advice and first_alert is None:
                    first_alert = {"step": report.step,
                                   "heads": [f"{e.layer}/{e.head}" for e in advice],
                                   "reason": advice[0].reason}
            loss_v = loss.item()
            losses.append(loss_v)
            log.write(json.dumps({"step": step, "loss": loss_v, "grad_norm": gnorm,
                                  "lr": lr_at(step, s), "seconds": dt,
                                  "monitored": monitored}) + "\n")
            if step % 100 == 0:
                print(f"{config} {arm} s{seed} step {step} loss {loss_v:.3f} "
                      f"{(step + 1) / (time.perf_counter() - t_start):.2f} steps/s",
                      file=stream, flush=True)
            if not math.isfinite(loss_v):
                break
    Fp32DeltaAttention.fp32_delta = False
    seconds = time.perf_counter() - t_start
    spike = first_spike(losses, s["warmup"])
    growth = {k: v[-1][1] / v[0][1] for k, v in spectral.items() if v and v[0][1] > 0}
    top = sorted(growth, key=growth.get, reverse=True)[:4]
    flagged = sorted({f"{e.layer}/{e.head}" for e in watcher.events
                      if e.kind == "mode" and e.reason != "set by user"})
    med = {k: (sorted(v)[len(v) // 2] if v else None) for k, v in times.items()}
    summary = {
        "config": config, "arm": arm, "seed": seed, "settings": s, "model": asdict(gcfg),
        "steps_done": len(losses), "seconds": seconds,
        "final_loss_mean_last100": sum(losses[-100:]) / len(losses[-100:]),
        "best_loss_ema": min(loss_ema(losses), default=None),
        "spike_step": spike,
        "first_alert": first_alert,
        "lead_steps": (spike - first_alert["step"]) if spike is not None and first_alert
        else None,
        "flagged_heads": flagged,
        "events": [e.to_dict() for e in watcher.events],
        "wq_growth_top": {k: growth[k] for k in top},
        "wq_growth_median": sorted(growth.values())[len(growth) // 2] if growth else None,
        "flagged_among_top_growth": sorted(set(flagged) & set(top)),
        "median_step_seconds": med,
        "monitored_over_plain": (med["monitored"] / med["plain"])
        if med["monitored"] and med["plain"] else None,
        "monitor_errors_total": watcher.monitor_errors_total,
        "qk_clips_total": sum(e.kind == "qk_clip" and e.applied for e in watcher.events),
        "final_modes": {k: [m.name for m in v] for k, v in watcher.head_modes().items()},
    }
    watcher.remove()
    torch.save(model.state_dict(), out / "model.pt")  # for reproduction.grad_error
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reproduction.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, choices=sorted(CONFIGS))
    p.add_argument("--arm", default="unmitigated", choices=ARMS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, help="override the configuration's step count")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-every", type=int, default=0,
                   help="also save the weights every N steps (model_step{N}.pt)")
    p.add_argument("--stop-after", type=int,
                   help="stop after N steps, keeping the configuration's lr schedule")
    a = p.parse_args(argv)
    overrides = {"steps": a.steps} if a.steps else None
    summary = run(a.config, a.arm, a.seed, a.out, overrides, threads=a.threads,
                  save_every=a.save_every, stop_after=a.stop_after)
    keys = ("config", "arm", "seed", "steps_done", "seconds", "spike_step", "first_alert",
            "lead_steps", "flagged_heads", "wq_growth_top", "monitored_over_plain")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
