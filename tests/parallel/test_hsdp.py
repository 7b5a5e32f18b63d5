"""HSDP (fully_shard on a 2-D mesh: replicate × shard): every head measured on every
rank's own batch, reduced over the 4 replicas of the data, equal to one process on the
global batch.

Four gloo ranks hold the 4-layer model of tests/scaled_heads.py with each block
fully_shard-ed over a (replicate 2, shard 2) mesh (weights are DTensors
(Replicate(), Shard(0))); each rank trains one BF16-autocast step on its own batch.
One process training the same model on the four batches at once is the truth.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import gloo_ranks
from scaled_heads import EPS, N_LAYERS, VOCAB, Stage, batch, full_model

import flashwatch as fw


def _heads(model, tokens) -> tuple[int, list]:
    w = fw.watch(model, config=fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS,
                                              collective_timeout_s=60))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    r = w.step()
    errors = w.monitor_errors_total
    w.remove()
    return errors, [(h.layer, h.head, h.delta_error_sum, h.delta_error_rows,
                     h.tied_rowmax_ratio, h.attention_max_logit, h.wq_spectral_norm)
                    for h in r.heads]


def _hsdp(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    placements = tuple(model.layers["0"].attention.q_proj.weight.placements)
    errors, heads = _heads(model, batch(100 + rank))
    torch.save({"errors": errors, "heads": heads, "placements": str(placements)},
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_hsdp_reports_what_one_process_reports_on_the_global_batch(tmp_path):
    got = gloo_ranks(_hsdp, 4, tmp_path)
    torch.set_num_threads(1)
    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    errors, want = _heads(model, torch.cat([batch(100 + r) for r in range(4)]))
    assert errors == 0
    for rank, r in enumerate(got):
        assert "Replicate" in r["placements"] and "Shard" in r["placements"]
        assert r["errors"] == 0, rank
        assert [h[:2] for h in r["heads"]] == [h[:2] for h in want]
        for a, b in zip(r["heads"], want, strict=True):
            assert a[3] == b[3] and a[4] == b[4], (rank, a, b)  # rows, ties: exact counts
            assert a[2] == pytest.approx(b[2], rel=1e-4, abs=1e-9), (rank, a, b)
            assert a[5] == pytest.approx(b[5], rel=1e-6), (rank, a, b)
            assert a[6] == pytest.approx(b[6], rel=1e-3), (rank, a, b)
