"""flashwatch.integrations.olmo_core.FlashWatchCallback in OLMo-core 3.0.0's own training
loop: TrainerConfig → Trainer, TransformerTrainModule(Config) with BF16 autocast, OLMo's
NumpyFSLDataLoader over a token file, its Checkpointer, on CPU. Each watched step's heads
equal the FP64 truth of that step's forward and not of OLMo's dry-run batch; the keys
reach OLMo's logger callbacks; a resume through OLMo's Checkpointer equals the
uninterrupted run; under OLMo's FSDP on 2 gloo ranks each head covers both ranks' rows."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _trainers import OLMO_VOCAB, olmo_sites, olmo_transformer
from olmo_core.config import DType
from olmo_core.data import DataCollator, NumpyFSLDataLoader, NumpyFSLDataset
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import TransformerTrainModuleConfig
from sdpa_calls import SdpaCalls, check_heads, head_truth

from flashwatch import Mode
from flashwatch.integrations import shared
from flashwatch.integrations.olmo_core import FlashWatchCallback

SEQ = 32  # tokens per instance; 2 instances per rank and batch


def write_tokens(folder: Path) -> Path:
    """A token file of OLMo's numpy format (raw uint16) with 64 instances. Each instance
    is 4 random tokens repeated: with no position embedding but RoPE, repeats give equal
    keys at equal distances, so rows have tied maxima (the exact tie check can fail)."""
    g = np.random.default_rng(0)
    tokens = np.concatenate([np.tile(g.integers(1, OLMO_VOCAB, 4), SEQ // 4) for _ in range(64)])
    path = folder / "tokens.npy"
    tokens.astype(np.uint16).tofile(path)
    return path


def build(folder: Path, callbacks: dict, *, steps: int, hard_stop: int | None = None,
          save_interval: int | None = None, save_async: bool | None = None, dp=None,
          world: int = 1, rank: int = 0):
    """OLMo's Trainer as its docs build one: the tiny llama_like transformer (seed 0),
    AdamW, BF16 autocast, 2 instances per rank and step; checkpoints every
    `save_interval` steps to folder/ckpt (None: no checkpoints; save_async: OLMo's
    default, asynchronous where the backend has CPU collectives); `callbacks` added
    with TrainerConfig.with_callback (which deep-copies them: the live ones are
    trainer.callbacks[name])."""
    dataset = NumpyFSLDataset(folder / "tokens.npy", sequence_length=SEQ, pad_token_id=0,
                              eos_token_id=0, vocab_size=OLMO_VOCAB)
    dataset.work_dir = folder / "work"
    loader = NumpyFSLDataLoader(dataset, collator=DataCollator(pad_token_id=0),
                                global_batch_size=2 * SEQ * world, work_dir=folder / "work",
                                dp_world_size=world, dp_rank=rank)
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=1e-2),
        autocast_precision=DType.bfloat16, dp_config=dp,
    ).build(olmo_transformer(), device=torch.device("cpu"))
    config = TrainerConfig(
        save_folder=str(folder / "ckpt"), device="cpu", max_duration=Duration.steps(steps),
        hard_stop=None if hard_stop is None else Duration.steps(hard_stop),
        metrics_collect_interval=1, no_checkpoints=save_interval is None,
        callbacks={"checkpointer": CheckpointerCallback(save_interval=save_interval or 1,
                                                        pre_train_checkpoint=False,
                                                        save_async=save_async)})
    for name, cb in callbacks.items():
        config = config.with_callback(name, cb)
    return config.build(module, loader)


class ReportSink:
    """A flashwatch sink that keeps every report."""

    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


@dataclasses.dataclass
class Recorder(Callback):
    """What each check compares with: the SDPA calls of every training step's forward
    (pre_step to pre_optim_step), of OLMo's dry-run batch (pre_train to the first
    pre_step), and the flashwatch/* keys OLMo hands its logger callbacks, by step."""

    def __post_init__(self):
        self.calls, self.dry_run, self.logged = {}, None, defaultdict(dict)
        self._mode = None

    def pre_train(self):
        self._start()

    def pre_step(self, batch):
        if self.dry_run is None:
            self.dry_run = self._stop()
        self._start()

    def pre_optim_step(self):
        self.calls[self.step] = self._stop()

    def log_metrics(self, step, metrics):
        ours = {k: v for k, v in metrics.items() if k.startswith("flashwatch/")}
        if ours:
            self.logged[step].update(ours)

    def close(self):
        if self._mode is not None:
            self._stop()

    def _start(self):
        self._mode = SdpaCalls()
        self._mode.__enter__()

    def _stop(self):
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        return mode.calls


@dataclasses.dataclass
class Evaluate(Callback):
    """A forward on other tokens after every step, as OLMo's EvaluatorCallback.perform_eval
    makes them (train_module.eval_batch under no_grad, in post_step)."""

    def post_step(self):
        tokens = torch.randint(1, OLMO_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(
            self.step))
        with torch.no_grad():
            self.trainer.train_module.eval_batch({"input_ids": tokens})


@dataclasses.dataclass
class SetModes(Callback):
    """At OLMo step 2, head 0 of the first layer to BETA by hand (watcher.set_head_modes):
    a mode the saved state must carry over a resume."""

    def pre_step(self, batch):
        if self.step == 2:
            watcher = self.trainer.callbacks["flashwatch"].watcher
            watcher.set_head_modes(olmo_sites()[0], [Mode.BETA] + [Mode.STANDARD] * 7)


# ----------------------------------------------------------------------- 1 process


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 steps, every step monitored, an evaluation forward after each: (the flashwatch
    callback, the recorder)."""
    folder = tmp_path_factory.mktemp("olmo_run")
    write_tokens(folder)
    trainer = build(folder, {"flashwatch": FlashWatchCallback(every_n_steps=1,
                                                              sinks=[ReportSink()]),
                             "recorder": Recorder(), "evaluate": Evaluate()}, steps=3)
    trainer.fit()
    return trainer.callbacks["flashwatch"], trainer.callbacks["recorder"]


def test_each_step_is_its_own_forward_and_not_the_dry_run(run):
    """Each report's heads are exactly its step's training forward: neither OLMo's
    dry-run batch before step 1 nor the evaluation forwards between steps."""
    cb, rec = run
    reports = cb.options.sinks[0].reports
    assert [r.step for r in reports] == [0, 1, 2]  # watcher steps: OLMo's steps 1-3
    assert cb.watcher is None  # removed at close
    assert cb.state_dict()["watcher"]["errors_total"] == 0
    for report, step in zip(reports, (1, 2, 3), strict=True):
        check_heads(report, rec.calls[step], olmo_sites(), rel=1e-4)
    # Merged into step 1, OLMo's dry-run batch (random tokens) would change its numbers:
    # some head has a larger max logit or other ties there.
    dry, first = [head_truth(c) for c in rec.dry_run], [head_truth(c) for c in rec.calls[1]]
    assert len(dry) == 2
    assert any((d[1] > f[1]).any() or (d[0] != f[0]).any() for d, f in zip(dry, first, strict=True))
    # ties in the truth: the exact tie comparison above could fail
    assert sum(int(head_truth(c)[0].sum()) for calls in rec.calls.values() for c in calls) > 0


def test_keys_reach_olmos_logger_callbacks(run):
    """log_metrics, which every OLMo logger callback (console, W&B, Comet) implements,
    gets each report's bounded key set at the OLMo step it was made in."""
    cb, rec = run
    reports = cb.options.sinks[0].reports
    assert sorted(rec.logged) == [1, 2, 3]
    for report in reports:
        want = shared.logged_metrics(report, SimpleNamespace(monitor_errors_total=0),
                                     shared.Reports(), top_k=3, log_per_head=False)
        assert rec.logged[report.step + 1] == want
        assert want["flashwatch/monitor_step"] == report.step
        for layer in olmo_sites():
            assert want[f"flashwatch/{layer}/attention_max_logit_max"] == max(
                h.attention_max_logit for h in report.heads if h.layer == layer)
    # 6 + 8 per layer + 9 per worst head, less what a first step cannot measure yet (NaN)
    assert len(rec.logged[3]) <= 6 + 8 * 2 + 9 * 3
    assert all(not math.isnan(v) for step in rec.logged.values() for v in step.values())


def test_a_failure_inside_flashwatch_is_logged_once_and_training_goes_on(
        tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(shared, "logged_metrics", broken)
    write_tokens(tmp_path)
    trainer = build(tmp_path, {"flashwatch": FlashWatchCallback(every_n_steps=1,
                                                                sinks=[ReportSink()])},
                    steps=3)
    with caplog.at_level("ERROR", logger="flashwatch"):
        trainer.fit()
    assert trainer.global_step == 3
    assert len(trainer.callbacks["flashwatch"].options.sinks[0].reports) == 3
    failed = [r for r in caplog.records if "broken on purpose" in r.getMessage()]
    assert len(failed) == 1 and "recording metrics failed" in failed[0].getMessage()


# ---------------------------------------------------------------- checkpoint and resume


def differences(a, b, at: str = "") -> list[str]:
    """Where a and b differ (exactly; NaN equals NaN), through dicts, lists, tuples."""
    if isinstance(a, torch.Tensor):
        same = (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and bool(((a == b) | (a.isnan() & b.isnan())).all()))
        return [] if same else [at]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [at]
        return [d for k in a for d in differences(a[k], b[k], f"{at}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [at]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{at}/{i}")]
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return [] if a == b or nan else [at]


def comparable(report) -> dict:
    d = report.to_dict()
    d.pop("monitor_seconds")
    return d


def test_resume_through_olmos_checkpointer_equals_the_uninterrupted_run(tmp_path):
    """6 steps, every second monitored, head 0 set to BETA at step 2. Interrupted: a
    checkpoint at step 3 (the Checkpointer's post_train_batch) and a hard stop there,
    then a fresh model, train module, loader and Trainer resume from it to step 6."""
    def callbacks():
        return {"flashwatch": FlashWatchCallback(every_n_steps=2, sinks=[ReportSink()]),
                "modes": SetModes()}

    runs = {}
    for name in ("whole", "interrupted"):
        (tmp_path / name).mkdir()
        write_tokens(tmp_path / name)
    whole = build(tmp_path / "whole", callbacks(), steps=6)
    whole.fit()
    first = build(tmp_path / "interrupted", callbacks(), steps=6, hard_stop=3, save_interval=3)
    first.fit()
    saved = torch.load(tmp_path / "interrupted/ckpt/step3/train/rank0.pt", weights_only=False)
    assert saved["callbacks"]["flashwatch"]["watcher"]["step"] == 3  # stepped before the save
    second = build(tmp_path / "interrupted", callbacks(), steps=6, save_interval=3)
    second.fit()
    assert second.global_step == 6
    for name, trainer in (("whole", whole), ("first", first), ("second", second)):
        cb = trainer.callbacks["flashwatch"]
        runs[name] = (cb.state_dict()["watcher"], cb.options.sinks[0].reports)
    assert [r.step for r in runs["whole"][1]] == [0, 2, 4]
    assert [r.step for r in runs["first"][1]] == [0, 2]
    assert [r.step for r in runs["second"][1]] == [4]
    state, resumed = runs["second"][0], runs["whole"][0]
    assert state["step"] == 6 and state["errors_total"] == 0
    # over the job's 16 global heads, layer by layer: set at step 2, before the save
    assert state["modes"].tolist() == [int(Mode.BETA)] + [int(Mode.STANDARD)] * 15
    assert differences(state, resumed) == []
    assert comparable(runs["second"][1][0]) == comparable(runs["whole"][1][2])


# ------------------------------------------------------------------- 2 gloo ranks, FSDP


def _fsdp_run(rank, world, init_file, out_dir, hard_stop):
    """OLMo's FSDP (TransformerDataParallelConfig name=fsdp) to step 3, each rank its own
    batches, a checkpoint every 2 steps in the folder above out_dir; hard_stop: stop
    there. Saves each report's heads, the truths of this rank's SDPA calls by step, and
    the watcher's final step count.

    Checkpoints are saved synchronously: with OLMo's default async saves 2 runs in 4 hung
    at the end of fit(), rank 0 in reduce_metrics' all_reduce under
    _join_bookkeeping_ops, rank 1 gone; likely because the async save's done-callback
    records checkpoint/save_async_duration_s from another thread, so the ranks can flush
    metrics a different number of times (6 runs in 6 passed with synchronous saves)."""
    import torch.distributed as dist
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.train.train_module import TransformerDataParallelConfig

    # both ranks save to one local folder: OLMo refuses that unless told the filesystem
    # is shared (it is: one machine)
    os.environ["OLMO_SHARED_FS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    dp = TransformerDataParallelConfig(name=DataParallelType.fsdp, param_dtype=DType.float32)
    trainer = build(Path(out_dir).parent,
                    {"flashwatch": FlashWatchCallback(every_n_steps=1, sinks=[ReportSink()]),
                     "recorder": Recorder()},
                    steps=3, hard_stop=hard_stop, save_interval=2, dp=dp, world=world,
                    rank=rank, save_async=False)
    trainer.fit()
    cb, rec = trainer.callbacks["flashwatch"], trainer.callbacks["recorder"]
    torch.save(dict(
        reports=[(r.step, [(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio)
                           for h in r.heads]) for r in cb.options.sinks[0].reports],
        calls={s: [head_truth(c) for c in calls] for s, calls in rec.calls.items()},
        step=cb.state_dict()["watcher"]["step"]), Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_first(rank, world, init_file, out_dir):
    _fsdp_run(rank, world, init_file, out_dir, hard_stop=2)


def _fsdp_resumed(rank, world, init_file, out_dir):
    _fsdp_run(rank, world, init_file, out_dir, hard_stop=None)


def test_fsdp_on_two_gloo_ranks_with_a_resume(tmp_path):
    """2 steps, a checkpoint and a hard stop; new processes resume to step 3 (OLMo
    builds one world mesh per process). Every rank reports the same heads, each over
    both ranks' rows: ties the sum, max logit the max of their SDPA calls (FP64)."""
    from _helpers import gloo_ranks

    write_tokens(tmp_path)
    for name in ("first", "resumed"):
        (tmp_path / name).mkdir()
    first = gloo_ranks(_fsdp_first, 2, (tmp_path / "first").resolve())
    resumed = gloo_ranks(_fsdp_resumed, 2, (tmp_path / "resumed").resolve())
    assert [r["step"] for r in first + resumed] == [2, 2, 3, 3]  # continued at step 2
    ranks = [dict(reports=a["reports"] + b["reports"], calls={**a["calls"], **b["calls"]})
             for a, b in zip(first, resumed, strict=True)]
    for r in ranks:
        assert [s for s, _ in r["reports"]] == [0, 1, 2]
        assert r["reports"] == ranks[0]["reports"]
    for step, heads in ranks[0]["reports"]:
        by = {(layer, h): (m, t) for layer, h, m, t in heads}
        truths = [r["calls"][step + 1] for r in ranks]  # OLMo's step = watcher's + 1
        for i, layer in enumerate(olmo_sites()):
            for h in range(8):
                m, ratio = by[(layer, h)]
                assert m == pytest.approx(max(float(t[i][1][h]) for t in truths), rel=1e-4)
                rows = sum(t[i][2] for t in truths)
                assert round(ratio * rows) == sum(int(t[i][0][h]) for t in truths)
