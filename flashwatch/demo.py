"""`flashwatch demo`: a small GPT trained on CPU in BF16 autocast, everything switched on.

The run directory it leaves (also after Ctrl-C):
  flashwatch.jsonl   one StepReport per monitored step (JsonlSink)
  train.jsonl        one line per optimizer step: step, loss, seconds
  watcher_state.pt   Watcher.state_dict(), for resuming
  head_modes.json    the final mode of every head
  summary.json       settings, steps done, how it ended, flagged heads and events
`flashwatch report RUN_DIR` turns it into plots and a Markdown summary.

Data: byte-level text generated from a seeded template grammar with heavy repetition
(no download). The model has no position embedding, so repeated tokens make identical
keys and rows with tied maxima occur.
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

import flashwatch as fw
from flashwatch.report.sinks import ConsoleSink, JsonlSink

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "a", "big",
         "red", "old", "and", "then", "it", "slept", "barked", "again"]


def make_corpus(n_bytes: int, seed: int) -> torch.Tensor:
    """Seeded sentences from a tiny grammar, as bytes (vocab 256)."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        s = " ".join(words) + ". " + ("again " * rng.randint(0, 3))
        parts.append(s)
        size += len(s)
    return torch.tensor(list("".join(parts).encode()[:n_bytes]), dtype=torch.long)


def run_demo(*, steps: int, seed: int, out: Path, port: int | None, mitigation: str,
             every: int, batch: int = 8, block: int = 64,
             lr: float = 3e-3, print_every: int = 10, stream=None) -> dict:
    """Train, watch, write the run directory; returns the summary dict."""
    GPT, GPTConfig = _example_gpt()
    stream = stream or sys.stdout
    # The exporter binds first: a taken port then stops the demo before the run directory
    # exists, so no empty directory is left behind.
    exporter = _exporter(port) if port else None
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # No position embedding: the repeated bytes then give identical keys, hence rows with
    # tied maxima (10-60 % of sampled rows here), the condition flashwatch watches for.
    cfg = GPTConfig(block_size=block, vocab_size=256, n_layer=4, n_head=4, n_embd=64,
                    position_embedding=False)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = make_corpus(200_000, seed)
    gen = torch.Generator().manual_seed(seed)
    sinks = [JsonlSink(out / "flashwatch.jsonl"), ConsoleSink(top=5, every=10, stream=stream)]
    if exporter is not None:
        sinks.append(exporter)
    watcher = fw.watch(model, sinks=sinks, mitigation=mitigation, every_n_steps=every,
                       seed=seed)
    summary = {"settings": dict(steps=steps, seed=seed, mitigation=mitigation, every=every,
                                batch=batch, block=block, lr=lr, port=port,
                                model=asdict(cfg)),
               "steps_done": 0, "ended": "running"}
    print(f"flashwatch demo: {steps} steps, GPT {cfg.n_layer}×{cfg.n_head} heads, bf16 "
          f"autocast on CPU, mitigation={mitigation}; run directory {out}", file=stream)
    if exporter is not None:
        print(f"Prometheus metrics: http://127.0.0.1:{exporter.port}/metrics", file=stream)
    data.to(torch.uint16).numpy().tofile(out / "corpus.bin")  # `diagnose --data`, nanoGPT's
    save = _Checkpoints(model, asdict(cfg), out, steps)
    t_start = time.perf_counter()
    try:
        _train(model, opt, watcher, lambda: _batch(data, block, batch, gen), steps=steps,
               log_path=out / "train.jsonl", summary=summary, print_every=print_every,
               stream=stream, on_step=save)
        if summary["ended"] == "running":
            summary["ended"] = "completed"
    except KeyboardInterrupt:
        summary["ended"] = "interrupted"
        print("\ninterrupted: writing the run directory", file=stream)
    finally:
        _finish(watcher, out, summary, time.perf_counter() - t_start)
    _print_next_steps(out, exporter, stream)
    return summary


class PortUnavailable(RuntimeError):
    """The demo's exporter port cannot be bound; the message is one line for the CLI."""


def _exporter(port: int):
    """A PrometheusSink on 127.0.0.1:port; PortUnavailable naming the CLI's --port when the
    port is taken or not ours to bind."""
    from flashwatch.integrations.prometheus import PrometheusSink

    try:
        return PrometheusSink(port=port, local_rank=0, rank=0)
    except (RuntimeError, OSError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
        if not isinstance(cause, OSError):
            raise
        reason = getattr(cause, "strerror", None) or str(cause)
        raise PortUnavailable(
            f"port {port} for the Prometheus exporter: {reason}; pass another with "
            f"--port N, or --port 0 to run without the exporter") from e


def _batch(data: torch.Tensor, block: int, batch: int,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of `block` bytes and the same windows one byte on."""
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
    inputs = torch.stack([data[i:i + block] for i in ix])
    targets = torch.stack([data[i + 1:i + block + 1] for i in ix])
    return inputs, targets


class _Checkpoints:
    """The model in nanoGPT's format (ckpt_<step>.pt, the step zero-padded so a shell glob
    lists them oldest first) CHECKPOINTS times over the run, the last at its end:
    `flashwatch diagnose runs/demo-*/ckpt_*.pt --data runs/demo-*/corpus.bin`."""

    count = 4

    def __init__(self, model, model_args: dict, out: Path, steps: int):
        self.model, self.args, self.out = model, model_args, out
        self.every = max(1, steps // self.count)
        self.last = steps

    def __call__(self, done: int) -> None:
        if done % self.every == 0 or done == self.last:
            torch.save({"model_args": self.args, "iter_num": done,
                        "model": self.model.state_dict()}, self.out / f"ckpt_{done:06d}.pt")


def _train(model, opt, watcher, next_batch, *, steps: int, log_path: Path, summary: dict,
           print_every: int, stream, on_step=None) -> None:
    """The optimizer steps: one line in train.jsonl each, progress every print_every.
    Ends early on Ctrl-C (KeyboardInterrupt, between two steps) or a non-finite loss."""
    t_start = time.perf_counter()
    stop = _StopOnSigint()
    with stop, open(log_path, "a", encoding="utf-8") as log:
        for step in range(steps):
            if stop.requested:
                raise KeyboardInterrupt
            t0 = time.perf_counter()
            x, y = next_batch()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            watcher.step()
            dt = time.perf_counter() - t0
            loss_v = loss.item()
            log.write(json.dumps({"step": step, "loss": loss_v, "seconds": dt}) + "\n")
            log.flush()
            summary["steps_done"] = step + 1
            if on_step is not None:
                on_step(step + 1)
            if step % print_every == 0 or step == steps - 1:
                rate = (step + 1) / (time.perf_counter() - t_start)
                print(_progress(step, steps, loss_v, rate, watcher), file=stream)
            if not math.isfinite(loss_v):
                summary["ended"] = "loss not finite"
                return


def _progress(step: int, steps: int, loss: float, rate: float, watcher) -> str:
    """A progress bar, the loss, steps per second and how many heads left STANDARD."""
    modes = sum(m != fw.Mode.STANDARD for ms in watcher.head_modes().values() for m in ms)
    done = int(20 * (step + 1) / steps)
    return (f"[{'#' * done}{'.' * (20 - done)}] "
            f"step {step + 1:>5}/{steps}  loss {loss:.3f}  "
            f"{rate:.2f} steps/s  heads not STANDARD: {modes}")


class _StopOnSigint:
    """Ctrl-C ends the demo between two steps: the first SIGINT sets a flag the loop
    reads, a second one interrupts at once. A KeyboardInterrupt raised wherever the
    signal lands can be swallowed (a finalizer or weakref callback running at that
    moment only prints "Exception ignored"), which left the demo running."""

    def __init__(self):
        self.requested = False
        self._old = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _example_gpt():
    """The demo's model: flashwatch/nanogpt.py."""
    from flashwatch.nanogpt import GPT, GPTConfig

    return GPT, GPTConfig


def _finish(watcher, out: Path, summary: dict, seconds: float) -> None:
    summary["seconds"] = seconds
    summary["monitor_errors_total"] = watcher.monitor_errors_total
    summary["events"] = [e.to_dict() for e in watcher.events]
    modes = {layer: [m.name for m in ms] for layer, ms in watcher.head_modes().items()}
    torch.save(watcher.state_dict(), out / "watcher_state.pt")
    (out / "head_modes.json").write_text(json.dumps(modes, indent=2) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    watcher.remove()


def _print_next_steps(out: Path, exporter, stream) -> None:
    print(f"\nrun directory: {out}\n"
          f"  flashwatch.jsonl, train.jsonl, watcher_state.pt, head_modes.json, summary.json,\n"
          f"  ckpt_<step>.pt (the model), corpus.bin (its data)\n"
          f"plots and a summary:  flashwatch report {out}\n"
          f"every head, exactly:  flashwatch diagnose {out}/ckpt_*.pt --data "
          f"{out}/corpus.bin", file=stream)
    if exporter is not None:
        print("Prometheus and Grafana: `flashwatch dashboards --out DIR` writes the scrape "
              "job (set its target to 127.0.0.1:<port>),\nthe alert rules and the Grafana "
              "dashboard with their setup steps",
              file=stream)
