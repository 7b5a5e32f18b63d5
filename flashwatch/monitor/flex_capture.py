"""What a watched layer's FlexAttention and varlen calls record: the Recorder's half for
the two attention functions flashwatch/monitor/flex.py reads (capture.py has SDPA's).

A call is measured where it runs with real tensors. Eager flex_attention compiles the op
into a graph of torch's "eager" backend, so the watched module's TorchFunctionMode sees the
op twice: while Dynamo traces it (passed through untouched: nothing of ours is traced into
the graph) and when that graph runs it (score and mask mods as traced graphs, captured
tensors lifted into buffers), which is measured. On measured steps every compiled
function runs eagerly (Dynamo's force_eager stance, attach.py), and so do the steps of a
layer whose modes route its flex calls: the op is then called directly (the mods as the
model wrote them) and measured; so is a model's torch.compile'd flex_attention (Hugging
Face's, torchtitan's). Layers that make such calls never take the traced probe
(layer_state.traceable). A direct call would run torch's unfused flex, [B, H, N, N] FP32
scores per layer; on CUDA flashwatch runs it through torch.compile(flex_attention)
instead (`_run_flex`).

Routing (head modes): flashwatch's kernel runs a call whose score mod is the identity or a
softcap (flex.score_kind), its mask_mod as a dense boolean mask (causal, document, sliding
window: any mask), varlen's documents the same way; another score mod (ALiBi, relative
biases) is not one the kernel can apply, so such a layer runs its own kernel, reported
unmitigable with that reason. A routed call hands back the kernel's log-sum-exp in the
op's units (flex on CUDA computes one for its backward whenever grad is on; callers may
read it: attention sinks); it carries no gradient, so a gradient that reaches it is
counted as a monitor error and the layer runs its own kernel from then on
(`_LseGuard`). QK-clip acts on the weights whatever the kernel.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from flashwatch.kernels.dispatch import NotInKernel
from flashwatch.monitor import traced
from flashwatch.monitor.attach import forcing_eager
from flashwatch.monitor.checkpointing import outside_selective_checkpoint
from flashwatch.monitor.flex import FlexCall, VarlenCall, score_kind
from flashwatch.monitor.layer_state import LayerState


class FlexCapture:
    """Mixed into capture.Recorder: on_flex and on_varlen, the counterparts of on_sdpa."""

    def on_flex(self, st: LayerState, func, args, kwargs):
        if torch.compiler.is_compiling():  # traced, not run: its run comes here too
            return func(*args, **kwargs)
        try:
            with outside_selective_checkpoint():
                call = FlexCall.of(args, kwargs)
                call.q, call.k, call.v = traced.autocast_qkv(call.q, call.k, call.v)
                ours = self._layer_heads(st, call.q)
                why = call.hidden_blocks() if ours and self.cadence.measuring else None
                if why is not None:
                    st.buf.unmeasured, ours = why, False
                    self.warn_once(st, "blocks", f"flashwatch: {st.site.name}: {why}")
        except Exception as e:
            self.ledger.error(f"attention call {st.site.name}", e)
            return func(*args, **kwargs)
        st.compiled.flex_seen = True
        result = self._guarded_route(st, self._route_flex, call) if ours and st.routed \
            else None
        routed = result is not None
        if result is None:
            result = self._run_flex(st, func, args, kwargs)
            self._watch_lse(st, result[1])
        if ours and self.cadence.measuring:
            self._measure(st, call.q, call.k, call.v, result[0], call, routed)
        return result

    def _run_flex(self, st, func, args, kwargs):
        """The op's call as the model would run it. On a measured step flashwatch's
        force_eager stance makes a model's compiled flex_attention call the op eagerly:
        torch's unfused implementation, [B, H, N, N] FP32 scores per layer (8.6 GB at
        H 32, N 8,192). Where FUSED_DEVICES has the device, it runs compiled instead
        (flex_attention under torch.compile, inductor's fused kernel, compiled once per
        shape and mod as the model's own is); a failure there falls back to the op. Not
        under a dispatch mode (selective activation checkpointing's caches the region's
        ops by their order: a compiled call in place of the op would shift it)."""
        q = args[0] if args else kwargs.get("query")
        if not (forcing_eager() and q.device.type in FUSED_DEVICES and not st.fused_failed
                and not _get_current_dispatch_mode_stack()):
            return func(*args, **kwargs)
        try:
            return fused_flex(args, kwargs)
        except Exception as e:
            st.fused_failed = True
            self.ledger.error(f"compiled flex_attention {st.site.name}", RuntimeError(
                f"running its flex_attention call through torch.compile failed "
                f"({type(e).__name__}: {e}); torch's unfused flex runs there instead"))
            return func(*args, **kwargs)

    def on_varlen(self, st: LayerState, func, args, kwargs):
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        try:
            with outside_selective_checkpoint():
                call = VarlenCall.of(args, kwargs)
                q = k = v = None
                ours = call.unmeasurable is None
                if ours:
                    q, k, v = traced.autocast_qkv(*call.views())
                    ours = self._layer_heads(st, q)
                else:
                    st.buf.unmeasured = call.unmeasurable
                    self.warn_once(st, "varlen", f"flashwatch: {st.site.name}: a varlen "
                                   f"call not measured: {call.unmeasurable}")
        except Exception as e:
            self.ledger.error(f"attention call {st.site.name}", e)
            return func(*args, **kwargs)
        st.compiled.flex_seen = True
        result = self._guarded_route(st, self._route_varlen, call, q, k, v) \
            if ours and st.routed else None
        routed = result is not None
        if result is None:
            result = func(*args, **kwargs)
        if ours and self.cadence.measuring:
            self._measure(st, q, k, v, result[0], call, routed, grad_view=_packed_to_bhnd)
        return result

    def _measure(self, st, q, k, v, out, call, routed, grad_view=None):
        """The probe on the call's [B, H, N, D] views with its own scores."""
        try:
            with outside_selective_checkpoint():
                st.buf.calls += 1
                self._safe_probe(st, q, k, v, out, False, call.scale, None, routed,
                                 score_fn=call.score_fn(), grad_view=grad_view)
        except Exception as e:
            self.ledger.error(f"probe {st.site.name}", e)

    def _guarded_route(self, st, route, *args):
        """route(st, *args), or None after a failure of ours, counted: the call then runs
        its own kernel (a fallback with the reason)."""
        try:
            return route(st, *args)
        except Exception as e:
            st.flex_refused = self._routing_failed(st, e)
            return None

    def _route_flex(self, st, call: FlexCall):
        """(out, lse, empty max) of the op from flashwatch's kernel with the layer's
        modes, or None: the call runs its own kernel, counted as a fallback with the
        reason."""
        reason = None
        try:
            kind, softcap = score_kind(call.score_mod)
        except Exception as e:  # an odd score_mod object: not one the kernel runs
            self.ledger.error(f"routing {st.site.name}", e)
            kind, softcap = "other", None
        if kind == "other":
            reason = ("its flex_attention score_mod is neither the identity nor a softcap "
                      "(ALiBi, a bias, control flow), which flashwatch's kernel does not apply")
        elif call.kernel_options.get("OUTPUT_MAX"):
            reason = "the caller reads flex_attention's row maxima (max_scores)"
        elif torch.is_grad_enabled() and any(
                isinstance(b, torch.Tensor) and b.requires_grad for b in call.mask_buffers):
            reason = "its mask_mod reads a tensor that requires grad"
        routed = self._route_masked(st, call.q, call.k, call.v, call.scale, call.dense_mask,
                                    reason, softcap)
        if routed is None:
            return None
        out, lse = routed
        lse = lse.masked_fill(lse == math.inf, -math.inf)  # no key seen: flex's -inf
        if call.kernel_options.get("BACKEND", "AUTO") != "FLASH" or \
                _flex_debug():  # the op's units: flex_attention multiplies by ln 2
            lse = lse / math.log(2)
        # torch's flex backward takes the lse's gradient: ours has none, so one that
        # arrives is counted and the layer stays on its own kernel from then on
        return out, _LseGuard.apply(lse, out, self._lse_gradient(st)), out.new_empty(0)

    def _route_varlen(self, st, call: VarlenCall, q, k, v):
        """(packed out, lse [H, T], rng state) as the op returns them, or None. The lse
        has no gradient, as torch's own varlen backward gives it none (+inf: no key)."""
        reason = call.unmeasurable
        if reason is None and call.q.shape[0] * call.k.shape[0] > VARLEN_DENSE_MAX:
            reason = (f"its {call.q.shape[0]} packed tokens would need a dense [T, T] "
                      f"mask for flashwatch's kernel (routed up to "
                      f"{int(VARLEN_DENSE_MAX ** 0.5)} tokens)")
        routed = self._route_masked(st, q, k, v, call.scale, call.dense_mask, reason)
        if routed is None:
            return None
        out, lse = routed
        return (out[0].permute(1, 0, 2), lse[0].detach(),
                torch.zeros(2, dtype=torch.uint64, device=out.device))

    def _route_masked(self, st, q, k, v, scale, dense_mask, reason, softcap=None):
        """(out [B, H, N, Dv], lse [B, H, N], natural log, +inf: no key) or None."""
        if reason is None and st.lse_gradient:
            reason = ("a gradient reached the log-sum-exp of one of its routed calls "
                      "(attention sinks?), which flashwatch's kernel does not give one")
        if reason is None:  # a failure of ours here: `_guarded_route` counts it
            mask = dense_mask()
            causal = bool(_is_causal(mask))
            try:
                lse = []
                out = self._routed(st, q, k, v, causal, scale, None,
                                   attn_mask=None if causal else mask, lse_out=lse,
                                   softcap=softcap)
                st.flex_refused = None
                return out, lse[0]
            except NotInKernel as e:  # a known limit of the backend (docs/limits.md)
                reason = f"its mask is one its backend cannot run ({e})"
        st.flex_refused = reason
        self._unmitigable(st, reason)
        return None

    @staticmethod
    def _watch_lse(st, lse) -> None:
        """An unrouted call whose lse a gradient reaches (attention sinks) tells, before
        any routing, that the layer must not be routed: no step's gradient is lost."""
        if (st.lse_gradient or not torch.is_grad_enabled() or not isinstance(lse, torch.Tensor)
                or not lse.requires_grad or not lse.numel()):
            return
        st_ref = weakref.ref(st)

        def seen(grad):
            s = st_ref()
            if s is not None and grad is not None:
                s.lse_gradient = True
        lse.register_hook(seen)

    def _lse_gradient(self, st):
        """What `_LseGuard` calls when a gradient reaches a routed call's lse: count it,
        say why, and keep the layer on its own kernel from now on (weak references: the
        autograd graph must not keep the watcher alive)."""
        rec_ref, st_ref = weakref.ref(self), weakref.ref(st)

        def on_grad(grad):
            rec, st = rec_ref(), st_ref()
            if rec is None or st is None or st.lse_gradient:
                return
            st.lse_gradient = True
            rec.ledger.error(f"routing {st.site.name}", RuntimeError(
                f"a gradient reached the log-sum-exp of a call of {st.site.name} that "
                f"flashwatch's kernel ran with head modes (attention sinks?); the kernel "
                f"has no gradient for it, so this backward left that part of dq, dk out; "
                f"the layer runs its own kernel from now on"))
        return on_grad


class _LseGuard(torch.autograd.Function):
    """The routed kernel's log-sum-exp, tied to its output so that a gradient reaching
    it is seen (`on_grad`), then dropped: the kernel's backward has no term for it."""

    @staticmethod
    def forward(ctx, lse, out, on_grad):
        ctx.on_grad = on_grad
        return lse.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.on_grad(grad)
        return None, None, None


# Devices where a measured step runs flex compiled (`FlexCapture._run_flex`): CUDA, where
# the unfused scores would not fit at long sequences. The CPU runs torch's own flex
# eagerly (its compile costs ≈ 18 s per shape and mod on a 2-core CPU).
FUSED_DEVICES = ("cuda",)
_COMPILED: list = []


def fused_flex(args, kwargs):
    """The flex_attention op's call (q, k, v, score_mod, block mask tuple, scale,
    kernel_options, buffers) through torch.compile(flex_attention), returned as the op
    returns it: (out, lse, max) in the op's units (log2 unless BACKEND is "FLASH")."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

    a = dict(zip(("q", "k", "v", "score_mod", "bm", "scale", "options", "smb", "mmb"),
                 args, strict=False))
    a.update(kwargs)
    t = a["bm"]
    if len(t) != 17 or a.get("smb") or a.get("mmb"):
        raise RuntimeError(f"a block mask tuple of {len(t)} fields or lifted buffers: not "
                           f"the layout torch 2.13 hands a direct call")
    bm = BlockMask((t[0], t[1]), *t[2:10], BLOCK_SIZE=(t[14], t[15]), mask_mod=t[16],
                   dq_write_order=t[10], dq_write_order_full=t[11], dq_kv_order=t[12],
                   dq_kv_order_spt=t[13])
    options = dict(a["options"])
    options.pop("FORCE_USE_FLEX_ATTENTION", None)  # legacy: BACKEND set above replaces it
    lse, mx = options.pop("OUTPUT_LOGSUMEXP", False), options.pop("OUTPUT_MAX", False)
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, fullgraph=True))
    q, k = a["q"], a["k"]
    with torch.compiler.set_stance("default"):
        out, aux = _COMPILED[0](q, k, a["v"], score_mod=a["score_mod"], block_mask=bm,
                                scale=a["scale"], enable_gqa=q.shape[1] != k.shape[1],
                                kernel_options=options,
                                return_aux=AuxRequest(lse=bool(lse), max_scores=bool(mx)))
    log2 = options.get("BACKEND", "AUTO") != "FLASH"
    units = (lambda x: x / math.log(2)) if log2 else (lambda x: x)
    empty = out.new_empty(0)
    return (out, units(aux.lse) if aux.lse is not None else empty,
            units(aux.max_scores) if aux.max_scores is not None else empty)


# varlen routes its packed documents as one [T, T] boolean mask: up to 16,384 tokens
# (256 MB); longer packs keep their own kernel, reported unmitigable with the reason
VARLEN_DENSE_MAX = 1 << 28


def _flex_debug() -> bool:
    """torch's debug switch, under which flex_attention reads the op's lse as log2 even
    with BACKEND "FLASH"."""
    from torch.nn.attention import flex_attention as fa

    return bool(getattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False))


def _is_causal(mask) -> torch.Tensor:
    """Is a [B, H, Nq, Nk] boolean mask exactly SDPA's causal one (top-left aligned)?
    Then the kernel's causal path runs (no mask read). A host sync on CUDA, on routed
    calls only."""
    Nq, Nk = mask.shape[-2:]
    tril = torch.ones(Nq, Nk, dtype=torch.bool, device=mask.device).tril()
    return (mask == tril).all()


def _packed_to_bhnd(g):
    """varlen's packed [T, H, D] as the probe's [1, H, T, D]."""
    return g.permute(1, 0, 2).unsqueeze(0)
