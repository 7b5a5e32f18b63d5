"""FlexAttention and varlen calls, read as the probe measures them.

Two attention functions hand their kernels more than SDPA's arguments:

  flex_attention(q, k, v, score_mod, block_mask)   reaches torch's flex_attention
      higher-order op with (q, k, v, score_mod, block_mask.as_tuple(), scale,
      kernel_options, score_mod_other_buffers, mask_mod_other_buffers): the kernel's
      score of query q_idx and key kv_idx in batch element b, head h, is
          score_mod(scale·q·kᵀ, b, h, q_idx, kv_idx, *score buffers)
      where mask_mod(b, h, q_idx, kv_idx, *mask buffers) holds, else -inf (the block
      mask's sparsity skips blocks mask_mod would hide whole: the same scores).
  varlen_attn(q, k, v, cu_seq_q, cu_seq_k, ...)    reaches torch_attn::_varlen_attn with
      packed [T, H, D] tensors: query row t of document i (cu_seq_q[i] ≤ t < cu_seq_q[i+1])
      sees the keys of document i only, causal and windowed as is_causal and
      window_size say, aligned at the documents' ends (flash attention's convention).

Each becomes one probe call on [B, H, N, D] views (varlen: B = 1, N = T) with a
`score_fn(s, lo, hi, q0, q1)` that applies the call's score mod and masks to a chunk of
the probe's FP32 scores (elements lo:hi, query rows q0:q1; flashwatch/monitor/probe.py),
so every row is measured in bounded memory as the kernel scores it. The score and mask
mods are evaluated as torch's own reference does, vmapped over index tensors.

Both are reached through the watched module's TorchFunctionMode (attach.py): a
higher-order op and a custom op call __torch_function__ as SDPA does.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch


def _flex_hop():
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
    except ImportError:  # a torch without FlexAttention
        return None
    return flex_attention


def _varlen_ops() -> tuple:
    try:
        import torch.nn.attention.varlen  # noqa: F401  (registers the op)
        packet = torch.ops.torch_attn._varlen_attn
    except (ImportError, AttributeError, RuntimeError):  # a torch without varlen
        return ()
    return (packet, packet.default)


# Looked up at the first watch (`load`), not at import: importing torch's flex op imports
# torch._dynamo, and with it Triton where installed, which `import flashwatch` must not.
FLEX_HOP = None
VARLEN_OPS: tuple = ()


def load() -> None:
    global FLEX_HOP, VARLEN_OPS
    if FLEX_HOP is None:
        FLEX_HOP = _flex_hop()
    if not VARLEN_OPS:
        VARLEN_OPS = _varlen_ops()


def is_flex(func) -> bool:
    return FLEX_HOP is not None and func is FLEX_HOP


def is_varlen(func) -> bool:
    return func in VARLEN_OPS


# ---------------------------------------------------------------------------- flex

FLEX_ARGS = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options",
             "score_mod_other_buffers", "mask_mod_other_buffers")


@dataclass
class FlexCall:
    """One flex_attention op call, by name."""

    q: torch.Tensor  # [B, H, Nq, D]
    k: torch.Tensor  # [B, H_kv, Nk, D]
    v: torch.Tensor
    score_mod: Callable
    block: tuple  # BlockMask.as_tuple()
    mask_mod: Callable
    scale: float
    kernel_options: dict
    score_buffers: tuple
    mask_buffers: tuple

    @staticmethod
    def of(args, kwargs) -> FlexCall:
        a = dict(zip(FLEX_ARGS, args, strict=False))
        a.update(kwargs)
        return FlexCall(a["query"], a["key"], a["value"], a["score_mod"], a["block_mask"],
                        a["block_mask"][-1], float(a["scale"]), a.get("kernel_options") or {},
                        tuple(a.get("score_mod_other_buffers", ())),
                        tuple(a.get("mask_mod_other_buffers", ())))

    def hidden_blocks(self) -> str | None:
        """Why the probe cannot read this call's mask, or None: a BlockMask without a
        mask_mod (BlockMask.from_kv_blocks) that leaves key blocks out, which the kernel
        skips and a mask_mod cannot tell (one host sync, for such masks only)."""
        from torch.nn.attention.flex_attention import noop_mask

        t = self.block
        if self.mask_mod is not noop_mask or len(t) != 17 or t[3] is None:
            return None
        seen = t[2] + (t[4] if t[4] is not None else 0)  # partial + full key blocks
        if bool((seen < t[3].shape[-1]).any()):
            return ("its BlockMask leaves key blocks out without a mask_mod "
                    "(BlockMask.from_kv_blocks): the blocks the kernel skips are not "
                    "readable from the call; give the BlockMask the mask_mod it encodes")
        return None

    def score_fn(self):
        """The probe's per-chunk score function (module docstring)."""
        score = _vmap_bhqk(self.score_mod, with_score=True, n_buffers=len(self.score_buffers))
        keep = _vmap_bhqk(self.mask_mod, with_score=False, n_buffers=len(self.mask_buffers))
        Nk = self.k.shape[2]

        def apply(s, lo, hi, q0, q1):
            b, h, m, n = _indices(s.device, lo, hi, s.shape[1], q0, q1, Nk)
            with _index_transform():
                s = score(s, b, h, m, n, *self.score_buffers).float()
                visible = keep(b, h, m, n, *self.mask_buffers)
            return s.masked_fill(~visible.expand(s.shape), -math.inf)
        return apply

    def dense_mask(self) -> torch.Tensor:
        """mask_mod over the whole call, bool (True: attends), what flashwatch's kernel
        takes as attn_mask when the call is routed: [B, 1, Nq, Nk] when every head's
        mask is head 0's (evaluated head by head: B·Nq·Nk booleans at a time, 64 MB at
        8,192 tokens, not B·H·Nq·Nk), else [B, H, Nq, Nk]."""
        B, H, Nq, _ = self.q.shape
        keep = _vmap_bhqk(self.mask_mod, with_score=False, n_buffers=len(self.mask_buffers))
        b, h, m, n = _indices(self.q.device, 0, B, H, 0, Nq, self.k.shape[2])
        with _index_transform():
            def head(i):
                return keep(b, h[i:i + 1], m, n, *self.mask_buffers)
            first = head(0)
            if all(torch.equal(head(i), first) for i in range(1, H)):  # a sync per head
                return first
            return torch.cat([first] + [head(i) for i in range(1, H)], 1)


def score_kind(fn) -> tuple[str, float | None]:
    """What a score mod does, as flashwatch's kernel can run it: ("identity", None) for
    torch's default (no score_mod given), a traced graph or a Python function whose
    torch.fx trace returns the score unchanged (Hugging Face passes its own closure, the
    identity for Llama); ("softcap", c) for c·tanh(score / c) (Gemma2's, in either
    order of the product); else ("other", None): control flow on the score, biases,
    anything position-dependent."""
    if getattr(fn, "__name__", None) == "_identity" and \
            getattr(fn, "__module__", "").startswith("torch.nn.attention"):
        return "identity", None
    graph = getattr(fn, "graph", None)
    if graph is None:
        try:  # control flow on the score cannot be traced: not one the kernel runs
            graph = torch.fx.symbolic_trace(fn).graph
        except Exception:
            return "other", None
    nodes = list(graph.nodes)
    score = next((n for n in nodes if n.op == "placeholder"), None)
    out = [n for n in nodes if n.op == "output"]
    calls = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
    if score is None or not out:
        return "other", None
    result = out[0].args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    if result is score and not calls:
        return "identity", None
    if len(calls) == 3:
        div, tanh, mul = calls
        c = div.args[1] if len(div.args) == 2 else None
        factors = list(mul.args) if len(mul.args) == 2 else []
        other = [a for a in factors if a is not tanh]
        if (div.target in (operator.truediv, torch.div) and div.args[0] is score
                and isinstance(c, (int, float)) and c > 0
                and tanh.target in (torch.tanh, torch.Tensor.tanh) and tanh.args == (div,)
                and mul.target in (operator.mul, torch.mul) and result is mul
                and len(other) == 1 and isinstance(other[0], (int, float))
                and other[0] == c):
            return "softcap", float(c)
    return "other", None


def _indices(device, lo, hi, H, q0, q1, Nk):
    return (torch.arange(lo, hi, device=device), torch.arange(H, device=device),
            torch.arange(q0, q1, device=device), torch.arange(Nk, device=device))


def _vmap_bhqk(fn, *, with_score: bool, n_buffers: int):
    """fn(score?, b, h, q_idx, kv_idx, *buffers) on elements as torch's reference calls
    it, vmapped to [n, H, m, Nk] over index vectors b [n], h [H], q_idx [m], kv_idx [Nk]
    (and a score tensor of that shape)."""
    lead = (0,) if with_score else ()
    rest = (None,) * n_buffers
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
                 (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=lead + dims + rest, out_dims=0)
    return fn


def _index_transform():
    """torch's reference turns `buffer[q_idx]` inside a mod into an index op that vmap
    batches (TransformGetItemToIndex); without it (an older torch), a plain context."""
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:
        import contextlib
        return contextlib.nullcontext()
    return TransformGetItemToIndex()


# -------------------------------------------------------------------------- varlen

VARLEN_ARGS = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k",
               "is_causal", "scale", "window_size", "enable_gqa", "seqused_k", "block_table",
               "num_splits")


@dataclass
class VarlenCall:
    """One torch_attn::_varlen_attn call, by name, and its documents."""

    q: torch.Tensor  # [Tq, H, D] packed
    k: torch.Tensor  # [Tk, H_kv, D]
    v: torch.Tensor
    cu_q: torch.Tensor  # [n + 1] document starts, then the end
    cu_k: torch.Tensor
    causal: bool
    scale: float | None
    window: tuple[int, int]  # (left, right), -1: unbounded
    unmeasurable: str | None  # why the call is not one the probe reads (paged KV)

    @staticmethod
    def of(args, kwargs) -> VarlenCall:
        a = dict(zip(VARLEN_ARGS, args, strict=False))
        a.update(kwargs)
        why = None
        if a.get("seqused_k") is not None or a.get("block_table") is not None:
            why = ("it reads a paged or partly used KV cache (seqused_k / block_table), "
                   "an inference call")
        window = tuple(a.get("window_size") or (-1, -1))
        cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else a["cu_seq_q"]
        return VarlenCall(a["query"], a["key"], a["value"], a["cu_seq_q"], cu_k,
                          bool(a.get("is_causal", False)), a.get("scale"),
                          (int(window[0]), int(window[1])), why)

    def views(self):
        """q, k, v as the probe's [1, H, T, D] views (no copy)."""
        return tuple(x.permute(1, 0, 2).unsqueeze(0) for x in (self.q, self.k, self.v))

    def _positions(self, cu, n, device):
        """(document, position from the document's end) of each of n packed rows:
        rows past the last document get document -1."""
        t = torch.arange(n, device=device)
        cu = cu.to(device=device, dtype=torch.int64)
        doc = torch.searchsorted(cu, t, right=True) - 1
        inside = t < cu[-1]
        doc = torch.where(inside, doc, -1)
        end = cu[(doc + 1).clamp(max=cu.numel() - 1)]
        return doc, t - end  # ≤ -1 inside a document

    def _band(self):
        """(documents and positions of queries and keys, left, right) for `_visible`."""
        dev = self.q.device
        dq, pq = self._positions(self.cu_q, self.q.shape[0], dev)
        dk, pk = self._positions(self.cu_k, self.k.shape[0], dev)
        left, right = self.window
        return dq, pq, dk, pk, left, 0 if self.causal else right

    def score_fn(self):
        """The probe's per-chunk score function: other documents' keys, and keys outside
        the causal / windowed band, at -inf."""
        dq, pq, dk, pk, left, right = self._band()

        def apply(s, lo, hi, q0, q1):
            return s.masked_fill(~self._visible(dq[q0:q1], pq[q0:q1], dk, pk, left, right),
                                 -math.inf)
        return apply

    @staticmethod
    def _visible(dq, pq, dk, pk, left, right):
        ok = (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
        off = pk[None, :] - pq[:, None]  # key minus query, both aligned at the end
        if right >= 0:
            ok &= off <= right
        if left >= 0:
            ok &= off >= -left
        return ok

    def dense_mask(self) -> torch.Tensor:
        """[1, 1, Tq, Tk] bool: the whole call's visibility, for flashwatch's kernel."""
        return self._visible(*self._band())[None, None]
