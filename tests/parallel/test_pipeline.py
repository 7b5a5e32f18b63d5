"""Pipeline parallelism: each stage watches its own layers, every global head is reported
once under its own name, on every rank, and a mode or a QK-clip acts on the stage that
holds the head.

Two gloo processes run a 4-layer Llama-shaped model split into two hand-written stages
(activations sent forward, their gradients back, as torch.distributed.pipelining does
underneath): 2 + 2 layers, 3 + 1, and 0 + 4 (stage 0 holds only the embedding: no
attention layer, and it still joins every collective); and 2 + 2 under
torch.distributed.pipelining's GPipe and 1F1B schedules with 3 micro-batches, whose
first step runs an extra forward for metadata inference (on torch.empty inputs after
stage 0) that is not measured. Each head's W^Q is scaled by its
own factor, so a number reported under the wrong layer or head shows. The truth is
computed on the full model, built from the same seed on each rank, in FP64 over every
row: max logit, tied rows (a row whose maximum occurs twice within eps), W^Q σ
(matrix_norm). Before names keyed the exchange, stage 0 reported stage 1's numbers
under its own layer names (relative error 2.79 on max logit) and pooled ties across
stages.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _helpers import gloo_ranks
from scaled_heads import (
    D_MODEL,
    EPS,
    N_LAYERS,
    VOCAB,
    B,
    H,
    Stage,
    T,
    batch,
    full_model,
    pipeline_step,
    truth,
)

import flashwatch as fw

SPLITS = {"2+2": 2, "3+1": 3, "0+4": 0}  # layers on stage 0
# torch.distributed.pipelining, 2 + 2 layers; interleaved: 2 stages of 1 layer per rank
SCHEDULES = ("gpipe", "1f1b", "interleaved")
TAU = 2.0  # QK-clip threshold: between the heads' max logits (checked below)


def _run(split: str, rank: int) -> dict:
    full = full_model()
    first = SPLITS[split]
    mine = list(range(first)) if rank == 0 else list(range(first, N_LAYERS))
    stage = Stage(full, mine, first=rank == 0, last=rank == 1)
    cfg = fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS, mitigation="auto",
                         qk_clip_threshold=TAU, collective_timeout_s=60)
    w = fw.watch(stage, config=cfg)
    opt = torch.optim.SGD(stage.parameters(), lr=0.0)  # weights change by QK-clip only
    q_before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    tokens = batch(0)
    pipeline_step(stage, rank, tokens, opt)
    r0 = w.step()
    q_after = {n: p.detach().clone() for n, p in stage.named_parameters()}
    # a mode set by hand on the stage that holds layers.3 reaches that stage's kernel
    if rank == 1:
        w.set_head_modes("layers.3.attention", [0, int(fw.Mode.FP32_O), 0, 0])
    pipeline_step(stage, rank, batch(1), opt)
    r1 = w.step()
    out = dict(
        truth=truth(full_model(), tokens),
        heads0=[(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio,
                 h.wq_spectral_norm) for h in r0.heads],
        modes1={(h.layer, h.head): int(h.head_mode) for h in r1.heads},
        unmitigable1=dict(r1.unmitigable), errors=w.monitor_errors_total,
        held=[st.site.name for st in w.layer_states],
        clip_events=[(e.layer, e.head) for e in r0.events if e.kind == "qk_clip"],
        ratios={n: (q_after[n] / q_before[n]) for n in q_before
                if n.endswith(("q_proj.weight", "k_proj.weight"))})
    w.remove()
    return out


def _scheduled(schedule_name: str, rank: int) -> dict:
    """2 + 2 layers run by torch.distributed.pipelining (PipelineStage, 3 micro-batches):
    the first step is monitored, where the stage's metadata inference runs an extra
    forward on torch.empty inputs (stage 1) that must not be measured. GPipe and 1F1B:
    one stage of 2 layers per rank. Interleaved 1F1B: 4 stages of one layer, rank r
    holding stages r and r + 2, watched by one watcher over a module that holds the
    rank's layers under their names in the model (the stages share them)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    full = full_model()
    loss_fn = lambda out, tgt: F.cross_entropy(out.reshape(-1, VOCAB), tgt.reshape(-1))  # noqa: E731
    if schedule_name == "interleaved":
        mine = [rank, rank + 2]
        w = fw.watch(Stage(full, mine, first=False, last=False), config=_schedule_config())
        stages = [PipelineStage(Stage(full, [i], first=i == 0, last=i == N_LAYERS - 1), i,
                                N_LAYERS, torch.device("cpu")) for i in mine]
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=3, loss_fn=loss_fn)
    else:
        mod = Stage(full, [0, 1] if rank == 0 else [2, 3], first=rank == 0, last=rank == 1)
        w = fw.watch(mod, config=_schedule_config())
        stage = PipelineStage(mod, rank, 2, torch.device("cpu"))
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](
            stage, n_microbatches=3, loss_fn=loss_fn)
    tokens = batch(0)
    if rank == 0:
        schedule.step(tokens[:, :-1])
    else:
        schedule.step(target=tokens[:, 1:])
    r = w.step()
    out = dict(truth=truth(full_model(), tokens), errors=w.monitor_errors_total,
               held=[st.site.name for st in w.layer_states],
               heads0=[(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio,
                        h.wq_spectral_norm) for h in r.heads])
    w.remove()
    return out


def _schedule_config():
    return fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS,
                          collective_timeout_s=60)


def _bf16_reports(run_step, steps=2) -> list:
    """(layer, head, δ sum, δ rows, tie ratio, max logit) of each head, at each of
    `steps` monitored steps of BF16-autocast training: what the sign statistic reads."""
    out = []
    for step in range(steps):
        r = run_step(step)
        out.append([(h.layer, h.head, h.delta_error_sum, h.delta_error_rows,
                     h.tied_rowmax_ratio, h.attention_max_logit) for h in r.heads])
    return out


def _bf16_config():
    return fw.WatchConfig(every_n_steps=1, rows_per_head="all", collective_timeout_s=60)


def _bf16_pipeline(rank: int) -> list:
    """2 + 2 stages under BF16 autocast: the δ error of each stage's heads, which under
    pipeline parallelism is the whole loss's, not a replica's share of it."""
    full = full_model()
    stage = Stage(full, [0, 1] if rank == 0 else [2, 3], first=rank == 0, last=rank == 1)
    w = fw.watch(stage, config=_bf16_config())
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)

    def run_step(step):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipeline_step(stage, rank, batch(step), opt)
        return w.step()

    try:
        return _bf16_reports(run_step)
    finally:
        w.remove()


def bf16_single_process() -> list:
    """The same training on the whole model in one process: the truth for the stages."""
    full = full_model()
    model = Stage(full, list(range(N_LAYERS)), first=True, last=True)
    w = fw.watch(model, config=_bf16_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run_step(step):
        tokens = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, VOCAB),
                            tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        return w.step()

    try:
        return _bf16_reports(run_step)
    finally:
        w.remove()


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    results = {}
    for split in SPLITS:
        results[split] = _run(split, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    results["bf16"] = _bf16_pipeline(rank)
    for schedule in SCHEDULES:
        results[schedule] = _scheduled(schedule, rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return gloo_ranks(_worker, 2, tmp_path_factory.mktemp("pipeline"))


@pytest.mark.parametrize("split", list(SPLITS) + list(SCHEDULES))
def test_every_global_head_is_reported_once_under_its_name_on_both_stages(results, split):
    r0, r1 = results[0][split], results[1][split]
    truth = r0["truth"]
    assert r0["errors"] == r1["errors"] == 0
    assert r0["heads0"] == r1["heads0"]  # the same global table on both stages
    keys = [(layer, h) for layer, h, *_ in r0["heads0"]]
    assert sorted(keys) == sorted(truth) and len(set(keys)) == len(keys)  # each once
    if split != "interleaved":  # in the model's order (interleaved: rank 0's layers first)
        assert keys == list(truth)
    first = SPLITS.get(split, 2)
    if split in SPLITS:
        assert r0["held"] == [f"layers.{i}.attention" for i in range(first)]
        assert r1["held"] == [f"layers.{i}.attention" for i in range(first, N_LAYERS)]
    if split == "interleaved":  # rank r: stages r and r + 2
        assert r0["held"] == ["layers.0.attention", "layers.2.attention"]
        assert r1["held"] == ["layers.1.attention", "layers.3.attention"]
    for layer, h, max_logit, tie, sigma in r0["heads0"]:
        t = truth[(layer, h)]
        assert max_logit == pytest.approx(t["max_logit"], rel=1e-5), (layer, h)
        assert tie == t["tie"], (layer, h)  # every row counted: exactly the FP64 count
        assert sigma == pytest.approx(t["sigma"], rel=1e-4), (layer, h)
    ties = [t["tie"] for t in truth.values()]
    assert min(ties) < max(ties)  # the planted data makes them differ between heads


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_hand_set_mode_runs_on_the_stage_that_holds_the_head(results, split):
    r0, r1 = results[0][split], results[1][split]
    for r in (r0, r1):  # both stages report it, and that the kernel ran it
        assert r["modes1"][("layers.3.attention", 1)] == int(fw.Mode.FP32_O)
        assert {k for k, m in r["modes1"].items() if m} == {("layers.3.attention", 1)}
    assert "layers.3.attention" not in r1["unmitigable1"]


@pytest.mark.parametrize("split", list(SPLITS))
def test_qk_clip_scales_exactly_the_heads_above_tau_on_their_stage(results, split):
    truth = results[0][split]["truth"]
    above = {k for k, t in truth.items() if t["max_logit"] > TAU}
    assert 0 < len(above) < len(truth)  # τ splits the heads
    clipped = set()
    for rank in (0, 1):
        r = results[rank][split]
        # each stage reports every clip of the job, once (the stage that holds a head
        # scales it; the books are the same on both: tests/parallel/test_global_books.py)
        assert sorted(tuple(e) for e in r["clip_events"]) == sorted(above)
        for name, ratio in r["ratios"].items():
            layer = name.split(".attention.")[0] + ".attention"
            which = "q" if "q_proj" in name else "k"
            per_head = ratio.view(H, -1)
            for h in range(H):
                t = truth[(layer, h)]["max_logit"]
                eta = TAU / t
                want = eta ** 0.5 if (layer, h) in above else 1.0  # α = 0.5 (default)
                assert torch.allclose(per_head[h], torch.full_like(per_head[h], want),
                                      rtol=1e-5), (name, h, which)
                if (layer, h) in above:
                    clipped.add((layer, h))
    assert clipped == above  # each scaled on the stage that holds it


def test_bf16_stages_report_what_the_whole_model_reports_in_one_process(results):
    """Under BF16 autocast, with every row measured: each head's δ sum, δ rows, tie ratio
    and max logit on either stage equal the one-process run's (the stage's dO is the
    whole loss's: scaling it as a replica's share would halve every stage's Σc)."""
    torch.set_num_threads(1)
    truth = bf16_single_process()
    for rank in (0, 1):
        got = results[rank]["bf16"]
        for step, (mine, want) in enumerate(zip(got, truth, strict=True)):
            assert [h[:2] for h in mine] == [h[:2] for h in want]
            for a, b in zip(mine, want, strict=True):
                assert a[3] == b[3] and a[3] > 0, (step, a, b)  # rows with δ
                assert a[4] == b[4], (step, a, b)
                assert a[5] == pytest.approx(b[5], rel=1e-6), (step, a, b)
                assert a[2] == pytest.approx(b[2], rel=1e-4, abs=1e-9), (step, a, b)
    assert any(abs(h[2]) > 1e-6 for h in truth[0])  # BF16 made a δ error to compare


# --- DP × PP: 4 ranks, 2 stages × 2 data-parallel replicas of each ---------------------


def _dp_pp_worker(rank, world, init_file, out_dir):
    """Rank = 2·stage + replica. Each stage is DDP over its two replicas; replica d of
    stage 0 sends to replica d of stage 1. Replica d trains on batch(step, d)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    stage_idx, dp = divmod(rank, 2)
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    full = full_model()
    mod = Stage(full, [0, 1] if stage_idx == 0 else [2, 3], first=stage_idx == 0,
                last=stage_idx == 1)
    w = fw.watch(mod, config=fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS,
                                            collective_timeout_s=60))
    model = DDP(mod, process_group=dp_groups[stage_idx])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"reports": []}
    for step in range(2):
        tokens = batch(10 * step + dp)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if stage_idx == 0:
                act = model(tokens[:, :-1])
                dist.send(act.detach().float(), rank + 2)
                grad = torch.empty(act.shape)
                dist.recv(grad, rank + 2)
                act.backward(grad.to(act.dtype))
            else:
                act = torch.empty(B, T, D_MODEL)
                dist.recv(act, rank - 2)
                act.requires_grad_(True)
                logits = model(act)
                F.cross_entropy(logits.float().reshape(-1, VOCAB),
                                tokens[:, 1:].reshape(-1)).backward()
                dist.send(act.grad.float(), rank - 2)
        opt.step()
        opt.zero_grad()
        r = w.step()
        out["reports"].append([(h.layer, h.head, h.delta_error_sum, h.delta_error_rows,
                                h.tied_rowmax_ratio, h.attention_max_logit)
                               for h in r.heads])
    out["errors"] = w.monitor_errors_total
    w.remove()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def dp_single_process() -> list:
    """One process training the whole model on both replicas' batches at once (the
    global batch, its mean loss): what the 4 ranks must each report."""
    full = full_model()
    model = Stage(full, list(range(N_LAYERS)), first=True, last=True)
    w = fw.watch(model, config=fw.WatchConfig(every_n_steps=1, rows_per_head="all", eps=EPS))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reports = []
    for step in range(2):
        tokens = torch.cat([batch(10 * step + d) for d in range(2)])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, VOCAB),
                            tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        r = w.step()
        reports.append([(h.layer, h.head, h.delta_error_sum, h.delta_error_rows,
                         h.tied_rowmax_ratio, h.attention_max_logit) for h in r.heads])
    w.remove()
    return reports


def test_dp_x_pp_reports_what_one_process_reports_on_the_global_batch(tmp_path):
    """4 gloo ranks, 2 pipeline stages × 2 DDP replicas, BF16 autocast, every row
    measured: all four ranks report the same 16 heads, each equal to one process
    training the whole model on the global batch (replicas summed and divided by their
    count, 2; the stages placed, not summed): δ sum, δ rows, tie ratio, max logit at the
    first step; rows and max logit at the second (after a step, DDP's summation order
    moves the weights by rounding, and δ is a rounding error itself)."""
    results = gloo_ranks(_dp_pp_worker, 4, tmp_path)
    torch.set_num_threads(1)
    truth = dp_single_process()
    for rank, r in enumerate(results):
        assert r["errors"] == 0, rank
        for step, (mine, want) in enumerate(zip(r["reports"], truth, strict=True)):
            assert [h[:2] for h in mine] == [h[:2] for h in want]
            for a, b in zip(mine, want, strict=True):
                assert a[3] == b[3] and a[3] > 0, (rank, step, a, b)
                # BF16: after a step the weights differ by rounding; heads differ by ≥ 10 %
                assert a[5] == pytest.approx(b[5], rel=1e-6 if step == 0 else 1e-2), (rank, a, b)
                if step == 0:  # then the weights differ by the order DDP sums gradients
                    assert a[4] == pytest.approx(b[4], abs=1e-12), (rank, step, a, b)
                    assert a[2] == pytest.approx(b[2], rel=1e-4, abs=1e-9), (rank, a, b)
