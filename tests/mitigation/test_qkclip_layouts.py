"""flashwatch/mitigation/qkclip.py, which rows it scales: q/k biases with their rows, each
head's own q and k rows in fused layouts (GPT-NeoX, Falcon, Phi-3), QK-norm layers refused and left
alone, DTensor shards scaled locally."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _helpers import llama_with_qk_bias, qk_gpt
from torch.overrides import TorchFunctionMode

import flashwatch as fw
from flashwatch.mitigation import qkclip
from flashwatch.sites import find_sites
from standins import hf_inputs, hf_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_clip_scales_the_bias_with_its_rows():
    # q = W x + b: q scales by η^α only if b does; a zero input isolates b.
    torch.manual_seed(1)
    model = llama_with_qk_bias()
    site = find_sites(model)[0]
    eta = torch.tensor([0.25, 1.0, 1.0, 0.64], dtype=torch.float64)
    q_before = site.module.q_proj(torch.randn(3, site.d_model)).detach()
    xin = torch.randn(3, site.d_model)
    q0, k0 = site.module.q_proj(xin).detach(), site.module.k_proj(xin).detach()
    qkclip.scale_site(site, eta, alpha=0.5)
    q1, k1 = site.module.q_proj(xin).detach(), site.module.k_proj(xin).detach()
    D = site.head_dim
    want_q = q0 * eta.sqrt().float().repeat_interleave(D)
    want_k = k0 * torch.tensor([0.5, 0.8]).repeat_interleave(D)  # min η of each group, ^0.5
    torch.testing.assert_close(q1, want_q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(k1, want_k, rtol=1e-6, atol=1e-7)
    assert q_before.shape == q1.shape


def _hf_steps(model, w, inputs, steps):
    reports = []
    for _ in range(steps):
        out = model(**inputs, labels=inputs["input_ids"])
        out.loss.backward()
        model.zero_grad()
        reports.append(w.step())
    return reports


def test_qk_norm_layers_are_refused_and_left_alone(caplog):
    """Qwen3's q_norm/k_norm undo any scaling of W^Q, W^K (issue 28: 240 clips in 30
    steps, W^Q 25× smaller, max logit unmoved): refused once per head, never scaled."""
    model, kind = hf_tiny("qwen3")
    inputs = hf_inputs(kind, B=2, N=12)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    w = fw.watch(model, every_n_steps=1, mitigation="auto", qk_clip_threshold=0.05)
    reports = _hf_steps(model, w, inputs, 3)
    w.remove()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    events = [e for r in reports for e in r.events if e.kind == "qk_clip"]
    assert events and not any(e.applied for e in events)
    assert all("q_norm" in e.reason and "k_norm" in e.reason for e in events)
    assert len({(e.layer, e.head) for e in events}) == len(events)  # once per head
    assert reports[-1].qk_clips_total == 0
    assert sum("undoes any scaling" in r.message for r in caplog.records) == 2  # per layer


class _QKV(TorchFunctionMode):
    """q, k, v of the first SDPA call (layer 0), as the model passes them."""

    def __init__(self):
        super().__init__()
        self.qkv = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and self.qkv is None:
            self.qkv = [t.detach().double() for t in args[:3]]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["gpt_neox", "falcon_new", "phi3"])
def test_fused_layouts_scale_each_heads_own_q_and_k_rows(arch):
    """Per-head interleaved (GPT-NeoX), per-group (Falcon's new architecture) and
    [Q | K | V] with grouped K (Phi-3): q of head h × η_h^α, k × its K head's η^(1−α),
    v untouched, read at the SDPA call (rotary is linear, so it keeps the factors)."""
    model, kind = hf_tiny(arch)
    for p in model.parameters():  # make biases count where the layer has them
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.5)
    site = find_sites(model)[0]
    inputs = hf_inputs(kind, B=2, N=6)
    runs = []
    for eta in (None, torch.tensor([0.25, 1.0, 1.0, 0.64], dtype=torch.float64)):
        if eta is not None:
            qkclip.scale_site(site, eta, alpha=0.5)
        with torch.no_grad(), _QKV() as cap:
            model(**inputs)
        runs.append(cap.qkv)
    (q0, k0, v0), (q1, k1, v1) = runs
    group = site.num_heads // site.num_kv_heads
    k_eta = qkclip.kv_factors(eta, site.num_kv_heads)
    if k0.shape[1] == site.num_heads:  # K broadcast or repeated to the query heads
        k_eta = k_eta.repeat_interleave(group)
    torch.testing.assert_close(q1, q0 * eta.sqrt().view(1, -1, 1, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k1, k0 * k_eta.sqrt().view(1, -1, 1, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v1, v0, rtol=0, atol=0)


def _dtensor_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    result = {}
    # Rows of a fused QKV Linear (nanoGPT) sharded over ranks, an odd count of rows per
    # shard boundary so a head straddles the two shards (3C = 48, head_dim 4: 6 heads
    # per shard of 24 rows, boundary inside no head; 3C = 45 below splits one).
    for rows in (48, 45):
        full = torch.randn(rows, 8)
        dt = distribute_tensor(full.clone(), mesh, [Shard(0)])
        factors = torch.linspace(0.3, 1.0, rows - 5, dtype=torch.float64)
        qkclip.write(qkclip._mul_channels(dt, 0, 3, factors))
        result[rows] = dt.full_tensor()
    # FSDP2: sites found before sharding (after works too: tests/parallel/test_distributed.py);
    # fully_shard keeps the modules, the parameters become DTensors sharded on dim 0.
    try:
        from torch.distributed.fsdp import fully_shard

        model = qk_gpt()
        sites = find_sites(model)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        eta = torch.tensor([0.25, 1.0, 0.5, 1.0], dtype=torch.float64)
        for site in sites:
            qkclip.scale_site(site, eta, 0.5)
        result["fsdp"] = {n: p.full_tensor() for n, p in model.named_parameters()
                          if "c_attn" in n}
    except Exception as e:  # noqa: BLE001 (reported to the test, which decides)
        result["fsdp_error"] = repr(e)
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "dtensor.pt"))
    # The FSDP model and DTensors freed before the group goes, and both ranks done: rank
    # 1 aborted in teardown ("terminate called without an active exception", SIGABRT)
    # in 2 of 4 full runs on a loaded 2-core machine before this; the cause was not
    # established, this only makes the teardown orderly.
    import gc

    result = model = dt = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def test_dtensor_shards_are_scaled_locally(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_dtensor_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    got = torch.load(tmp_path / "dtensor.pt", weights_only=False)
    torch.manual_seed(0)
    for rows in (48, 45):
        full = torch.randn(rows, 8)
        factors = torch.linspace(0.3, 1.0, rows - 5, dtype=torch.float64)
        full[3:rows - 2] *= factors.float().view(-1, 1)
        assert torch.equal(got[rows], full), rows
    assert "fsdp_error" not in got, got.get("fsdp_error")
    model = qk_gpt()
    eta = torch.tensor([0.25, 1.0, 0.5, 1.0], dtype=torch.float64)
    for site in find_sites(model):
        qkclip.scale_site(site, eta, 0.5)
    for n, p in model.named_parameters():
        if "c_attn" in n:
            assert torch.equal(got["fsdp"][n], p.detach()), n
