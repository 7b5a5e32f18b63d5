"""`FlashWatchCallback`: flashwatch for PyTorch Lightning in one line (docs/design.md §7).

    from flashwatch.integrations.lightning import FlashWatchCallback
    trainer = L.Trainer(callbacks=[FlashWatchCallback(mitigation="auto")], ...)
"""

from __future__ import annotations

import logging

from flashwatch._checks import log_once, missing_extra

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
except ImportError as e:
    raise missing_extra("lightning", "lightning", "flashwatch.integrations.lightning") from e

import flashwatch
from flashwatch.config import WatchConfig
from flashwatch.integrations import shared
from flashwatch.report.records import StepReport

log = logging.getLogger("flashwatch")


class FlashWatchCallback(pl.Callback):
    """Watches the attention layers of the LightningModule while it trains.

    Keyword arguments (the Hugging Face callback takes the same):
      config           a `flashwatch.WatchConfig` (default: its defaults); any of its
                       fields may also be passed as a keyword (every_n_steps,
                       mitigation, ...) and then replaces the config's value:
                       FlashWatchCallback(config=cfg, every_n_steps=5).
      sinks            extra flashwatch sinks (JsonlSink, ConsoleSink, PrometheusSink,
                       ...). They stay yours: teardown does not close them, so a second
                       fit() writes to them again; close them when done.
      sites            which modules to watch, passed to `flashwatch.watch` (default:
                       found automatically).
      log_per_head     also log every head's metrics (keys grow with layers × heads).
      top_k            how many worst heads (largest delta_drift_z) to log. Default 3.
      prometheus_port  serve a Prometheus endpoint on this base port (+ LOCAL_RANK);
                       None (default) = no endpoint. prometheus_addr (default
                       "127.0.0.1"), prometheus_rank_zero_only, prometheus_certfile and
                       prometheus_keyfile are passed to `PrometheusSink`.

    Behaviour:
      on_fit_start attaches a watcher to pl_module, after `configure_model()` has built
                   its layers and the strategy has wrapped them (DDP, FSDP); if no
                   attention layer is found it warns once and training runs unwatched.
                   A checkpoint's state loaded before that is applied once the watcher
                   exists.
      each optimizer step: one `watcher.step()`, detected as a change of
                   trainer.global_step at the end of a batch, so accumulate_grad_batches
                   > 1 gives one monitor step per optimizer step, not per micro-batch.
      validation   monitoring pauses while validation runs (sanity check included), so
                   validation batches never enter the training step's numbers.
      state_dict   modes, accumulators, RNG and events: `trainer.fit(ckpt_path=...)`
                   resumes the watcher exactly.
      teardown     removes the watcher (the model is left as it was) and closes the
                   Prometheus endpoint it opened (prometheus_port), not your sinks.
      first report one line on global rank 0 through Lightning's console logger
                   (rank_zero_info): layers and heads watched, the cadence, modes, and
                   the log_every_n_steps at which keys are logged (Lightning's default
                   50 logs nothing in a shorter run).
      A failure inside flashwatch is logged and counted, never raised into training.

    Logged keys (through `pl_module.log`, rank 0 only, at the trainer's
    log_every_n_steps cadence; each logging step logs the newest monitored step's report
    once; NaN values, i.e. not measured yet, are not logged):
      flashwatch/monitor_step                  optimizer step the values describe
      flashwatch/monitor_seconds               time flashwatch spent on that step
      flashwatch/monitor_errors_total          failures inside flashwatch so far
      flashwatch/mitigations_total             mode switches seen running in a monitored
                                               step since this callback was made (never
                                               a decision that did not run)
      flashwatch/heads_not_standard            heads in BETA or FP32_O, all layers
      flashwatch/qk_clips_total                QK-clips whose effect was seen (opt-in)
      flashwatch/<layer>/tied_rowmax_ratio_max     max over the layer's heads
      flashwatch/<layer>/attention_max_logit_max
      flashwatch/<layer>/delta_drift_z_max
      flashwatch/<layer>/delta_coherence_max
      flashwatch/<layer>/wq_spectral_norm_max
      flashwatch/<layer>/delta_error_share_max
      flashwatch/<layer>/heads_not_standard
      flashwatch/<layer>/heads_flagged         heads the policy flags this step
      flashwatch/worst_<i>/<metric>            i = 1..top_k, heads by delta_drift_z
                                               (largest first); metric: the logged
                                               rows of flashwatch.report.metrics (7),
      flashwatch/worst_<i>/layer_index         plus the head's position: layer index in
      flashwatch/worst_<i>/head                watch order, head index
      flashwatch/<layer>/head_<h>/<metric>     only with log_per_head=True: every metric
      flashwatch/<layer>/head_<h>/head_mode    of those and the mode (0, 1, 2)
    With L watched layers that is 6 + 8·L + 9·top_k keys, per-head adds 8 per head.
    """

    def __init__(self, *, config: WatchConfig | None = None, **kwargs):
        self.config, options = shared.configure("FlashWatchCallback", config, kwargs)
        self.sinks, self.sites = list(options.sinks), options.sites
        self.log_per_head, self.top_k = options.log_per_head, options.top_k
        self._options = options
        self.watcher: flashwatch.Watcher | None = None
        self._pending_state: dict | None = None  # loaded before on_fit_start, or left by teardown
        self._seen_step: int | None = None  # trainer.global_step at the last watcher.step()
        self._reports = shared.Reports()  # newest report not yet logged, confirmed counts
        self._logged: set = set()  # what was logged once
        self._announced = False  # the first-report line was printed

    # ---------------------------------------------------------------- Lightning hooks

    def on_fit_start(self, trainer, pl_module) -> None:
        # Not in setup(): Lightning calls configure_model() after it, and models built
        # for FSDP create their layers there (setup would find none and watch nothing).
        self._attach(trainer, pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step  # after a checkpoint restored global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._after_batch(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._pause(True)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._pause(False)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._detach()

    def state_dict(self) -> dict:
        if self.watcher is not None:
            return {"watcher": self.watcher.state_dict()}
        return {} if self._pending_state is None else {"watcher": self._pending_state}

    def load_state_dict(self, state_dict: dict) -> None:
        self._pending_state = state_dict.get("watcher")
        if self.watcher is not None:
            self._apply_pending()

    # ------------------------------------------------------------------------ methods

    def _attach(self, trainer, pl_module) -> None:
        if self.watcher is not None:
            return
        try:
            sites = flashwatch.find_sites(pl_module, self.sites)
        except ValueError as e:
            if self.sites is not None:  # the user named sites and they are wrong: say so
                raise
            # nothing found to watch: train unwatched, say so once
            rank_zero_warn(f"FlashWatchCallback: not watching {type(pl_module).__name__}: "
                           f"no attention layer found ({e}). Pass sites=... to name its "
                           f"attention modules (see flashwatch.find_sites).")
            return
        self.watcher = shared.open_watcher(pl_module, self.config, self._options, sites,
                                           local_rank=trainer.local_rank,
                                           rank=trainer.global_rank)
        if not trainer.loggers:
            rank_zero_warn("FlashWatchCallback: the trainer has no logger, so flashwatch "
                           "keys are not logged through Lightning (sinks still receive "
                           "every report); pass logger=... to the Trainer to log them")
        self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending_state is not None:
            shared.restore(self.watcher, self._pending_state, "the checkpoint")
            self._pending_state = None

    def _after_batch(self, trainer, pl_module) -> None:
        w = self.watcher
        if w is None or trainer.global_step == self._seen_step:
            return  # unwatched, or a micro-batch of gradient accumulation
        self._seen_step = trainer.global_step
        report = w.step()
        self._reports.add(report)
        if report is not None and not self._announced:
            self._announce(trainer, report)
        # Lightning writes step metrics when should_update_logs is true for this batch
        # (every log_every_n_steps optimizer steps); logging on other batches is wasted.
        connector = getattr(trainer, "_logger_connector", None)
        if self._reports.latest is None or not getattr(connector, "should_update_logs", True):
            return
        report = self._reports.take()
        if not trainer.is_global_zero:
            return
        try:
            for key, value in self._metrics(report).items():
                pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True)
        except Exception as e:  # logging must never stop training
            log_once(log, self._logged, "log", "flashwatch: logging through Lightning failed "
                     "(%s: %s); training continues, sinks still receive reports",
                     type(e).__name__, e, level=logging.ERROR, exc_info=e)

    def _announce(self, trainer, report: StepReport) -> None:
        """One line on global rank 0 at the first report, through Lightning's console
        logger: Lightning writes metrics every log_every_n_steps (default 50) optimizer
        steps, so a 20-step run would otherwise show no sign of flashwatch."""
        self._announced = True
        try:
            layers = len({h.layer for h in report.heads})
            moved = sum(int(h.head_mode) != flashwatch.Mode.STANDARD for h in report.heads)
            rank_zero_info(
                f"flashwatch: watching {layers} attention layers ({len(report.heads)} heads), "
                f"one optimizer step in {self.config.every_n_steps} monitored; first report "
                f"at step {report.step}: {moved} heads not STANDARD; flashwatch/* keys are "
                f"logged every {trainer.log_every_n_steps} steps (Trainer log_every_n_steps)")
        except Exception as e:  # a message must never stop training
            log_once(log, self._logged, "announce", "flashwatch: first-report line failed "
                     "(%s: %s)", type(e).__name__, e, level=logging.ERROR, exc_info=e)

    def _metrics(self, report: StepReport) -> dict[str, float]:
        return shared.logged_metrics(report, self.watcher, self._reports, top_k=self.top_k,
                                     log_per_head=self.log_per_head)

    def _pause(self, paused: bool) -> None:
        if self.watcher is None:
            return
        if paused:
            self.watcher.pause()
        else:
            self.watcher.resume()

    def _detach(self) -> None:
        if self.watcher is None:
            return
        self._pause(False)
        # keep the final state: trainer.save_checkpoint() after fit() still saves it
        self._pending_state = shared.close_watcher(self.watcher, self.sinks)
        self.watcher = None
        self._reports.take()
