"""Lightning: the same small GPT with FlashWatchCallback, BF16 mixed precision on CPU.

python examples/train_lightning.py --steps 200 --out runs/lightning
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from examples.gpt import GPT, GPTConfig  # noqa: E402
from flashwatch.integrations.lightning import FlashWatchCallback  # noqa: E402


class LitGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64))

    def training_step(self, batch, batch_idx):
        _, loss = self.model(*batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/lightning"))
    args = ap.parse_args()

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (512, 65))  # use your tokens here
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8,
                      shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu", precision="bf16-mixed", max_steps=args.steps,
        default_root_dir=args.out, log_every_n_steps=min(10, args.steps),
        enable_progress_bar=False,
        logger=pl.loggers.CSVLogger(args.out),
        # The one line: flashwatch as a callback; WatchConfig fields are its arguments.
        callbacks=[FlashWatchCallback(mitigation="auto", every_n_steps=2)],
    )
    trainer.fit(LitGPT(), data)
    print("logged to", trainer.logger.log_dir)


if __name__ == "__main__":
    main()
