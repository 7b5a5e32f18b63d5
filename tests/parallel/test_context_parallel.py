"""Context parallelism over the sequence ("ring" CP), on gloo ranks. torch's own
context_parallel cannot run on CPU ranks (torch 2.13: "aten._scaled_dot_product_flash_
attention_for_cpu.default does not have a sharding strategy registered"), so:

- all-gather CP, the stand-in: each rank holds its shard of the sequence, all-gathers K
  and V over the CP group (autograd-aware) and calls SDPA with its query rows against
  every key, masked causally at their global positions. Gradients are averaged over the
  group (DDP), the loss each rank's own mean. flashwatch needs no CP code: a rank measures
  its rows; ties and rows add and max logits max over the ranks, Σc is scaled as the
  averaged gradient is, as over data-parallel ranks. Against the FP64 truth of one
  process on the whole sequence.
- torch's ring CP hands SDPA q, k, v as DTensors split over the sequence: a call holds
  this rank's keys only, the others' come in blocks inside the op. Refused by name: one
  error per layer and the reason, never numbers from a rank's own keys.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import gloo_ranks
from sdpa_calls import SdpaCalls, check_heads
from torch import nn

import flashwatch as fw

D, H, VOCAB, N, B = 32, 4, 64, 16, 3
LAYERS = ["blocks.0.attn", "blocks.1.attn"]


class Attention(nn.Module):
    """q, k, v projections and SDPA; under a CP group K and V are gathered first."""

    def __init__(self, cp_group=None, ring_mesh=None):
        super().__init__()
        self.num_heads, self.head_dim = H, D // H
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D, D, bias=False) for _ in range(4))
        self.cp_group, self.ring_mesh = cp_group, ring_mesh

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, H, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.ring_mesh is not None:
            o = _ring(q, k, v, self.ring_mesh)
        else:
            start = 0
            if self.cp_group is not None:
                from torch.distributed.nn.functional import all_gather

                k, v = (torch.cat(all_gather(t.contiguous(), group=self.cp_group), dim=2)
                        for t in (k, v))
                start = dist.get_rank(self.cp_group) * n  # this shard's global positions
            # causal at global positions; the same masked kernel with and without CP, so
            # O rounds alike (is_causal's kernel rounds otherwise: Σc, a sum of rounding
            # errors, moved 16 %)
            rows = torch.arange(start, start + n)[:, None]
            mask = torch.arange(k.shape[2])[None, :] <= rows
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, D))


def _ring(q, k, v, mesh):
    """What a model under torch's ring CP calls: SDPA on DTensors split over the
    sequence. On a CPU the op has no sharding rule and raises; the stand-in for the
    ring kernel a GPU runs is then causal attention written out (no second SDPA call)."""
    from torch.distributed.tensor import DTensor, Shard

    dq, dk, dv = (DTensor.from_local(t, mesh, [Shard(2)]) for t in (q, k, v))
    try:
        return F.scaled_dot_product_attention(dq, dk, dv, is_causal=True).to_local()
    except NotImplementedError:
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        return s.softmax(-1) @ v


class Block(nn.Module):
    def __init__(self, **cp):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = Attention(**cp)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Model(nn.Module):
    def __init__(self, **cp):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(**cp) for _ in LAYERS])
        self.head = nn.Linear(D, VOCAB)
        with torch.no_grad():  # larger logits: heads differ, max logits well above 0
            for blk in self.blocks:
                blk.attn.q_proj.weight.mul_(3.0)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (B, N + 1), generator=g)


def _step(model, w, tokens):
    """One BF16-autocast step on `tokens` (inputs, targets) with the mean loss; the
    report and the SDPA calls of the forward."""
    with SdpaCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return w.step(), seen.calls


def _cp_worker(rank, world, init_file, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    # K/V exchanged on a group of their own: all_gather's backward (an all_to_all) on
    # DDP's group would interleave with DDP's asynchronous all_reduce of the gradients
    cp_group = dist.new_group(list(range(world)))
    model = DDP(Model(cp_group=cp_group))  # the gradient averaged over the CP ranks
    w = fw.watch(model, every_n_steps=1, rows_per_head="all")
    tokens = _tokens()
    n = N // world
    mine = tokens[:, rank * n: rank * n + n + 1]  # its rows, and their next tokens
    report, _ = _step(model, w, mine)
    torch.save(dict(heads={(h.layer, h.head): h for h in report.heads},
                    errors=w.monitor_errors_total), os.path.join(out_dir, f"rank{rank}.pt"))
    w.remove()
    del model, w
    import gc

    gc.collect()  # the DDP reducer before the group (tests/parallel/test_distributed.py)
    dist.barrier()
    dist.destroy_process_group()


def test_all_gather_context_parallel_is_measured_over_the_whole_sequence(tmp_path):
    ranks = gloo_ranks(_cp_worker, 2, tmp_path)
    alone = Model()
    w = fw.watch(alone, every_n_steps=1, rows_per_head="all")
    one, calls = _step(alone, w, _tokens())
    w.remove()
    assert ranks[0]["errors"] == ranks[1]["errors"] == 0
    got = ranks[0]["heads"]
    assert got.keys() == ranks[1]["heads"].keys()
    for key, h in got.items():  # one reduced report on both ranks
        assert h.to_dict() == pytest.approx(ranks[1]["heads"][key].to_dict(), nan_ok=True)
    # every head against FP64 on the whole sequence: max logit, ties over all B·N rows
    report = type("R", (), {"heads": list(got.values())})
    check_heads(report, calls, LAYERS, rel=1e-5)
    # Σc, the sum over rows, at the scale of one process on the whole sequence (the same
    # averaged gradient). The last layer's dO comes from each rank's own loss, the same
    # arithmetic as one process: equal. An earlier layer's dO also gathers the other
    # rank's loss through the all-gathered K/V (all_gather's backward sums in another
    # order), and Σc, a signed sum of BF16 rounding errors, moves with it: 0.91-1.16
    # here, where a wrong scale would be 2 or 0.5.
    last = LAYERS[-1]
    for h in one.heads:
        mine = got[(h.layer, h.head)]
        assert abs(h.delta_error_sum) > 0
        rel = 1e-6 if h.layer == last else 0.25
        assert mine.delta_error_sum == pytest.approx(h.delta_error_sum, rel=rel), h
        assert mine.wq_spectral_norm == pytest.approx(h.wq_spectral_norm, rel=1e-5)


def test_ring_context_parallel_is_refused_by_name(tmp_path, caplog):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = Model(ring_mesh=init_device_mesh("cpu", (1,)))
        w = fw.watch(model, every_n_steps=1)
        with caplog.at_level("WARNING", logger="flashwatch"):
            report, _ = _step(model, w, _tokens())
        errors = w.monitor_errors_total
        w.remove()
    finally:
        dist.destroy_process_group()
    assert errors == len(LAYERS)  # one per layer that measured nothing, with the reason
    assert all(math.isnan(h.attention_max_logit) for h in report.heads)
    assert "split over the sequence" in caplog.text
