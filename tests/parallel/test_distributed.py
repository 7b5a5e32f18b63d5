"""flashwatch/parallel/power.py (and sharding.py's rows): W^Q spectral norms of sharded
weights, on 2 gloo ranks:
a DTensor q_proj whose shard boundary splits a head, FSDP2 `fully_shard` with the
watcher attached before or after sharding, and DDP; DDP and FSDP2 under torch.compile."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch.parallel import power
from flashwatch.parallel import sharding as fw_dist
from flashwatch.sites import find_sites

SMALL = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)


class QKVAttention(nn.Module):
    """Hugging Face layout, 3 heads of 5: q_proj has 15 rows, split 8 | 7 over 2 ranks,
    so head 1 (rows 5..9) straddles the shard boundary."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(12, 15) for _ in range(3))
        self.num_heads, self.head_dim = 3, 5


def _exact(w: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(w.double(), ord=2)


def _batch(seed, B=4, T=16):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, SMALL["vocab_size"], (B, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _close(dist) -> None:
    """Destroy the process group once the caller dropped its DDP model: a DDP Reducer
    freed after destroy_process_group() joins a gloo thread that waits for the GIL its
    destructor holds (hung a fresh `make test` once)."""
    import gc

    gc.collect()
    dist.destroy_process_group()


def _train(model, w, steps, rank):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reports = []
    for i in range(steps):
        x, y = _batch(100 * i + rank)  # other data on each rank
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reports.append(w.step())
    return reports


def _sigmas(report):
    return {(h.layer, h.head): h.wq_spectral_norm for h in report.heads}


def _wq_exact(model):
    """Exact W^Q norms per (layer, head) from the gathered weights."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "c_attn"):
            w = mod.c_attn.weight
            w = w.full_tensor() if fw_dist.is_dtensor(w) else w
            C = w.shape[1]
            for h, s in enumerate(_exact(w[:C].detach().unflatten(0, (4, C // 4)))):
                out[(name.removeprefix("module."), h)] = float(s)
    return out


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    result = {}

    # A DTensor q_proj: local rows, partial sums, one all_reduce per iteration.
    torch.manual_seed(0)
    attn = QKVAttention()
    site = find_sites(attn)[0]
    full = attn.q_proj.weight.detach().clone()
    attn.q_proj.weight = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    rows, head, _ = fw_dist.local_wq_rows(site)
    result["rows"] = head.tolist()
    sigma, v = power.spectral_norm(site, None, 4)
    result["dtensor"] = (sigma, _exact(full.unflatten(0, (3, 5))))
    result["warm"] = power.spectral_norm(site, v * 0.5 + 0.1, 4)[0]

    # GPT-2's Conv1D shards W^Q's columns: the gathering fallback, found after sharding.
    import standins

    torch.manual_seed(0)
    gpt2 = standins.TinyGPT2(standins.GPT2Config())
    attn2 = gpt2.transformer.h[0].attn
    full2 = attn2.c_attn.weight.detach().clone()
    attn2.c_attn.weight = nn.Parameter(distribute_tensor(full2, mesh, [Shard(0)]))
    site2 = next(s for s in find_sites(gpt2) if s.module is attn2)
    assert fw_dist.local_wq_rows(site2) is None
    C, H = full2.shape[0], attn2.num_heads
    result["conv1d"] = (power.spectral_norm(site2, None, 4)[0],
                        _exact(full2.T[:C].unflatten(0, (H, C // H))))

    # FSDP2, the watcher attached before and after fully_shard.
    for when in ("before", "after"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        w = fw.watch(model, every_n_steps=1) if when == "before" else None
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if w is None:
            w = fw.watch(model, every_n_steps=1)
        reports = _train(model, w, 3, rank)
        result[when] = (_sigmas(reports[-1]), _wq_exact(model),
                        [r.to_dict()["heads"] for r in reports], w.monitor_errors_total)

    # DDP: plain weights, the same numbers on every rank, names without "module.".
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(**SMALL)))
    w = fw.watch(model, every_n_steps=1)
    reports = _train(model, w, 2, rank)
    result["ddp"] = (_sigmas(reports[-1]), _wq_exact(model), w.monitor_errors_total)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    w.remove()
    del model, w
    _close(dist)


def test_sharded_spectral_norms_on_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0["rows"] == [0] * 5 + [1] * 3 and r1["rows"] == [1] * 2 + [2] * 5
    for r in (r0, r1):
        got, want = r["dtensor"]
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)
        torch.testing.assert_close(r["warm"].double(), want, rtol=1e-4, atol=0)
    assert torch.equal(r0["dtensor"][0], r1["dtensor"][0])
    for r in (r0, r1):
        torch.testing.assert_close(r["conv1d"][0].double(), r["conv1d"][1], rtol=1e-4, atol=0)
    plain = [f"transformer.h.{i}.attn" for i in range(2)]
    for key in ("before", "after", "ddp"):
        sig0, exact, *_ = r0[key]
        assert sorted({layer for layer, _ in sig0}) == plain, key
        assert sig0 == r1[key][0], key  # identical on both ranks
        if key != "ddp":
            assert r0[key][2] == r1[key][2], key  # every number and mode of every report
        # DDP runs the plain power iteration, whose warm-start stopping rule (relative
        # change < 1e-6) left 1.3e-3 on one head of this run: 3e-3 there.
        rtol = 3e-3 if key == "ddp" else 1e-3
        for head, s in sig0.items():
            assert abs(s - exact[head]) <= rtol * exact[head], (key, head, s, exact[head])
        assert r0[key][-1] == 0 and r1[key][-1] == 0, key  # no monitor errors
    # Sharding changes nothing a report says but the arithmetic order: modes, counts
    # and norms match between attaching before and after fully_shard.
    for a, b in zip(r0["before"][2], r0["after"][2], strict=True):
        for ha, hb in zip(a, b, strict=True):
            assert ha["head_mode"] == hb["head_mode"]
            assert abs(ha["wq_spectral_norm"] - hb["wq_spectral_norm"]) <= \
                1e-5 * ha["wq_spectral_norm"]
    # FSDP2's W^Q gradient is a DTensor shard of the averaged gradient: the δ-error share
    # is still measured (finite, > 0) and identical on both ranks.
    for key in ("after", "before"):
        shares = [h["delta_error_share"] for rep in r0[key][2] for h in rep]
        assert all(v is not None and v > 0 for v in shares), (key, shares)


# ------------------------------------------------------- per-rank normalisation


def _global_batch():
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, SMALL["vocab_size"], (8, 17), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _one_step(model, w, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    return {(h.layer, h.head): h for h in w.step().heads}


def _same(a: dict, b: dict) -> bool:
    """Two {(layer, head): HeadRecord} equal field by field, NaN equal to NaN."""
    return a.keys() == b.keys() and all(a[k].to_dict() == b[k].to_dict() for k in a)


def _norm_worker(rank, world, init_file, out_dir, rows, same_data):
    """One DDP step on 4 sequences per rank: the global batch's halves, or (same_data)
    its first 4 on both ranks."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(**SMALL)))
    w = fw.watch(model, every_n_steps=1, rows_per_head=rows)
    x, y = _global_batch()
    mine = slice(0, 4) if same_data else slice(4 * rank, 4 * rank + 4)
    heads = _one_step(model, w, x[mine], y[mine])
    torch.save(heads, os.path.join(out_dir, f"norm{rank}.pt"))
    w.remove()
    del model, w
    _close(dist)


def test_sums_over_rows_do_not_change_with_the_world_size(tmp_path):
    """2 DDP ranks with 4 sequences each report the δ sums of 1 process on all 8."""
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, every_n_steps=1, rows_per_head=8 * 16)
    alone = _one_step(model, w, *_global_batch())
    mp.spawn(_norm_worker, args=(2, str(tmp_path / "init"), str(tmp_path), 8 * 16, False),
             nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"norm{r}.pt", weights_only=False) for r in (0, 1)]
    assert _same(ranks[0], ranks[1])  # identical on both ranks (NaN fields included)
    for key, h in alone.items():
        got = ranks[0][key]
        assert abs(h.delta_error_sum) > 0
        assert got.delta_error_sum == pytest.approx(h.delta_error_sum, rel=1e-3), key
        assert got.tied_rowmax_ratio == h.tied_rowmax_ratio


def test_sampled_sums_do_not_change_with_the_world_size(tmp_path):
    """Sampled rows (8 of 64 per call). Both ranks hold the same 4 sequences and draw the
    same rows, so each rank's sampled sum S is one process's on those 4 sequences. The
    global batch is the 4 sequences twice, where every row's share of the gradient, and
    so c, halves: one process on it samples 8 rows of c/2, S/2 in expectation. The two
    ranks must report S/2, not 2·S (summed over ranks) nor S (÷ world size only)."""
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    w = fw.watch(model, every_n_steps=1, rows_per_head=8)
    x, y = _global_batch()
    alone = _one_step(model, w, x[:4], y[:4])
    mp.spawn(_norm_worker, args=(2, str(tmp_path / "init"), str(tmp_path), 8, True),
             nprocs=2, join=True)
    got = torch.load(tmp_path / "norm0.pt", weights_only=False)
    for key, h in alone.items():
        assert abs(h.delta_error_sum) > 0
        assert got[key].delta_error_sum == pytest.approx(h.delta_error_sum / 2, rel=1e-6), key


def _fsdp_norm_worker(rank, world, init_file, out_dir):
    """One FSDP2 step on the global batch's halves, the loss and gradient reduction as
    each trainer writes them: "mean" (each rank its own mean loss, FSDP2 averages:
    torch's default) and "sum" (torchtitan's: each rank's token sum ÷ the global token
    count, set_gradient_divide_factor(1.0): the reduced gradient is the ranks' sum). The
    same optimizer step either way."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    x, y = _global_batch()
    mine = slice(4 * rank, 4 * rank + 4)
    out = {}
    for convention in ("mean", "sum"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if convention == "sum":
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        w = fw.watch(model, every_n_steps=1, rows_per_head=8 * 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(x[mine], y[mine])
        if convention == "sum":
            loss = F.cross_entropy(logits.float().flatten(0, 1), y[mine].flatten(),
                                   reduction="sum") / y.numel()
        loss.backward()
        grad = model.transformer.h[0].attn.c_attn.weight.grad.full_tensor()
        out[convention] = ({(h.layer, h.head): h for h in w.step().heads}, grad,
                           w.monitor_errors_total)
        w.remove()
    torch.save(out, os.path.join(out_dir, f"fsdp_norm{rank}.pt"))
    _close(dist)


def test_fsdp2_numbers_do_not_depend_on_how_the_trainer_scales_its_loss(tmp_path):
    """torchtitan's FSDP2 sums gradients (divide factor 1) of losses already divided by
    the global token count; torch's default averages per-rank mean losses. Same step,
    same numbers: Σc and the δ share were W times smaller under the sum (the share's
    numerator was divided by W², the averaged gradient's scale)."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_norm_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    got = torch.load(tmp_path / "fsdp_norm0.pt", weights_only=False)
    (mean, g_mean, e_mean), (summed, g_sum, e_sum) = got["mean"], got["sum"]
    assert e_mean == e_sum == 0
    torch.testing.assert_close(g_sum, g_mean, rtol=1e-5, atol=1e-8)  # the same gradient
    for key, h in mean.items():
        assert h.delta_error_share > 0 and abs(h.delta_error_sum) > 0, key
        assert summed[key].delta_error_share == pytest.approx(h.delta_error_share,
                                                              rel=1e-4), key
        assert summed[key].delta_error_sum == pytest.approx(h.delta_error_sum, rel=1e-4), key


# ------------------------------------------------------- DDP and torch.compile


def _compile_worker(rank, world, init_file, out_dir):
    """DDP around a model, eager and torch.compile'd (aot_eager); FSDP2 per block,
    eager and with each block compiled (regional compilation, FSDP2's usual recipe);
    the same data: the compiled ones' monitored steps are traced (flashwatch/monitor/traced.py)
    after the first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in ("eager", "compiled", "fsdp2", "fsdp2 compiled"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        if kind.startswith("fsdp2"):
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
                if kind == "fsdp2 compiled":
                    block.compile(backend="aot_eager")
            fully_shard(model, mesh=mesh)
        else:
            model = DDP(model)
        w = fw.watch(model, every_n_steps=2, rows_per_head=8)
        run = torch.compile(model, backend="aot_eager") if kind == "compiled" else model
        reports, stances = [], []
        for i in range(5):
            stances.append(torch._dynamo.eval_frame._stance.stance)
            x, y = _batch(100 * i + rank)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = run(x, y)
            loss.backward()
            reports.append(w.step())
        out[kind] = ([r.to_dict()["heads"] for r in reports if r is not None], stances,
                     w.monitor_errors_total, [st.compiled.traced for st in w.layer_states])
        w.remove()
        del model, run, w
    torch.save(out, os.path.join(out_dir, f"compile{rank}.pt"))
    torch._dynamo.reset()
    _close(dist)


def test_compiled_monitored_steps_are_traced_and_equal_eager_on_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_compile_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    ranks = [torch.load(tmp_path / f"compile{r}.pt", weights_only=False) for r in (0, 1)]
    for kinds in (("eager", "compiled"), ("fsdp2", "fsdp2 compiled")):
        for r in ranks:
            eager, compiled = r[kinds[0]], r[kinds[1]]
            assert compiled[1] == ["force_eager"] + ["default"] * 4  # traced from step 2
            assert compiled[3] == [True, True] and compiled[2] == eager[2] == 0
            assert len(compiled[0]) == len(eager[0]) == 3
            for got, want in zip(compiled[0], eager[0], strict=True):
                for g, e in zip(got, want, strict=True):
                    assert (g["layer"], g["head"]) == (e["layer"], e["head"])
                    for key in ("tied_rowmax_ratio", "attention_max_logit", "delta_error_sum",
                                "wq_spectral_norm", "delta_error_share"):
                        assert g[key] is not None, (kinds, key)  # measured, not NaN
                        assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-12), key
        assert ranks[0][kinds[1]][0] == ranks[1][kinds[1]][0]  # one report on every rank


@pytest.mark.parametrize("batch_bytes", [None, 1])
def test_spectral_norms_batches_plain_sites_and_keeps_each_ones_failure_its_own(
        batch_bytes, monkeypatch):
    """Two layers of one shape (one batched iteration) and a layer of another shape,
    cold then warm: each σ is the exact one of its own W^Q; a site whose W^Q cannot be
    read gets its exception and leaves the others' norms alone. batch_bytes=1: one layer
    per batch (large models)."""
    if batch_bytes is not None:
        monkeypatch.setattr(power, "BATCH_BYTES", batch_bytes)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**SMALL))
    other = GPT(GPTConfig(**{**SMALL, "n_embd": 48, "n_head": 3}))
    sites = find_sites(gpt) + find_sites(other)[:1]
    broken = find_sites(other)[1]
    broken.wq_source = lambda: torch.zeros(7)  # not [H·D, d_model]: wq() raises
    sites.insert(1, broken)
    vs = [None] * len(sites)
    for _ in range(2):  # cold, then warm from the returned vectors
        got = power.spectral_norms(sites, vs, 4, tol=1e-10, max_iters=500)
        assert isinstance(got[1], RuntimeError)
        for i in (0, 2, 3):
            sigma, v = got[i]
            assert sigma.shape == (sites[i].num_heads,)
            assert v.shape == (sites[i].num_heads, sites[i].d_model)
            exact = _exact(sites[i].wq())
            assert torch.allclose(sigma.double(), exact, rtol=1e-4), (i, sigma, exact)
        vs = [None if isinstance(g, Exception) else g[1] for g in got]
