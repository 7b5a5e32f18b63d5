"""`flashwatch diagnose CHECKPOINT [CHECKPOINT ...] --data DATA`: load, measure, report.

Checkpoints are measured one after another on the same batches (one model in memory
at a time), oldest first, so growth between them is per head on identical rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from flashwatch.diagnosis.diagnose import diagnose
from flashwatch.diagnosis.load import (
    context_length,
    describe,
    load_checkpoint,
    load_tokens,
    make_batches,
)
from flashwatch.diagnosis.rank import VERDICTS, growth, rank
from flashwatch.diagnosis.report import write_report

MAX_BLOCK = 1024  # default tokens per row: GPT-2's context
SHOWN = 5  # heads printed to the terminal
DEFAULT_OBJECTIVE = "next-token cross-entropy"


def run_diagnose(args: argparse.Namespace) -> list[Path]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    out = args.out or Path("runs") / time.strftime("diagnose-%Y%m%d-%H%M%S")
    results, batches = [], None
    layers = parse_layers(args.layers) if getattr(args, "layers", None) else None
    for spec in args.checkpoints:
        loaded = load_checkpoint(spec, device, getattr(args, "model", None))
        model = loaded.model
        if batches is None:
            tokens = load_tokens(args.data, spec, model)
            block = args.block or min(MAX_BLOCK, context_length(model) or MAX_BLOCK,
                                      tokens.shape[-1] - 1)
            batches = make_batches(tokens, args.batches, args.batch_size, block, args.seed)
        result = diagnose(model, batches, dtype=dtype, tau=args.tau, name=describe(spec),
                          loss_fn=loaded.loss_fn, layers=layers)
        results.append(result | loaded.describe())
        del model, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    grown = growth(results)
    if grown:  # the last checkpoint's verdicts also weigh W^Q growth against the layer
        last = results[-1]
        last["heads"] = rank(last["heads"], last["batches"], last["tau"], grown)
    written = write_report(results, out, grown)
    for r in results:
        _summary(r, sys.stdout, shown=SHOWN if r is results[-1] else 0)
    return written


def parse_layers(text: str) -> list[int]:
    """"0,5-7" -> [0, 5, 6, 7]; ValueError naming the bad part."""
    out = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"--layers {text!r}: {part!r} is not an index or a range "
                             "a-b; e.g. --layers 0,5-7") from None
    return out


def _summary(result: dict, stream, shown: int) -> None:
    heads = result["heads"]
    counts = {v: sum(h["verdict"] == v for h in heads) for v in VERDICTS[:3]}
    what = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    print(f"{result['name']}: {sum(counts.values())} of {len(heads)} heads flagged"
          f"{f' ({what})' if what else ''}; {result['batches']} batches, "
          f"{result['seconds']:.1f} s; {result.get('model_class', 'model')} from "
          f"{result.get('checkpoint_kind', 'memory')}", file=stream)
    if result.get("objective", DEFAULT_OBJECTIVE) != DEFAULT_OBJECTIVE:
        print(f"  objective: {result['objective']}", file=stream)
    for h in heads[:shown]:
        print(f"  #{h['rank']} {h['layer']}/{h['head']} {h['verdict']}: {h['evidence']}",
              file=stream)
        if h["verdict"] != "ok":
            print(f"      → {h['recommendation']}", file=stream)
