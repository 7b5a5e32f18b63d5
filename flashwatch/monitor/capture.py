"""Capture: what a watched layer's attention calls and gradients record during a step.

The Recorder is the one interface flashwatch/monitor/attach.py (eager forwards, hooks) and
flashwatch/monitor/traced.py (compiled forwards) call into:

    cadence                      routed or measured step: attach.py reads it inline
    on_sdpa / interceptor(st)    an F.scaled_dot_product_attention / flashwatch.attention
                                 call of a watched layer: route it to flashwatch's kernel
                                 with the layer's modes, probe it on measured steps
    traced_probe / traced_grad   the same probe from compiled code (torch.ops.flashwatch)
    wq_grad_hook(st)             ‖dW^Q_h‖² after each accumulation into the Q weight
    ledger                       errors and warnings, logged once and counted

The probe's side of it (sampling, c[T] in the gradient hooks, per-micro-batch totals) is
flashwatch/monitor/probing.py's ProbeRecorder, which Recorder extends. Everything it
accumulates goes into the layers' StepBuffers (flashwatch/monitor/layer_state.py)
on the device the calls ran on; flashwatch/monitor/monitored_step.py reads them once per step.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from flashwatch.config import WatchConfig
from flashwatch.kernels import dispatch as _dispatch_mod
from flashwatch.kernels.common import AttentionStats, check_inputs
from flashwatch.monitor import traced
from flashwatch.monitor.checkpointing import outside_selective_checkpoint, recomputing
from flashwatch.monitor.flex_capture import FlexCapture
from flashwatch.monitor.layer_state import LayerState
from flashwatch.monitor.ledger import ErrorLedger
from flashwatch.monitor.probing import ProbeRecorder
from flashwatch.parallel.sharding import (
    fsdp_grad_divisor,
    sequence_sharded,
    unnarrowed_tp,
    wq_grad_sq,
)

log = logging.getLogger("flashwatch")


@dataclass
class Cadence:
    """Where the watcher is in its cadence, shared by the Watcher and its Recorder."""

    monitoring: bool = True  # this step is monitored (step 0 is)
    paused: bool = False  # pause(): forward passes are not measured (validation)
    removed: bool = False

    @property
    def measuring(self) -> bool:
        return self.monitoring and not self.paused


class Recorder(ProbeRecorder, FlexCapture):
    """Records a watcher's layers' attention calls and gradients into their buffers:
    routes calls to flashwatch's kernel here, measures them in ProbeRecorder
    (flashwatch/monitor/probing.py); FlexAttention and varlen calls in FlexCapture
    (flashwatch/monitor/flex_capture.py)."""

    def __init__(self, owner, config: WatchConfig, states: list[LayerState],
                 cadence: Cadence, ledger: ErrorLedger, n_heads: int | None = None) -> None:
        super().__init__(config, states, cadence, ledger, n_heads)
        self.owner = owner  # the Watcher: kept alive as long as its model holds us
        self.attachment = None  # set by the Watcher (flashwatch/monitor/attach.py)
        # set by the Watcher: (layer) -> None once it watches this rank's part of a layer
        # that tensor parallelism split after attach, or why it cannot (a str)
        self.split = None
        self.roots = ()  # set by the Watcher: weak references to the watched model(s)
        self._divisors = WeakIdKeyDictionary()  # FSDP2 parameter -> its gradient divisor

    def grad_divisor(self, param) -> float:
        """What FSDP2 divides `param`'s reduced gradient by, 0 for its default (the mean
        over the data-parallel ranks: the holders `aggregate.finish` divides by), looked
        up once per parameter (sharding.fsdp_grad_divisor)."""
        if param not in self._divisors:
            roots = [r() for r in self.roots]
            self._divisors[param] = float(fsdp_grad_divisor([r for r in roots if r is not None],
                                                            param) or 0.0)
        return self._divisors[param]

    def wq_grad_hook(self, st: LayerState):
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
            if (w is None or st is None or not w.cadence.measuring or w.cadence.removed
                    or param.grad is None):
                return
            try:
                st.buf.wq_grad_sq, st.buf.wq_grad_averaged = wq_grad_sq(st.site, param.grad)
                if st.buf.wq_grad_averaged:
                    st.buf.wq_grad_divisor = w.grad_divisor(param)
            except Exception as e:
                w.ledger.error(f"W^Q gradient {st.site.name}", e)
        return hook

    def on_sdpa(self, st: LayerState, func, args, kwargs):
        """A watched layer's SDPA call: ours before it (what to route), the call itself
        (the model's: its errors are the model's), ours after it (measuring). A failure
        of ours is counted and the call runs as the model made it, unmeasured."""
        try:
            with outside_selective_checkpoint():  # our ops are not the region's (checkpointing.py)
                a, q, k, v, route = self._plan_sdpa(st, args, kwargs)
        except Exception as e:
            self.ledger.error(f"attention call {st.site.name}", e)
            return func(*args, **kwargs)
        if a is None:  # seen, not measured: st.buf.unmeasured says why (head_modes.judge)
            return func(*args, **kwargs)
        mask, dropout = a.get("attn_mask"), a.get("dropout_p", 0.0)
        causal, scale = bool(a.get("is_causal", False)), a.get("scale")
        out = self._route_sdpa(st, q, k, v, mask, dropout, causal, scale) if route else None
        routed = out is not None
        if out is None:
            out = func(*args, **kwargs)
        if self.cadence.measuring:
            try:
                with outside_selective_checkpoint():
                    self._measure_sdpa(st, a, q, k, v, out, routed)
            except Exception as e:
                self.ledger.error(f"probe {st.site.name}", e)
        return out

    def _plan_sdpa(self, st: LayerState, args, kwargs):
        """(SDPA's arguments by name, q, k, v as SDPA computes with them, route?), or
        a None first item for a call that is not the layer's heads."""
        a = traced.sdpa_args(args, kwargs)
        if sequence_sharded(a["key"]):
            # ring context parallelism: each rank's keys are its shard; the scores of a
            # row against the others' keys are made inside the op, never in one call
            st.buf.unmeasured = ("its attention inputs are split over the sequence (ring "
                                 "context parallelism: each call holds this rank's keys "
                                 "only); gather K and V over the context-parallel group "
                                 "before the call (all-gather context parallelism) to "
                                 "measure it")
            self.warn_once(st, "ring", f"flashwatch: {st.site.name}: {st.buf.unmeasured}")
            return None, None, None, None, False
        # route and probe what SDPA computes with (autocast: rotary models hand it FP32
        # q, k and a BF16 v)
        q, k, v = traced.autocast_qkv(a["query"], a["key"], a["value"])
        if not self._layer_heads(st, q):
            return None, q, k, v, False
        return a, q, k, v, st.routed

    def _layer_heads(self, st: LayerState, q) -> bool:
        """Does a call's q [B, H, N, D] hold the layer's heads (narrowing a layer that
        tensor parallelism split after attach to this rank's heads first)? If not, the
        call is left unmeasured with the reason in st.buf.unmeasured."""
        if q.dim() == 4 and q.shape[1] == st.site.num_heads \
                and unnarrowed_tp(st.site) is not None:
            # its Q projection split, yet every head here: the output was gathered (the
            # same on every rank, as the split and the call are)
            st.site.output_gathered = True
        why = "a decode step folding query heads?"
        if q.dim() == 4 and q.shape[1] < st.site.num_heads \
                and unnarrowed_tp(st.site) is not None:
            # watched whole, then split by parallelize_module: from now on this rank
            # watches its own heads (flashwatch/sites/discovery.py); tried once a step
            why = st.buf.split_refused
            if why is None:
                why = self.split(st) if self.split is not None else "nothing narrows it here"
                st.buf.split_refused = why
            if why is None:
                log.info("flashwatch: %s was split by tensor parallelism after "
                         "flashwatch.watch attached: this rank watches its heads %d..%d of %d",
                         st.site.name, st.site.head_offset,
                         st.site.head_offset + st.site.num_heads - 1, st.site.global_heads)
            else:
                why = f"split by tensor parallelism after attach, but {why}"
        if q.dim() == 4 and q.shape[1] != st.site.num_heads:
            # e.g. a KV-cached decode step of a grouped-query model that folds its query
            # heads into the length axis ([B, H_kv, n_rep, D]): not the layer's heads, so
            # neither its modes nor its head arrays apply. Skipped, never misattributed.
            st.buf.unmeasured = (f"an attention call with {q.shape[1]} heads, not the "
                                 f"layer's {st.site.num_heads} ({why})")
            self.warn_once(st, "heads", f"flashwatch: {st.site.name}: {st.buf.unmeasured}; "
                           f"such calls run as they are and are not measured")
            return False
        return True

    def _measure_sdpa(self, st: LayerState, a, q, k, v, out, routed: bool) -> None:
        mask, dropout = a.get("attn_mask"), a.get("dropout_p", 0.0)
        causal, scale = bool(a.get("is_causal", False)), a.get("scale")
        st.compiled.sdpa_seen = True
        st.buf.calls += 1
        self._check_q(st, a["query"])
        dropped = bool(dropout) and torch.is_grad_enabled()  # never routed (above)
        if dropped:  # the kernel's O is dropped out; the FP32 recomputation is not
            st.compiled.dropout_seen = True
            self.warn_once(st, "dropout", f"flashwatch: {st.site.name} uses attention "
                           f"dropout ({dropout}): its δ error is not measured (O_used "
                           f"is dropped out, the FP32 recomputation is not); ties and "
                           f"max logit still are")
        self._safe_probe(st, q, k, v, out, causal, scale, mask, routed, grad=not dropped)

    def _route_sdpa(self, st, q, k, v, mask, dropout, causal, scale):
        """The call through flashwatch's kernel with the layer's modes, or None (it
        then runs the original kernel, counted as a fallback when modes are set)."""
        try:
            reason = None
            if dropout and torch.is_grad_enabled():
                reason = f"it uses attention dropout ({dropout})"
            elif q.dim() != 4:
                reason = f"its q has {q.dim()} dims"
            if reason is None:
                try:
                    return self._routed(st, q, k, v, causal, scale, None, attn_mask=mask)
                except _dispatch_mod.NotInKernel as e:  # a known limit (docs/limits.md)
                    reason = f"it passes attn_mask, which its backend cannot run ({e})"
            self._unmitigable(st, reason)
        except Exception as e:
            self._routing_failed(st, e)
        return None

    def _unmitigable(self, st: LayerState, reason: str) -> None:
        """A call of a routed layer that flashwatch's kernel cannot run: it runs its own
        kernel, counted as a fallback, said once."""
        self._fallback(st, reason)
        self.warn_once(st, "unmitigable", f"flashwatch: cannot apply head modes to "
                       f"{st.site.name} because {reason}; it stays on its own kernel "
                       f"and is still measured")

    def _routing_failed(self, st: LayerState, e: Exception) -> str:
        """A failure of ours while routing a call: counted, the call runs its own kernel."""
        self.ledger.error(f"routing {st.site.name}", e)
        st.unmitigable = f"routing failed ({type(e).__name__}: {e})"
        st.fallback_calls += 1
        return st.unmitigable

    def _check_q(self, st: LayerState, q) -> None:
        """The layer's W^Q slice against the q its SDPA call received, once
        (flashwatch/sites/layouts.py QCheck): a wrong slice is refused by name."""
        qc = st.q_check
        if qc is None or qc.done or qc.failed or recomputing():
            return
        try:
            qc(st.buf.x, q)  # True: checked; False: try the next call
        except RuntimeError as e:  # names the layer, the layout and the fix
            self.ledger.error(f"W^Q layout {st.site.name}", e)
            st.wq_refused = str(e)

    def interceptor(self, st: LayerState):
        def intercept(q, k, v, *, causal=False, scale=None, head_modes=None, beta=2.0,
                      eps=1e-3, stats=None, backend="auto", attn_mask=None, softcap=None,
                      sliding_window=None):
            st.compiled.fw_seen = True  # its compiled steps stay on the eager path (traced.py)
            if self.cadence.measuring:
                st.buf.calls += 1
            # The caller's mistakes are the caller's errors, exactly as without a watcher.
            check_inputs(q, k, v, causal=causal, scale=scale, head_modes=head_modes,
                         beta=beta, eps=eps, stats=stats, attn_mask=attn_mask,
                         softcap=softcap, sliding_window=sliding_window)
            # One β and eps per watched layer, the WatchConfig's: the heads the policy
            # switches and the ties it counts must use the values it was configured with.
            if (beta, eps) != (self.config.beta, self.config.eps):
                self.warn_once(st, "beta", f"flashwatch: {st.site.name} calls "
                                f"flashwatch.attention with beta={beta}, eps={eps}; inside a "
                                f"watched layer the WatchConfig's beta={self.config.beta}, "
                                f"eps={self.config.eps} apply (pass them to flashwatch.watch)")
            try:
                out = self._routed(st, q, k, v, causal, scale, head_modes, user_stats=stats,
                                   backend=backend, attn_mask=attn_mask, softcap=softcap,
                                   sliding_window=sliding_window)
            except _dispatch_mod.NotInKernel:  # the call is refused without a watcher too
                raise
            except Exception as e:  # a failure of ours: run the call as it was made
                self.ledger.error(f"routing {st.site.name}", e)
                self._fallback(st, f"routing failed ({type(e).__name__}: {e})")
                return _dispatch_mod.call_kernel(q, k, v, causal=causal, scale=scale,
                                               head_modes=head_modes, beta=beta, eps=eps,
                                               stats=stats, backend=backend,
                                               attn_mask=attn_mask, softcap=softcap,
                                               sliding_window=sliding_window)
            if self.cadence.measuring:
                with outside_selective_checkpoint():
                    self._safe_probe(st, q, k, v, out, causal, scale, attn_mask, True,
                                     softcap=softcap, sliding_window=sliding_window)
            return out
        return intercept

    @staticmethod
    def _fallback(st: LayerState, reason: str) -> None:
        """An attention call of a routed layer ran the original kernel, not its modes."""
        if bool(st.modes.any()) and not recomputing():
            st.fallback_calls += 1
            st.unmitigable = reason

    def _routed(self, st, q, k, v, causal, scale, head_modes, *, user_stats=None, beta=None,
                eps=None, backend=None, attn_mask=None, softcap=None, sliding_window=None,
                lse_out=None):
        cfg = self.config
        if k.shape[1] != q.shape[1]:  # grouped-query attention (enable_gqa)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        modes = st.modes
        if head_modes is not None:  # the caller's own modes: the stronger of the two wins
            from flashwatch.kernels.common import normalize_head_modes
            modes = torch.maximum(modes, normalize_head_modes(head_modes, q.shape[1]))
        stats = None
        if self.cadence.measuring or user_stats is not None:
            stats = AttentionStats.zeros(q.shape[1], device=q.device)
        o32 = [] if self.cadence.measuring else None  # the kernel's FP32 O: c[T] on every row
        out = _dispatch_mod.call_kernel(
            q, k, v, causal=causal, scale=scale, head_modes=modes,
            beta=cfg.beta if beta is None else beta, eps=cfg.eps if eps is None else eps,
            stats=stats, backend=backend or cfg.backend, o32_out=o32, attn_mask=attn_mask,
            softcap=softcap, sliding_window=sliding_window, lse_out=lse_out)
        if not recomputing():
            st.routed_calls += 1
        st.buf.o32 = o32[0] if o32 and o32[0].shape[0] == q.shape[1] else None
        st.buf.o32_paper = (backend or cfg.backend) == "paper"
        if stats is not None:
            if user_stats is not None:
                user_stats.add_(stats.tied_rows, 0, stats.guarded_rows, stats.max_logit)
                user_stats.rows += stats.rows.to(user_stats.rows.device)
            if self.cadence.measuring and not recomputing() and self.tokens.rows(
                    st, q.shape[0], q.shape[2], q.device) is None:
                # accumulated on the device; with padding the probe counts the call's
                # real rows instead (the kernel's counters cover every row)
                st.buf.kernel_counted = True
                if st.buf.stats.rows.device != stats.rows.device:  # the step's first call
                    st.buf.stats = AttentionStats(*(x.to(stats.rows.device) for x in (
                        st.buf.stats.tied_rows, st.buf.stats.rows, st.buf.stats.guarded_rows,
                        st.buf.stats.max_logit)))
                st.buf.stats.add_(stats.tied_rows, 0, stats.guarded_rows, stats.max_logit)
                st.buf.stats.rows += stats.rows
        return out

