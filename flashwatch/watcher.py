"""`flashwatch.watch(model)`: attach to a model's attention layers, measure, mitigate.

One monitored optimizer step, end to end (docs/design.md §2):
  forward   flashwatch/attach.py marks the watched attention module current on monitored
            steps and at routed layers (else its forward only calls the original, for
            torch.compile), so its F.scaled_dot_product_attention and flashwatch.attention
            calls reach `_on_sdpa` / the interceptor here (in compiled code, once the
            layer was seen calling SDPA: `_traced_probe` via flashwatch/traced.py's
            ops, traced into the graph). A layer with a non-STANDARD
            head is routed to flashwatch's kernel with its modes. On monitored steps the
            probe samples rows, recomputes them in FP32 and hooks the output's gradient.
  backward  the gradient hook computes c[T] of the sampled rows; when flashwatch's own
            kernel ran, from the kernel's FP32 O on every row (Σc, Σc² then cover all
            rows); each micro-batch's samples are then reduced together (the sketch G,
            the sums: probe.totals); a post-accumulate-grad hook on the Q projection's
            weight keeps ‖dW^Q_h‖² of the step for delta_error_share.
  step()    once per optimizer step: W^Q spectral norms, one SUM and one MAX all_reduce
            across ranks (constant size in the world size), signals, policy, new
            modes from the next step, a StepReport to sinks.
Failures inside flashwatch are logged once, counted and never raised into training.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from flashwatch import aggregate, probe, qkclip, reduce, smallops, traced
from flashwatch import dispatch as _dispatch_mod
from flashwatch.attach import Attachment, recomputing
from flashwatch.config import WatchConfig
from flashwatch.distributed import RemoteFailure, spectral_norms, wq_grad_sq
from flashwatch.kernels.common import AttentionStats, Mode, check_inputs, no_autocast
from flashwatch.policy import Policy
from flashwatch.qkclip import QKClip
from flashwatch.report import HeadRecord, StepReport
from flashwatch.signals import HeadSignals
from flashwatch.sinks import Sink
from flashwatch.sites import AttentionSite, find_sites

log = logging.getLogger("flashwatch")

STATE_VERSION = 1
# Stop the warm-started power iteration of a sharded W^Q (FSDP2; whole weights use the
# Gram matrix, flashwatch/spectral.py) once σ changes by less than this between
# iterations: its growth rule acts on changes of 20 %, and 1e-6 took 16 iterations a
# layer against ≈ 7 on the benchmark GPT for digits no rule reads (error against
# matrix_norm stays < 1e-3: tests/test_distributed.py).
SPECTRAL_TOL = 1e-5


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: non_blocking (cudaMemcpyAsync
    stages a pageable source at once and does not wait for the stream; a blocking copy
    synchronises it)."""
    return t.to(device, non_blocking=True)


@dataclass
class _SiteState:
    """Runtime state of one watched layer: modes, sketch matrices, step accumulators."""

    site: AttentionSite
    offset: int  # index of head 0 in the watcher's flat head arrays
    modes: torch.Tensor  # int32 [H], applied modes, read at every call
    omega_x: torch.Tensor  # [d_model, k]
    omega_a: torch.Tensor  # [d_head, k]
    omega_q: torch.Tensor  # [d_head, k], for q-space terms when X is not available
    heads: torch.Tensor | None = None  # [H] int64: offset + arange(H), for probe.totals
    power_v: torch.Tensor | None = None  # warm start of the W^Q power iteration
    x: torch.Tensor | None = None  # input of the Q projection during the current call
    warned: set = field(default_factory=set)
    unmitigable: str | None = None  # why its modes could not be applied, last known
    shadowed: bool = False  # an instance attribute `forward` hides the wrapper
    # Plain Python bools, read by the forward wrapper before anything else: torch.compile
    # guards on them (one recompile when one flips) instead of tracing watcher code.
    routed: bool = False  # route_all or a non-STANDARD head: its calls go to our kernel
    # Since the last report: forwards of the module while routed, calls of ours that
    # ran its modes, and attention calls made with modes set that ran the original
    # kernel. Modes count as applied only if the first two are > 0 and the last is 0.
    module_calls: int = 0
    routed_calls: int = 0
    fallback_calls: int = 0
    pending: list = field(default_factory=list)  # applied mode events not yet seen run
    # accumulators of the current monitored step (reset in step())
    stats: AttentionStats | None = None  # exact counters of routed calls (on the device)
    stats_exact: bool = False  # a routed call of this step filled `stats`
    device_cache: dict = field(default_factory=dict)  # device -> (Ω_x, Ω_a, Ω_q, heads)
    samples: list = field(default_factory=list)  # probe.Sample of each probed call
    probe_rows: int = 0
    grad_rows: int = 0  # sampled rows whose gradient arrived
    o32: torch.Tensor | None = None  # the current routed call's FP32 O, every head
    o32_paper: bool = False  # ... made by backend="paper", whose δ is a BF16 rowsum
    # rows c covered, rows it missed (sampled calls), sampled rows with X (no X: no share)
    delta_rows: int = 0
    delta_missed: int = 0
    share_rows: int = 0
    # per head [H] float64: ‖dW^Q_h‖²_F of the step's gradient (see _wq_grad_hook)
    wq_grad_sq: torch.Tensor | None = None
    wq_grad_averaged: bool = False  # wq_grad_sq from FSDP2's shard of the averaged gradient
    wq_hooked: object = None  # the Q weight whose gradient hook is registered
    sampled: bool = False  # a probed call of this step measured only some of its rows
    # (sample, every_row, rows of the call) of calls made without grad, for a
    # reentrant checkpoint's recompute to hook
    no_grad_samples: list = field(default_factory=list)
    # Compiled monitored steps (flashwatch/traced.py): the layer's key for the probe ops
    # and what eager monitored steps saw it do. `traced` (read by the forward wrapper on
    # measured steps; Dynamo guards on it) says whether its compiled forward runs the
    # traced probe.
    key: int = -1  # in traced's registry
    key_t: torch.Tensor | None = None  # the same as a 0-dim tensor: a graph input, not a
    # constant each block's graph would specialise on
    q_path: str | None = None  # the nn.Linear Q projection inside the module (traced.q_path)
    sdpa_seen: bool = False  # made an F.scaled_dot_product_attention call while measured
    checkpointed: bool = False  # its forward was recomputed (activation checkpointing)
    dropout_seen: bool = False  # called SDPA with attention dropout while measured
    fw_seen: bool = False  # made a flashwatch.attention call while measured
    traced: bool = False
    # (sample, None, rows) of the step's traced calls by call id, until their gradient
    traced_pending: dict = field(default_factory=dict)

    def on_device(self, device) -> tuple:
        """(Ω_x, Ω_a, Ω_q, heads) on `device`, moved once per run, not once per call."""
        got = self.device_cache.get(device)
        if got is None:
            got = tuple(_to_device(x, device) for x in (self.omega_x, self.omega_a,
                                                        self.omega_q, self.heads))
            self.device_cache[device] = got
        return got

    def reset(self) -> None:
        H = self.site.num_heads
        dev = self.stats.rows.device if self.stats is not None else "cpu"
        self.stats = AttentionStats.zeros(H, device=dev)  # stays where the calls ran
        self.stats_exact = False
        self.samples = []
        self.probe_rows = self.grad_rows = 0
        self.o32 = None
        self.delta_rows = self.delta_missed = self.share_rows = 0
        self.wq_grad_sq = torch.full((H,), math.nan, dtype=torch.float64, device=dev)
        self.sampled = False
        self.no_grad_samples = []
        self.traced_pending = {}
        self.x = None


class Watcher:
    """Watches the attention layers of one model. Create it with `flashwatch.watch`."""

    def __init__(self, model: nn.Module, config: WatchConfig | None = None,
                 sinks: Iterable[Sink] | None = None, sites=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config or WatchConfig()
        if not isinstance(self.config, WatchConfig):
            raise TypeError(f"config must be a flashwatch.WatchConfig, got "
                            f"{type(self.config).__name__}")
        self.sinks = list(sinks or [])
        for s in self.sinks:
            if not callable(getattr(s, "write", None)):
                raise TypeError(f"sink {s!r} has no write(report) method")
        self.sites = find_sites(model, sites)
        cfg = self.config
        k = cfg.sketch_dim
        self._states: list[_SiteState] = []
        offset = 0
        for i, site in enumerate(self.sites):
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
            # Gaussian sketches scaled so z and y keep the norms of X and PK on average.
            st = _SiteState(
                site=site, offset=offset,
                modes=torch.zeros(site.num_heads, dtype=torch.int32),
                omega_x=torch.randn(site.d_model, k, generator=g) / math.sqrt(k),
                omega_a=torch.randn(site.head_dim, k, generator=g) / math.sqrt(k),
                omega_q=torch.randn(site.head_dim, k, generator=g) / math.sqrt(k),
                heads=torch.arange(offset, offset + site.num_heads),
            )
            st.reset()
            self._states.append(st)
            offset += site.num_heads
        self._heads = [(st.site.name, h) for st in self._states
                       for h in range(st.site.num_heads)]
        self._signals = HeadSignals(len(self._heads), k, cfg.window)
        self._policy = Policy(cfg, self._heads)
        self._qk_clip = QKClip(cfg, self.sites)
        self._gen = torch.Generator().manual_seed(cfg.seed)
        self._step = 0  # optimizer steps completed = index of the step being accumulated
        self._monitoring = True  # step 0 is monitored
        self._paused = False  # pause(): forward passes are not measured (validation)
        self._events: list = []
        self._unreported: list = []  # hand-set mode changes not yet in a StepReport
        self._errors_total = 0
        self._error_keys: set = set()
        self._monitor_seconds = 0.0
        # probe.totals of the step's samples reduced so far (`_sample_done`), and how many
        # samples got their c since
        self._totals: dict | None = None
        self._samples_done = 0
        self._traced_ids = itertools.count()  # ids of the probed calls in compiled code
        self._confirmed: list = []  # mode events seen run since the last report
        self._source = 0  # the rank whose decisions a disagreeing vote adopts
        # The monitor's own process group, created here on every rank (a collective):
        # nothing of ours can pair with a training collective (flashwatch/reduce.py).
        self._monitor = reduce.MonitorGroup(reduce.DEFAULT_TIMEOUT_S)
        self._monitor.check_same(heads=len(self._heads), layers=len(self.sites),
                                 sketch_dim=cfg.sketch_dim, every_n_steps=cfg.every_n_steps)
        self._removed = False
        self._attachment = Attachment(self)
        for st in self._states:
            st.key = traced.register(self, st)
            st.key_t = torch.tensor(st.key)
            st.q_path = traced.q_path(st.site.module, st.site.q_module)
            self._set_modes(st, st.modes)
            self._attachment.wrap(st)
        weakref.finalize(self, traced.unregister, [st.key for st in self._states])
        self._arm()  # step 0 is monitored

    # ----------------------------------------------------------------------- public API

    @property
    def step_count(self) -> int:
        """Optimizer steps completed (calls to step())."""
        return self._step

    @property
    def monitor_errors_total(self) -> int:
        return self._errors_total

    @property
    def events(self) -> list:
        """Every mode change and QK-clip (applied or advised) since the start, oldest
        first."""
        return list(self._events)

    def head_modes(self) -> dict[str, list[Mode]]:
        return {st.site.name: [Mode(int(m)) for m in st.modes] for st in self._states}

    def pause(self) -> None:
        """Stop measuring forward passes (e.g. during validation) until `resume()`.
        Head modes still apply; the step count is unaffected."""
        self._paused = True
        self._arm()

    def resume(self) -> None:
        self._paused = False
        self._arm()

    @property
    def _measuring(self) -> bool:
        return self._monitoring and not self._paused

    def set_head_modes(self, layer: str, modes) -> None:
        """Set the modes of one watched layer by hand, from the next attention call on
        (e.g. to apply what "advise" recommends). Logged as user events. Compiled or
        not, the layer's next forward runs them; if it makes no call flashwatch can
        route, the next report lists the layer in `unmitigable` and its events say
        applied=False."""
        from flashwatch.kernels.common import normalize_head_modes
        from flashwatch.report import Event

        st = next((s for s in self._states if s.site.name == layer), None)
        if st is None:
            raise ValueError(f"layer {layer!r} is not watched; watched layers: "
                             f"{[s.site.name for s in self._states]}")
        new = normalize_head_modes(modes, st.site.num_heads)
        changed = torch.zeros(len(self._heads), dtype=torch.bool)
        for h in range(st.site.num_heads):
            if int(new[h]) != int(st.modes[h]):
                changed[st.offset + h] = True
                event = Event(step=self._step, layer=layer, head=h,
                              from_mode=Mode(int(st.modes[h])), to_mode=Mode(int(new[h])),
                              reason="set by user", applied=True)
                self._events.append(event)
                self._unreported.append(event)  # goes out with the next report
                if event.to_mode != Mode.STANDARD:
                    st.pending.append(event)  # applied once a report sees it run
        self._set_modes(st, new)
        self._stance()  # a routed layer runs eagerly (flashwatch/attach.py)
        if changed.any():  # judge the new mode on what comes after it only
            self._signals.reset_window(changed)
            self._policy.restart(changed)

    def step(self) -> StepReport | None:
        """Call once per optimizer step. Returns the report of a monitored step, else None."""
        if self._removed:
            raise RuntimeError("this Watcher was removed; create a new one with "
                               "flashwatch.watch(model)")
        t0 = time.perf_counter()
        completed, was_monitoring = self._step, self._monitoring
        self._step += 1
        self._monitoring = self._step % self.config.every_n_steps == 0
        self._arm()
        if not was_monitoring:
            return None
        try:
            report = self._build_report(completed)
        except Exception as e:  # never take the run down
            self._error("step", e)
            self._clear_step()
            return None
        finally:  # the layers this step saw measured, and new modes, decide the stance
            self._stance()
        report.monitor_seconds = self._monitor_seconds + time.perf_counter() - t0
        self._monitor_seconds = 0.0
        report.monitor_errors_total = self._errors_total
        for sink in self.sinks:
            try:
                sink.write(report)
            except Exception as e:
                self._error(f"sink {type(sink).__name__}", e)
        report.monitor_errors_total = self._errors_total
        return report

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "step": self._step,
            "monitoring": self._monitoring,
            "sites": [(st.site.name, st.site.num_heads) for st in self._states],
            "modes": [st.modes.clone() for st in self._states],
            "power_v": [None if st.power_v is None else st.power_v.clone()
                        for st in self._states],
            "rng": self._gen.get_state(),
            "signals": self._signals.state_dict(),
            "policy": self._policy.state_dict(),
            "events": [e.to_dict() for e in self._events],
            "unreported": [e.to_dict() for e in self._unreported],
            "errors_total": self._errors_total,
            "qk_clip": self._qk_clip.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        from flashwatch.report import Event

        if not isinstance(sd, dict) or sd.get("version") != STATE_VERSION:
            raise ValueError(f"not a flashwatch Watcher state (version "
                             f"{sd.get('version') if isinstance(sd, dict) else None!r}, "
                             f"expected {STATE_VERSION})")
        mine = [(st.site.name, st.site.num_heads) for st in self._states]
        theirs = [tuple(x) for x in sd["sites"]]
        if mine != theirs:
            raise ValueError(f"the saved watcher watched layers {theirs}, this one watches "
                             f"{mine}; load it into a watcher of the same model")
        if sd["config"] != self.config.to_dict():
            log.warning("flashwatch: resuming with a different WatchConfig than the saved "
                        "run's; decisions may differ from the uninterrupted run")
        self._step = int(sd["step"])
        self._monitoring = bool(sd["monitoring"])
        for st, modes, v in zip(self._states, sd["modes"], sd["power_v"], strict=True):
            self._set_modes(st, modes.clone().to(torch.int32))
            st.power_v = None if v is None else v.clone()
        self._arm()
        self._clear_step()
        self._gen.set_state(sd["rng"])
        self._signals.load_state_dict(sd["signals"])
        self._policy.load_state_dict(sd["policy"])
        self._events = [Event.from_dict(e) for e in sd["events"]]
        self._unreported = [Event.from_dict(e) for e in sd.get("unreported", [])]
        self._errors_total = int(sd["errors_total"])
        if "qk_clip" in sd:
            self._qk_clip.load_state_dict(sd["qk_clip"])

    def remove(self) -> None:
        """Detach every hook and close the sinks; the model is left as it was."""
        if self._removed:
            return
        self._removed = True
        self._attachment.detach()
        traced.unregister([st.key for st in self._states])
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:
                    self._error(f"sink {type(sink).__name__}.close", e)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ forward wrapper

    def _arm(self) -> None:
        """The X and ‖dW^Q‖² hooks run on monitored steps only, and measured steps run
        compiled code eagerly (flashwatch/attach.py)."""
        if self._monitoring:
            self._attachment.arm(self._states)
        else:
            self._attachment.disarm()
        self._stance()

    def _stance(self) -> None:
        """A measured step stays compiled when every layer can run the traced probe
        (flashwatch/traced.py); else every compiled function runs it eagerly."""
        for st in self._states:
            st.traced = self._traceable(st)
        self._attachment.force_eager(
            self._measuring and not all(st.traced for st in self._states))

    @staticmethod
    def _traceable(st: _SiteState) -> bool:
        """Seen measured (eagerly) making SDPA calls only, no head modes, never recomputed
        by activation checkpointing (Dynamo cannot enter the mode inside a checkpoint
        region: the graph break would cost the layer loop's frame its graph for good),
        and X from an nn.Linear Q projection inside the module, or none: what the traced
        probe measures like the eager one."""
        return (traced.SUPPORTED and st.sdpa_seen and not st.fw_seen and not st.checkpointed
                and not st.dropout_seen and not st.routed and not st.shadowed
                and (st.site.q_module is None or st.q_path is not None))

    def _set_modes(self, st: _SiteState, modes: torch.Tensor) -> None:
        st.modes = modes
        st.routed = self.config.route_all or bool(modes.any())

    def _wq_grad_hook(self, st: _SiteState):
        """‖dW^Q_h‖²_F per head after each accumulation into the Q weight's .grad: the
        last one of a monitored step is the whole step's gradient, before clipping and
        before the user's zero_grad, wherever they call watcher.step().
        The hook holds the watcher and layer weakly: the weight's C++ side holds the
        hook, and a cycle through it (watcher → layer → weight → hook → watcher) is one
        Python's gc cannot see, so a watcher (and the layers it holds) dropped without
        remove() would never be collected."""
        w_ref, st_ref = weakref.ref(self), weakref.ref(st)

        def hook(param):
            w, st = w_ref(), st_ref()
            if w is None or st is None or not w._measuring or w._removed or param.grad is None:
                return
            try:
                st.wq_grad_sq, st.wq_grad_averaged = wq_grad_sq(st.site, param.grad)
            except Exception as e:
                w._error(f"W^Q gradient {st.site.name}", e)
        return hook

    # ------------------------------------------------------------- attention handling

    def _on_sdpa(self, st: _SiteState, func, args, kwargs):
        a = traced.sdpa_args(args, kwargs)
        # route and probe what SDPA computes with (autocast: rotary models hand it FP32
        # q, k and a BF16 v)
        q, k, v = traced.autocast_qkv(a["query"], a["key"], a["value"])
        mask, dropout = a.get("attn_mask"), a.get("dropout_p", 0.0)
        causal, scale = bool(a.get("is_causal", False)), a.get("scale")
        route = st.routed
        out, routed = None, False
        if route:
            reason = None
            if mask is not None:
                reason = "it passes attn_mask"
            elif dropout and torch.is_grad_enabled():
                reason = f"it uses attention dropout ({dropout})"
            elif q.dim() != 4:
                reason = f"its q has {q.dim()} dims"
            if reason is None:
                try:
                    out = self._routed(st, q, k, v, causal, scale, None)
                    routed = True
                except Exception as e:
                    self._error(f"routing {st.site.name}", e)
                    self._fallback(st, f"routing failed ({type(e).__name__}: {e})")
            else:
                self._fallback(st, reason)
                self._warn_once(st, "unmitigable",
                                f"flashwatch: cannot apply head modes to {st.site.name} "
                                f"because {reason}; it stays on the original kernel and "
                                f"is still measured")
        if out is None:
            out = func(*args, **kwargs)
        if self._measuring:
            st.sdpa_seen = True
            dropped = bool(dropout) and torch.is_grad_enabled()  # never routed (above)
            if dropped:  # the kernel's O is dropped out; the FP32 recomputation is not
                st.dropout_seen = True
                self._warn_once(st, "dropout", f"flashwatch: {st.site.name} uses attention "
                                f"dropout ({dropout}): its δ error is not measured (O_used "
                                f"is dropped out, the FP32 recomputation is not); ties and "
                                f"max logit still are")
            self._safe_probe(st, q, k, v, out, causal, scale, mask, routed, grad=not dropped)
        return out

    def _make_fw_interceptor(self, st: _SiteState):
        def intercept(q, k, v, *, causal=False, scale=None, head_modes=None, beta=2.0,
                      eps=1e-3, stats=None, backend="auto"):
            st.fw_seen = True  # its compiled steps stay on the eager path (traced.py)
            # The caller's mistakes are the caller's errors, exactly as without a watcher.
            check_inputs(q, k, v, causal=causal, scale=scale, head_modes=head_modes,
                         beta=beta, eps=eps, stats=stats)
            # One β and eps per watched layer, the WatchConfig's: the heads the policy
            # switches and the ties it counts must use the values it was configured with.
            if (beta, eps) != (self.config.beta, self.config.eps):
                self._warn_once(st, "beta", f"flashwatch: {st.site.name} calls "
                                f"flashwatch.attention with beta={beta}, eps={eps}; inside a "
                                f"watched layer the WatchConfig's beta={self.config.beta}, "
                                f"eps={self.config.eps} apply (pass them to flashwatch.watch)")
            try:
                out = self._routed(st, q, k, v, causal, scale, head_modes, user_stats=stats,
                                   backend=backend)
            except Exception as e:  # a failure of ours: run the call as it was made
                self._error(f"routing {st.site.name}", e)
                self._fallback(st, f"routing failed ({type(e).__name__}: {e})")
                return _dispatch_mod._dispatch(q, k, v, causal=causal, scale=scale,
                                               head_modes=head_modes, beta=beta, eps=eps,
                                               stats=stats, backend=backend)
            if self._measuring:
                self._safe_probe(st, q, k, v, out, causal, scale, None, True)
            return out
        return intercept

    @staticmethod
    def _fallback(st: _SiteState, reason: str) -> None:
        """An attention call of a routed layer ran the original kernel, not its modes."""
        if bool(st.modes.any()) and not recomputing():
            st.fallback_calls += 1
            st.unmitigable = reason

    def _routed(self, st, q, k, v, causal, scale, head_modes, *, user_stats=None, beta=None,
                eps=None, backend=None):
        cfg = self.config
        if k.shape[1] != q.shape[1]:  # grouped-query attention (enable_gqa)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        modes = st.modes
        if head_modes is not None:  # the caller's own modes: the stronger of the two wins
            from flashwatch.kernels.common import normalize_head_modes
            modes = torch.maximum(modes, normalize_head_modes(head_modes, q.shape[1]))
        stats = None
        if self._measuring or user_stats is not None:
            stats = AttentionStats.zeros(q.shape[1], device=q.device)
        o32 = [] if self._measuring else None  # the kernel's FP32 O: c[T] on every row
        out = _dispatch_mod._dispatch(
            q, k, v, causal=causal, scale=scale, head_modes=modes,
            beta=cfg.beta if beta is None else beta, eps=cfg.eps if eps is None else eps,
            stats=stats, backend=backend or cfg.backend, o32_out=o32)
        if not recomputing():
            st.routed_calls += 1
        st.o32 = o32[0] if o32 and o32[0].shape[0] == q.shape[1] else None
        st.o32_paper = (backend or cfg.backend) == "paper"
        if stats is not None:
            if user_stats is not None:
                user_stats.add_(stats.tied_rows, 0, stats.guarded_rows, stats.max_logit)
                user_stats.rows += stats.rows.to(user_stats.rows.device)
            if self._measuring and not recomputing():  # accumulated on the device
                if st.stats.rows.device != stats.rows.device:  # the step's first call
                    st.stats = AttentionStats(*(x.to(stats.rows.device) for x in (
                        st.stats.tied_rows, st.stats.rows, st.stats.guarded_rows,
                        st.stats.max_logit)))
                st.stats.add_(stats.tied_rows, 0, stats.guarded_rows, stats.max_logit)
                st.stats.rows += stats.rows
                st.stats_exact = True
        return out

    def _safe_probe(self, st, q, k, v, out, causal, scale, mask, routed, grad=True):
        """The probe on an eager call; grad=False: its ties and max logit only."""
        t0 = time.perf_counter()
        try:
            if recomputing():
                st.checkpointed = True  # keeps the eager path (traced.py cannot trace it)
                if grad:
                    self._hook_recompute(st, out)
            else:
                got = self._probe(st, q, k, v, out, causal, scale, mask, routed, st.x)
                if got is not None and grad:
                    if out.requires_grad:  # the hook goes on the tensor autograd sees
                        out.register_hook(self._grad_hook(st, *got))
                    else:  # a reentrant checkpoint's first forward: its recompute hooks it
                        st.no_grad_samples.append(got)
        except Exception as e:
            self._error(f"probe {st.site.name}", e)
        self._monitor_seconds += time.perf_counter() - t0

    def _traced_probe(self, st, q, k, v, out, x, mask, causal, scale):
        """torch.ops.flashwatch.probe (a compiled monitored step, flashwatch/traced.py):
        the eager probe on the call, X handed in by the layer's Interceptor; the
        gradient arrives through torch.ops.flashwatch.probe_grad (`_traced_grad`)."""
        if not self._measuring or self._removed or recomputing():
            return -1  # a checkpoint's recompute inside the compiled backward: counted
        t0 = time.perf_counter()
        call = -1
        try:
            if x is None and st.q_path is not None:
                self._warn_once(st, "traced x", f"flashwatch: {st.site.name}: inside compiled "
                                f"code no F.linear call on the Q projection's weight came "
                                f"before SDPA; using q-space sketch terms and no "
                                f"delta_error_share there")
            got = self._probe(st, q, k, v, out, causal, scale, mask, False, x)
            if got is not None:
                call = next(self._traced_ids)
                st.traced_pending[call] = got
        except Exception as e:
            self._error(f"probe {st.site.name}", e)
        self._monitor_seconds += time.perf_counter() - t0
        return call

    def _traced_grad(self, st, call: int, grad) -> None:
        """torch.ops.flashwatch.probe_grad: the gradient of probed call `call` (each
        further backward through it, retain_graph, counts as in eager)."""
        if self._removed:
            return
        got = st.traced_pending.get(call)
        if got is not None:
            self._grad_hook(st, *got)(grad)
        else:  # its sample was reduced (a further backward, retain_graph) or never made
            self._warn_once(st, "traced grad", f"flashwatch: {st.site.name}: a gradient "
                            f"inside compiled code found no probed call to pair with (a "
                            f"further backward through a reduced call, or a backward "
                            f"after step()); its δ error is not measured")

    def _probe(self, st, q, k, v, out, causal, scale, mask, routed, x):
        """Sample rows of the call, recompute them in FP32, keep their Sample; returns
        (sample, every_row, rows of the call) for the gradient step, None if not probed."""
        cfg = self.config
        o32_all, st.o32 = (st.o32 if routed else None), None
        if q.dim() != 4 or out.shape[:3] != q.shape[:3]:
            self._warn_once(st, "shape", f"flashwatch: {st.site.name}: attention on shape "
                            f"{tuple(q.shape)} is not [B, H, N, D]; not probed")
            return None
        B, H, Nq, D = q.shape
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        with torch.no_grad(), no_autocast(q.device):
            q, k, v, out = q.detach(), k.detach(), v.detach(), out.detach()
            n_rows = B * Nq if cfg.rows_per_head == "all" else cfg.rows_per_head
            elems, tq = probe.sample_rows(self._gen, B, Nq, n_rows)
            elems = None if elems is None else _to_device(elems, q.device)
            tq = _to_device(tq, q.device)
            omega_x, omega_a, omega_q, heads = st.on_device(q.device)
            b, t = probe.flat(elems, tq)
            st.sampled = st.sampled or len(b) < B * Nq  # G from some rows only
            o32, pk, tied, row_max = probe.recompute(q, k, v, elems, tq, causal=causal,
                                                     scale=scale, attn_mask=mask, eps=cfg.eps)
            o_used = out[b, :, t].float()
            fp32_heads = st.modes == int(Mode.FP32_O)  # CPU: .any() syncs nothing
            fp32_dev = None
            if routed and bool(fp32_heads.any()):
                # δ of these heads came from the kernel's FP32 O; its residual error is at
                # FP32 rounding, far below what the probe resolves: count it as 0. A where,
                # not boolean indexing (nonzero: a host sync on CUDA).
                fp32_dev = _to_device(fp32_heads, q.device)
                o_used = torch.where(fp32_dev[None, :, None], o32, o_used)
            every_row = None  # (O_used, O_fp32 [B, H, Nq, D], FP32_O heads, BF16 δ)
            if o32_all is not None:
                # O_fp32 = the kernel's FP32 accumulator divided by l: exactly what the
                # FP32_O fix hands δ, so c measures the rounding that fix removes. Both
                # are saved for the backward anyway: holding them costs no memory.
                every_row = (out, o32_all.permute(1, 0, 2, 3), fp32_dev,
                             st.o32_paper)
            # Share of the W^Q gradient (docs/design.md §5): e_T = α c[T] PK[T] X[T]ᵀ is
            # rank 1, ‖e_T‖² = α² c² ‖PK‖² ‖X‖²; sampled rows stand for B·Nq / R rows each.
            share_w = None
            if x is not None and x.dim() == 3 and x.shape[:2] == (B, Nq) and \
                    x.shape[2] == st.site.d_model:
                xr = x.detach()[b, t].float()
                z = smallops.matmul(xr, omega_x)  # [R, k]
                f64 = torch.float64  # squares in FP32 (a weight: 1e-7 is plenty), sums in FP64
                share_w = (scale ** 2 * B * Nq / len(b)) * (
                    xr.square().sum(-1, keepdim=True, dtype=f64) * pk.square().sum(-1, dtype=f64))
            else:
                if x is not None:
                    self._warn_once(st, "x", f"flashwatch: {st.site.name}: the Q projection's "
                                    f"input has shape {tuple(x.shape)}, not [B, N, d_model]; "
                                    f"using q-space sketch terms")
                z = smallops.matmul(q[b, :, t].float(), omega_q)  # [R, H, k]
            y = smallops.matmul(pk, omega_a)  # [R, H, k]
        sample = probe.Sample(heads=heads, b=b, t=t, tied=tied, row_max=row_max, z=z, y=y,
                              share_w=share_w, d=probe.o_error(o_used, o32),
                              shape=(B, Nq))
        st.samples.append(sample)
        st.probe_rows += len(b)  # with its ties, never apart from them
        return sample, every_row, B * Nq

    def _hook_recompute(self, st, out):
        """Activation checkpointing's recompute of a call already counted: count nothing
        again. Non-reentrant: the first forward's output got the gradient hook, done.
        Reentrant: the first forward ran without grad and left its sample; the gradient
        flows through this recomputed output, so hook that sample here. Recomputes run
        in reverse call order, hence the last sample first."""
        if not (out.requires_grad and st.no_grad_samples):
            return
        sample, every_row, n_rows = st.no_grad_samples.pop()
        d = sample.d
        # the call's shape, known on the host (b.max() would be a host sync)
        if out.dim() != 4 or not (sample.shape[0] <= out.shape[0]
                                  and sample.shape[1] <= out.shape[2]
                                  and d.shape[1:] == (out.shape[1], out.shape[3])):
            self._warn_once(st, "recompute", f"flashwatch: {st.site.name}: a recomputed "
                            f"call's output {tuple(out.shape)} does not fit the sample of "
                            f"its first forward; its δ error is not measured")
            return
        out.register_hook(self._grad_hook(st, sample, every_row, n_rows))

    def _grad_hook(self, st, sample, every_row, n_rows):
        """c[T] of the sampled rows while dO is at hand: against the kernel's own O_fp32
        where flashwatch's kernel ran (`every_row`, which also gives c on every row),
        else against the probe's FP32 recomputation. The sketch and the sums follow in
        probe.totals, for a micro-batch's calls at once (`_sample_done`)."""
        def hook(grad):
            if self._removed:
                return None
            t0 = time.perf_counter()
            try:
                with torch.no_grad(), no_autocast(grad.device):
                    s, b, t = sample, sample.b, sample.t
                    if every_row is not None:  # c = δ_used - rowsum(dO ∘ O_fp32)
                        o_all, o32_all, fp32_heads, bf16_delta = every_row
                        if bf16_delta:  # the paper backward's δ: product and sum in BF16
                            c_all = (grad * o_all).sum(-1).double() - (
                                grad.float() * o32_all).sum(-1, dtype=torch.float64)
                        else:
                            c_all = (grad.float() * (o_all.float() - o32_all)).sum(
                                -1, dtype=torch.float64)
                        if fp32_heads is not None:  # δ used the FP32 O: no error
                            c_all = c_all.masked_fill(fp32_heads[None, :, None], 0.0)
                        # The sampled rows' c is the kernel's own: exactly what FP32_O
                        # removes. Elsewhere it is against the probe's FP32 recomputation,
                        # which also counts the rounding of P̄ in O (reads high: README).
                        c = c_all[b, :, t]  # [R, H]
                        sums = torch.stack([c_all.sum((0, 2)), c_all.square().sum((0, 2))])
                        st.delta_rows += c_all.shape[0] * c_all.shape[2]
                    else:
                        c = probe.c_of(grad[b, :, t], s.d)
                        sums = None
                        st.delta_rows += len(b)
                        st.delta_missed += n_rows - len(b)
                    if s.c is None:
                        s.c, s.c_all = c, sums
                    else:  # a further backward through the call (retain_graph): its
                        # gradient adds to W^Q's, so its c counts too, as a record of its
                        # own; its rows' ties were counted with the forward's
                        st.samples.append(dataclasses.replace(
                            s, c=c, c_all=sums, tied=torch.zeros_like(s.tied),
                            row_max=torch.full_like(s.row_max, -math.inf)))
                    st.grad_rows += len(b)
                    if s.share_w is not None:
                        st.share_rows += len(b)
                    self._sample_done()
            except Exception as e:
                self._error(f"gradient probe {st.site.name}", e)
            self._monitor_seconds += time.perf_counter() - t0
            return None
        return hook

    def _clear_step(self) -> None:
        """Empty every accumulator of the step being measured (after its report, after a
        failed one, on load)."""
        for st in self._states:
            st.reset()
        self._totals, self._samples_done = None, 0

    def _sample_done(self) -> None:
        """Once as many calls as there are layers have their c (a micro-batch, usually),
        reduce them into the step's totals: memory stays one micro-batch of samples
        however many micro-batches an optimizer step accumulates."""
        self._samples_done += 1
        if self._samples_done < len(self._states):
            return
        self._samples_done = 0
        done = [s for st in self._states for s in st.samples if s.c is not None]
        # Into a copy: if the reduction fails, the samples stay for step() to reduce.
        acc = None if self._totals is None else {k: v.clone() for k, v in self._totals.items()}
        self._totals = probe.totals(done, len(self._heads), self.config.sketch_dim, acc,
                                    device=done[0].d.device if done else "cpu")
        for st in self._states:
            st.samples = [s for s in st.samples if s.c is None]
            # reduced: only a further backward (retain_graph) would look for it again
            st.traced_pending = {i: got for i, got in st.traced_pending.items()
                                 if got[0].c is None}

    # ------------------------------------------------------------------------- step

    def _build_report(self, step: int) -> StepReport:
        """A monitored step's report. Every rank issues the same collectives in the same
        order whatever fails locally (flashwatch/reduce.py): buffers → W^Q norms (sharded
        ones: collectives) → one move to the host → exchange → decide → vote."""
        not_applied, withdrawn = self._judge_modes()
        local = None
        try:
            layers, totals = self._step_buffers()
        except Exception as e:
            self._error("step totals", e)
            layers = totals = None
        sigma = self._spectral()  # every rank: sharded W^Q norms are collectives
        if layers is not None:
            try:
                local = aggregate.contribution(
                    aggregate.to_host(aggregate.gather(layers, totals, sigma)))
            except Exception as e:
                self._error("step totals", e)
        self._clear_step()
        red = self._exchange(local, step)
        decision, values, arrays, clips = self._decide_together(step, red)
        if arrays is None:
            raise RuntimeError(f"no numbers to report at step {step}: "
                               f"{self._monitor.broken or 'see the errors logged above'}")
        return self._report(step, arrays, values, decision, clips, not_applied, withdrawn)

    def _judge_modes(self) -> tuple[dict, list]:
        """Which layers' non-STANDARD modes did not run since the last report, and the
        events withdrawn for it (local facts: each rank reports its own)."""
        not_applied, withdrawn = {}, []
        for st in self._states:
            reason = self._not_applied(st)
            if reason is not None:  # say so, never claim the modes applied
                not_applied[st.site.name] = reason
                if st.module_calls or st.fallback_calls or st.shadowed:  # seen failing now
                    self._error(f"mitigation {st.site.name}", RuntimeError(reason))
                    withdrawn += self._withdraw(st, reason)
            elif st.routed_calls > 0:
                self._confirmed += [e for e in st.pending if e.applied]
                st.pending.clear()  # seen run: the events stand
                st.unmitigable = None
            st.module_calls = st.routed_calls = st.fallback_calls = 0
        return not_applied, withdrawn

    def _step_buffers(self) -> tuple[list, dict]:
        """The layers' buffers and the probe totals of every call not reduced yet, where
        they were accumulated (flashwatch/probe.py, flashwatch/aggregate.py)."""
        rest = [smp for st in self._states for smp in st.samples]
        device = (self._totals["G"].device if self._totals is not None
                  else rest[0].d.device if rest else "cpu")
        tot = probe.totals(rest, len(self._heads), self.config.sketch_dim, self._totals,
                           device=device)
        layers = [aggregate.LayerBuffers(
            num_heads=st.site.num_heads, exact=bool(st.stats_exact),
            tied_rows=st.stats.tied_rows, rows=st.stats.rows,
            guarded_rows=st.stats.guarded_rows, max_logit=st.stats.max_logit,
            wq_grad_sq=st.wq_grad_sq, probe_rows=st.probe_rows, grad_rows=st.grad_rows,
            delta_rows=st.delta_rows, delta_missed=st.delta_missed,
            share_rows=st.share_rows, sampled=st.sampled, averaged=st.wq_grad_averaged)
            for st in self._states]
        return layers, tot

    def _spectral(self) -> list:
        """Each layer's W^Q spectral norms [H] where they are computed (NaN: failed).
        Plain W^Q from their Gram matrices, same-shape ones batched over layers; sharded
        (DTensor) ones by the fault-symmetric sharded power iteration, on every rank."""
        cfg = self.config
        try:
            with torch.no_grad():
                norms = spectral_norms([st.site for st in self._states],
                                       [st.power_v for st in self._states], cfg.power_iters,
                                       monitor=self._monitor, max_iters=cfg.power_max_iters,
                                       tol=SPECTRAL_TOL)
        except Exception as e:
            self._error("spectral norms", e)
            norms = [e] * len(self._states)
        out = []
        for st, got in zip(self._states, norms, strict=True):
            if isinstance(got, Exception):
                if not isinstance(got, RemoteFailure):  # counted where it happened
                    self._error(f"spectral norm {st.site.name}", got)
                out.append(torch.full((st.site.num_heads,), math.nan, dtype=torch.float64))
                continue
            s, st.power_v = got
            out.append(s)
        return out

    def _exchange(self, local: dict | None, step: int):
        """reduce.exchange on the monitor's group, or None once the group is broken.
        Ranks at different step counts are told so (every rank: it is in the reduced
        numbers) and realigned to the highest."""
        shapes = aggregate.shapes(len(self._heads), self.config.sketch_dim)
        monitor = self._monitor if self._monitor.distributed else None
        if monitor is not None and monitor.broken is not None:
            return None
        try:
            red = reduce.exchange(monitor, local, local, shapes, step=step)
        except Exception as e:
            self._error("cross-rank reduction", e)
            return None
        if red.local_error is not None:
            self._error("cross-rank reduction", red.local_error)
        if not red.in_step:
            self._error("step alignment", RuntimeError(
                f"ranks reached different monitored steps (lowest step count "
                f"{red.steps[0]}, highest {red.steps[1]}; this rank {step}): every rank must "
                f"call watcher.step() once per optimizer step and load the same watcher "
                f"state; decisions are skipped and step counts realigned to "
                f"{red.steps[1]}"))
            self._step = red.steps[1] + 1
            self._monitoring = self._step % self.config.every_n_steps == 0
            self._arm()
        elif red.failed_ranks and local is not None:
            self._warn_global("remote", f"flashwatch: {red.failed_ranks} rank(s) failed "
                              f"to measure step {step}; its numbers miss their rows and "
                              f"no mode changes are decided from it")
        return red

    def _decide_together(self, step: int, red):
        """finish → signals → policy → QK-clip plan, then a vote that every rank issues:
        if any rank failed (or holds other modes), every rank takes the state of the
        lowest rank that did not fail, so modes stay identical everywhere."""
        decision = values = arrays = None
        failed, clip_plan = False, None
        try:
            if red is not None:
                arrays = aggregate.finish(red.sums, red.maxes, self._monitor.world)
                if red.in_step and not red.failed_ranks:
                    values, decision = self._decide(step, arrays)
                    clip_plan = self._qk_clip_plan(arrays)
        except Exception as e:
            self._error("decide", e)
            failed, decision = True, None
        modes = (decision.modes if decision is not None else
                 torch.cat([st.modes for st in self._states]).long())
        agreed = red is None or self._vote_agrees(failed, modes)
        if not agreed and self._monitor.rank != self._source:
            decision = None  # this rank takes the source rank's decision instead
        if decision is not None:
            self._apply_decision(decision)
        if not agreed:
            clip_plan = None  # weights change only where every rank agreed
            self._heal()
        clips = self._safe_qk_clip(step, arrays, clip_plan)
        return decision, values, arrays, clips

    def _decide(self, step: int, a: aggregate.HeadArrays):
        t = torch.from_numpy
        values = self._signals.update(t(a.G), t(a.sigma), t(a.delta_sum_w), t(a.delta_sq_w),
                                      t(a.share), share_weight=t(a.wq_grad_sq))
        modes = torch.cat([st.modes for st in self._states]).long()
        decision = self._policy.decide(step, t(a.tie_ratio), values, modes,
                                       max_logit=t(a.max_logit), share=t(a.share))
        return values, decision

    def _vote_agrees(self, failed: bool, modes: torch.Tensor) -> bool:
        """One MAX all_reduce of [failed, mode hash, -mode hash, -(first healthy rank)]:
        True when no rank failed and all hold the same modes."""
        mon = self._monitor
        if not mon.distributed:
            return not failed
        h = float((modes.double() * torch.arange(1, modes.numel() + 1,
                                                  dtype=torch.float64)).sum())
        me = float(mon.world if failed else mon.rank)
        vote = torch.tensor([float(failed), h, -h, -me], dtype=torch.float64)
        try:
            mon.all_reduce_(vote, "max")
        except Exception as e:
            self._error("vote", e)
            return False
        self._source = int(-vote[3])  # the lowest rank that did not fail
        agree = vote[0] == 0 and vote[1] == -vote[2]
        if not agree:
            self._warn_global("vote", "flashwatch: ranks disagreed at a monitored step (a "
                              "rank failed, or holds other head modes); every rank takes "
                              "the decisions of the lowest rank that did not fail")
        return bool(agree)

    def _heal(self) -> None:
        """Every rank takes the signals, policy and modes of `self._source` (one
        broadcast on the monitor's group; no healthy rank: each keeps its own)."""
        mon = self._monitor
        if not mon.distributed or self._source >= mon.world:
            return
        import torch.distributed as dist

        box = [None]
        if mon.rank == self._source:
            box = [dict(signals=self._signals.state_dict(), policy=self._policy.state_dict(),
                        modes=[st.modes.clone() for st in self._states])]
        try:
            dist.broadcast_object_list(box, src=self._source, group=mon.group)
            if mon.rank != self._source:
                self._signals.load_state_dict(box[0]["signals"])
                self._policy.load_state_dict(box[0]["policy"])
                for st, m in zip(self._states, box[0]["modes"], strict=True):
                    self._set_modes(st, m.clone().to(torch.int32))
        except Exception as e:
            self._error("state broadcast", e)

    def _apply_decision(self, decision) -> None:
        new_modes = decision.modes.to(torch.int32)
        for st in self._states:
            self._set_modes(st, new_modes[st.offset:st.offset + st.site.num_heads].clone())
        by_name = {st.site.name: st for st in self._states}
        for e in decision.events:
            if e.applied and e.kind == "mode" and e.to_mode != Mode.STANDARD:
                by_name[e.layer].pending.append(e)
        if decision.reset_window.any():
            self._signals.reset_window(decision.reset_window)
        self._events.extend(decision.events)

    def _report(self, step, a, values, decision, clips, not_applied, withdrawn) -> StepReport:
        n = len(self._heads)
        nan = np.full(n, np.nan)
        modes = torch.cat([st.modes for st in self._states]).long()
        cols = dict(
            tied_rowmax_ratio=a.tie_ratio, attention_max_logit=a.max_logit,
            delta_error_sum=a.delta_sum, delta_error_rows=a.delta_rows,
            delta_error_all_rows=(a.delta_rows > 0) & (a.delta_missed == 0),
            delta_error_share=a.share, guarded_rows=a.guarded.astype(np.int64),
            wq_spectral_norm=a.sigma)
        # values None: nothing was decided this step (signals not updated): NaN
        for f in ("delta_sign_z", "delta_error_share_mean", "delta_error_share_std", "r_projection",
                  "r_projection_cumulative", "delta_drift_z", "delta_coherence"):
            cols[f] = nan if values is None else getattr(values, f)
        # One tolist() per field, not a tensor index per head and field (5,120 heads:
        # benchmarks/bench_scale.py).
        columns = {k: (v.tolist() if hasattr(v, "tolist") else list(v))
                   for k, v in cols.items()}
        ran = modes.clone()  # what the kernel runs: not a layer's modes it cannot apply
        for st in self._states:
            if st.site.name in not_applied:
                ran[st.offset:st.offset + st.site.num_heads] = int(Mode.STANDARD)
        recommended = (decision.recommended if decision is not None else modes).tolist()
        flagged = (decision.flagged if decision is not None
                   else torch.zeros(n, dtype=torch.bool)).tolist()
        names = list(columns)
        records = [HeadRecord(layer=layer, head=head, **dict(zip(names, vals, strict=True)),
                              head_mode=Mode(m), recommended_mode=Mode(r), flagged=bool(f))
                   for (layer, head), m, r, f, *vals in zip(
                       self._heads, ran.tolist(), recommended, flagged, *columns.values(),
                       strict=True)]
        events = self._unreported + withdrawn + \
            (list(decision.events) if decision is not None else []) + clips
        self._unreported = []
        report = StepReport(step=step, heads=records, events=events,
                            unmitigable=not_applied, qk_clips_total=self._qk_clip.total)
        if hasattr(report, "confirmed"):  # mode events seen run (counters count these)
            report.confirmed = self._confirmed
        self._confirmed = []
        return report

    def _not_applied(self, st: _SiteState) -> str | None:
        """Why the layer's non-STANDARD modes did not run since the last report, if they
        did not; None if they ran or the layer had no call to judge by."""
        if not bool(st.modes.any()):
            return None
        if st.shadowed:
            return ("its instance attribute `forward` hides flashwatch's wrapper, so its "
                    "attention calls never reach flashwatch")
        if st.fallback_calls > 0:
            return st.unmitigable
        if st.module_calls > 0 and st.routed_calls == 0:
            return (f"its module ran {st.module_calls} time(s) with head modes set but made "
                    f"no attention call flashwatch could route (neither "
                    f"F.scaled_dot_product_attention nor flashwatch.attention)")
        if st.module_calls == 0 and st.routed_calls == 0:
            return st.unmitigable  # not called since: the last thing known
        return None

    def _withdraw(self, st: _SiteState, reason: str) -> list:
        """Mark the layer's pending mode events applied=False; the copies not yet
        reported go out with this report."""
        out = []
        for e in st.pending:
            e.applied = False
            e.reason = f"{e.reason}; not applied: {reason}"
            if not any(e is u for u in self._unreported):
                out.append(dataclasses.replace(e))
        st.pending.clear()
        return out

    def _qk_clip_plan(self, a) -> torch.Tensor | None:
        """The reduced max logits QK-clip will act on, checked before the vote (its
        factors are a pure function of them, the same on every rank); None: no clip."""
        cfg = self.config
        if cfg.qk_clip_threshold is None or cfg.mitigation == "off":
            return None
        max_logit = torch.from_numpy(a.max_logit)
        qkclip.clip_factors(max_logit, cfg.qk_clip_threshold)
        return max_logit

    def _safe_qk_clip(self, step, a, max_logit) -> list:
        """QK-clip after the vote: every rank that agreed scales the same heads by the
        same factors (flashwatch/qkclip.py)."""
        if max_logit is None:
            return []
        modes = torch.cat([st.modes for st in self._states]).long()
        try:
            clips = self._qk_clip.apply(step, max_logit, modes)
        except Exception as e:
            self._error("qk_clip", e)
            return []
        self._events.extend(clips)
        return clips

    # ----------------------------------------------------------------------- errors

    def _error(self, where: str, exc: BaseException) -> None:
        self._errors_total += 1
        key = (where, type(exc).__name__)
        if key not in self._error_keys:
            self._error_keys.add(key)
            log.error("flashwatch: %s failed (%s: %s); training continues, the error is "
                      "counted in flashwatch_monitor_errors_total and logged once",
                      where, type(exc).__name__, exc, exc_info=exc)

    def _warn_global(self, key: str, message: str) -> None:
        if key not in self._error_keys:
            self._error_keys.add(key)
            log.warning(message)

    def _warn_once(self, st: _SiteState, key: str, message: str) -> None:
        if key not in st.warned:
            st.warned.add(key)
            log.warning(message)


def watch(model: nn.Module, config: WatchConfig | None = None, sinks=None, sites=None,
          **kwargs) -> Watcher:
    """Attach flashwatch to `model`'s attention layers; returns the Watcher.

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
