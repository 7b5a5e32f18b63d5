"""Fused QKV under tensor parallelism: Megatron-core's `linear_qkv` (rows per query
group) split by ColwiseParallel over whole groups, 2 gloo ranks, flashwatch attached
after parallelize_module or before it (then narrowed at the first call). Every global
head against the FP64 truth of the unsharded model's SDPA calls, and QK-clip writes
exactly the rows one process writes (tests/standins.py TinyMegatron)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _helpers import batch, finish_rank, gloo_ranks
from sdpa_calls import SdpaCalls, check_heads

import flashwatch as fw
from flashwatch.mitigation import qkclip
from flashwatch.sites import find_sites
from standins import TinyMegatron

ETA = torch.tensor([0.25, 1.0, 1.0, 0.64], dtype=torch.float64)


def _parallelize(model, mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for layer in model.decoder.layers:
        parallelize_module(layer["self_attention"], mesh, {
            "linear_qkv": ColwiseParallel(), "linear_proj": RowwiseParallel()})


def _worker(rank, world, init_file, out_dir):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    x, y = batch(torch.Generator().manual_seed(0), B=2, T=12)
    out = {}
    for when in ("after", "before"):
        torch.manual_seed(0)
        model = TinyMegatron()
        w = fw.watch(model, every_n_steps=1) if when == "before" else None
        _parallelize(model, mesh)
        w = w or fw.watch(model, every_n_steps=1)
        _, loss = model(x, y)
        loss.backward()
        report = w.step()
        out[when] = dict(errors=w.monitor_errors_total, heads=report.heads,
                         sites=[(s.num_heads, s.global_heads, s.head_offset)
                                for s in w.sites])
        w.remove()
    # QK-clip's writes on the rank's site (η of its own heads, as the watcher hands
    # it) land on the global rows one process scales
    for site in find_sites(model):
        own = ETA[site.head_offset:site.head_offset + site.num_heads]
        qkclip.scale_site(site, own, alpha=0.5)
    out["clipped"] = {n: p.full_tensor() for n, p in model.named_parameters()
                      if "linear_qkv" in n}
    finish_rank(out, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return gloo_ranks(_worker, 2, tmp_path_factory.mktemp("fused_tp"))


@pytest.mark.parametrize("when", ["after", "before"])
def test_each_rank_measures_its_query_groups_by_global_head(ranks, when):
    torch.manual_seed(0)
    whole = TinyMegatron()
    x, y = batch(torch.Generator().manual_seed(0), B=2, T=12)
    with SdpaCalls() as calls:
        whole(x, y)
    names = [s.name for s in find_sites(whole)]
    for rank, r in enumerate(ranks):
        got = r[when]
        assert got["errors"] == 0
        assert got["sites"] == [(2, 4, 2 * rank)] * 2  # one group of 2 heads per rank
        report = type("R", (), {"heads": got["heads"]})
        check_heads(report, calls.calls, names, rel=1e-5)


def test_qk_clip_writes_the_rows_one_process_writes(ranks):
    torch.manual_seed(0)
    whole = TinyMegatron()
    for site in find_sites(whole):
        qkclip.scale_site(site, ETA, alpha=0.5)
    want = {n: p.detach() for n, p in whole.named_parameters() if "linear_qkv" in n}
    for r in ranks:
        assert sorted(r["clipped"]) == sorted(want)
        for n, t in want.items():
            torch.testing.assert_close(r["clipped"][n], t, rtol=0, atol=0)


def _packed_worker(rank, world, init_file, out_dir):
    """Hugging Face Phi-3's packed qkv_proj ([Q | K | V], GQA) under its TP plan's
    "colwise_gather_output": ColwiseParallel with the output gathered, so every rank
    computes every head from a weight split by rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from standins import hf_inputs, hf_tiny

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for when in ("after", "before"):
        model, kind = hf_tiny("phi3")
        w = fw.watch(model, every_n_steps=1) if when == "before" else None
        for layer in model.model.layers:
            parallelize_module(layer.self_attn, mesh,
                               {"qkv_proj": ColwiseParallel(output_layouts=Replicate())})
        w = w or fw.watch(model, every_n_steps=1)
        inputs = hf_inputs(kind, B=2, N=12)
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        report = w.step()
        out[when] = dict(errors=w.monitor_errors_total, heads=report.heads)
        w.remove()
    finish_rank(out, out_dir, rank)


@pytest.fixture(scope="module")
def packed_ranks(tmp_path_factory):
    return gloo_ranks(_packed_worker, 2, tmp_path_factory.mktemp("packed_tp"))


@pytest.mark.parametrize("when", ["after", "before"])
def test_packed_qkv_with_gathered_output_is_measured_whole(packed_ranks, when):
    """Was: attach raised on every rank (after), or every head NaN (before). Every rank
    measures every head, each head counted as held by both (ties over the same rows
    twice, divided by 2), and W^Q σ from the rows each rank holds."""
    from standins import hf_inputs, hf_tiny

    model, kind = hf_tiny("phi3")
    sites = find_sites(model)
    sigma = {s.name: torch.linalg.matrix_norm(s.wq().double(), ord=2) for s in sites}
    inputs = hf_inputs(kind, B=2, N=12)
    with SdpaCalls() as calls:
        model(**inputs)
    for r in packed_ranks:
        got = r[when]
        assert got["errors"] == 0
        report = type("R", (), {"heads": got["heads"]})
        check_heads(report, calls.calls, [s.name for s in sites], rel=1e-5)
        for h in got["heads"]:
            assert h.wq_spectral_norm == pytest.approx(float(sigma[h.layer][h.head]),
                                                       rel=1e-3)
