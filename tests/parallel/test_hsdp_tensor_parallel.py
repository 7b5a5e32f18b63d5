"""HSDP × TP on a 3-D (replicate 2, shard 2, tp 2) mesh, 8 gloo ranks: torchtitan's plan
over mesh["tp"], then fully_shard over mesh["replicate", "shard"] (HSDP): weights
(Replicate(), _StridedShard(0), Shard(0)) outside the forward. Each of the 4 dp replicas
trains on its own batch; every rank reports the same 16 heads, equal to the FP64 truth
on the 4 batches together (tests/scaled_heads.py: each head its own W^Q scale). It used
to be refused by name at attach."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import finish_rank, gloo_ranks
from scaled_heads import EPS, N_LAYERS, VOCAB, H, Stage, batch, full_model, truth

import flashwatch as fw

WORLD = 8


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp = rank // 2  # the dp replica: (replicate, shard) coordinates
    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    for blk in model.layers.values():
        parallelize_module(blk.attention, mesh["tp"], {
            "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
        fully_shard(blk, mesh=mesh["replicate", "shard"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    w = fw.watch(model, config=fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS,
                                              collective_timeout_s=120))
    tokens = batch(10 + dp)
    F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB),
                    tokens[:, 1:].reshape(-1)).backward()
    report = w.step()
    out = dict(errors=w.monitor_errors_total,
               heads=[(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio,
                       h.wq_spectral_norm, h.wq_grad_norm) for h in report.heads])
    w.remove()
    finish_rank(out, out_dir, rank)


def test_hsdp_x_tp_reports_every_head_against_fp64(tmp_path):
    results = gloo_ranks(_worker, WORLD, tmp_path)
    tokens = torch.cat([batch(10 + dp) for dp in range(4)])
    want = truth(full_model(), tokens)
    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB),
                    tokens[:, 1:].reshape(-1)).backward()  # the mean over the 4 batches
    grads = {(f"layers.{i}.attention", h): float(
        model.layers[str(i)].attention.q_proj.weight.grad.view(H, -1).norm(dim=1)[h])
        for i in range(N_LAYERS) for h in range(H)}
    for r in results:
        assert r["errors"] == 0
        assert r["heads"] == results[0]["heads"]
        assert [(layer, h) for layer, h, *_ in r["heads"]] == list(want)
        for layer, h, max_logit, tie, sigma, grad in r["heads"]:
            t = want[(layer, h)]
            assert max_logit == pytest.approx(t["max_logit"], rel=1e-5), (layer, h)
            assert tie == t["tie"], (layer, h)
            assert sigma == pytest.approx(t["sigma"], rel=1e-3), (layer, h)
            assert grad == pytest.approx(grads[(layer, h)], rel=1e-4), (layer, h)
