"""Plain PyTorch: a small GPT trained in BF16 autocast with flashwatch attached.

python examples/train_plain.py --steps 200 --out runs/plain
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from flashwatch.report.sinks import ConsoleSink, JsonlSink  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/plain"))
    args = ap.parse_args()

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (4096,))  # use your tokens here

    # The one line: attach flashwatch. It finds the attention layers by itself.
    watcher = fw.watch(model, mitigation="auto", every_n_steps=5,
                       sinks=[JsonlSink(args.out / "flashwatch.jsonl"),
                              ConsoleSink(top=3, every=10)])
    for step in range(args.steps):
        ix = torch.randint(len(data) - 65, (8,))
        x = torch.stack([data[i:i + 64] for i in ix])
        y = torch.stack([data[i + 1:i + 65] for i in ix])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # "cuda" on a GPU
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watcher.step()  # once per optimizer step
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f}")

    torch.save({"model": model.state_dict(), "flashwatch": watcher.state_dict()},
               args.out / "checkpoint.pt")
    print("final head modes:", {k: [m.name for m in v] for k, v in watcher.head_modes().items()})
    watcher.remove()


if __name__ == "__main__":
    main()
