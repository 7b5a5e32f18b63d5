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

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:
    raise ImportError("flashwatch.integrations.transformers needs Hugging Face transformers; "
                      "install it with: pip install 'flashwatch[transformers]'") from e

import flashwatch
from flashwatch.config import WatchConfig
from flashwatch.integrations import shared
from flashwatch.report import StepReport

log = logging.getLogger("flashwatch")

STATE_FILE = "flashwatch_state.pt"  # in each checkpoint-<step>/ folder the Trainer saves


class FlashWatchTrainerCallback(transformers.TrainerCallback):
    """Watches the attention layers of a `transformers.Trainer`'s model while it trains.

    `trainer`: the Trainer this callback is added to (it logs through `trainer.log`, so
    every `report_to` integration — TensorBoard, W&B, MLflow, ... — gets the keys).

    Keyword arguments: every field of `flashwatch.WatchConfig` (same names and defaults),
    and, as for the Lightning `FlashWatchCallback`: sinks (yours: never closed by the
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
                   `trainer.log`: the bounded set of FlashWatchCallback (5 + 7 per layer
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

    def __init__(self, trainer, *, sinks=None, sites=None, log_per_head: bool = False,
                 top_k: int = 3, prometheus_port: int | None = None,
                 prometheus_addr: str = "127.0.0.1", prometheus_rank_zero_only: bool = False,
                 prometheus_certfile: str | None = None, prometheus_keyfile: str | None = None,
                 **config):
        if not isinstance(trainer, transformers.Trainer):
            raise TypeError(f"FlashWatchTrainerCallback needs the transformers.Trainer it is "
                            f"added to (it logs through trainer.log), got {trainer!r}; use "
                            f"trainer.add_callback(FlashWatchTrainerCallback(trainer, ...))")
        unknown = sorted(set(config) - set(WatchConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(f"FlashWatchTrainerCallback got unknown option(s) {unknown}; valid "
                            f"options: the WatchConfig fields "
                            f"{list(WatchConfig.__dataclass_fields__)} and sinks, sites, "
                            f"log_per_head, top_k, prometheus_*")
        args = locals()
        self.trainer = trainer
        self.config = WatchConfig(**config)
        shared.set_options(self, "FlashWatchTrainerCallback",
                           **{o: args[o] for o in shared.OPTIONS})
        self.watcher: flashwatch.Watcher | None
        self._final_state: dict | None = None  # the watcher's state at the last train end
        self._latest: StepReport | None = None  # newest report not yet logged
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
        self.watcher = shared.open_watcher(model, self.config, self.sinks, sites,
                                           self.prometheus, local_rank=args.local_process_index,
                                           rank=args.process_index)
        if state.global_step > 0:  # resuming: the Trainer restored global_step
            self._restore(args, state)
        if args.eval_on_start:
            self.watcher.pause()

    def on_step_end(self, args, state, control, **kwargs):
        w = self.watcher
        if w is None:
            return
        report = w.step()
        if report is not None:
            self._latest = report
        if control.should_evaluate:  # the Trainer evaluates next; on_evaluate resumes
            w.pause()
        # DefaultFlowCallback (always first) has set should_log for this step
        if control.should_log and self._latest is not None:
            report, self._latest = self._latest, None
            if state.is_world_process_zero:
                metrics = shared.logged_metrics(report, w, top_k=self.top_k,
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
        self.watcher, self._latest = None, None

    def _restore(self, args, state) -> None:
        path = _state_path(args, state)
        if not os.path.isfile(path):
            log.warning("flashwatch: resuming at step %d without a watcher state: %s does not "
                        "exist (a checkpoint from another output_dir?); monitoring starts "
                        "fresh (modes STANDARD)", state.global_step, path)
            return
        try:
            self.watcher.load_state_dict(torch.load(path, weights_only=True))
        except Exception as e:
            log.error("flashwatch: could not restore the watcher from %s (%s); monitoring "
                      "starts fresh (modes STANDARD)", path, e)

    def _guard(self, what: str, fn, *args) -> None:
        """fn(*args); a failure is logged once and training goes on."""
        try:
            fn(*args)
        except Exception as e:
            if what not in self._failed:
                self._failed.add(what)
                log.error("flashwatch: %s failed (%s: %s); training continues", what,
                          type(e).__name__, e, exc_info=e)


def _state_path(args, state) -> str:
    """The watcher's file in the checkpoint folder the Trainer writes (and resumes at) for
    this step: <output_dir>/checkpoint-<step>/flashwatch_state.pt."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}",
                        STATE_FILE)
