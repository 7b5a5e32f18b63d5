"""torchtitan 0.3.0's tensor parallelism (its parallelize_llama, SequenceParallel on, 2 gloo
ranks), with each SPMD backend it offers: "spmd_types" (the default: plain local weights,
the split declared in each Linear's ShardingConfig; flashwatch/sites/torchtitan.py) and
"partial_dtensor" (DTensor weights), flashwatch attached before or after parallelize.
Every global head against FP64: its tied rows exactly against the q, k the rank's own
SDPA call received (the rank's heads), and its max logit against the unsharded model
built from the same seed (which global head it is)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _helpers import finish_rank
from _trainers import (
    ROWS,
    TITAN_HEADS,
    TITAN_VOCAB,
    forward_backward,
    step_record,
    titan_llama,
    titan_sites,
    torchtitan_on_cpu,
)
from sdpa_calls import head_truth

import flashwatch as fw
from flashwatch.sites import find_sites

WORLD = 2
CASES = [(b, w) for b in ("spmd_types", "partial_dtensor") for w in ("before", "after")]


def _worker(rank, world, init_file, out_dir):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    tokens = torch.randint(0, TITAN_VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    whole = titan_llama()
    whole_calls = forward_backward(whole, tokens)
    sigma = [torch.linalg.matrix_norm(s.wq().double(), ord=2) for s in find_sites(whole)]
    out = {"whole": [head_truth(c)[1] for c in whole_calls], "sigma": sigma}
    with torchtitan_on_cpu():
        for backend, when in CASES:
            model = titan_llama(sharded=True)
            w = fw.watch(model, every_n_steps=1) if when == "before" else None
            dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1,
                                world_size=world, spmd_backend=backend)
            if backend == "spmd_types":
                # parallelize_llama's first step; its fully_shard step raises on CPU even
                # without flashwatch ("When dp_mesh_dims is provided, all parameters must
                # be DTensors on the full SPMD mesh ... plain tensor for parameter
                # 'weight'", torchtitan 0.3.0, torch 2.13.0, gloo)
                dims.build_mesh()
                model.parallelize(dims)
            else:
                parallelize_llama(
                    model, parallel_dims=dims,
                    training=TrainingConfig(mixed_precision_param="float32"),
                    parallelism=ParallelismConfig(tensor_parallel_degree=world,
                                                  spmd_backend=backend),
                    compile_config=CompileConfig(), ac_config=None, dump_folder=out_dir)
            w = w or fw.watch(model, every_n_steps=1)
            out[(backend, when)] = step_record(w, forward_backward(model, tokens))
            w.remove()
    finish_rank(out, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from _helpers import gloo_ranks

    return gloo_ranks(_worker, WORLD, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("backend,when", CASES)
def test_tensor_parallel_heads_are_exact_by_global_index(ranks, backend, when):
    local = TITAN_HEADS // WORLD
    whole, sigma = ranks[0]["whole"], ranks[0]["sigma"]
    for rank, r in enumerate(ranks):
        got = r[(backend, when)]
        assert got["errors"] == 0
        by = {(layer, h): (m, t) for layer, h, m, t, _ in got["heads"]}
        # W^Q σ of every global head: the unsharded model's head of that index
        for layer, h, _, _, s in got["heads"]:
            assert s == pytest.approx(float(sigma[int(layer.split(".")[1])][h]), rel=1e-3)
        assert sorted(by) == sorted((n, h) for n in titan_sites() for h in range(TITAN_HEADS))
        # this rank's own SDPA calls: its heads [rank·8, rank·8 + 8) of each layer
        for name, (tied, mx, rows) in zip(titan_sites(), got["calls"], strict=True):
            assert len(tied) == local
            for i in range(local):
                m, t = by[(name, rank * local + i)]
                assert m == pytest.approx(float(mx[i]), rel=1e-5), (name, i)
                assert round(t * rows) == int(tied[i]), (name, i)
        if backend == "spmd_types":
            continue  # its forward differs from the unsharded model's (closing note)
        # and every global head is the unsharded model's head of that index
        for name, whole_mx in zip(titan_sites(), whole, strict=True):
            for h in range(TITAN_HEADS):
                assert by[(name, h)][0] == pytest.approx(float(whole_mx[h]), rel=1e-4)
    assert all(math.isfinite(m) for _, _, m, _, _ in ranks[0][(backend, when)]["heads"])
    ROWS[("torchtitan 0.3.0", "Llama3, fuse_qkv=True",
          f"TP 2 gloo ranks (SequenceParallel), {backend}, watched {when} parallelize")] = (
        "layers.{i}.attention: fused_qkv, per_group_qkv, 8 of 16 heads per rank",
        "every global head: ties exact vs the rank's SDPA call, W^Q σ ≤ 1e-3 vs the "
        "unsharded model" + ("" if backend == "spmd_types" else ", max logit ≤ 1e-4 vs it")
        + "; 0 errors")


def _fsdp_tp_worker(rank, world, init_file, out_dir):
    """FSDP2 × TP by parallelize_llama (dp_shard 2 × tp 2, partial_dtensor: the spmd_types
    path's fully_shard raises on CPU, above), each dp replica its own batch."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    dp = rank // 2  # tp is innermost in ParallelDims' mesh
    tokens = torch.randint(0, TITAN_VOCAB, (2, 32),
                           generator=torch.Generator().manual_seed(10 + dp))
    out = {}
    with torchtitan_on_cpu():
        for when in ("before", "after"):
            model = titan_llama(sharded=True)
            w = fw.watch(model, every_n_steps=1) if when == "before" else None
            dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1,
                                world_size=world, spmd_backend="partial_dtensor")
            parallelize_llama(
                model, parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param="float32"),
                parallelism=ParallelismConfig(data_parallel_shard_degree=2,
                                              tensor_parallel_degree=2,
                                              spmd_backend="partial_dtensor"),
                compile_config=CompileConfig(), ac_config=None, dump_folder=out_dir)
            # torchtitan sets FSDP2's gradient divide factor 1, reduced as PREMUL_SUM(1),
            # which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): SUM is the
            # same reduction
            for m in model.modules():
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)
            w = w or fw.watch(model, every_n_steps=1)
            out[when] = step_record(w, forward_backward(model, tokens))
            w.remove()
    finish_rank(out, out_dir, rank)


@pytest.fixture(scope="module")
def fsdp_tp_ranks(tmp_path_factory):
    from _helpers import gloo_ranks

    return gloo_ranks(_fsdp_tp_worker, 4, tmp_path_factory.mktemp("fsdp_tp"))


@pytest.mark.parametrize("when", ["before", "after"])
def test_fsdp2_x_tp_heads_sum_the_dp_replicas_by_global_index(fsdp_tp_ranks, when):
    """Each global head is held by one tp rank in each of 2 dp replicas: its tied rows
    are the sum of the two replicas' calls, its max logit their max (FP64 truths of each
    rank's own SDPA call), W^Q σ the unsharded model's; every rank reports the same."""
    local = TITAN_HEADS // 2
    whole = titan_llama()
    sigma = [torch.linalg.matrix_norm(s.wq().double(), ord=2) for s in find_sites(whole)]
    reports = [r[when] for r in fsdp_tp_ranks]
    assert [r["errors"] for r in reports] == [0] * 4
    assert all(r["heads"] == reports[0]["heads"] for r in reports)
    by = {(layer, h): (m, t, s) for layer, h, m, t, s in reports[0]["heads"]}
    for i, name in enumerate(titan_sites()):
        for h in range(TITAN_HEADS):
            tp, j = divmod(h, local)
            truths = [fsdp_tp_ranks[dp * 2 + tp][when]["calls"][i] for dp in range(2)]
            tied = sum(int(t[0][j]) for t in truths)
            rows = sum(t[2] for t in truths)
            m, ratio, s = by[(name, h)]
            assert m == pytest.approx(max(float(t[1][j]) for t in truths), rel=1e-5)
            assert round(ratio * rows) == tied
            assert s == pytest.approx(float(sigma[i][h]), rel=1e-3)
    ROWS[("torchtitan 0.3.0", "Llama3, fuse_qkv=True",
          f"FSDP2 × TP (2 × 2 gloo ranks), partial_dtensor, watched {when} parallelize")] = (
        "layers.{i}.attention: fused_qkv, per_group_qkv, 8 of 16 heads per tp rank",
        "every global head: ties and max logit over both dp replicas exact vs their SDPA "
        "calls, W^Q σ ≤ 1e-3 vs the unsharded model; 0 errors")
