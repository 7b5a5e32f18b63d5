"""flashwatch.integrations.torchtitan: torchtitan 0.3.0's own Trainer and training loop
(its llama3_debugmodel config cut to 2 layers on torchtitan's SDPA backend, SelectiveAC,
its checkpointer, MetricsProcessor and validator), watched by the documented line
`watched(config, ...)`. Each monitored step against the FP64 truth of what that step's
forward handed SDPA; the keys in torchtitan's TensorBoard events; resume through its
checkpointer; 2 gloo ranks with its data parallelism.

Data and tokenizer are stand-ins (torchtitan's default c4_test dataset and tokenizer
files ship in its repository, not in the wheel): seeded random tokens, one stream per
data-parallel rank, stateful so a resumed run reads on where it stopped."""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _helpers import ListSink, finish_rank, gloo_ranks
from _trainers import TITAN_VOCAB, record, titan_llama, titan_sites, torchtitan_on_cpu
from sdpa_calls import SdpaCalls, check_heads, head_truth
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from flashwatch.integrations.torchtitan import FlashWatchTrainer, watched


class Tokens(BaseTokenizer):
    """No text: the data below is token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config, *, tokenizer_path=None):
        super().__init__()

    def encode(self, *args, **kwargs):
        return []

    def decode(self, *args, **kwargs):
        return ""

    def get_vocab_size(self):
        return TITAN_VOCAB


class RandomTokens(BaseDataLoader):
    """Batch n of data-parallel rank r: seeded by (split, n, r); its state is n."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        split: int = 0  # 1: the validator's stream
        infinite: bool = True  # the Validator sets it

    def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len,
                 local_batch_size, **kwargs):
        self.split, self.rank = config.split, dp_rank
        self.shape, self.n = (local_batch_size, seq_len + 1), 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(10_000 * self.split + 100 * self.n + self.rank)
            self.n += 1
            t = torch.randint(0, TITAN_VOCAB, self.shape, generator=g)
            yield {"input": t[:, :-1]}, t[:, 1:]

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state_dict):
        self.n = state_dict["n"]


def titan_config(folder, *, steps=3, dtype="float32", validate=False, backend="sdpa",
                 **parallelism):
    """torchtitan's own llama3_debugmodel Trainer.Config, with 2 of its layers on its SDPA
    backend (its default flex backend has no backward on CPU; backend "flex" or "varlen":
    the registry's model with that backend, test_torchtitan_trainer_flex.py), 2 × 32
    tokens a step, its SelectiveAC, its checkpointer saving every 2 steps, TensorBoard
    on, log_freq 1."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()
    if backend != "sdpa":
        cfg.model_spec = model_registry("debugmodel", attn_backend=backend)
    model = cfg.model_spec.model
    model.layers = model.layers[:2]
    for layer in model.layers if backend == "sdpa" else ():
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.tokenizer, cfg.dataloader = Tokens.Config(), RandomTokens.Config()
    cfg.training.seq_len, cfg.training.local_batch_size = 32, 2
    cfg.training.steps, cfg.training.dtype = steps, dtype
    cfg.dump_folder = str(folder)
    cfg.checkpoint.enable, cfg.checkpoint.interval = True, 2
    cfg.metrics.enable_tensorboard = True
    cfg.debug.seed = 0  # the same initial weights in every job (unset: a random seed)
    cfg.validator.enable = validate
    cfg.validator.freq, cfg.validator.steps = 1, 1
    cfg.validator.dataloader = RandomTokens.Config(split=1)
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    return cfg


class Forwards:
    """The SDPA calls of each forward of `model` with its train flag, recorded from its
    forward pre-hook to its forward hook: activation checkpointing's recompute in the
    backward runs inside no forward of the whole model, so it is not recorded."""

    def __init__(self, model):
        self.calls: list[tuple[bool, list]] = []
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)

    def _enter(self, module, args):
        self._mode = SdpaCalls()
        self._mode.__enter__()

    def _leave(self, module, args, out):
        self._mode.__exit__(None, None, None)
        self.calls.append((module.training, self._mode.calls))

    def training(self):
        return [calls for train, calls in self.calls if train]


def run(cfg, **watch):
    """Build the watched trainer from `cfg` (watched(cfg, **watch)) and train it; the
    trainer, the forwards it made, the reports its watcher wrote. Its monitor errors
    must be none."""
    sink = ListSink()
    trainer = watched(cfg, sinks=[sink], **watch).build()
    forwards = Forwards(trainer.model_parts[0])
    try:
        trainer.train()
        assert trainer.flashwatch.watcher.monitor_errors_total == 0
        trainer.sites = [_site_row(s) for s in trainer.flashwatch.watcher.sites]
    finally:
        trainer.close()
    return trainer, forwards, sink.reports


def _site_row(site):
    """What _trainers.record reads of a site, picklable (from a gloo rank)."""
    keys = ("name", "kind", "layout", "layer_heads", "num_kv_heads", "num_heads")
    return SimpleNamespace(**{k: getattr(site, k) for k in keys})


MODEL = "llama3_debugmodel, 2 layers, SDPA backend"


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = glob.glob(os.path.join(folder, "tb", "*", "events.*"))
    events = EventAccumulator(path)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def _wq_sigma(model) -> dict[str, torch.Tensor]:
    """Per layer, the FP64 spectral norm of each head's W^Q, read from torchtitan's
    fused wqkv: rows per K/V group, its query heads' then k's then v's."""
    out = {}
    for i, block in enumerate(model.layers.values()):
        attn = block.attention
        w = attn.qkv_linear.wqkv.weight
        w = (w.full_tensor() if callable(getattr(w, "full_tensor", None)) else w).double()
        per_kv = attn.n_heads // attn.n_kv_heads
        wq = w.view(attn.n_kv_heads, per_kv + 2, attn.head_dim, -1)[:, :per_kv]
        out[f"layers.{i}.attention"] = torch.linalg.matrix_norm(
            wq.reshape(attn.n_heads, attn.head_dim, -1), ord=2)
    return out


def test_every_step_of_its_loop_is_measured_exactly_and_logged_where_it_logs(titan, tmp_path):
    # BF16 weights (training.dtype): the SDPA inputs are BF16, the truth FP64 of them
    trainer, forwards, reports = run(titan_config(tmp_path, dtype="bfloat16"),
                                     every_n_steps=1)
    w = trainer.flashwatch
    assert isinstance(trainer, FlashWatchTrainer) and w.watcher is None  # removed at close
    assert [r.step for r in reports] == [0, 1, 2]
    assert reports[-1].heads and all(h.attention_max_logit > 0 for h in reports[-1].heads)
    for report, calls in zip(reports, forwards.training(), strict=True):
        assert calls[0]["q"].dtype == torch.bfloat16
        check_heads(report, calls, titan_sites(), rel=1e-4)
    # the backward's signals and σ are measured too (NaN with 0 errors before: the
    # trainer's FSDP weights on a ("dp_shard",) mesh of 1 were read as unsplit TP)
    last = reports[-1]
    assert all(h.delta_error_share > 0 and h.delta_error_rows > 0 for h in last.heads)
    for layer, want in _wq_sigma(trainer.model_parts[0]).items():
        got = [h.wq_spectral_norm for h in last.heads if h.layer == layer]
        assert got == pytest.approx(want.tolist(), rel=1e-4)  # weights as the last step left them
    scalars = _scalars(tmp_path)
    # torchtitan's step s (log_freq 1) carries monitored step s - 1
    assert scalars["flashwatch/monitor_step"] == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert scalars["flashwatch/monitor_errors_total"] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    for step, report in enumerate(reports, start=1):
        for layer in titan_sites():
            want = max(h.attention_max_logit for h in report.heads if h.layer == layer)
            got = dict(scalars[f"flashwatch/{layer}/attention_max_logit_max"])[step]
            assert got == pytest.approx(want, rel=1e-6)
    assert "loss_metrics/global_avg_loss" in scalars  # torchtitan's own keys, same file
    record(("torchtitan 0.3.0", MODEL, "its Trainer via watched(): SelectiveAC, BF16 "
            "weights, FSDP2 of 1, 1 process"), trainer.sites,
           "each step: max logit ≤ 1e-4, ties exact, σ ≤ 1e-4 vs FP64; keys in its "
           "TensorBoard; resume continues; 0 errors")


def test_validation_forwards_stay_out_of_the_next_step(titan, tmp_path):
    # torchtitan validates after every step (freq 1) on another token stream
    trainer, forwards, reports = run(titan_config(tmp_path, validate=True), every_n_steps=1)
    assert sum(not train for train, _ in forwards.calls) == 3  # one validation per step
    for report, calls in zip(reports, forwards.training(), strict=True):
        check_heads(report, calls, titan_sites(), rel=1e-4)


def _heads(report):
    return [(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio,
             h.wq_spectral_norm) for h in report.heads]


def _same_heads(a, b, rel):
    """Two _heads lists: the same heads, numbers within rel (NaN, not measured, equal)."""
    assert [x[:2] for x in a] == [y[:2] for y in b]
    assert [v for x in a for v in x[2:]] == pytest.approx([v for y in b for v in y[2:]],
                                                          rel=rel, nan_ok=True)


def _lasting(cfg):
    """`cfg` with a learning rate that does not depend on the job's length (one warmup
    step, which fits a 2-step job, then a decay to min_lr_factor 1), so a 2-step job's
    weights are a 4-step job's at step 2."""
    cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.min_lr_factor = 1, 1.0
    return cfg


def test_resume_through_its_checkpointer_continues_the_watcher(titan, tmp_path):
    whole, _, want = run(_lasting(titan_config(tmp_path / "whole", steps=4)), every_n_steps=1)
    run(_lasting(titan_config(tmp_path / "resumed", steps=2)), every_n_steps=1)
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoint")) == ["step-2"]
    # a new job on the same folder: torchtitan loads step-2 (model, optimizer, data,
    # train state and the watcher's entry) and trains steps 3 and 4
    resumed, _, got = run(_lasting(titan_config(tmp_path / "resumed", steps=4)),
                          every_n_steps=1)
    assert [r.step for r in got] == [2, 3]
    # the same numbers as the uninterrupted job (σ's power iteration continues from the
    # saved vectors: a fresh start differs in the 4th digit)
    for a, b in zip(want[2:], got, strict=True):
        _same_heads(_heads(a), _heads(b), rel=1e-6)


def test_a_checkpoint_written_without_flashwatch_resumes_with_a_fresh_watcher(
        titan, tmp_path, caplog):
    plain = titan_config(tmp_path, steps=2).build()  # torchtitan alone
    try:
        plain.train()
    finally:
        plain.close()
    with caplog.at_level(logging.WARNING):
        trainer, forwards, reports = run(titan_config(tmp_path, steps=3), every_n_steps=1)
    assert trainer.step == 3 and [r.step for r in reports] == [0]
    check_heads(reports[0], forwards.training()[0], titan_sites(), rel=1e-4)
    assert "written without flashwatch" in caplog.text


def test_watched_refuses_what_it_cannot_use(torchtitan_on_cpu, tmp_path):
    with pytest.raises(TypeError, match="every_n_step.*every_n_steps"):
        watched(titan_config(tmp_path), every_n_step=10)
    with pytest.raises(TypeError, match="torchtitan Trainer.Config"):
        watched({"steps": 3})


# ------------------------------------------------------------- 2 gloo ranks, DDP


def _ddp_worker(rank, world, init_file, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    with torchtitan_on_cpu():
        cfg = titan_config(os.path.join(out_dir, "job"), steps=2,
                           data_parallel_replicate_degree=world, spmd_backend="partial_dtensor")
        trainer, forwards, reports = run(cfg, every_n_steps=1)  # saves step-2
    torch.save(dict(calls=[[head_truth(c) for c in calls] for calls in forwards.training()],
                    heads=[_heads(r) for r in reports], sites=trainer.sites),
               f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    """2 steps of the job on 2 gloo ranks (data_parallel_replicate 2), its checkpoint
    folder; what each rank saw."""
    out = tmp_path_factory.mktemp("titan_ddp")
    return out, gloo_ranks(_ddp_worker, 2, out)


def test_data_parallel_ranks_report_the_heads_of_both_ranks_batches(ddp_job):
    _, ranks = ddp_job
    for a, b in zip(ranks[0]["heads"], ranks[1]["heads"], strict=True):
        _same_heads(a, b, rel=0)  # one reduced report on every rank
    for step, heads in enumerate(ranks[0]["heads"]):
        truths = [r["calls"][step] for r in ranks]  # per rank: per layer (tied, max, rows)
        for i, layer in enumerate(titan_sites()):
            tied = sum(t[i][0] for t in truths)
            mx = torch.stack([t[i][1] for t in truths]).amax(0)
            rows = sum(t[i][2] for t in truths)
            got = [h for h in heads if h[0] == layer]
            assert [h[1] for h in got] == list(range(len(mx)))
            for h, (_, _, m, ratio, _) in enumerate(got):
                assert m == pytest.approx(float(mx[h]), rel=1e-4)
                assert round(ratio * rows) == int(tied[h])
    record(("torchtitan 0.3.0", MODEL, "its Trainer via watched(): data_parallel_replicate "
            "2 (partial_dtensor), 2 gloo ranks"), ranks[0]["sites"],
           "each step, both ranks' rows: max logit ≤ 1e-4, ties exact vs FP64; 0 errors")


def test_a_2_rank_checkpoint_resumes_in_one_process(ddp_job, titan):
    """torchtitan reshards model and optimizer from its DCP checkpoint; the watcher's
    entry (a state by global head) comes back with them: the count carries on."""
    folder, ranks = ddp_job
    trainer, forwards, reports = run(titan_config(folder / "job", steps=3), every_n_steps=1)
    assert trainer.step == 3 and [r.step for r in reports] == [2]
    check_heads(reports[0], forwards.training()[0], titan_sites(), rel=1e-4)


# ------------------------------------------------------------- 2 gloo ranks, TP


def _tp_worker(rank, world, init_file, out_dir):
    """torchtitan's TP (tensor_parallel_degree 2, SequenceParallel on) through its
    Trainer, on the two DTensor backends: "partial_dtensor" (TP weights on the tp mesh)
    and "full_dtensor" (every weight on the whole SPMD mesh, (Replicate, Shard(0)))."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    out = {}
    with torchtitan_on_cpu():
        for backend in ("partial_dtensor", "full_dtensor"):
            cfg = titan_config(os.path.join(out_dir, backend), steps=2,
                               tensor_parallel_degree=world, spmd_backend=backend)
            cfg.checkpoint.enable = False
            trainer, forwards, reports = run(cfg, every_n_steps=1)
            out[backend] = dict(
                calls=[[head_truth(c) for c in calls] for calls in forwards.training()],
                heads=[_heads(r) for r in reports], sites=trainer.sites,
                sigma=_wq_sigma(trainer.model_parts[0]))  # full_tensor: every rank
    finish_rank(out, out_dir, rank)


@pytest.fixture(scope="module")
def tp_job(tmp_path_factory):
    return gloo_ranks(_tp_worker, 2, tmp_path_factory.mktemp("titan_tp"))


@pytest.mark.parametrize("backend", ["partial_dtensor", "full_dtensor"])
def test_tensor_parallel_ranks_report_every_global_head(tp_job, backend):
    """Each rank computes 8 of the 16 heads (whole K/V groups); the reduced report holds
    all 16 by global index, each against the FP64 truth of the rank that computed it.
    "full_dtensor" was refused at its first call ("a tensor-parallel Linear whose weight
    is sharded on a 2-D mesh as (Replicate(), Shard(dim=0)) is not supported"): NaN,
    2 errors."""
    ranks = [r[backend] for r in tp_job]
    for a, b in zip(ranks[0]["heads"], ranks[1]["heads"], strict=True):
        _same_heads(a, b, rel=0)
    for step, heads in enumerate(ranks[0]["heads"]):
        for i, layer in enumerate(titan_sites()):
            got = {h[1]: h for h in heads if h[0] == layer}
            assert sorted(got) == list(range(16))
            for rank, r in enumerate(ranks):
                tied, mx, rows = r["calls"][step][i]
                assert len(mx) == 8  # this rank's heads
                for h in range(8):
                    _, _, m, ratio, sigma = got[8 * rank + h]
                    assert m == pytest.approx(float(mx[h]), rel=1e-4)
                    assert round(ratio * rows) == int(tied[h])
    # σ of a TP-sharded W^Q: the warm-started sharded power iteration, which stops at a
    # relative change < 1e-5 (flashwatch/parallel/power.py): 1.06e-3 off on one head of
    # 32 here, as in tests/trainers/test_torchtitan_tp.py (1e-3)
    last = ranks[0]["heads"][-1]
    for layer, want in ranks[0]["sigma"].items():
        assert [h[4] for h in last if h[0] == layer] == pytest.approx(want.tolist(), rel=2e-3)
    record(("torchtitan 0.3.0", MODEL, f"its Trainer via watched(): TP 2 ({backend}), "
            "2 gloo ranks"), ranks[0]["sites"],
           "each step, every global head: max logit ≤ 1e-4, ties exact, σ ≤ 2e-3 vs FP64; "
           "0 errors")


def test_a_pipeline_ranks_model_parts_are_watched_as_one(torchtitan_on_cpu, gloo_world):
    """Under PP the Trainer holds a list of model parts (pipeline_llm's): watched as one,
    each layer under its whole-model name (find_sites refused the list: "model must be a
    torch.nn.Module, got list", raised from the Trainer's __init__), also for a part
    list of one. The PP loop itself: test_pipeline_stages_report_every_layer_of_the_job."""
    from flashwatch.integrations.torchtitan import TitanWatch

    parts = [titan_llama(n_layers=2)]
    trainer = SimpleNamespace(model_parts=parts, checkpointer=SimpleNamespace(enable=False),
                              parallel_dims=SimpleNamespace(pp_enabled=True))
    watch = TitanWatch(trainer, {"every_n_steps": 1})
    try:
        assert [s.name for s in watch.watcher.sites] == titan_sites()
    finally:
        watch.close()


def test_the_documented_line_through_torchtitans_command_line(monkeypatch):
    """`-m torchtitan.train --module <pkg> --config <fn>` with CLI overrides: torchtitan's
    ConfigManager (tyro) parses a FlashWatchTrainer.Config, its flashwatch arguments kept
    (a Python-only field, left out of the command line)."""
    from torchtitan.config import ConfigManager

    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    cfg = ConfigManager().parse_args(["--module", "titan_jobs", "--config",
                                      "llama3_debugmodel_watched", "--training.steps", "7"])
    assert isinstance(cfg, FlashWatchTrainer.Config)
    assert cfg.training.steps == 7
    assert cfg.flashwatch == {"mitigation": "auto", "every_n_steps": 10}
    with pytest.raises(SystemExit):  # not a command-line option
        ConfigManager().parse_args(["--module", "titan_jobs", "--config",
                                    "llama3_debugmodel_watched", "--flashwatch", "{}"])


# ------------------------------------------------------------- 2 gloo ranks, PP


def _pp_worker(rank, world, init_file, out_dir):
    """torchtitan's PP through its Trainer: 2 stages of one layer, 1F1B, 2 microbatches
    of 1 sequence a step (torch 2.13's step() gets the microbatch lists torchtitan 0.3
    passes from torchtitan_on_cpu)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    with torchtitan_on_cpu():
        cfg = titan_config(os.path.join(out_dir, "pp"), steps=2, pipeline_parallel_degree=world,
                           pipeline_parallel_schedule="1F1B",
                           pipeline_parallel_microbatch_size=1)
        cfg.checkpoint.enable = False
        cfg.training.disable_cuda_graphs = True  # torchtitan: CUDA graphs refuse PP
        trainer, forwards, reports = run(cfg, every_n_steps=1)
    finish_rank(dict(calls=[[head_truth(c) for c in calls] for calls in forwards.training()],
                     heads=[_heads(r) for r in reports], sites=trainer.sites),
                out_dir, rank)


def test_pipeline_stages_report_every_layer_of_the_job(tmp_path):
    """Each stage measures its layer over the step's 2 microbatches; every rank reports
    both layers, each against the FP64 truth of the stage that holds it."""
    ranks = gloo_ranks(_pp_worker, 2, tmp_path)
    for a, b in zip(ranks[0]["heads"], ranks[1]["heads"], strict=True):
        _same_heads(a, b, rel=0)
    for rank, r in enumerate(ranks):
        # the stage's forwards: its first-step metadata inference (left unmeasured),
        # then 2 microbatches a step
        assert len(r["calls"]) == 1 + 2 * 2
        layer = titan_sites()[rank]  # stage r holds layers.r
        for step, heads in enumerate(ranks[0]["heads"]):
            (t0,), (t1,) = r["calls"][1 + 2 * step: 3 + 2 * step]  # one layer per stage
            tied, rows = t0[0] + t1[0], t0[2] + t1[2]
            mx = torch.maximum(t0[1], t1[1])
            got = [h for h in heads if h[0] == layer]
            assert [h[1] for h in got] == list(range(16))
            for h, (_, _, m, ratio, _) in enumerate(got):
                assert m == pytest.approx(float(mx[h]), rel=1e-4)
                assert round(ratio * rows) == int(tied[h])
    record(("torchtitan 0.3.0", MODEL, "its Trainer via watched(): PP 2 (1F1B, 2 "
            "microbatches), 2 gloo ranks"), ranks[1]["sites"],
           "each step, each layer on its stage: max logit ≤ 1e-4, ties exact vs FP64; "
           "0 errors")
