"""flashwatch.integrations.lightning: a real Lightning Trainer (CPU, bf16-mixed) with
FlashWatchCallback: its config, logged keys, resume, gradient accumulation, validation.
Two-process strategies (DDP, FSDP2): tests/integrations/test_lightning_strategies.py."""

from __future__ import annotations

import csv
import logging
import math
import os
import re
import urllib.request

import lightning.pytorch as pl
import pytest
import torch
from _helpers import ListSink
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch import Mode
from flashwatch.integrations.lightning import FlashWatchCallback
from flashwatch.integrations.prometheus import PrometheusSink

SMALL = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
LAYERS = ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]


class LitGPT(pl.LightningModule):
    def __init__(self, seed=0, lr=3e-3):
        super().__init__()
        torch.manual_seed(seed)
        self.model = GPT(GPTConfig(**SMALL))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _data(batches, B=4, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, SMALL["vocab_size"], (batches * B, T + 1), generator=g)
    return DataLoader(TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=B, shuffle=False)


def _trainer(tmp_path, callbacks, **kw):
    kw.setdefault("logger", False)
    return pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed",
                      log_every_n_steps=1, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False,
                      callbacks=callbacks, default_root_dir=tmp_path, **kw)


def _comparable(report):
    d = report.to_dict()
    d.pop("monitor_seconds")
    return d


def test_config_and_fields_are_taken_like_the_hf_callback_and_unknown_ones_are_named():
    cb = FlashWatchCallback(every_n_steps=3, mitigation="auto")
    assert cb.config == fw.WatchConfig(every_n_steps=3, mitigation="auto")
    base = fw.WatchConfig(window=8, mitigation="auto")
    assert FlashWatchCallback(config=base).config is base
    # a keyword replaces the config's value; the other fields stay the config's
    assert FlashWatchCallback(config=base, window=16).config == fw.WatchConfig(
        window=16, mitigation="auto")
    assert FlashWatchCallback().config == fw.WatchConfig()
    with pytest.raises(TypeError, match=r"FlashWatchCallback got unknown option\(s\) "
                       r"\['every_n_step'\] \(did you mean 'every_n_steps'\?\).*config="):
        FlashWatchCallback(every_n_step=3)
    with pytest.raises(TypeError, match=r"FlashWatchCallback: config must be a "
                       r"flashwatch.WatchConfig, got \{'window': 8\}"):
        FlashWatchCallback(config={"window": 8})
    with pytest.raises(ValueError, match="FlashWatchCallback: mitigation must be one of"):
        FlashWatchCallback(mitigation="sometimes")
    with pytest.raises(ValueError, match=r"FlashWatchCallback: top_k must be an int ≥ 0, "
                       r"got -1; 0 = no worst-head keys"):
        FlashWatchCallback(top_k=-1)
    with pytest.raises(TypeError, match="log_per_head must be True or False, got 1"):
        FlashWatchCallback(log_per_head=1)


class ScrapeAtEnd(pl.Callback):
    """Scrapes the callback's Prometheus endpoint while the trainer is still running."""

    def __init__(self, fw_cb):
        self.fw_cb, self.url, self.body = fw_cb, None, None

    def on_train_end(self, trainer, pl_module):
        self.url = self.fw_cb.watcher.sinks[-1].url
        self.body = urllib.request.urlopen(self.url, timeout=5).read().decode()


def test_trainer_logs_bounded_finite_keys_to_csv(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    sink = ListSink()
    cb = FlashWatchCallback(every_n_steps=1, log_per_head=True, sinks=[sink],
                            prometheus_port=0)
    scrape = ScrapeAtEnd(cb)
    _trainer(tmp_path, [cb, scrape], logger=logger, max_steps=4).fit(LitGPT(), _data(4))
    assert [r.step for r in sink.reports] == [0, 1, 2, 3]
    assert cb.watcher is None  # teardown removed it ...
    assert "flashwatch_monitor_step 3.0" in scrape.body
    with pytest.raises(OSError):  # ... and shut the endpoint down
        urllib.request.urlopen(scrape.url, timeout=2)

    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    keys = {k for r in rows for k, v in r.items() if k.startswith("flashwatch/") and v != ""}
    want = {"flashwatch/monitor_step", "flashwatch/monitor_seconds",
            "flashwatch/monitor_errors_total", "flashwatch/mitigations_total",
            "flashwatch/heads_not_standard", "flashwatch/qk_clips_total"}
    for layer in LAYERS:
        want |= {f"flashwatch/{layer}/{m}_max" for m in (
            "tied_rowmax_ratio", "attention_max_logit", "delta_drift_z", "delta_coherence",
            "wq_spectral_norm", "delta_error_share")}
        want |= {f"flashwatch/{layer}/heads_not_standard", f"flashwatch/{layer}/heads_flagged"}
        for h in range(4):
            want |= {f"flashwatch/{layer}/head_{h}/{m}" for m in (
                "tied_rowmax_ratio", "attention_max_logit", "delta_error_sum",
                "r_projection_cumulative", "delta_drift_z", "delta_coherence",
                "wq_spectral_norm", "head_mode")}
    for i in (1, 2, 3):  # top_k = 3 by default
        want |= {f"flashwatch/worst_{i}/{m}" for m in (
            "tied_rowmax_ratio", "attention_max_logit", "delta_error_sum",
            "r_projection_cumulative", "delta_drift_z", "delta_coherence",
            "wq_spectral_norm", "layer_index", "head")}
    assert keys == want
    # the docstring's count: 6 + 8·L + 9·top_k, + 8 per head
    assert len(want) == 6 + 8 * 2 + 9 * 3 + 8 * 8
    doc = FlashWatchCallback.__doc__
    for key in want:  # every key family is documented
        generic = re.sub(r"model\.transformer\.h\.\d\.attn", "<layer>", key)
        generic = re.sub(r"head_\d", "head_<h>", re.sub(r"worst_\d", "worst_<i>", generic))
        assert generic in doc or generic.rsplit("/", 1)[0] + "/<metric>" in doc, generic
    for r in rows:
        for k, v in r.items():
            if k.startswith("flashwatch/") and v != "":
                assert math.isfinite(float(v)), (k, v)
    # at log_every_n_steps=1 each monitored step is logged once, on the same row as loss
    logged = [r for r in rows if r.get("flashwatch/monitor_step", "") != ""]
    assert [float(r["flashwatch/monitor_step"]) for r in logged] == [0, 1, 2, 3]
    assert all(r["loss"] != "" for r in logged)


def test_a_sink_the_user_passed_stays_open_and_serves_a_second_fit(tmp_path):
    sink = PrometheusSink(port=0)  # the user's: the callback never closes it
    cb = FlashWatchCallback(every_n_steps=1, sinks=[sink])
    try:
        steps = 0
        for n in (2, 3):  # the watcher's state carries over to the second fit()
            _trainer(tmp_path, [cb], max_steps=n).fit(LitGPT(), _data(n))
            steps += n
            body = urllib.request.urlopen(sink.url, timeout=5).read().decode()
            assert f"flashwatch_monitor_step {steps - 1}.0" in body
    finally:
        sink.close()


def test_unwatchable_module_warns_once_and_trains(tmp_path):
    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    cb = FlashWatchCallback()
    with pytest.warns(UserWarning, match="not watching Plain") as rec:
        _trainer(tmp_path, [cb], max_steps=2).fit(Plain(), data)
    assert sum("not watching" in str(w.message) for w in rec) == 1


def test_accumulate_grad_batches_gives_one_monitor_step_per_optimizer_step(tmp_path):
    sink = ListSink()
    cb = FlashWatchCallback(every_n_steps=1, sinks=[sink])
    trainer = _trainer(tmp_path, [cb], max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(LitGPT(), _data(6))  # 6 micro-batches → 3 optimizer steps
    assert trainer.global_step == 3
    assert [r.step for r in sink.reports] == [0, 1, 2]
    assert cb.state_dict()["watcher"]["step"] == 3


class LitGPTVal(LitGPT):
    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.model(x.flip(0))  # other tokens than training: would change the numbers


def test_validation_batches_do_not_enter_the_reports(tmp_path):
    def run(module, val):
        sink = ListSink()
        cb = FlashWatchCallback(every_n_steps=1, sinks=[sink])
        _trainer(tmp_path, [cb], max_epochs=2, num_sanity_val_steps=2).fit(
            module, _data(2), val_dataloaders=_data(2, seed=1) if val else None)
        return [_comparable(r) for r in sink.reports]

    assert run(LitGPTVal(), val=True) == run(LitGPT(), val=False)


def test_a_failing_lightning_log_never_stops_training(tmp_path, caplog):
    class Broken(LitGPT):
        def log(self, name, *args, **kwargs):
            if name.startswith("flashwatch/"):
                raise RuntimeError("logger down")
            return super().log(name, *args, **kwargs)

    sink = ListSink()
    trainer = _trainer(tmp_path, [FlashWatchCallback(every_n_steps=1, sinks=[sink])],
                       logger=CSVLogger(tmp_path, name="csv"), max_steps=3)
    with caplog.at_level(logging.ERROR, logger="flashwatch"):
        trainer.fit(Broken(), _data(3))
    assert trainer.global_step == 3 and len(sink.reports) == 3
    assert sum("logging through Lightning failed" in r.message for r in caplog.records) == 1


class SetModesAt(pl.Callback):
    """Forces modes by hand after optimizer step `at` (after flashwatch's own step)."""

    def __init__(self, at, fw_cb):
        self.at, self.fw_cb = at, fw_cb

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            self.fw_cb.watcher.set_head_modes(
                LAYERS[0], [Mode.BETA, Mode.STANDARD, Mode.FP32_O, Mode.STANDARD])


def test_resume_from_checkpoint_restores_modes_and_continues_identically(tmp_path):
    def run(max_epochs, ckpt=None, save=None):
        sink = ListSink()
        # rows_per_head < B·T: row sampling draws from the watcher's RNG, which must resume
        cb = FlashWatchCallback(every_n_steps=1, rows_per_head=16, window=8, min_history=4,
                                sinks=[sink])
        trainer = _trainer(tmp_path, [cb, SetModesAt(3, cb)], max_epochs=max_epochs)
        trainer.fit(LitGPT(), _data(2), ckpt_path=ckpt)  # 2 optimizer steps per epoch
        if save:
            trainer.save_checkpoint(save)
        return sink.reports, cb.state_dict()["watcher"]

    straight, final = run(4)
    first, _ = run(2, save=tmp_path / "half.ckpt")
    resumed, final2 = run(4, ckpt=tmp_path / "half.ckpt")
    assert [r.step for r in resumed] == [4, 5, 6, 7]
    # modes set at step 3 came back from the checkpoint, not from SetModesAt (step 3 is
    # not run again)
    assert [h.head_mode for h in resumed[0].heads[:4]] == [
        Mode.BETA, Mode.STANDARD, Mode.FP32_O, Mode.STANDARD]
    assert [_comparable(r) for r in first + resumed] == [_comparable(r) for r in straight]
    assert [m.tolist() for m in final2["modes"]] == [m.tolist() for m in final["modes"]]
    assert final2["events"] == final["events"]


class LitBuiltLate(LitGPT):
    """Layers built in configure_model(), the pattern Lightning recommends for FSDP."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.lr = 3e-3
        self.model = None

    def configure_model(self):
        if self.model is None:
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(**SMALL))


def test_layers_built_in_configure_model_are_watched(tmp_path):
    sink = ListSink()
    cb = FlashWatchCallback(every_n_steps=1, sinks=[sink])
    _trainer(tmp_path, [cb], max_steps=3).fit(LitBuiltLate(), _data(3))
    assert len(sink.reports) == 3
    assert sorted({h.layer for h in sink.reports[-1].heads}) == LAYERS
    assert all(math.isfinite(h.wq_spectral_norm) for h in sink.reports[-1].heads)


def test_a_short_fit_with_default_log_cadence_says_flashwatch_runs(tmp_path, caplog):
    # Lightning's default log_every_n_steps=50 logs no metric in a 20-step fit: the
    # callback's own first-report line is then the only sign that flashwatch ran.
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=20,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, logger=False, default_root_dir=tmp_path,
                         callbacks=[FlashWatchCallback(every_n_steps=4)])
    with caplog.at_level(logging.INFO):
        trainer.fit(LitGPT(), _data(20))
    lines = [r.getMessage() for r in caplog.records if "flashwatch: watching" in r.getMessage()]
    assert len(lines) == 1, lines  # once, not every report
    assert "watching 2 attention layers (8 heads)" in lines[0], lines[0]
    assert "one optimizer step in 4" in lines[0] and "first report at step 0" in lines[0]
    assert "every 50 steps" in lines[0], lines[0]
