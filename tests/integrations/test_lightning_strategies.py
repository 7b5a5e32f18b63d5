"""flashwatch.integrations.lightning under two-process strategies on the CPU: two DDP
ranks end with identical modes; FSDP2 (ModelParallelStrategy) watched after sharding."""

from __future__ import annotations

import os
import socket

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from flashwatch import Mode
from flashwatch.integrations.lightning import FlashWatchCallback
from flashwatch.kernels import dispatch as fw_dispatch
from standins import TiedAttention, leaning_dispatch


class LitTied(pl.LightningModule):
    """Rank 0: a kernel whose O leans positive and a fixed input with loss = sum, so its
    δ error persists in sign. Rank 1: the plain kernel and a new input each step; alone it
    never triggers a switch (tests/test_watcher.py checks that control). lr = 0 keeps
    the weights, and so the planted condition, fixed while optimizer steps still count."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.tied, self.plain = TiedAttention(C=16, tie=True), TiedAttention(C=16)

    def setup(self, stage):
        if self.global_rank == 0:
            # this spawned process only
            fw_dispatch.call_kernel = leaning_dispatch(fw_dispatch.call_kernel, 2e-2)
        self.gen = torch.Generator().manual_seed(self.global_rank)
        self.fixed = torch.randn(2, 8, 16, generator=self.gen)

    def training_step(self, batch, batch_idx):
        x = self.fixed if self.global_rank == 0 else torch.randn(2, 8, 16, generator=self.gen)
        return self.plain(x + self.tied(x)).float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class DumpModes(pl.Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        cb = next(c for c in trainer.callbacks if isinstance(c, FlashWatchCallback))
        torch.save({"modes": cb.watcher.head_modes(),
                    "events": [e.to_dict() for e in cb.watcher.events],
                    "port": cb.watcher.sinks[-1].port},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def test_two_ddp_ranks_end_with_identical_modes(tmp_path):
    with socket.socket() as s:  # a free base port; each rank serves on base + local rank
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    cb = FlashWatchCallback(every_n_steps=1, mitigation="auto", min_history=8, patience=2,
                            verify_steps=8, window=32, prometheus_port=base)
    data = DataLoader(TensorDataset(torch.zeros(60, 1)), batch_size=1)  # 30 steps per rank
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn",
                         precision="bf16-mixed", max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[cb, DumpModes(str(tmp_path))],
                         default_root_dir=tmp_path)
    trainer.fit(LitTied(), data)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert (r0.pop("port"), r1.pop("port")) == (base, base + 1)
    assert r0 == r1
    assert r0["modes"]["tied"] != [Mode.STANDARD] * 2  # the reduced numbers moved both
    assert r0["modes"]["plain"] == [Mode.STANDARD] * 2


def test_fsdp2_model_parallel_strategy_on_two_cpu_processes(tmp_path):
    """FSDP2 through Lightning (`ModelParallelStrategy`, fully_shard in configure_model):
    watched after sharding, W^Q norms of the unsharded weights, identical on both ranks.
    (Lightning's strategy="fsdp", FSDP1, refuses accelerator="cpu".)"""
    import subprocess
    import sys

    job = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fsdp2_job.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, job, str(tmp_path)], check=True, env=env, timeout=600,
                   cwd=tmp_path)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0["errors"] == r1["errors"] == 0
    assert len(r0["reports"]) == 3
    for a, b in zip(r0["reports"], r1["reports"], strict=True):
        a.pop("monitor_seconds"), b.pop("monitor_seconds")
        assert a == b
    for h in r0["reports"][-1]["heads"]:
        want = r0["exact"][h["layer"]][h["head"]]
        assert abs(h["wq_spectral_norm"] - want) <= 1e-3 * want, h
