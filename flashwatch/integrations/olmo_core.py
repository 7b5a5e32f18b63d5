"""`FlashWatchCallback`: flashwatch for OLMo-core 3's `Trainer` in one line (docs/design.md §7).

    from flashwatch.integrations.olmo_core import FlashWatchCallback
    trainer_config = trainer_config.with_callback("flashwatch",
                                                  FlashWatchCallback(mitigation="auto"))
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from flashwatch._checks import missing_extra

try:
    from olmo_core.distributed.utils import get_local_rank, get_rank
    from olmo_core.train.callbacks import Callback, CheckpointerCallback
except ImportError as e:
    raise missing_extra("olmo_core", "olmo-core", "flashwatch.integrations.olmo_core") from e

import flashwatch
from flashwatch.config import WatchConfig
from flashwatch.integrations import shared
from flashwatch.report.records import StepReport

log = logging.getLogger("flashwatch")


@dataclasses.dataclass(init=False)
class FlashWatchCallback(Callback):
    """Watches the attention layers of an OLMo-core `Trainer`'s model while it trains.

    Keyword arguments, as for the Lightning `FlashWatchCallback` (one implementation,
    flashwatch/integrations/shared.py): config (a `flashwatch.WatchConfig`) and/or its
    fields as keywords (a keyword replaces the config's value), sinks (never closed by
    the callback), sites, log_per_head, top_k, prometheus_port (an endpoint on this base
    port + local rank, closed when training ends), prometheus_addr,
    prometheus_rank_zero_only, prometheus_certfile, prometheus_keyfile.

    Like every OLMo callback it is a dataclass: its fields, `config` (the whole
    WatchConfig) and `options` (the other arguments, a shared.Options), are what OLMo's
    config system saves and rebuilds it from (`Config.merge`, YAML/JSON, the config W&B
    records), e.g. `--trainer.callbacks.flashwatch.config.every_n_steps=5`.
    `TrainerConfig.with_callback` deep-copies its callbacks, the sinks passed here too:
    the live callback is `trainer.callbacks["flashwatch"]`.

    Behaviour:
      pre_train    finds the attention layers of `train_module.model` (a named `sites`
                   that is wrong raises here, before the dry run); none found: a warning,
                   training runs unwatched.
      pre_step     the first attaches the watcher: after the Trainer's dry-run batch
                   (random tokens through train_batch(dry_run=True), no pre_step), which
                   otherwise counts into step 1's numbers. Each one resumes measuring.
      post_train_batch  one `watcher.step()` per optimizer step (the train module runs
                   a batch's micro-batches inside one train_batch), its report's keys
                   through `trainer.record_metric`, then measuring pauses until the next
                   pre_step: evaluators (post_step, post_train) and other callbacks'
                   forwards never enter the numbers. A step in `steps_to_skip` (no
                   forward, no optimizer step) is no watcher step.
      priority     CheckpointerCallback's + 1 (2): the watcher has stepped before the
                   Checkpointer saves in its post_train_batch, so a resume continues at
                   the next step (at priority 0 it repeated one).
      state_dict   the watcher's state, in the trainer state OLMo's Checkpointer writes
                   (train/rank<r>.pt, torch.save per rank; a missing rank falls back to
                   rank 0's, which loads on every rank): a resume from its checkpoint
                   continues the step count, modes, windows and RNG exactly.
      close        removes the watcher (the model is left as it was; OLMo calls close
                   at the end of fit(), on an error too); state_dict then returns its
                   final state.
      A failure inside flashwatch is logged once, never raised into training.

    Keys (the Lightning callback's, listed in its docstring: 6 + 8 per layer + 9 per
    top_k head, 8 per head with log_per_head=True) go through trainer.record_metric at
    every monitored step, so every OLMo logger callback (console, W&B, Comet) gets them.
    reduce_type=None: after the watcher's own reduction every rank holds the same per-head
    numbers, so OLMo's all-reduce would only add work, and a rank whose monitored step
    failed (no report) cannot misalign it; monitor_seconds and monitor_errors_total are
    global rank 0's, as the loggers log rank 0's values. flashwatch/monitor_step is the
    watcher's count, from 0: OLMo's step − 1. The console logger prints only the keys
    its `metrics` patterns match: add "flashwatch/*" there to see them.
    """

    priority: ClassVar[int] = CheckpointerCallback.priority + 1

    config: WatchConfig
    options: shared.Options

    def __init__(self, *, config: WatchConfig | None = None,
                 options: shared.Options | None = None, **kwargs):
        if options is not None:  # OLMo's Config.from_dict rebuilding a saved callback
            if not isinstance(options, shared.Options):
                raise TypeError(f"FlashWatchCallback: options must be a flashwatch "
                                f"integrations.shared.Options (what OLMo's config system "
                                f"saves), got {options!r}; pass sinks=, top_k=, ... as "
                                f"keywords instead")
            kwargs = {**{f: getattr(options, f) for f in shared.OPTIONS}, **kwargs}
        self.config, self.options = shared.configure("FlashWatchCallback", config, kwargs)
        self.watcher: flashwatch.Watcher | None = None
        self._sites: list | None = None  # found in pre_train, attached at the first pre_step
        self._pending: dict | None = None  # loaded before the watcher exists, or left by close
        self._skipping = False  # this step is in trainer.steps_to_skip
        self._reports = shared.Reports()  # confirmed counts (every report is recorded)
        self._failed: set = set()  # what already failed once (logged once)
        self._announced = False

    # ------------------------------------------------------------------- OLMo hooks

    def pre_train(self) -> None:
        model = self.trainer.train_module.model
        try:
            self._sites = flashwatch.find_sites(model, self.options.sites)
        except ValueError as e:
            if self.options.sites is not None:  # the user named sites and they are wrong
                raise
            self._sites = None
            if get_rank() == 0:
                log.warning("FlashWatchCallback: not watching %s: no attention layer found "
                            "(%s). Pass sites=... to name its attention modules (see "
                            "flashwatch.find_sites).", type(model).__name__, e)

    def pre_step(self, batch) -> None:
        if self.watcher is None and self._sites is not None:
            self._attach()
        self._skipping = any(r.start <= self.step < r.stop
                             for r in self.trainer.steps_to_skip or ())
        if self.watcher is not None and not self._skipping:
            self._guard("resuming the watcher", self.watcher.resume)

    def post_train_batch(self) -> None:
        w = self.watcher
        if w is None or self._skipping:
            return
        report = self._guard("watcher.step()", w.step)
        self._guard("pausing the watcher", w.pause)
        if report is None:
            return
        self._reports.add(report)
        self._guard("recording metrics", self._record, report)
        if not self._announced:
            self._announced = True
            self._guard("the first-report line", self._announce, report)

    def close(self) -> None:
        self._detach()

    def state_dict(self) -> dict:
        if self.watcher is not None:
            return {"watcher": self.watcher.state_dict()}
        return {} if self._pending is None else {"watcher": self._pending}

    def load_state_dict(self, state_dict: dict) -> None:
        # Trainer.fit() loads the checkpoint before pre_train: the watcher comes later
        self._pending = state_dict.get("watcher")
        if self.watcher is not None:
            self._apply_pending()

    # ---------------------------------------------------------------------- methods

    def _attach(self) -> None:
        # Configuration errors (a Prometheus port in use) raise here, before step 1
        # trains, as the Lightning callback's do at fit start.
        self.watcher = shared.open_watcher(self.trainer.train_module.model, self.config,
                                           self.options, self._sites,
                                           local_rank=get_local_rank(), rank=get_rank())
        self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending is not None:
            shared.restore(self.watcher, self._pending, "the checkpoint")
            self._pending = None

    def _record(self, report: StepReport) -> None:
        metrics = shared.logged_metrics(report, self.watcher, self._reports,
                                        top_k=self.options.top_k,
                                        log_per_head=self.options.log_per_head)
        for key, value in metrics.items():
            self.trainer.record_metric(key, value, reduce_type=None)

    def _announce(self, report: StepReport) -> None:
        """One line on rank 0: OLMo's console logger prints none of the keys unless its
        `metrics` patterns name them, so a run would otherwise show no sign of flashwatch."""
        if get_rank() != 0:
            return
        layers = len({h.layer for h in report.heads})
        moved = sum(int(h.head_mode) != flashwatch.Mode.STANDARD for h in report.heads)
        log.info("flashwatch: watching %d attention layers (%d heads), one optimizer step in "
                 "%d monitored; first report at step %d: %d heads not STANDARD; keys "
                 "flashwatch/* go to trainer.record_metric (console: add 'flashwatch/*' to "
                 "ConsoleLoggerCallback.metrics)", layers, len(report.heads),
                 self.config.every_n_steps, self.step, moved)

    def _guard(self, what: str, fn, *args):
        return shared.guard(self._failed, what, fn, *args)

    def _detach(self) -> None:
        if self.watcher is None:
            return
        w, self.watcher = self.watcher, None
        self._pending = self._guard("removing the watcher", shared.close_watcher, w,
                                    self.options.sinks)
