"""A watcher's state through torch.distributed.checkpoint (how torchtitan and OLMo-core
save) when a job restarts on another world size: tensor parallelism over 2 gloo ranks →
4 ranks → 1 process, on the 16-head model of tests/scaled_heads.py.

Job A (TP 2) trains 3 monitored steps in BF16 autocast with mitigation "auto" (a δ-share
threshold of 1e-9 switches every head at step 0) and QK-clip at τ = 2 (heads above it
clipped), then saves; job B (TP 4: one head of each layer per rank) loads into fresh
watchers, then takes one more step and saves; one process loads that. The truth is job
A's own state: every field that describes the job by global head — step count, modes,
hand-set flags, drift and δ-share windows, policy counters, QK-clip books, events — must
come back equal on every rank of B and in the single process, and B's step must carry
on from it (the step count, the modes run).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _helpers import gloo_ranks, on_mesh
from scaled_heads import EPS, N_LAYERS, VOCAB, Stage, batch, full_model, tp_model

import flashwatch as fw

# what a state says about the job, by global head (power_v and rng are per-rank caches)
JOB_FIELDS = ("step", "heads", "modes", "user_set", "signals", "policy", "events",
              "unreported", "qk_clip")


def _cfg():
    return fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS, mitigation="auto",
                          delta_share_threshold=1e-9, delta_share_steps=1,
                          qk_clip_threshold=2.0, collective_timeout_s=60)


def _train(model, w, steps, first):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(first, first + steps):
        tokens = batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a δ error to switch on
            logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        w.step()


def _fresh_target(model) -> dict:
    """A fresh watcher's state: what torchtitan and OLMo-core hand dcp.load."""
    w = fw.watch(model, config=_cfg())
    target = {"flashwatch": w.state_dict()}
    w.remove()
    return target


def _job_a(mesh, ckpt):
    model = tp_model(mesh)
    w = fw.watch(model, config=_cfg())
    _train(model, w, steps=3, first=0)
    dcp.save({"flashwatch": w.state_dict()}, checkpoint_id=f"{ckpt}/a")
    out = dict(state=w.state_dict(), errors=w.monitor_errors_total)
    w.remove()
    return out


def _job_b(mesh, ckpt):
    model = tp_model(mesh)
    target = _fresh_target(model)
    dcp.load(target, checkpoint_id=f"{ckpt}/a")
    w = fw.watch(model, config=_cfg())
    w.load_state_dict(target["flashwatch"])
    out = dict(loaded=w.state_dict(), local_modes={n: [int(m) for m in ms]
                                                   for n, ms in w.head_modes().items()},
               offsets={st.site.name: st.site.head_offset for st in w.layer_states})
    _train(model, w, steps=1, first=3)
    dcp.save({"flashwatch": w.state_dict()}, checkpoint_id=f"{ckpt}/b")
    out.update(after=w.state_dict(), errors=w.monitor_errors_total)
    w.remove()
    return out


def _worker(job, ckpt, rank, world, init_file, out_dir):
    on_mesh(rank, world, init_file, out_dir,
            lambda mesh: [(job.__name__, functools.partial(job, mesh, ckpt))])


def _same(a, b, path="state"):
    """Nested equality of two states (tensors exactly, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, path
        assert torch.equal(a.nan_to_num(1e300), b.nan_to_num(1e300)), path
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def test_a_tp2_state_resumes_on_4_ranks_then_in_one_process(tmp_path):
    torch.set_num_threads(1)
    (tmp_path / "a_ranks").mkdir(), (tmp_path / "b_ranks").mkdir()
    a = gloo_ranks(functools.partial(_worker, _job_a, str(tmp_path)), 2, tmp_path / "a_ranks")
    b = gloo_ranks(functools.partial(_worker, _job_b, str(tmp_path)), 4, tmp_path / "b_ranks")
    saved = a[0]["_job_a"]["state"]
    assert a[0]["_job_a"]["errors"] == a[1]["_job_a"]["errors"] == 0
    # the run made the state worth carrying: every head switched, some clipped, windows
    assert saved["step"] == 3 and int((saved["modes"] != 0).sum()) == 16
    assert any(e["kind"] == "qk_clip" for e in saved["events"])
    assert int(saved["signals"]["fill"].min()) >= 2  # every head's windows hold steps
    assert bool((saved["signals"]["sigma_ring"] > 0).any())
    for field in JOB_FIELDS:  # both ranks of A describe the same job
        _same(saved[field], a[1]["_job_a"]["state"][field], field)
    for rank in range(4):
        got = b[rank]["_job_b"]
        assert got["errors"] == 0, rank
        for field in JOB_FIELDS:
            _same(saved[field], got["loaded"][field], f"rank {rank}: {field}")
        # each rank holds its one head of each layer, with that head's saved mode
        for name, first in got["offsets"].items():
            assert first == rank
            i = list(saved["heads"]).index((name, rank))
            assert got["local_modes"][name] == [int(saved["modes"][i])]
        assert got["after"]["step"] == 4  # B's step carried on from A's 3
    after = b[0]["_job_b"]["after"]
    for rank in (1, 2, 3):
        for field in JOB_FIELDS:
            _same(after[field], b[rank]["_job_b"]["after"][field], f"rank {rank}: {field}")
    # 4 ranks → 1 process
    whole = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    target = _fresh_target(whole)
    dcp.load(target, checkpoint_id=tmp_path / "b")
    w = fw.watch(whole, config=_cfg())
    w.load_state_dict(target["flashwatch"])
    state = w.state_dict()
    w.remove()
    for field in JOB_FIELDS:
        _same(after[field], state[field], f"1 process: {field}")
