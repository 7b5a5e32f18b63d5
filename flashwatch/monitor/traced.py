"""The probe inside compiled code: monitored steps of a torch.compile'd model that stay
compiled, instead of running the whole model eagerly (Dynamo's force_eager stance).

On such a step a watched layer runs its forward inside its `Interceptor`, a
TorchFunctionMode that Dynamo traces into the model's graph (no graph break). The mode
  - keeps the Q projection's input X: the argument of the F.linear call on W^Q (what
    the eager path's forward pre-hook on the Q projection receives);
  - follows each F.scaled_dot_product_attention call by

      torch.ops.flashwatch.probe(q, k, v, out, x, attn_mask, key, causal, scale)
          -> (out', call)

    an opaque op: when the compiled graph runs, it hands the call to the watcher's
    probe (rows, FP32 recomputation, ties, sketch terms) and returns a copy of `out`
    (a custom op may not return its input) and the call's id. Its backward,

      torch.ops.flashwatch.probe_grad(grad, key, call) -> grad'

    hands the output's gradient to that call's sample (c[T] of the sampled rows) and
    passes it on unchanged. Both are tagged cudagraph_unsafe: a CUDA graph replay
    would not run their Python.
`key` names the layer (`register`): a 0-dim int64 tensor, so a graph holds no reference
to a watcher, and is an input of the graph, not a constant it specialises on.

Used only for layers an earlier eager monitored step showed it can measure like the
eager probe (flashwatch/monitor/layer_state.py `LayerState.traceable` says which); any other layer
keeps the watcher on the force_eager path (flashwatch/monitor/attach.py).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

# key -> (recorder, layer state), both weak: the ops only find them while they live.
_SITES: dict[int, tuple] = {}
_KEYS = itertools.count()

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")


def register(recorder, st) -> int:
    key = next(_KEYS)
    _SITES[key] = (weakref.ref(recorder), weakref.ref(st))
    return key


def unregister(keys) -> None:
    for key in keys:
        _SITES.pop(key, None)


def _lookup(key: int):
    entry = _SITES.get(key)
    if entry is None:
        return None, None
    return entry[0](), entry[1]()


def sdpa_args(args, kwargs) -> dict:
    """F.scaled_dot_product_attention's arguments by name (it takes fewer positionals)."""
    a = dict(zip(SDPA_ARGS, args, strict=False))
    a.update(kwargs)
    return a


def autocast_qkv(q, k, v):
    """q, k, v in the dtype SDPA computes with under the active autocast (rotary models
    hand it FP32 q, k and a BF16 v), else as given."""
    if torch.is_autocast_enabled(q.device.type):
        dt = torch.get_autocast_dtype(q.device.type)
        return q.to(dt), k.to(dt), v.to(dt)
    return q, k, v


# Dynamo traces a TorchFunctionMode entered inside compiled code in recent torch only;
# checked with 2.13 (tests/monitor/test_traced.py). Older: the force_eager path, as before.
SUPPORTED = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def _custom_op(name):
    """torch.library.custom_op, tagged cudagraph_unsafe where torch has the tag: the ops
    run Python when the graph executes, which a CUDA graph replay would skip."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        return torch.library.custom_op(name, mutates_args=())
    return torch.library.custom_op(name, mutates_args=(), tags=(tag,))


@_custom_op("flashwatch::probe")
def probe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
          x: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],  # noqa: UP045
          key: torch.Tensor, causal: bool, scale: Optional[float]  # noqa: UP045
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (a copy of out, the call's id: 0-dim int64, -1 if not probed), the id
    saved for the backward so that its gradient reaches this call's sample, whatever
    other forwards ran in between."""
    w, st = _lookup(int(key))
    call = -1
    if w is not None and st is not None:
        call = w.traced_probe(st, q, k, v, out, x, attn_mask, causal, scale)
    return out.clone(), torch.tensor(call, dtype=torch.int64)


@probe.register_fake
def _probe_fake(q, k, v, out, x, attn_mask, key, causal, scale):
    return torch.empty_like(out), torch.empty((), dtype=torch.int64)


@_custom_op("flashwatch::probe_grad")
def probe_grad(grad: torch.Tensor, key: torch.Tensor, call: torch.Tensor) -> torch.Tensor:
    w, st = _lookup(int(key))
    if w is not None and st is not None:
        w.traced_grad(st, int(call), grad)
    return grad.clone()


@probe_grad.register_fake
def _probe_grad_fake(grad, key, call):
    return torch.empty_like(grad)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[6], output[1])


def _backward(ctx, grad, _grad_call):
    key, call = ctx.saved_tensors
    return None, None, None, probe_grad(grad, key, call), None, None, None, None, None


probe.register_autograd(_backward, setup_context=_setup_context)


class Interceptor(TorchFunctionMode):
    """One watched layer's forward on a compiled monitored step (see the module doc).
    Built inside the traced forward from what the graph takes as inputs (the layer's
    key tensor, the module's own W^Q), so blocks compiled one by one share one graph."""

    def __init__(self, key: torch.Tensor, wq):
        super().__init__()
        self.key, self.wq, self.x = key, wq, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = func(*args, **kwargs)
            a = sdpa_args(args, kwargs)
            q, k, v = autocast_qkv(a["query"], a["key"], a["value"])
            return probe(q, k, v, out, self.x, a.get("attn_mask"), self.key,
                         bool(a.get("is_causal", False)), a.get("scale"))[0]
        if func is F.linear and self.wq is not None and len(args) > 1 and args[1] is self.wq:
            self.x = args[0]
        return func(*args, **kwargs)


def q_path(module: nn.Module, q_module) -> str | None:
    """Where an nn.Linear Q projection sits inside the attention module ("" = itself),
    None if it is not an nn.Linear or not inside it."""
    if not isinstance(q_module, nn.Linear):
        return None
    return next((name for name, m in module.named_modules() if m is q_module), None)


def run(st, module, original, args, kwargs):
    """The watched forward of a compiled monitored step, traced by Dynamo."""
    wq = None if st.compiled.q_path is None else module.get_submodule(st.compiled.q_path).weight
    with Interceptor(st.compiled.key_t, wq):
        return original(module, *args, **kwargs)
