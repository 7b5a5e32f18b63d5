"""`FlashWatchTrainerCallback`: flashwatch for the Hugging Face `Trainer`.

    from flashwatch.integrations.transformers import FlashWatchTrainerCallback
    trainer = Trainer(model=model, args=TrainingArguments(..., bf16=True), ...)
    trainer.add_callback(FlashWatchTrainerCallback(trainer, mitigation="auto"))
    trainer.train()  # resume_from_checkpoint=True brings the watcher back too
"""

from __future__ import annotations

import logging
import os

import torch

from flashwatch._checks import missing_extra

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:
    raise missing_extra("transformers", "transformers",
                        "flashwatch.integrations.transformers") from e

import flashwatch
from flashwatch.config import WatchConfig
from flashwatch.integrations import shared

log = logging.getLogger("flashwatch")

STATE_FILE = "flashwatch_state.pt"  # in each checkpoint-<step>/ folder the Trainer saves


class FlashWatchTrainerCallback(transformers.TrainerCallback):
    """Watches the attention layers of a `transformers.Trainer`'s model while it trains.

    `trainer`: the Trainer this callback is added to (it logs through `trainer.log`, so
    every `report_to` integration — TensorBoard, W&B, MLflow, ... — gets the keys).

    Keyword arguments, as for the Lightning `FlashWatchCallback` (one implementation,
    flashwatch/integrations/shared.py): config (a `flashwatch.WatchConfig`) and/or its fields as
    keywords (a keyword replaces the config's value), sinks (yours: never closed by the
    callback), sites, log_per_head, top_k, prometheus_port (an endpoint on this base port
    + local process index, closed at train end), prometheus_addr,
    prometheus_rank_zero_only, prometheus_certfile, prometheus_keyfile.

    Behaviour:
      train begin  attaches a watcher to `trainer.model` (after the Trainer has wrapped
                   or compiled it: hooks sit on the inner modules); if no attention layer
                   is found it warns once and training runs unwatched.
      step end     one `watcher.step()` per optimizer step (the Trainer calls it once per
                   gradient_accumulation_steps micro-batches); at the Trainer's logging
                   steps, on the main process only, the newest report's keys go through
                   `trainer.log`: the bounded set of FlashWatchCallback (6 + 8 per layer
                   + 9 per top_k head; 8 per head with log_per_head=True).
      evaluation   monitoring pauses while the Trainer evaluates (eval_on_start too).
      save         the watcher's state goes to checkpoint-<step>/flashwatch_state.pt;
                   `trainer.train(resume_from_checkpoint=...)` loads it from the
                   checkpoint-<step> folder of args.output_dir, so a resumed run
                   continues exactly (a checkpoint from another output_dir: warned,
                   the watcher starts fresh).
      train end    removes the watcher; the model is left as it was.
      A failure inside flashwatch is logged, never raised into training (the
      watcher's own failures are also counted in monitor_errors_total).
    """

    def __init__(self, trainer, *, config: WatchConfig | None = None, **kwargs):
        if not isinstance(trainer, transformers.Trainer):
            raise TypeError(f"FlashWatchTrainerCallback needs the transformers.Trainer it is "
                            f"added to (it logs through trainer.log), got {trainer!r}; use "
                            f"trainer.add_callback(FlashWatchTrainerCallback(trainer, ...))")
        self.trainer = trainer
        self.config, options = shared.configure("FlashWatchTrainerCallback", config, kwargs)
        self.sinks, self.sites = list(options.sinks), options.sites
        self.log_per_head, self.top_k = options.log_per_head, options.top_k
        self._options = options
        self.watcher: flashwatch.Watcher | None = None
        self._final_state: dict | None = None  # the watcher's state at the last train end
        self._reports = shared.Reports()  # newest report not yet logged, confirmed counts
        self._failed: set = set()  # what already failed once (logged once)

    def state_dict(self) -> dict:
        """The watcher's state: live during training, else as the last train() left it."""
        return self.watcher.state_dict() if self.watcher is not None else self._final_state

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args, state, control, **kwargs):
        if self.watcher is not None:  # the last train() ended on an exception
            self._close()
        model = self.trainer.model
        try:
            sites = flashwatch.find_sites(model, self.sites)
        except ValueError as e:
            if self.sites is not None:  # the user named sites and they are wrong: say so
                raise
            if state.is_world_process_zero:
                log.warning("FlashWatchTrainerCallback: not watching %s: no attention layer "
                            "found (%s). Pass sites=... to name its attention modules (see "
                            "flashwatch.find_sites).", type(model).__name__, e)
            return
        self.watcher = shared.open_watcher(model, self.config, self._options, sites,
                                           local_rank=args.local_process_index,
                                           rank=args.process_index)
        if state.global_step > 0:  # resuming: the Trainer restored global_step
            self._restore(args, state)
        if args.eval_on_start:
            self.watcher.pause()

    def on_step_end(self, args, state, control, **kwargs):
        w = self.watcher
        if w is None:
            return
        self._reports.add(w.step())
        if control.should_evaluate:  # the Trainer evaluates next; on_evaluate resumes
            w.pause()
        # DefaultFlowCallback (always first) has set should_log for this step
        if control.should_log and self._reports.latest is not None:
            report = self._reports.take()
            if state.is_world_process_zero:
                metrics = shared.logged_metrics(report, w, self._reports, top_k=self.top_k,
                                                log_per_head=self.log_per_head)
                self._guard("logging through trainer.log", self.trainer.log, metrics)
                control.should_log = True  # trainer.log cleared it; the loss is logged next

    def on_evaluate(self, args, state, control, **kwargs):
        if self.watcher is not None:
            self.watcher.resume()

    def on_save(self, args, state, control, **kwargs):
        if self.watcher is None or not args.should_save:
            return
        self._guard("saving the watcher state", torch.save, self.watcher.state_dict(),
                    _state_path(args, state))

    def on_train_end(self, args, state, control, **kwargs):
        if self.watcher is not None:
            self._close()

    # ------------------------------------------------------------------------ methods

    def _close(self) -> None:
        self._final_state = shared.close_watcher(self.watcher, self.sinks)
        self.watcher = None
        self._reports.take()

    def _restore(self, args, state) -> None:
        path = _state_path(args, state)
        if not os.path.isfile(path):
            log.warning("flashwatch: resuming at step %d without a watcher state: %s does not "
                        "exist (a checkpoint from another output_dir?); monitoring starts "
                        "fresh (modes STANDARD)", state.global_step, path)
            return
        try:
            state = torch.load(path, weights_only=True)
        except Exception as e:
            log.error("flashwatch: could not read %s (%s: %s); monitoring starts fresh "
                      "(modes STANDARD)", path, type(e).__name__, e)
            return
        shared.restore(self.watcher, state, path)

    def _guard(self, what: str, fn, *args) -> None:
        shared.guard(self._failed, what, fn, *args)


def _state_path(args, state) -> str:
    """The watcher's file in the checkpoint folder the Trainer writes (and resumes at) for
    this step: <output_dir>/checkpoint-<step>/flashwatch_state.pt."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}",
                        STATE_FILE)
