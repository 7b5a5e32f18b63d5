"""torchtitan 0.3.0's pipeline parallelism by its own pipeline_llm (4 layers over 2 gloo
ranks, 2 microbatches of 1; schedules 1F1B, GPipe and Interleaved1F1B, whose ranks hold
two stages each), the rank's model parts watched as pipeline_llm returns them,
fw.watch(model_parts): every layer, held by one stage, reported by every rank under its
name in the whole model, each head's max logit and tied rows against the FP64 truth of
the unsharded model's forward on the batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import finish_rank
from _trainers import ROWS, TITAN_HEADS, TITAN_VOCAB, titan_llama, torchtitan_on_cpu
from sdpa_calls import SdpaCalls, head_truth

import flashwatch as fw

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
LAYERS = 4


def _loss(pred, labels):  # torchtitan's loss functions return (loss, extras)
    return F.cross_entropy(pred.float().flatten(0, 1), labels.flatten()), None


def _worker(rank, world, init_file, out_dir):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    tokens = torch.randint(0, TITAN_VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    out = {}
    with torchtitan_on_cpu():
        for schedule_name in SCHEDULES:
            model = titan_llama(n_layers=LAYERS)
            # pipeline_llm reads only the layer count of the model's config
            model_config = type("Config", (), {"layers": [None] * LAYERS})
            schedule, parts, first, last = pipeline_llm(
                model, parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1,
                                                  pp=world, ep=1, world_size=world),
                training=TrainingConfig(local_batch_size=2),
                parallelism=ParallelismConfig(pipeline_parallel_degree=world,
                                              pipeline_parallel_schedule=schedule_name,
                                              pipeline_parallel_microbatch_size=1),
                compile_config=CompileConfig(), ac_config=None, dump_folder=out_dir,
                device=torch.device("cpu"), model_config=model_config,
                parallelize_fn=lambda m, **kw: m,  # no SPMD parallelism here
                loss_fn=_loss)
            w = fw.watch(parts, every_n_steps=1)
            if first:
                schedule.step(tokens[:, :-1], target=tokens[:, 1:] if last else None)
            else:
                schedule.step(target=tokens[:, 1:])
            report = w.step()
            out[schedule_name] = dict(
                errors=w.monitor_errors_total,
                heads=[(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio)
                       for h in report.heads])
            w.remove()
    finish_rank(out, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from _helpers import gloo_ranks

    return gloo_ranks(_worker, 2, tmp_path_factory.mktemp("pp"))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_stage_layer_by_its_name(ranks, schedule):
    whole = titan_llama(n_layers=LAYERS)
    tokens = torch.randint(0, TITAN_VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), SdpaCalls() as calls:
        whole(tokens[:, :-1])
    for r in ranks:
        got = r[schedule]
        assert got["errors"] == 0
        by = {(layer, h): (m, t) for layer, h, m, t in got["heads"]}
        assert len(by) == LAYERS * TITAN_HEADS
        for i, call in enumerate(calls.calls):
            tied, mx, rows = head_truth(call)
            for h in range(TITAN_HEADS):
                m, t = by[(f"layers.{i}.attention", h)]
                assert m == pytest.approx(float(mx[h]), rel=1e-4)
                assert round(t * rows) == int(tied[h])
    ROWS[("torchtitan 0.3.0", "Llama3, fuse_qkv=True, 4 layers",
          f"pipeline_llm {schedule}, 2 gloo ranks, 2 microbatches")] = (
        "layers.{i}.attention by stage, fw.watch(model_parts)",
        "every layer's heads on every rank: max logit ≤ 1e-4, ties exact vs FP64 of the "
        "unsharded forward; 0 errors")
