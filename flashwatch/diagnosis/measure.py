"""What `flashwatch diagnose` measures on one batch: every row of every attention call,
per head, exactly (FP64), against the arithmetic the model actually ran.

Capture (`Capture`, one batch): forward hooks on each site's module tell which layer is
running; a TorchFunctionMode catches that layer's F.scaled_dot_product_attention call
(q, k, v, mask and scale as the model passes them, and the output O it returned); a
pre-hook on the Q projection keeps X. When the backward reaches O, a hook on O's
gradient runs `exact_call` with dO, then lets go of the layer's tensors: layers are
measured one at a time, in backward order, and hold nothing autograd does not hold.

Per head h and row T (docs/design.md §1, the paper's Eq. 3), with s = α q·kᵀ in FP64:
  tied[T]   ≥ 2 visible scores within eps of the row max (scores rounded to
            `scores_dtype` first when given: the paper's arithmetic forms them in BF16)
  c[T]      = rowsum(dO ∘ O_used)[T] − rowsum(dO ∘ O_ref)[T], O_ref = softmax(s) V in
            FP64 (or `reference(...)`): the δ error of the backward
  E_h       = α Σ_T c[T] (PK)[T]ᵀ X[T] with PK = softmax(s) K: dW^Q_h(exact δ) −
            dW^Q_h(used δ), [d_head, d_model]. When q is not X·W^Qᵀ (RoPE, QK-norm) the
            error α c[T] (PK)[T] of dq is taken back to W^Q by autograd instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from flashwatch.kernels.common import no_autocast
from flashwatch.monitor.probe import MASKED  # additive masks at or below it hide a key
from flashwatch.monitor.traced import autocast_qkv
from flashwatch.sites.site import AttentionSite

SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# At most this many bytes of FP64 [T, S] work per chunk of heads (about five such
# matrices per head: products, scores, weights, masks): GPT-2 Small (T = S = 1,024)
# runs 3 heads at a time, ≈ 120 MiB.
CHUNK_BYTES = 128 << 20


class LayerBatch:
    """One layer's sums over one batch's calls, per head (float64, CPU)."""

    def __init__(self, site: AttentionSite):
        H, D, C = site.num_heads, site.head_dim, site.d_model
        z = dict(dtype=torch.float64)
        self.rows, self.tied = torch.zeros(H, **z), torch.zeros(H, **z)
        self.max_logit = torch.full((H,), -math.inf, **z)
        self.c_sum, self.c_abs = torch.zeros(H, **z), torch.zeros(H, **z)
        self.E = torch.zeros(H, D, C, **z)  # dW^Q(exact δ) − dW^Q(used δ)
        self.calls = 0
        self.linear = True  # False once a call took E through autograd (q ≠ X·W^Qᵀ)


class Capture(TorchFunctionMode):
    """Measures the attention calls of one forward/backward of `sites` (module docstring).

    Use as `with Capture(...) as cap: loss = ...` then `loss.backward()`; `cap.layers[i]`
    holds site i's LayerBatch once the backward has run. `close()` removes the hooks."""

    def __init__(self, sites: list[AttentionSite], *, eps: float, scores_dtype=None,
                 reference=None, on_layer=None):
        super().__init__()
        self.on_layer = on_layer  # called with the number of calls measured so far
        self.measured = 0
        self.sites, self.eps, self.scores_dtype, self.reference = sites, eps, scores_dtype, \
            reference
        self.layers = [LayerBatch(s) for s in sites]
        self.current: int | None = None
        self.x: dict[int, torch.Tensor] = {}
        self.q_out: dict[int, torch.Tensor] = {}
        self.pending = 0  # calls whose dO has not arrived yet
        self.handles = []
        for i, site in enumerate(sites):
            self.handles.append(site.module.register_forward_pre_hook(self._enter(i)))
            self.handles.append(site.module.register_forward_hook(self._leave(i)))
            if site.q_module is not None:
                self.handles.append(site.q_module.register_forward_pre_hook(self._keep_x(i)))
                self.handles.append(site.q_module.register_forward_hook(self._keep_q(i)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _enter(self, i):
        def hook(_module, _args):
            self.current = i
        return hook

    def _leave(self, i):
        def hook(_module, _args, _out):
            self.current = None
        return hook

    def _keep_x(self, i):
        def hook(_module, args):
            if self.current == i and args and isinstance(args[0], torch.Tensor):
                self.x[i] = args[0]
        return hook

    def _keep_q(self, i):
        def hook(_module, _args, out):
            if self.current == i and isinstance(out, torch.Tensor):
                self.q_out[i] = out
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.current is not None:
            return self._on_sdpa(self.current, func, args, kwargs)
        return func(*args, **kwargs)

    def _on_sdpa(self, i, func, args, kwargs):
        site = self.sites[i]
        q, k, v = args[:3]
        extra = dict(zip(SDPA_ARGS, args[3:], strict=False)) | kwargs
        if extra.get("dropout_p", 0.0):
            raise RuntimeError(f"layer {site.name!r} calls SDPA with dropout_p="
                               f"{extra['dropout_p']}; diagnose measures deterministic "
                               "attention: put the model in eval mode (diagnose does) or set "
                               "its attention dropout to 0")
        if q.shape[1] != site.num_heads:
            raise RuntimeError(f"layer {site.name!r}: SDPA got q {list(q.shape)}, expected "
                               f"[batch, {site.num_heads} heads, tokens, {site.head_dim}]")
        o = func(*args, **kwargs)
        if not o.requires_grad:
            raise RuntimeError(f"layer {site.name!r}: no gradient reaches its attention "
                               "output, so dO and the δ error cannot be measured; call "
                               "diagnose outside torch.no_grad() / inference_mode()")
        linear = self._is_linear(i, q)
        # What the kernel computes with: under autocast SDPA receives q, k, v rounded to
        # the autocast dtype (rotary models pass FP32 q, k); the watcher's probe rounds
        # them with the same function, so both measure the arithmetic training ran.
        q, k, v = autocast_qkv(q, k, v)
        call = dict(q=q, k=k, v=v, o=o.detach(), x=self.x.get(i), mask=extra.get("attn_mask"),
                    causal=bool(extra.get("is_causal", False)),
                    scale=extra.get("scale") or 1.0 / math.sqrt(q.shape[-1]),
                    linear=linear)
        self.pending += 1

        def on_grad(do):
            held = call.copy()
            call.clear()  # the layer's tensors go as soon as it is measured
            if held:
                self.pending -= 1
                measure_call(self.layers[i], site, held, do, self.eps, self.scores_dtype,
                             self.reference)
                self.measured += 1
                if self.on_layer is not None:
                    self.on_layer(self.measured)
        o.register_hook(on_grad)
        return o

    def _is_linear(self, i, q) -> bool:
        """q at SDPA is exactly the Q projection's output, head-major: no RoPE/QK-norm."""
        out, site = self.q_out.get(i), self.sites[i]
        if out is None or self.x.get(i) is None:
            return False
        start, stop = site.q_slice_of_output
        want = out[..., start:stop].unflatten(-1, (site.num_heads, site.head_dim))
        return want.dim() == 4 and want.transpose(1, 2).shape == q.shape and \
            torch.equal(want.transpose(1, 2), q)


def measure_call(acc: LayerBatch, site: AttentionSite, call: dict, do, eps, scores_dtype,
                 reference) -> None:
    """Add one SDPA call's exact per-head sums to `acc` (module docstring)."""
    q, k, v, o = call["q"], call["k"], call["v"], call["o"]
    with torch.no_grad(), no_autocast(q.device):
        o_ref = None
        if reference is not None:
            o_ref = reference(q.detach(), k.detach(), v.detach(), attn_mask=call["mask"],
                              is_causal=call["causal"], scale=call["scale"])
        dq_err = None if call["linear"] else torch.zeros(q.shape, dtype=torch.float64,
                                                         device=q.device)
        B, H, T = q.shape[:3]
        S = k.shape[2]
        step = max(1, CHUNK_BYTES // (40 * T * S))
        for b in range(B):
            for h0 in range(0, H, step):
                hs = slice(h0, min(H, h0 + step))
                part = exact_chunk(q, k, v, call, b, hs, eps, scores_dtype)
                ref = part["o"] if o_ref is None else o_ref[b, hs].double()
                c = (do[b, hs].double() * (o[b, hs].double() - ref)).sum(-1)  # [h, T]
                c = torch.where(part["visible"], c, 0.0)
                _add(acc, hs, part, c)
                g = call["scale"] * c[..., None] * part["pk"]  # dq error [h, T, D]
                if dq_err is None:
                    x = call["x"][b].double()  # [T, C]
                    acc.E[hs] += (g.mT @ x).cpu()
                else:
                    dq_err[b, hs] = g
    acc.calls += 1
    if dq_err is not None:
        acc.linear = False
        acc.E += _through_autograd(site, q, dq_err)


def _add(acc: LayerBatch, hs: slice, part: dict, c: torch.Tensor) -> None:
    acc.rows[hs] += part["visible"].sum(-1).double().cpu()
    acc.tied[hs] += part["tied"].sum(-1).double().cpu()
    acc.max_logit[hs] = torch.maximum(acc.max_logit[hs], part["max"].cpu())
    acc.c_sum[hs] += c.sum(-1).cpu()
    acc.c_abs[hs] += c.abs().sum(-1).cpu()


def exact_chunk(q, k, v, call: dict, b: int, hs: slice, eps: float, scores_dtype) -> dict:
    """FP64 attention of batch element b, heads hs: o and pk [h, T, D], visible and tied
    [h, T] bool, max [h] (largest visible score, -inf if none)."""
    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    kv = torch.arange(H, device=q.device)[hs] // (H // k.shape[1])  # grouped-query heads
    qd, kd, vd = q[b, hs].double(), k[b, kv].double(), v[b, kv].double()
    raw = qd @ kd.mT  # [h, T, S]
    s = raw * call["scale"]
    visible = torch.ones(T, S, dtype=torch.bool, device=q.device)
    if call["causal"]:
        visible = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    mask = call["mask"]
    if mask is not None:
        m = mask.expand(q.shape[0], H, T, S)[b, hs]
        if m.dtype == torch.bool:
            visible = visible & m
        else:
            visible = visible & (m > MASKED)
            s = s + torch.where(m > MASKED, m.double(), 0.0)
    s = s.masked_fill(~visible, -math.inf)
    mx = s.amax(-1)  # [h, T]
    rows = visible.any(-1).expand(mx.shape)
    st = s
    if scores_dtype is not None:  # as an unfused kernel: q·kᵀ rounded, then × α rounded
        st = ((raw.to(scores_dtype).double() * call["scale"]).to(scores_dtype).double()
              ).masked_fill(~visible, -math.inf)
    near = st >= (st.amax(-1, keepdim=True) - eps)
    tied = (near.sum(-1) >= 2) & rows
    # The kernel's own scores: its P, hence PK and (without `reference`) O_ref, come
    # from them; the δ error is then what its backward adds on top.
    p = torch.softmax(st, dim=-1).nan_to_num(0.0)  # rows with no visible key: 0
    return dict(o=p @ vd, pk=p @ kd, visible=rows, tied=tied,
                max=torch.where(rows, mx, -math.inf).amax(-1))


def _through_autograd(site: AttentionSite, q, dq_err) -> torch.Tensor:
    """dW^Q [H, D, C] (float64) of the dq error, taken back through q's own graph (RoPE,
    QK-norm, ...) by a nested backward that keeps the graph for the one in progress."""
    w = site.q_module.weight
    (g,) = torch.autograd.grad(q, w, dq_err.to(q.dtype), retain_graph=True)
    return wq_rows(site, g).double().cpu()


def wq_rows(site: AttentionSite, full: torch.Tensor) -> torch.Tensor:
    """The W^Q rows of a q_module weight-shaped tensor (its .grad, say) as [H, D, C]."""
    if type(site.q_module).__name__ == "Conv1D":  # stored [in, out]
        full = full.T
    start, stop = site.q_slice_of_output
    return full[start:stop].unflatten(0, (site.num_heads, site.head_dim))
