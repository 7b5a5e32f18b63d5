"""A Lightning fit on 2 CPU processes with FSDP2 (`ModelParallelStrategy`, layers built
and `fully_shard`-ed in configure_model), for tests/integrations/test_lightning_strategies.py.

Run as `python tests/fsdp2_job.py OUT_DIR`: Lightning starts the second process by
running this script again; each rank saves its reports and the exact W^Q norms of the
gathered weights to OUT_DIR/rank<r>.pt.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from examples.gpt import GPT, GPTConfig  # noqa: E402
from flashwatch.integrations.lightning import FlashWatchCallback  # noqa: E402

SMALL = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)


class LitFSDP2(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = None

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**SMALL))
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.model(*batch)[1]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Save(pl.Callback):
    def __init__(self, out_dir, sink):
        self.out_dir, self.sink = out_dir, sink

    def on_train_end(self, trainer, pl_module):
        cb = next(c for c in trainer.callbacks if isinstance(c, FlashWatchCallback))
        exact = {}
        for i, block in enumerate(pl_module.model.transformer.h):
            w = block.attn.c_attn.weight.full_tensor().detach()[:32].double()
            exact[f"model.transformer.h.{i}.attn"] = torch.linalg.matrix_norm(
                w.unflatten(0, (4, 8)), ord=2).tolist()
        torch.save({"reports": [r.to_dict() for r in self.sink.reports], "exact": exact,
                    "errors": cb.watcher.monitor_errors_total},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class ListSink:
    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sink = ListSink()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, SMALL["vocab_size"], (24, 17), generator=g)
    data = DataLoader(TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        callbacks=[FlashWatchCallback(every_n_steps=1, sinks=[sink]), Save(sys.argv[1], sink)],
        default_root_dir=sys.argv[1])
    trainer.fit(LitFSDP2(), data)
