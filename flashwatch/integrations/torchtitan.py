"""flashwatch for torchtitan 0.3's own Trainer, one line in the config function a job
launches with (docs/integrations.md):

    from flashwatch.integrations.torchtitan import watched
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_watched():
        return watched(llama3_8b(), mitigation="auto", every_n_steps=10)

    # torchrun ... -m torchtitan.train --module my_configs --config llama3_8b_watched

torchtitan 0.3 has no model-converter or optimizer hook to plug a monitor into, and its
override mechanism cannot replace the root Trainer.Config; what it offers for a trainer
change is a Trainer subclass with its own Config. `watched` returns the same config as a
`FlashWatchTrainer.Config`, so `config.build()` makes a FlashWatchTrainer: torchtitan's
Trainer with four additions, each after torchtitan's own code of that moment.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch.distributed as dist

from flashwatch._checks import missing_extra

try:
    import tyro  # torchtitan's CLI parser, a dependency of it
    from torchtitan.config import derive
    from torchtitan.tools.logging import logger as titan_logger
    from torchtitan.trainer import Trainer
except ImportError as e:
    raise missing_extra("torchtitan", "torchtitan", "flashwatch.integrations.torchtitan") from e

import flashwatch
from flashwatch.integrations import shared
from flashwatch.sites.discovery import NoAttentionLayers

log = logging.getLogger("flashwatch")

STATE_KEY = "flashwatch"  # the watcher's entry in torchtitan's checkpoint


def watched(config: Trainer.Config, **kwargs) -> FlashWatchTrainer.Config:
    """`config` (a torchtitan Trainer.Config) as a FlashWatchTrainer.Config, every field
    kept. Keyword arguments as for the Lightning callback: `config=` (a
    flashwatch.WatchConfig) and/or its fields (mitigation, every_n_steps, ...), sinks,
    sites, log_per_head, top_k, prometheus_*. They are checked here, so a misspelt one
    fails when the config is made, not after the model is built."""
    if not isinstance(config, Trainer.Config):
        raise TypeError(f"watched(config): config must be a torchtitan Trainer.Config (what "
                        f"a config_registry function returns), got {type(config).__name__}")
    _configure("watched", kwargs)
    return derive(config, FlashWatchTrainer.Config, flashwatch=dict(kwargs))


def _configure(owner: str, kwargs: dict):
    """shared.configure of `watched`'s keyword arguments, `config=` among them."""
    return shared.configure(owner, kwargs.get("config"),
                            {k: v for k, v in kwargs.items() if k != "config"})


class FlashWatchTrainer(Trainer):
    """torchtitan's Trainer, watched:

      attach      at the end of __init__: after the parallelize (or pipeline) function,
                  init_weights and the optimizers, so flashwatch sees the layers as they
                  train (TP, FSDP, PP model parts, compile, activation checkpointing).
                  Nothing found to watch: one warning, the job trains unwatched.
      step        one watcher.step() after each train_step (the optimizer step of all
                  its gradient-accumulation micro-batches), before torchtitan's
                  checkpointer saves, so a resumed job never repeats a monitored step.
      metrics     the newest report's keys (6 + 8 per layer + 9 per top_k head, as the
                  Lightning callback's) through torchtitan's MetricsProcessor logger, at
                  its log_freq: TensorBoard and W&B as configured, on the rank torchtitan
                  logs from; one console line at the first report.
      validation  monitoring pauses for torchtitan's validator, whose forwards would
                  otherwise count into the next step.
      checkpoint  the watcher's state is one more entry ("flashwatch") of torchtitan's
                  checkpoint (torch.distributed.checkpoint), so a resume continues the
                  step count, modes and signal windows, in another layout or world size
                  too. A checkpoint written without flashwatch resumes with the watcher
                  fresh (its entry is left out of loading, with a warning).
      close       removes the watcher; the model is left as it was.
    A failure inside flashwatch is logged and counted, never raised into training.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        flashwatch: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
        """Keyword arguments of `watched` (WatchConfig fields, sinks, sites, log_per_head,
        top_k, prometheus_*); set in Python, not on the command line."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.flashwatch = TitanWatch(self, config.flashwatch)

    def train(self):
        self.flashwatch.before_load()
        super().train()

    def train_step(self, data_iterator):
        self.flashwatch.before_step()
        super().train_step(data_iterator)
        self.flashwatch.after_step()

    def close(self) -> None:
        if hasattr(self, "flashwatch"):  # __init__ may have failed before it
            self.flashwatch.close()
        super().close()


class TitanWatch:
    """The watcher of one torchtitan Trainer, and its entry in the trainer's checkpoint
    (torch.distributed.checkpoint's Stateful: state_dict / load_state_dict)."""

    def __init__(self, trainer: Trainer, kwargs: dict):
        self.trainer = trainer
        self.config, self.options = _configure("FlashWatchTrainer", kwargs)
        self.reports = shared.Reports()
        self.watcher = self._attach(trainer)
        self._paused = False
        self._announced = False
        self._failed: set = set()
        checkpointer = trainer.checkpointer
        if self.watcher is not None and getattr(checkpointer, "enable", False):
            checkpointer.states[STATE_KEY] = self

    def _attach(self, trainer) -> flashwatch.Watcher | None:
        parts = trainer.model_parts
        # a pipeline rank's parts are watched as one, each layer under its whole-model
        # name; a stage without attention joins the others' watcher (a collective)
        model = parts if trainer.parallel_dims.pp_enabled or len(parts) > 1 else parts[0]
        try:
            return shared.open_watcher(model, self.config, self.options, self.options.sites,
                                       local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                                       rank=dist.get_rank() if dist.is_initialized() else 0)
        except NoAttentionLayers as e:  # no rank of the job holds one: the same everywhere
            if self.options.sites is not None:  # the user named sites and they are wrong
                raise
            titan_logger.warning(
                f"flashwatch: not watching {type(parts[0]).__name__}: no attention layer "
                f"found ({e}). Pass sites=[...] to watched() to name its attention modules.")
            return None

    # ------------------------------------------------------------ the trainer's moments

    def before_load(self) -> None:
        """Before torchtitan loads its checkpoint: one written without flashwatch has no
        "flashwatch" entry, which torch.distributed.checkpoint would refuse ("Missing
        key"); leave the entry out of loading and start the watcher fresh."""
        checkpointer = self.trainer.checkpointer
        if STATE_KEY not in getattr(checkpointer, "states", {}):
            return
        try:
            path = _checkpoint_to_load(checkpointer, self.trainer.config.checkpoint)
            if path is None or _has_entry(path, STATE_KEY):
                return
        except Exception as e:  # cannot tell: let torchtitan load as it would
            log.warning("flashwatch: could not read the checkpoint's keys before loading "
                        "(%s: %s)", type(e).__name__, e)
            return
        checkpointer.exclude_from_loading = [*checkpointer.exclude_from_loading, STATE_KEY]
        titan_logger.warning(f"flashwatch: {path} was written without flashwatch; the watcher "
                             f"starts fresh (modes STANDARD, step 0)")

    def before_step(self) -> None:
        if self._paused:
            self.watcher.resume()
            self._paused = False

    def after_step(self) -> None:
        w, trainer = self.watcher, self.trainer
        if w is None:
            return
        self.reports.add(w.step())  # never raises: its failures are counted
        if self.reports.latest is not None and not self._announced:
            self._announce(self.reports.latest)
        validator = getattr(trainer, "validator", None)
        if trainer.config.validator.enable and validator.should_validate(trainer.step):
            w.pause()  # torchtitan validates after the checkpoint save, before the next step
            self._paused = True
        if self.reports.latest is None or not trainer.metrics_processor.should_log(trainer.step):
            return
        shared.guard(self._failed, "logging through torchtitan's MetricsProcessor",
                     self._log, self.reports.take())

    def _log(self, report) -> None:
        metrics = shared.logged_metrics(report, self.watcher, self.reports,
                                        top_k=self.options.top_k,
                                        log_per_head=self.options.log_per_head)
        # a BaseLogger that drops everything on the ranks torchtitan does not log from
        self.trainer.metrics_processor.logger.log(metrics, self.trainer.step)

    def _announce(self, report) -> None:
        self._announced = True
        layers = len({h.layer for h in report.heads})
        moved = sum(int(h.head_mode) != flashwatch.Mode.STANDARD for h in report.heads)
        titan_logger.info(
            f"flashwatch: watching {layers} attention layers ({len(report.heads)} heads), one "
            f"optimizer step in {self.config.every_n_steps} monitored; first report at "
            f"step {self.trainer.step}: {moved} heads not STANDARD; flashwatch/* keys go to "
            f"torchtitan's metrics logger every {self.trainer.metrics_processor.config.log_freq}"
            f" steps")

    def close(self) -> None:
        if self.watcher is not None:
            shared.close_watcher(self.watcher, self.options.sinks)
            self.watcher = None

    # ------------------------------------------------- torch.distributed.checkpoint

    def state_dict(self) -> dict:
        return self.watcher.state_dict() if self.watcher is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.watcher is not None:
            shared.restore(self.watcher, state_dict, "torchtitan's checkpoint")


def _checkpoint_to_load(checkpointer, cfg) -> str | None:
    """The folder torchtitan's CheckpointManager.load will read states from (its rules:
    the newest step-N of its folder, or checkpoint.load_step, else initial_load_path
    unless that load is model-only), None where it loads none or only the model."""
    if os.path.isdir(checkpointer.folder):
        step = checkpointer._find_load_step() if cfg.load_step == -1 else cfg.load_step
        if step > 0:  # step 0 is a seed checkpoint: model only
            return checkpointer._create_checkpoint_id(step)
        if step == 0:
            return None
    if cfg.initial_load_path and not cfg.initial_load_model_only:
        return cfg.initial_load_path
    return None


def _has_entry(path: str, key: str) -> bool:
    """Whether the torch.distributed.checkpoint at `path` holds keys under `key`."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    return any(k == key or k.startswith(key + ".") for k in keys)
