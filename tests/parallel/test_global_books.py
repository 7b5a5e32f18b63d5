"""What a watcher keeps over the job's global head table under pipeline and tensor
parallelism: its saved state, the mode events it confirms, its QK-clip books, and a
hand-set mode that a local failure must not undo.

Two gloo processes run the 4-layer, 16-head model of tests/scaled_heads.py as 2 + 2
hand-written pipeline stages, or tensor-parallel (ColwiseParallel q/k/v, 2 heads of
each layer per rank). The truths are the test's own: the modes it sets by hand, every
head switched by a δ-share threshold of 1e-9, the heads whose FP64 max logit exceeds τ.
Before: a state held each rank's local modes under local head indices (rank 1 of TP
loaded rank 0's modes, stage 1 raised on load), rank 0 confirmed and counted only the
switches and clips of heads it held, and a hand-set mode on stage 1 was healed back to
STANDARD when stage 1's measurement failed at the next step.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _helpers import gloo_ranks, on_mesh
from scaled_heads import (
    EPS,
    N_LAYERS,
    VOCAB,
    Stage,
    batch,
    full_model,
    pipeline_step,
    tp_model,
    truth,
)

import flashwatch as fw
from flashwatch.monitor.head_modes import HeadModes
from flashwatch.monitor.monitored_step import StepPipeline

BETA, FP32_O = int(fw.Mode.BETA), int(fw.Mode.FP32_O)
# set by hand in the single-process run whose state every layout loads
SAVED = {("layers.1.attention", 2): BETA, ("layers.3.attention", 1): FP32_O}
TAU = 2.0  # QK-clip threshold between the heads' max logits (checked below)
HELD = {0: [0, 1], 1: [2, 3]}  # pipeline stage -> its layers


def _cfg(**kw):
    return fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS,
                          collective_timeout_s=60, **kw)


def _stage(rank):
    return Stage(full_model(), HELD[rank], first=rank == 0, last=rank == 1)


def _whole_step(model, tokens, opt, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, VOCAB),
                        tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _stepper(layout, rank, mesh, model):
    """(model, one training step on batch(i)) of `layout` ('pp' or 'tp')."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights change by QK-clip only
    if layout == "pp":
        return lambda i, autocast=False: _autocast(autocast, pipeline_step, model, rank,
                                                   batch(i), opt)
    return lambda i, autocast=False: _whole_step(model, batch(i), opt, autocast)


def _autocast(on, fn, *args):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
        fn(*args)


def _modes(report) -> dict:
    return {(h.layer, h.head): int(h.head_mode) for h in report.heads if h.head_mode}


def _events(events, kind="mode") -> list:
    return sorted((e.layer, e.head, int(e.to_mode), e.applied) for e in events
                  if e.kind == kind)


# --- the jobs each rank runs -------------------------------------------------------


def _loads_single_process_state(layout, rank, mesh, out_dir, via="torch"):
    """The single-process state loaded on every rank: each rank's own heads' modes,
    then run; this rank's state saved for the way back. via "dcp": through
    torch.distributed.checkpoint into a fresh watcher's state, as torchtitan and
    OLMo-core save and load (every rank saves into one checkpoint folder)."""
    import torch.distributed.checkpoint as dcp

    model = _stage(rank) if layout == "pp" else tp_model(mesh)
    w = fw.watch(model, config=_cfg())
    if via == "dcp":
        target = {"flashwatch": w.state_dict()}
        dcp.load(target, checkpoint_id=f"{out_dir}/single_dcp")
        w.load_state_dict(target["flashwatch"])
    else:
        w.load_state_dict(torch.load(f"{out_dir}/single.pt", weights_only=True))
    local = {name: [int(m) for m in modes] for name, modes in w.head_modes().items()}
    step = _stepper(layout, rank, mesh, model)
    step(0)
    r = w.step()
    if via == "dcp":
        dcp.save({"flashwatch": w.state_dict()}, checkpoint_id=f"{out_dir}/{layout}_dcp")
    else:
        torch.save(w.state_dict(), f"{out_dir}/{layout}{rank}.pt")
    out = dict(local=local, modes=_modes(r), unmitigable=dict(r.unmitigable),
               errors=w.monitor_errors_total,
               offsets={st.site.name: st.site.head_offset for st in w.layer_states})
    w.remove()
    return out


def _confirms_every_switch(layout, rank, mesh):
    """Step 0: a δ-share threshold of 1e-9 switches every head to FP32_O (BF16
    autocast makes a δ error); step 1 runs them: every rank confirms all 16, once.
    Then each rank sets a mode by hand on a head it holds (TP: rank 0 layers.2 global
    head 0, rank 1 layers.1 global head 3; PP: stage 1 layers.3 head 1)."""
    model = _stage(rank) if layout == "pp" else tp_model(mesh)
    w = fw.watch(model, config=_cfg(mitigation="auto", delta_share_threshold=1e-9,
                                    delta_share_steps=1))
    step = _stepper(layout, rank, mesh, model)
    out = {}
    for i in range(2):
        step(i, autocast=True)
        r = w.step()
        out[f"events{i}"], out[f"confirmed{i}"] = _events(r.events), _events(r.confirmed)
    w.remove()
    # STANDARD everywhere again; no advice (a BETA head unmeasured yet would get some)
    w = fw.watch(model, config=_cfg(mitigation="off"))
    if layout == "tp":
        w.set_head_modes(*(("layers.2.attention", [BETA, 0]) if rank == 0 else
                           ("layers.1.attention", [0, FP32_O])))
    elif rank == 1:
        w.set_head_modes("layers.3.attention", [0, FP32_O, 0, 0])
    for i in range(2):  # set before step 0's step(): applied from step 1's forward
        r = w.step()
        out[f"user{i}"], out[f"user_confirmed{i}"] = _events(r.events), _events(r.confirmed)
        step(i)
    r = w.step()
    out["user_confirmed2"] = _events(r.confirmed)
    out["errors"] = w.monitor_errors_total
    w.remove()
    return out


def _books_every_clip(layout, rank, mesh):
    """QK-clip at τ on the same batch twice: every rank's step 0 lists every clip of
    the job, its step 1 confirms each (the logits fell to τ), its total counts them."""
    model = _stage(rank) if layout == "pp" else tp_model(mesh)
    w = fw.watch(model, config=_cfg(mitigation="auto", qk_clip_threshold=TAU))
    step = _stepper(layout, rank, mesh, model)
    out = dict(truth=truth(full_model(), batch(0)))
    for i in range(2):
        step(0)
        r = w.step()
        out[f"clips{i}"] = _events(r.events, "qk_clip")
        out[f"confirmed{i}"] = _events(r.confirmed, "qk_clip")
        out[f"total{i}"] = r.qk_clips_total
    out["errors"] = w.monitor_errors_total
    w.remove()
    return out


class _FailOnce:
    """Make `owner.name` raise on its next call (this rank only), once."""

    def __init__(self, owner, name):
        self.owner, self.name, self.orig = owner, name, getattr(owner, name)
        setattr(owner, name, self)

    def __get__(self, obj, objtype=None):
        return self if obj is None else functools.partial(self.__call__, obj)

    def __call__(self, *args, **kwargs):
        setattr(self.owner, self.name, self.orig)
        raise RuntimeError(f"injected failure in {self.name}")


def _keeps_a_hand_set_mode(what_fails, rank):
    """Stage 1 sets layers.3 head 1 by hand, then fails locally at the next monitored
    step: its measurement ('measure') or its whole part of the exchange, modes included
    ('modes'). The mode must survive on both stages, its flag be in stage 1's state
    until an exchange carries it, and the next step end with both stages agreeing."""
    stage = _stage(rank)
    w = fw.watch(stage, config=_cfg())
    step = _stepper("pp", rank, None, stage)
    step(0)
    w.step()
    key = ("layers.3.attention", 1)
    if rank == 1:
        w.set_head_modes("layers.3.attention", [0, FP32_O, 0, 0])
        if what_fails == "measure":
            _FailOnce(StepPipeline, "_contribution")
        else:
            _FailOnce(HeadModes, "fields")
    step(1)
    r1 = w.step()
    i = list(w._pipeline.heads).index(key)
    out = dict(modes1=_modes(r1), mine1=w.head_modes(), errors1=w.monitor_errors_total,
               flag1=bool(w.state_dict()["user_set"][i]),
               user_events1=_events(r1.events))
    step(2)
    r2 = w.step()
    out.update(modes2=_modes(r2), errors2=w.monitor_errors_total,
               flag2=bool(w.state_dict()["user_set"][i]),
               state_modes2=w.state_dict()["modes"].tolist())
    w.remove()
    return out


def _worker(rank, world, init_file, out_dir):
    on_mesh(rank, world, init_file, out_dir, lambda mesh: [
        *[(f"load_{layout}_{via}", functools.partial(_loads_single_process_state, layout,
                                                     rank, mesh, out_dir, via))
          for layout in ("pp", "tp") for via in ("torch", "dcp")],
        *[(f"switch_{layout}", functools.partial(_confirms_every_switch, layout, rank, mesh))
          for layout in ("pp", "tp")],
        *[(f"clip_{layout}", functools.partial(_books_every_clip, layout, rank, mesh))
          for layout in ("pp", "tp")],
        *[(f"keep_{what}", functools.partial(_keeps_a_hand_set_mode, what, rank))
          for what in ("measure", "modes")]])


def _single_process(state=None):
    """The whole model in one process: its watcher with SAVED set by hand and run, or
    with `state` loaded."""
    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    w = fw.watch(model, config=_cfg())
    if state is not None:
        w.load_state_dict(state)
        return w
    for (layer, head), mode in SAVED.items():
        modes = [0] * 4
        modes[head] = mode
        w.set_head_modes(layer, modes)
    _whole_step(model, batch(0), torch.optim.SGD(model.parameters(), lr=0.0))
    assert _modes(w.step()) == SAVED
    return w


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("books")
    torch.set_num_threads(1)
    w = _single_process()
    torch.save(w.state_dict(), out / "single.pt")
    import torch.distributed.checkpoint as dcp

    dcp.save({"flashwatch": w.state_dict()}, checkpoint_id=out / "single_dcp")  # no group
    w.remove()
    got = gloo_ranks(_worker, 2, out)
    return out, got


# --- 1. the saved state -------------------------------------------------------------


@pytest.mark.parametrize("via", ["torch", "dcp"])
@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_a_single_process_state_loads_into_each_rank_and_back(results, layout, via):
    """torch.save, or torch.distributed.checkpoint into a fresh watcher's state (which
    failed with 'Missing key in checkpoint state_dict: events' when the state held
    events): 1 process → 2 ranks → 1 process."""
    out, got = results
    for rank in (0, 1):
        r = got[rank][f"load_{layout}_{via}"]
        assert r["errors"] == 0
        # each rank holds the modes of its own heads, at their local indices
        want = {}
        for name, first in r["offsets"].items():
            heads = range(first, first + len(r["local"][name]))
            want[name] = [SAVED.get((name, h), 0) for h in heads]
        assert r["local"] == want, rank
        assert r["modes"] == SAVED and r["unmitigable"] == {}, rank  # and they ran
    if via == "dcp":  # the job's checkpoint folder loads into one process
        import torch.distributed.checkpoint as dcp

        fresh = fw.watch(Stage(full_model(), list(range(N_LAYERS)), first=True, last=True),
                         config=_cfg())
        target = {"flashwatch": fresh.state_dict()}  # a fresh watcher's: no events
        fresh.remove()
        dcp.load(target, checkpoint_id=out / f"{layout}_dcp")
        states = [target["flashwatch"]]
    else:  # either rank's state loads into one process: every head's mode
        states = [torch.load(out / f"{layout}{rank}.pt", weights_only=True) for rank in (0, 1)]
    for state in states:
        w = _single_process(state)
        assert {(name, h): int(m) for name, modes in w.head_modes().items()
                for h, m in enumerate(modes) if m} == SAVED
        assert len(w.events) == len(SAVED) and w.step_count == 2  # 1 + the ranks' 1
        w.remove()


# --- 2. events confirmed and counted on every rank, once -----------------------------


@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_every_rank_confirms_every_switch_of_the_job_once(results, layout):
    _, got = results
    every = sorted((f"layers.{i}.attention", h, FP32_O, True)
                   for i in range(N_LAYERS) for h in range(4))
    hand = ([("layers.1.attention", 3, FP32_O, True), ("layers.2.attention", 0, BETA, True)]
            if layout == "tp" else [("layers.3.attention", 1, FP32_O, True)])
    for rank in (0, 1):
        r = got[rank][f"switch_{layout}"]
        assert r["errors"] == 0, rank
        assert r["events0"] == every and r["confirmed0"] == [], rank
        assert r["confirmed1"] == every, rank  # seen run where held, counted everywhere
        # hand-set modes: every rank reports each once (the holder's own event, or one
        # learnt from the exchange), and confirms each once its kernel ran them
        assert r["user0"] == hand, rank
        assert r["user_confirmed0"] == r["user1"] == [], rank
        assert r["user_confirmed1"] == hand and r["user_confirmed2"] == [], rank


@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_every_rank_books_every_clip_of_the_job_once(results, layout):
    _, got = results
    truth = got[0][f"clip_{layout}"]["truth"]
    above = sorted((layer, h, 0, True) for (layer, h), t in truth.items()
                   if t["max_logit"] > TAU)
    assert 0 < len(above) < len(truth)
    for rank in (0, 1):
        r = got[rank][f"clip_{layout}"]
        assert r["errors"] == 0, rank
        assert r["clips0"] == above and r["confirmed0"] == [] and r["total0"] == 0, rank
        assert r["confirmed1"] == above and r["total1"] == len(above), rank


# --- 3. a hand-set mode and a local failure -----------------------------------------


@pytest.mark.parametrize("what_fails", ["measure", "modes"])
def test_a_hand_set_mode_survives_a_failure_on_its_stage(results, what_fails):
    _, got = results
    key = ("layers.3.attention", 1)
    r0, r1 = (got[rank][f"keep_{what_fails}"] for rank in (0, 1))
    assert r0["errors1"] == 0 and r1["errors1"] == 1  # counted where it happened
    assert r1["mine1"]["layers.3.attention"] == [0, FP32_O, 0, 0]  # not healed back
    if what_fails == "measure":  # the modes went out with the fills: known at once
        assert r0["modes1"] == r1["modes1"] == {key: FP32_O}
        assert not r1["flag1"]
    else:  # nothing went out: kept, flagged in the state until the next exchange
        assert r1["flag1"]
    for r in (r0, r1):
        assert r["modes2"] == {key: FP32_O} and not r["flag2"]
        assert r["errors2"] == r["errors1"]
    assert r0["state_modes2"] == r1["state_modes2"]
    assert [e[:2] for e in r0["user_events1"] + r1["user_events1"]].count(key) >= 1
