"""flashwatch/parallel/reduce.py: SUM/MAX all_reduce of named per-head tensors, constant size, on
the monitor's own group; the fault-symmetric exchange."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashwatch.parallel import reduce

N_HEADS, K = 6, 3


def _inputs(rank: int):
    """What a rank's watcher would pass: counts, sums, a k×k sketch per head, a max."""
    g = torch.Generator().manual_seed(100 + rank)
    sums = dict(tied=torch.randint(0, 9, (N_HEADS,), generator=g).double(),
                rows=torch.full((N_HEADS,), 64.0, dtype=torch.float64),
                delta_sum=torch.randn(N_HEADS, generator=g, dtype=torch.float64),
                G=torch.randn(N_HEADS, K, K, generator=g, dtype=torch.float64))
    max_logit = torch.randn(N_HEADS, generator=g, dtype=torch.float64)
    max_logit[rank % N_HEADS] = -math.inf  # a head no row of this rank reached
    return sums, dict(max_logit=max_logit)


def _all_gather_reference(sums, maxes):
    """The reduction as the watcher did it before: all_gather, then sum / amax."""
    import torch.distributed as dist

    out = []
    for group, op in ((sums, "sum"), (maxes, "max")):
        res = {}
        for key, t in group.items():
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t)
            stacked = torch.stack(parts)
            res[key] = stacked.sum(0) if op == "sum" else stacked.amax(0)
        out.append(res)
    return out


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    sums, maxes = _inputs(rank)
    expected = _all_gather_reference(sums, maxes)
    monitor = reduce.MonitorGroup(timeout_s=60)
    calls = []
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("all_gather grows with the world size")

    dist.all_reduce, dist.all_gather = counting_all_reduce, forbidden
    try:
        got = reduce.all_reduce(sums, maxes, monitor)
    finally:
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather
    torch.save(dict(got=got, expected=expected, calls=calls), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def _run(tmp_path, world):
    import torch.multiprocessing as mp

    out = tmp_path / f"w{world}"
    out.mkdir()
    mp.spawn(_worker, args=(world, str(out / "init"), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_gloo_ranks_match_all_gather_exactly_with_two_constant_size_collectives(tmp_path):
    sizes = {}
    for world in (2, 3):
        results = _run(tmp_path, world)
        for r in results:
            for got, expected in zip(r["got"], r["expected"], strict=True):
                assert got.keys() == expected.keys()
                for key in got:
                    assert got[key].shape == expected[key].shape
                    if world == 2:  # a + b == b + a: bit for bit what all_gather gave
                        assert torch.equal(got[key], expected[key]), key
                    else:  # three addends: the collective may add in another order
                        torch.testing.assert_close(got[key], expected[key], rtol=1e-15,
                                                   atol=1e-15)
        sizes[world] = results[0]["calls"]
        assert all(r["calls"] == sizes[world] for r in results)
    # one SUM of n·(3 + k²) values and one MAX of n, whatever the world size
    assert sizes[2] == sizes[3] == [N_HEADS * (3 + K * K), N_HEADS]


def test_single_process_returns_float64_copies_with_shapes():
    sums, maxes = _inputs(0)
    got_sums, got_maxes = reduce.all_reduce(sums, maxes)
    for key, t in sums.items():
        assert got_sums[key].dtype == torch.float64 and torch.equal(got_sums[key], t)
        assert got_sums[key].data_ptr() != t.data_ptr()
    assert torch.equal(got_maxes["max_logit"], maxes["max_logit"])
    assert reduce.all_reduce({}, {}) == ({}, {})


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="sums must be a dict"):
        reduce.all_reduce([torch.zeros(2)], {})
    with pytest.raises(TypeError, match=r"maxes\['m'\] must be a torch.Tensor"):
        reduce.all_reduce({}, {"m": [1.0]})


def _exchange_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    monitor = reduce.MonitorGroup(timeout_s=60)
    shapes = {"a": (N_HEADS,), "G": (N_HEADS, K, K), "max:m": (N_HEADS,)}
    sums, maxes = _inputs(rank)
    local = dict(a=sums["delta_sum"], G=sums["G"], m=maxes["max_logit"])
    out = {}
    # rank 1's local stage failed: it sends fills, both ranks hear of it
    out["failed"] = reduce.exchange(monitor, None if rank == 1 else local,
                                    None if rank == 1 else local, shapes, step=4)
    out["both"] = reduce.exchange(monitor, local, local, shapes, step=6 + 2 * rank)
    try:
        monitor.check_same(heads=N_HEADS + rank, sketch_dim=K)
        out["check"] = None
    except ValueError as e:
        out["check"] = str(e)
    out["local"] = local
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_exchange_carries_failures_and_step_counts_to_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_exchange_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2)]
    for rank in range(2):
        failed, both = r[rank]["failed"], r[rank]["both"]
        # rank 1 contributed zeros and -inf: the sums are rank 0's alone
        assert failed.failed_ranks == 1 and failed.steps == (4, 4)
        # numpy, read from the buffers the collectives wrote (no torch call after them)
        assert isinstance(failed.sums["a"], np.ndarray)
        assert np.array_equal(failed.sums["a"], r[0]["local"]["a"].numpy())
        assert np.array_equal(failed.maxes["m"], r[0]["local"]["m"].numpy())
        # step counts 6 and 8: every rank learns both
        assert both.failed_ranks == 0 and both.steps == (6, 8) and not both.in_step
        assert np.array_equal(both.sums["G"], (r[0]["local"]["G"] + r[1]["local"]["G"]).numpy())
        assert "heads ranges over 6..7" in r[rank]["check"]


def test_monitor_group_timeout_is_validated():
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        reduce.MonitorGroup(timeout_s=0)
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match=r"timeout_s must be a positive number .*; seconds"):
            reduce.MonitorGroup(timeout_s=bad)
    for bad in ("60", True):
        with pytest.raises(TypeError, match=rf"timeout_s .* got {bad!r} \("):
            reduce.MonitorGroup(timeout_s=bad)
    assert reduce.MonitorGroup(timeout_s=30).timeout_s == 30.0
