"""`flashwatch.watch(model)`: attach to a model's attention layers, measure, mitigate.

The Watcher is a façade: cadence, pause, hand-set modes, state_dict, remove, the error
ledger. The work happens in rooms with named interfaces (docs/design.md §2):

  forward   flashwatch/monitor/attach.py wraps each watched layer's forward; on monitored steps
            and at routed layers its attention calls reach the Recorder
            (flashwatch/monitor/capture.py): routed to flashwatch's kernel with the layer's
            modes, probed on measured steps (compiled code: flashwatch/monitor/traced.py).
  backward  the Recorder's gradient hooks compute c[T] and reduce each micro-batch's
            samples (flashwatch/monitor/probe.py) into the layers' StepBuffers, on the device.
  step()    flashwatch/monitor/monitored_step.py: buffers → one move to the host → one reduction
            on the monitor's own group (flashwatch/parallel/reduce.py) → named per-head arrays
            (flashwatch/monitor/aggregate.py) → signals, policy, vote, QK-clip → a StepReport.
Failures inside flashwatch are logged once, counted and never raised into training, and
every rank issues the same collectives whatever failed on it.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from flashwatch.config import WatchConfig
from flashwatch.kernels.common import Mode
from flashwatch.mitigation import qkclip
from flashwatch.monitor import saved_state, tokens, traced
from flashwatch.monitor.attach import Attachment
from flashwatch.monitor.capture import Cadence, Recorder
from flashwatch.monitor.layer_state import LayerState
from flashwatch.monitor.ledger import ErrorLedger
from flashwatch.monitor.monitored_step import StepPipeline
from flashwatch.parallel import layout, reduce, sharding
from flashwatch.parallel.layout import HeadTable
from flashwatch.report.records import StepReport
from flashwatch.report.sinks import Sink
from flashwatch.sites import NoAttentionLayers, find_sites
from flashwatch.sites.discovery import split_by_tensor_parallelism
from flashwatch.sites.layouts import QCheck
from flashwatch.sites.site import ModelParts

log = logging.getLogger("flashwatch")

STATE_VERSION = saved_state.VERSION  # 2: global heads; 1 (each rank's own) still loads


def _layer_states(sites, sketch_dim: int, seed: int, table: HeadTable) -> list[LayerState]:
    """One state per local site, placed at its layer's offset in the global head table;
    its sketches seeded by the layer's table index, so replicas of a layer draw the same
    ones and pipeline stages draw different ones."""
    out = []
    for site in sites:
        offset, i = table.offset(site.name, site.head_offset), table.index(site.name)
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        k = sketch_dim  # Gaussian sketches scaled so z and y keep the norms of X and PK
        st = LayerState(site=site, offset=offset,
                        modes=torch.zeros(site.num_heads, dtype=torch.int32),
                        omega_x=torch.randn(site.d_model, k, generator=g) / math.sqrt(k),
                        omega_a=torch.randn(site.head_dim, k, generator=g) / math.sqrt(k),
                        omega_q=torch.randn(site.head_dim, k, generator=g) / math.sqrt(k),
                        heads=torch.arange(offset, offset + site.num_heads))
        if site.q_module is not None:  # checks its W^Q slice on its first measured call
            st.q_check = QCheck(site)
        st.reset()
        out.append(st)
    return out


def _facts(site) -> dict:
    """What every rank's QK-clip books need of a layer held elsewhere: its global K head
    count and its QK-norm (flashwatch/mitigation/qkclip.py)."""
    return {"kv_heads": site.num_kv_heads * site.layer_heads // site.num_heads,
            "qk_norm": qkclip.qk_norm(site)}


def _local_sites(model: nn.Module, sites) -> list:
    """find_sites, except that a rank of a distributed job whose part of the model has no
    attention layer (a pipeline stage with only the embeddings or the LM head) holds
    none and still joins the monitor's collectives, so no other rank waits for it."""
    try:
        return find_sites(model, sites)
    except NoAttentionLayers:
        if sites is not None or sharding.world_size() == 1:
            raise
        log.info("flashwatch: this rank's model holds no attention layer; it joins the "
                 "monitor's collectives and reports the other ranks' layers")
        return []


class Watcher:
    """Watches the attention layers of one model. Create it with `flashwatch.watch`."""

    def __init__(self, model: nn.Module, config: WatchConfig | None = None,
                 sinks: Iterable[Sink] | None = None, sites=None):
        if isinstance(model, (list, tuple)):  # a pipeline rank's model parts
            model = ModelParts(model)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or a list of them (a "
                            f"pipeline rank's model parts), got {type(model).__name__}")
        self.config = cfg = config or WatchConfig()
        if not isinstance(cfg, WatchConfig):
            raise TypeError(f"config must be a flashwatch.WatchConfig, got "
                            f"{type(cfg).__name__}")
        self.sinks = list(sinks or [])
        for s in self.sinks:
            if not callable(getattr(s, "write", None)):
                raise TypeError(f"sink {s!r} has no write(report) method")
        self.sites = _local_sites(model, sites)
        # The monitor's own process group, created here on every rank (a collective):
        # nothing of ours can pair with a training collective (flashwatch/parallel/reduce.py).
        monitor = reduce.MonitorGroup(cfg.collective_timeout_s)
        monitor.check_same(sketch_dim=cfg.sketch_dim, every_n_steps=cfg.every_n_steps)
        # Every rank's layers by name: one table of global heads (flashwatch/parallel/layout.py)
        self.head_table = layout.gather(monitor, [(s.name, s.layer_heads, s.head_offset,
                                                   s.num_heads, _facts(s)) for s in self.sites])
        if not self.head_table.layers:
            raise NoAttentionLayers("flashwatch.watch: no rank of the job holds an attention "
                                    "layer flashwatch recognises; pass sites=... (see "
                                    "flashwatch.make_site)")
        self._states = _layer_states(self.sites, cfg.sketch_dim, cfg.seed, self.head_table)
        self._step = 0  # optimizer steps completed = index of the step being accumulated
        self._cadence = Cadence()
        self._ledger = ErrorLedger()
        self._recorder = Recorder(self, cfg, self._states, self._cadence, self._ledger,
                                  n_heads=self.head_table.n)
        self._pipeline = StepPipeline(cfg, self._states, self._recorder, self._ledger,
                                      monitor, self._set_modes, self.head_table)
        self._attachment = self._recorder.attachment = Attachment(self._recorder)
        self._recorder.split = self._split
        # weakly: where FSDP2's gradient divisors are looked up (the model owns the watcher)
        roots = model.children() if isinstance(model, ModelParts) else [model]
        self._recorder.roots = tuple(weakref.ref(m) for m in roots)
        for st in self._states:
            st.compiled.key = traced.register(self._recorder, st)
            st.compiled.key_t = torch.tensor(st.compiled.key)
            st.compiled.q_path = traced.q_path(st.site.module, st.site.q_module)
            self._set_modes(st, st.modes)
            self._attachment.wrap(st)
        weakref.finalize(self, traced.unregister, [st.compiled.key for st in self._states])
        # Hugging Face models hand flashwatch their attention_mask: padding left out
        self._mask_hooks = tokens.hook_models(model, self._recorder.tokens)
        self._arm()  # step 0 is monitored

    # ----------------------------------------------------------------------- public API

    @property
    def step_count(self) -> int:
        """Optimizer steps completed (calls to step())."""
        return self._step

    @property
    def monitor_errors_total(self) -> int:
        return self._ledger.total

    @property
    def events(self) -> list:
        """Every mode change and QK-clip (applied or advised) since the start, oldest
        first."""
        return list(self._pipeline.events)

    @property
    def layer_states(self) -> list[LayerState]:
        """Test and debugging hook: each watched layer's runtime state
        (flashwatch/monitor/layer_state.py). Read it; it is not a stable API."""
        return list(self._states)

    @property
    def recorder(self) -> Recorder:
        """Test and debugging hook: the Recorder its layers' calls and gradients reach
        (flashwatch/monitor/capture.py), with the cadence and the step's probe totals. Read it;
        it is not a stable API."""
        return self._recorder

    def head_modes(self) -> dict[str, list[Mode]]:
        return {st.site.name: [Mode(int(m)) for m in st.modes] for st in self._states}

    def pause(self) -> None:
        """Stop measuring forward passes (e.g. during validation) until `resume()`.
        Head modes still apply; the step count is unaffected."""
        self._cadence.paused = True
        self._arm()

    def resume(self) -> None:
        self._cadence.paused = False
        self._arm()

    def set_valid_tokens(self, mask) -> None:
        """Which tokens of the coming forwards are real: `mask` [batch, tokens], True or 1
        for a real token, 0 for padding (a tokenizer's attention_mask). Padding query rows
        are then left out of ties, max logit and δ error; it holds until changed, and
        None clears it. Hugging Face models need no call: flashwatch reads the
        attention_mask their forward receives (a mask set here wins over it)."""
        self._recorder.tokens.set(tokens.as_mask(mask))

    def set_head_modes(self, layer: str, modes) -> None:
        """Set the modes of one watched layer by hand, from the next attention call on
        (e.g. to apply what "advise" recommends). Logged as user events. Compiled or
        not, the layer's next forward runs them; if it makes no call flashwatch can
        route, the next report lists the layer in `unmitigable` and its events say
        applied=False."""
        from flashwatch.kernels.common import normalize_head_modes

        st = next((s for s in self._states if s.site.name == layer), None)
        if st is None:
            raise ValueError(f"layer {layer!r} is not watched; watched layers: "
                             f"{[s.site.name for s in self._states]}")
        new = normalize_head_modes(modes, st.site.num_heads)
        self._pipeline.user_change(st, new, self._step)
        self._stance()  # a routed layer runs eagerly (flashwatch/monitor/attach.py)

    def step(self) -> StepReport | None:
        """Call once per optimizer step. Returns the report of a monitored step, else None."""
        if self._cadence.removed:
            raise RuntimeError("this Watcher was removed; create a new one with "
                               "flashwatch.watch(model)")
        grad = torch.is_grad_enabled()
        try:
            return self._step_once()
        finally:  # a torch.no_grad() of ours whose exit failed must not outlive step()
            if torch.is_grad_enabled() != grad:
                torch.set_grad_enabled(grad)

    def _step_once(self) -> StepReport | None:
        t0 = time.perf_counter()
        completed, was_monitoring = self._step, self._cadence.monitoring
        if self._cadence.measuring:  # a forward set during the step: before the next arm
            self._attachment.check_forwards(self._states)
        try:
            self._move_to(self._step + 1)
        except Exception as e:  # the count moved; hooks re-armed at the next step
            self._ledger.error("step", e)
        if not was_monitoring:
            return None
        try:  # runs its collectives to the end on every rank (monitored_step.py)
            report = self._pipeline.run(completed)
        except Exception as e:  # never take the run down
            self._ledger.error("step", e)
            self._pipeline._local("step", self._recorder.clear_step, None)
            return None
        finally:  # the layers this step saw measured, and new modes, decide the stance
            try:
                if self._pipeline.realign_to is not None:  # the ranks' counts differed
                    self._move_to(self._pipeline.realign_to)
                    self._pipeline.realign_to = None
                self._stance()
            except Exception as e:
                self._ledger.error("step", e)
        report.monitor_seconds = self._ledger.seconds + time.perf_counter() - t0
        self._ledger.seconds = 0.0
        report.monitor_errors_total = self._ledger.total
        for sink in self.sinks:
            try:
                sink.write(report)
            except Exception as e:
                self._ledger.error(f"sink {type(sink).__name__}", e)
        report.monitor_errors_total = self._ledger.total
        return report

    def state_dict(self) -> dict:
        """The watcher's state over the job's global head table (flashwatch/monitor/
        saved_state.py): any rank's loads on every rank of the job, and into a job of
        the same model in another parallel layout. Hand-set modes of another rank reach
        this rank's state at the monitored step after they were set. Its keys are the
        same at every step, so a fresh watcher's state is a torch.distributed.checkpoint
        load target (the power iteration's warm starts, a per-rank cache keyed by layer,
        come back only where the target already has that layer's)."""
        pipe = self._pipeline
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "step": self._step,
            "monitoring": self._cadence.monitoring,
            "heads": list(pipe.heads),
            "modes": pipe.global_modes().to(torch.int32),
            "user_set": pipe.book.user_set.clone(),
            "power_v": saved_state.warm_starts(self._states),
            "rng": self._recorder.gen.get_state(),
            "signals": pipe.signals.state_dict(),
            "policy": pipe.policy.state_dict(),
            # tuples: torch.distributed.checkpoint keeps a tuple whole (one key), where it
            # would flatten a list of dicts into a key per event, which a fresh watcher's
            # state (no events) lacks: "Missing key in checkpoint state_dict: events"
            "events": tuple(e.to_dict() for e in pipe.events),
            "unreported": tuple(e.to_dict() for e in pipe.unreported),
            "errors_total": self._ledger.total,
            "qk_clip": pipe.qk_clip.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """A state of `state_dict` (this rank's or another's, any parallel layout of the
        same model): each rank takes the heads it holds."""
        from flashwatch.report.records import Event

        version = sd.get("version") if isinstance(sd, dict) else None
        if version not in (1, STATE_VERSION):
            raise ValueError(f"not a flashwatch Watcher state (version {version!r}, "
                             f"expected {STATE_VERSION} or 1)")
        pipe = self._pipeline
        if version == 1:
            self._check_v1(sd)
            perm, n_saved = torch.arange(len(pipe.heads)), len(pipe.heads)
        else:
            perm, n_saved = saved_state.order(sd["heads"], pipe.heads), len(sd["heads"])
        if sd["config"] != self.config.to_dict():
            log.warning("flashwatch: resuming with a different WatchConfig than the saved "
                        "run's; decisions may differ from the uninterrupted run")
        self._step = int(sd["step"])
        self._cadence.monitoring = bool(sd["monitoring"])
        if version == 1:
            for st, modes, v in zip(self._states, sd["modes"], sd["power_v"], strict=True):
                pipe.book.set_modes(st, modes.clone().to(torch.int32))
                st.power_v = None if v is None else v.clone()
        else:
            pipe.book.set_all(sd["modes"][perm])
            user_set = sd.get("user_set")
            if user_set is not None:  # the holder sends them at the next exchange
                pipe.book.user_set = user_set[perm].bool() & pipe.held
            for st in self._states:
                st.power_v = saved_state.warm_start(sd.get("power_v") or {}, st)
        self._arm()
        self._recorder.clear_step()
        self._recorder.gen.set_state(sd["rng"])
        pipe.signals.load_state_dict(saved_state.reorder(sd["signals"], perm, n_saved))
        policy = saved_state.reorder(sd["policy"], perm, n_saved)
        pipe.policy.load_state_dict({**policy, "heads": list(pipe.heads)}
                                    if version != 1 else policy)
        pipe.events = [Event.from_dict(e) for e in sd["events"]]
        pipe.unreported = [Event.from_dict(e) for e in sd.get("unreported", [])]
        self._ledger.total = int(sd["errors_total"])
        if "qk_clip" in sd:
            pipe.qk_clip.load_state_dict(saved_state.reorder(sd["qk_clip"], perm, n_saved))

    def _check_v1(self, sd: dict) -> None:
        mine = [(st.site.name, st.site.num_heads) for st in self._states]
        theirs = [tuple(x) for x in sd["sites"]]
        if mine != theirs:
            raise ValueError(f"the saved watcher watched layers {theirs}, this one watches "
                             f"{mine}; load it into a watcher of the same model")

    def remove(self) -> None:
        """Detach every hook and close the sinks; the model is left as it was."""
        if self._cadence.removed:
            return
        self._cadence.removed = True
        self._attachment.detach()
        for h in self._mask_hooks:
            h.remove()
        traced.unregister([st.compiled.key for st in self._states])
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:
                    self._ledger.error(f"sink {type(sink).__name__}.close", e)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ---------------------------------------------------------------------- internals

    def _move_to(self, step: int) -> None:
        self._step = step
        self._cadence.monitoring = step % self.config.every_n_steps == 0
        self._arm()

    def _arm(self) -> None:
        """The X and ‖dW^Q‖² hooks run on monitored steps only, and measured steps run
        compiled code eagerly (flashwatch/monitor/attach.py)."""
        if self._cadence.monitoring:
            self._attachment.arm(self._states)
        else:
            self._attachment.disarm()
        self._stance()

    def _stance(self) -> None:
        """A measured step stays compiled when every layer can run the traced probe
        (flashwatch/monitor/traced.py); else every compiled function runs it eagerly."""
        for st in self._states:
            st.compiled.traced = st.traceable()
        # a routed layer's flex or varlen calls reach flashwatch's kernel only eagerly
        flex_routed = any(st.routed and st.compiled.flex_seen and st.flex_refused is None
                          and not st.lse_gradient for st in self._states)
        self._attachment.force_eager(flex_routed or (
            self._cadence.measuring and not all(st.compiled.traced for st in self._states)))

    def _split(self, st: LayerState) -> str | None:
        """A layer watched whole whose Q, K, V Linears `parallelize_module` split since
        (watch, then parallelize): this rank watches its own heads of it from now on, at
        their global indices, as if it had attached after (None), or why not."""
        try:
            site = split_by_tensor_parallelism(st.site)
            if isinstance(site, str):
                return site  # the same on every rank (the module's layout decides)
            i = next(j for j, s in enumerate(self.sites) if s is st.site)
            self._pipeline.narrow(st, site)  # all or nothing
            self.sites[i] = site
            self._set_modes(st, st.modes)
        except Exception as e:  # this rank only: the step is a failed one (monitored_step)
            self._ledger.error(f"narrowing {st.site.name}", e)
            st.buf.split_failed = True
            return f"narrowing it failed ({type(e).__name__}: {e})"
        return None

    def _set_modes(self, st: LayerState, modes: torch.Tensor) -> None:
        st.modes = modes
        routed = self.config.route_all or bool(modes.any())
        if routed and not st.routed:  # routed on unmonitored steps too: its own forward
            self._attachment.adopt(st)  # set since the last arm is wrapped now
        st.routed = routed


def watch(model: nn.Module | list[nn.Module], config: WatchConfig | None = None,
          sinks=None, sites=None, **kwargs) -> Watcher:
    """Attach flashwatch to `model`'s attention layers; returns the Watcher. `model` may
    be a list of the model parts a pipeline rank holds (torchtitan's `model_parts`),
    whose layers keep the names they have in the whole model.

    Pass a WatchConfig, or its fields as keyword arguments (not both). Call
    `watcher.step()` once per optimizer step; `watcher.remove()` (or a `with` block)
    detaches it.
    """
    if config is not None and kwargs:
        raise TypeError(f"pass either config= or WatchConfig fields as keywords, not both "
                        f"(got config and {sorted(kwargs)})")
    if config is None:
        config = WatchConfig.from_kwargs(**kwargs)
    return Watcher(model, config, sinks, sites)
