"""What a watched layer's FlexAttention and varlen calls record: the Recorder's half for
the two attention functions flashwatch/monitor/flex.py reads (capture.py has SDPA's).

A call is measured where it runs with real tensors: eager flex_attention compiles the op
into a graph of torch's "eager" backend, so the watched module's TorchFunctionMode sees
the op twice, once while Dynamo traces it (passed through untouched: nothing of ours is
traced into the graph) and once when that graph runs it, which is measured. On measured
steps every compiled function runs eagerly (Dynamo's force_eager stance, attach.py), so a
model's torch.compile'd flex_attention (Hugging Face's, torchtitan's) is measured the same
way; layers that make such calls never take the traced probe (layer_state.traceable).

Routing (head modes): flashwatch's kernel runs a call whose score mod is the identity, its
mask_mod as a dense boolean mask (causal, document, sliding window: any mask), the same
a score mod (softcap, ALiBi, relative biases) is not one the
kernel can apply, so such a layer runs its own kernel, reported unmitigable with that
reason. varlen is never routed (its callers may read the log-sum-exp: `_route_varlen`). QK-clip acts on the weights whatever the kernel.
"""

from __future__ import annotations

import torch

from flashwatch.monitor import traced
from flashwatch.monitor.checkpointing import outside_selective_checkpoint
from flashwatch.monitor.flex import FlexCall, VarlenCall, identity_score
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
        except Exception as e:
            self.ledger.error(f"attention call {st.site.name}", e)
            return func(*args, **kwargs)
        st.compiled.flex_seen = True
        result = self._route_flex(st, call) if ours and st.routed else None
        routed = result is not None
        if result is None:
            result = func(*args, **kwargs)
        if ours and self.cadence.measuring:
            self._measure(st, call.q, call.k, call.v, result[0], call, routed)
        return result

    def on_varlen(self, st: LayerState, func, args, kwargs):
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        try:
            with outside_selective_checkpoint():
                call = VarlenCall.of(args, kwargs)
                q, k, v = call.views()
                q, k, v = traced.autocast_qkv(q, k, v)
                ours = call.unmeasurable is None and self._layer_heads(st, q)
                if call.unmeasurable is not None:
                    st.buf.unmeasured = call.unmeasurable
                    self.warn_once(st, "varlen", f"flashwatch: {st.site.name}: a varlen "
                                   f"call not measured: {call.unmeasurable}")
        except Exception as e:
            self.ledger.error(f"attention call {st.site.name}", e)
            return func(*args, **kwargs)
        st.compiled.flex_seen = True
        result = self._route_varlen(st, call, q, k, v) if ours and st.routed else None
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

    def _route_flex(self, st, call: FlexCall):
        """(out, empty lse, empty max) from flashwatch's kernel with the layer's modes, or
        None: the call runs its own kernel, counted as a fallback with the reason."""
        reason = None
        if not identity_score(call.score_mod):
            reason = ("its flex_attention score_mod changes the scores (softcap, ALiBi, a "
                      "bias), which flashwatch's kernel does not apply")
        elif call.wants_stats():
            reason = "the caller reads flex_attention's log-sum-exp or row maxima"
        elif torch.is_grad_enabled() and any(
                isinstance(b, torch.Tensor) and b.requires_grad for b in call.mask_buffers):
            reason = "its mask_mod reads a tensor that requires grad"
        out = self._route_masked(st, call.q, call.k, call.v, call.scale, call.dense_mask,
                                 reason)
        if out is None:
            return None
        empty = out.new_empty(0)
        return out, empty, empty

    def _route_varlen(self, st, call: VarlenCall, q, k, v):
        """Never routed: the op always hands its caller the log-sum-exp, which callers
        read without saying so (torchtitan's attention sinks: an empty one crashed the
        forward) and flashwatch's kernel does not return with its gradient."""
        reason = call.unmeasurable or (
            "varlen_attn's callers may read its log-sum-exp (attention sinks), which "
            "flashwatch's kernel does not return with a gradient")
        return self._route_masked(st, q, k, v, call.scale, call.dense_mask, reason)

    def _route_masked(self, st, q, k, v, scale, dense_mask, reason):
        try:
            if reason is None:
                mask = dense_mask()
                causal = bool(_is_causal(mask))
                try:
                    return self._routed(st, q, k, v, causal, scale, None,
                                        attn_mask=None if causal else mask)
                except Exception as e:
                    from flashwatch.kernels.dispatch import NotInKernel
                    if not isinstance(e, NotInKernel):
                        raise
                    reason = f"its mask is one its backend cannot run ({e})"
            self._fallback(st, reason)
            self.warn_once(st, "unmitigable", f"flashwatch: cannot apply head modes to "
                           f"{st.site.name} because {reason}; it stays on its own kernel "
                           f"and is still measured")
        except Exception as e:
            self.ledger.error(f"routing {st.site.name}", e)
            st.unmitigable = f"routing failed ({type(e).__name__}: {e})"
            st.fallback_calls += 1
        return None


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
