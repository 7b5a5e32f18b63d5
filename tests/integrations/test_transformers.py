"""flashwatch.integrations.transformers: a real Hugging Face Trainer (CPU, bf16) on a tiny
Llama built from a config: logged keys, one monitor step per optimizer step, evaluation
kept out, the Prometheus endpoint, and resume from a checkpoint."""

from __future__ import annotations

import math
import urllib.request

import pytest
import torch
from _helpers import ListSink
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from flashwatch import Mode, WatchConfig
from flashwatch.integrations.transformers import STATE_FILE, FlashWatchTrainerCallback

LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def _llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _data(n, T=16, seed=0):
    ids = torch.randint(0, 64, (n, T), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r} for r in ids]


def _trainer(tmp_path, *, samples=16, eval_samples=0, **kw):
    args = dict(output_dir=str(tmp_path), bf16=True, use_cpu=True, per_device_train_batch_size=4,
                learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to="none",
                disable_tqdm=True, seed=0, dataloader_num_workers=0)
    args.update(kw)
    return Trainer(model=_llama(), args=TrainingArguments(**args), train_dataset=_data(samples),
                   eval_dataset=_data(eval_samples, seed=1) if eval_samples else None)


class RecordLogs(TrainerCallback):
    """Stands in for TensorBoard, W&B, ...: what every report_to integration receives."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


def _comparable(report):
    d = report.to_dict()
    d.pop("monitor_seconds")
    return d


# ------------------------------------------------------------------------- arguments


def test_options_are_checked_and_named():
    trainer = _trainer("unused", max_steps=1)  # never trains: no output written
    cb = FlashWatchTrainerCallback(trainer, every_n_steps=3, mitigation="auto")
    assert cb.config == WatchConfig(every_n_steps=3, mitigation="auto")
    base = WatchConfig(window=8)  # config= and keywords, as the Lightning callback
    assert FlashWatchTrainerCallback(trainer, config=base, seed=2).config == WatchConfig(
        window=8, seed=2)
    with pytest.raises(TypeError, match=r"transformers.Trainer.*add_callback"):
        FlashWatchTrainerCallback(None)
    with pytest.raises(TypeError, match=r"FlashWatchTrainerCallback got unknown option\(s\) "
                       r"\['every_n_step'\] \(did you mean 'every_n_steps'\?\)"):
        FlashWatchTrainerCallback(trainer, every_n_step=3)
    with pytest.raises(ValueError, match="FlashWatchTrainerCallback: mitigation"):
        FlashWatchTrainerCallback(trainer, mitigation="sometimes")
    with pytest.raises(ValueError, match="top_k"):
        FlashWatchTrainerCallback(trainer, top_k=-1)


# ------------------------------------------------- logging, accumulation, Prometheus


class ScrapeAtEnd(TrainerCallback):
    """Scrapes the callback's endpoint at train end, before flashwatch's callback closes it."""

    def __init__(self, fw_cb):
        self.fw_cb, self.url, self.body = fw_cb, None, None

    def on_train_end(self, args, state, control, **kwargs):
        self.url = self.fw_cb.watcher.sinks[-1].url
        self.body = urllib.request.urlopen(self.url, timeout=5).read().decode()


def test_trainer_logs_bounded_keys_once_per_optimizer_step(tmp_path):
    trainer = _trainer(tmp_path, max_steps=3, gradient_accumulation_steps=2)
    sink, seen = ListSink(), RecordLogs()
    cb = FlashWatchTrainerCallback(trainer, every_n_steps=1, sinks=[sink], prometheus_port=0)
    scrape = ScrapeAtEnd(cb)
    for c in (seen, scrape, cb):
        trainer.add_callback(c)
    trainer.train()  # 3 optimizer steps of 2 micro-batches each

    assert [r.step for r in sink.reports] == [0, 1, 2]
    assert cb.watcher is None and cb.state_dict()["step"] == 3
    assert not sink.closed  # a sink the user passed is the user's to close
    assert "flashwatch_monitor_step 2.0" in scrape.body
    with pytest.raises(OSError):  # the endpoint the callback opened is closed at train end
        urllib.request.urlopen(scrape.url, timeout=2)

    fw_logs = [(step, logs) for step, logs in seen.logs if "flashwatch/monitor_step" in logs]
    assert [(step, logs["flashwatch/monitor_step"]) for step, logs in fw_logs] == [
        (1, 0), (2, 1), (3, 2)]
    assert [step for step, logs in seen.logs if "loss" in logs] == [1, 2, 3]  # not displaced
    want = {"flashwatch/monitor_step", "flashwatch/monitor_seconds",
            "flashwatch/monitor_errors_total", "flashwatch/mitigations_total",
            "flashwatch/qk_clips_total", "flashwatch/heads_not_standard"}
    for layer in LAYERS:
        want |= {f"flashwatch/{layer}/{m}_max" for m in (
            "tied_rowmax_ratio", "attention_max_logit", "delta_drift_z", "delta_coherence",
            "wq_spectral_norm", "delta_error_share")}
        want |= {f"flashwatch/{layer}/heads_not_standard", f"flashwatch/{layer}/heads_flagged"}
    for i in (1, 2, 3):
        want |= {f"flashwatch/worst_{i}/{m}" for m in (
            "tied_rowmax_ratio", "attention_max_logit", "delta_error_sum",
            "r_projection_cumulative", "delta_drift_z", "delta_coherence",
            "wq_spectral_norm", "layer_index", "head")}
    for _, logs in fw_logs:
        assert {k for k in logs if k.startswith("flashwatch/")} == want
        assert all(math.isfinite(v) for k, v in logs.items() if k.startswith("flashwatch/"))
    assert cb.state_dict()["errors_total"] == 0


def test_evaluation_batches_do_not_enter_the_reports(tmp_path):
    def run(eval_samples, **kw):
        sink = ListSink()
        trainer = _trainer(tmp_path, max_steps=3, eval_samples=eval_samples, **kw)
        trainer.add_callback(FlashWatchTrainerCallback(trainer, every_n_steps=1, sinks=[sink]))
        trainer.train()
        return [_comparable(r) for r in sink.reports]

    evaluated = run(8, eval_strategy="steps", eval_steps=1, eval_on_start=True,
                    per_device_eval_batch_size=4)
    assert evaluated == run(0)


def test_a_model_without_attention_trains_unwatched_with_one_warning(tmp_path, caplog):
    trainer = _trainer(tmp_path, max_steps=1)
    cb = FlashWatchTrainerCallback(trainer, sites=None)
    trainer.model.model.layers = torch.nn.ModuleList()  # a Llama with no layer left
    trainer.add_callback(cb)
    trainer.train()
    assert cb.watcher is None and trainer.state.global_step == 1
    assert sum("not watching" in r.message for r in caplog.records) == 1


class RaiseAt(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt  # training stopped from outside


def test_train_after_an_interrupted_train_leaves_no_hook_behind(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2)
    cb = FlashWatchTrainerCallback(trainer, every_n_steps=1)
    trainer.add_callback(cb)
    trainer.add_callback(RaiseAt(1))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert cb.watcher is not None  # on_train_end never ran
    trainer.pop_callback(RaiseAt)
    trainer.train()
    assert cb.watcher is None and cb.state_dict()["step"] == 2
    attn = trainer.model.model.layers[0].self_attn
    assert not attn._forward_pre_hooks and not attn._forward_hooks


# ----------------------------------------------------------------------------- resume


class SetModesAt(TrainerCallback):
    """Forces modes by hand after optimizer step `at` (after flashwatch's own step)."""

    def __init__(self, at, fw_cb):
        self.at, self.fw_cb = at, fw_cb

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.fw_cb.watcher.set_head_modes(
                LAYERS[0], [Mode.BETA, Mode.STANDARD, Mode.FP32_O, Mode.STANDARD])


class StopAt(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:  # an interruption right after a checkpoint
            control.should_training_stop = control.should_save = True


def test_resume_from_checkpoint_continues_like_the_uninterrupted_run(tmp_path):
    def run(out, stop=None, resume=False):
        sink = ListSink()
        # rows_per_head < B·T: row sampling draws from the watcher's RNG, which must resume
        trainer = _trainer(out, max_steps=5, save_strategy="steps", save_steps=2)
        cb = FlashWatchTrainerCallback(trainer, every_n_steps=1, rows_per_head=16, window=8,
                                       min_history=2, sinks=[sink])
        for c in (cb, SetModesAt(2, cb)) + ((StopAt(stop),) if stop else ()):
            trainer.add_callback(c)
        trainer.train(resume_from_checkpoint=resume)
        return sink.reports, cb.state_dict()

    straight, final = run(tmp_path / "straight")
    first, _ = run(tmp_path / "split", stop=3)  # checkpoints at steps 2 and 3 ...
    assert (tmp_path / "split" / "checkpoint-3" / STATE_FILE).is_file()
    resumed, final2 = run(tmp_path / "split", resume=True)  # ... resumes from the last
    assert [r.step for r in resumed] == [3, 4]
    # the modes set after step 2 came back from the checkpoint (SetModesAt does not rerun)
    assert [h.head_mode for h in resumed[0].heads[:4]] == [
        Mode.BETA, Mode.STANDARD, Mode.FP32_O, Mode.STANDARD]
    assert [_comparable(r) for r in first + resumed] == [_comparable(r) for r in straight]
    assert final2["step"] == final["step"] == 5
    assert [m.tolist() for m in final2["modes"]] == [m.tolist() for m in final["modes"]]
    assert final2["events"] == final["events"]
    assert torch.equal(final2["rng"], final["rng"])
