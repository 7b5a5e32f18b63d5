"""Attachment: how a Watcher reaches into a model without a change to the model's code.

Three mechanisms, all undone by `Attachment.detach()`:
  forward    each watched attention module's class is swapped for one subclass per
             attention class (`watched_class`, flashwatch/monitor/forwards.py, with
             `OwnForward` and `Link`) whose forward reads the module's `Link`.
             A module with its own instance attribute `forward` (torchtitan's
             Module.parallelize, accelerate's hooks, `m.forward = ...`) gets it wrapped
             in its __dict__ (`Attachment.adopt`), at attach or, if set since, when a
             monitored step begins or ends and when its routing turns on.
             On steps where the layer is neither measured nor routed that forward only
             calls the original: plain attribute reads that torch.compile guards on,
             so compiled code traces it with no graph break (fullgraph=True holds).
             On measured steps inside compiled code, a layer known to make plain SDPA
             calls runs `flashwatch.monitor.traced.run` (traced into the graph: the probe is a
             torch.library op). Otherwise the layer runs eagerly (`Attachment.run`,
             torch._dynamo.disable: one graph break per watched layer on those steps).
  interception  while a watched module runs eagerly, a ContextVar (calls to
             flashwatch.attention) and a TorchFunctionMode (calls to
             F.scaled_dot_product_attention) attribute its attention calls to its layer.
  step hooks on monitored steps only: a forward pre-hook on the Q projection keeps its
             input X, and a post-accumulate-grad hook on its weight keeps ‖dW^Q_h‖²
             (delta_error_share). The watcher arms them when a monitored step begins and
             disarms them after its report, so an unmonitored step runs no flashwatch
             Python in the model at all (benchmarks/RESULTS.md, "Watcher overhead").
  stance     measured steps run every compiled function eagerly (`force_eager`) unless
             every watched layer can take the traced probe (Watcher._stance): see
             `Attachment.force_eager`.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from flashwatch.kernels import dispatch as _dispatch_mod
from flashwatch.monitor import flex as _flex
from flashwatch.monitor.checkpointing import outside_selective_checkpoint, recomputing
from flashwatch.monitor.forwards import (
    ABSENT,
    LINK,
    OWN_LINK,
    Link,
    OwnForward,
    place_link,
    watched_class,
    wrapped_here,
)
from flashwatch.parallel.pipelining import in_metadata_inference

log = logging.getLogger("flashwatch")

class _Interceptor(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention calls made inside a watched module, and its
    FlexAttention and varlen calls (torch's ops: flashwatch/monitor/flex.py)."""

    def __init__(self, attachment: Attachment):
        super().__init__()
        self.attachment = attachment

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Every op of the watched module's forward passes here: the cheap test first.
        if func is F.scaled_dot_product_attention:
            st = self.attachment.current
            if st is not None:
                return self.attachment.recorder.on_sdpa(st, func, args, kwargs)
        elif (_flex.is_flex(func) or _flex.is_varlen(func)) \
                and not torch.compiler.is_compiling():  # traced: seen again when it runs
            st = self.attachment.current
            if st is not None:
                rec = self.attachment.recorder
                on = rec.on_flex if _flex.is_flex(func) else rec.on_varlen
                return on(st, func, args, kwargs)
        return func(*args, **kwargs)


# ids of the attachments whose watcher measures the current step, and the stance to go
# back to. Ids, not a WeakSet: an attachment dropped while measuring (a watcher never
# removed, collected with its model) must also give the stance back, which its
# finalizer does by id; a WeakSet would forget it without a word and leave every later
# torch.compile in the process running eagerly.
_MEASURING: set[int] = set()
_PRIOR_STANCE: list = [None]


def _update_stance() -> None:
    from torch._dynamo import eval_frame

    if _MEASURING and _PRIOR_STANCE[0] is None:
        _PRIOR_STANCE[0] = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))
    elif not _MEASURING and _PRIOR_STANCE[0] is not None:
        eval_frame._set_stance(_PRIOR_STANCE[0])
        _PRIOR_STANCE[0] = None


def forcing_eager() -> bool:
    """Does a watcher hold the force_eager stance now (a measured step)?"""
    return _PRIOR_STANCE[0] is not None


def _measuring(key: int, on: bool) -> None:
    if on:
        _MEASURING.add(key)
    else:
        _MEASURING.discard(key)
    _update_stance()


def _forget(key: int) -> None:
    """Finalizer of an Attachment: a collected watcher measures nothing."""
    if key in _MEASURING:
        try:
            _measuring(key, False)
        except Exception as e:  # a finalizer must not raise; say why the stance stays
            log.warning("flashwatch: could not restore torch.compile's stance after a "
                        "watcher was dropped while measuring: %s", e)


class Attachment:
    """A watcher's hold on its model's watched layers (`recorder.attachment`)."""

    def __init__(self, recorder):
        self.recorder = recorder  # flashwatch/monitor/capture.py: the calls and hooks go there
        self._local = threading.local()  # per-thread stack of running watched modules
        self._mode = _Interceptor(self)
        self._unwraps: list = []
        self._step_handles: list = []  # hooks of the monitored step, when armed
        self.armed = False
        weakref.finalize(self, _forget, id(self))
        if "run" not in Attachment.__dict__:
            # Decorated here, at the first watch, not at import: importing torch._dynamo
            # imports Triton where it is installed (torch/_dynamo/utils.py), which made
            # `import flashwatch` 3.7 s instead of torch's own 1.8 s on a CPU machine.
            Attachment.run = torch._dynamo.disable(Attachment._run)
        _flex.load()  # torch's flex and varlen ops, for the interceptor (not at import)

    # ------------------------------------------------------------------------ forward

    def wrap(self, st) -> None:
        """Give the watched module the forward of `watched_class(type(module))` and a
        Link to the watcher and layer, and wrap its own instance forward if it has one
        (`adopt`). Dynamo guards on the module's type, so code compiled before the
        watcher was attached recompiles on its next call (no torch._dynamo.reset)."""
        mod = st.site.module
        d = mod.__dict__
        old = d.get(LINK, d.get(OWN_LINK))
        if old is not None and not old.recorder.cadence.removed:
            log.warning("flashwatch: %s was watched by another Watcher that was not "
                        "removed; this one takes the layer over", st.site.name)
        base = type(mod) if old is None else old.base
        link = Link(self.recorder, st, base)
        place_link(d, link, LINK)
        mod.__class__ = watched_class(base)
        self.adopt(st)

        def unwrap():
            if d.get(LINK) is link:
                del d[LINK]
            elif d.get(OWN_LINK) is link:
                del d[OWN_LINK]
            else:
                return  # another watcher took it over
            ours = d.get("forward")
            if wrapped_here(ours, mod):  # else replaced since: the user's stays
                d["forward"] = ours.own  # the module's own object, as it was
            if type(mod) is watched_class(base):  # else re-wrapped (fully_shard):
                mod.__class__ = base  # kept, its forward passes straight through
        self._unwraps.append(unwrap)

    def adopt(self, st) -> bool:
        """Wrap the module's own instance attribute `forward` if flashwatch has not yet:
        one set before attach, or since (torchtitan's Module.parallelize after watch,
        accelerate's add_hook_to_module, `m.forward = ...`). The Link then sits at
        OWN_LINK, so the class forward passes straight through when the own forward
        calls it (torchtitan's calls the `self.forward` it found when it parallelized:
        the class forward, once watched) and each call is measured once. True if it
        wrapped a forward now. A forward it cannot wrap (not callable: the module's
        calls fail anyway) leaves the layer `shadowed`, counted at every measured step
        (`check_forwards`). Never raises."""
        mod = st.site.module
        d = mod.__dict__
        link = d.get(LINK, d.get(OWN_LINK))
        if link is None or link.st is not st:  # removed, or another watcher took it over
            return False
        try:
            own = d.get("forward", ABSENT)
            st.shadowed = own is not ABSENT and not callable(own)
            if wrapped_here(own, mod):
                place_link(d, link, OWN_LINK)
                return False
            if own is ABSENT or st.shadowed:  # nothing of its own to wrap
                place_link(d, link, LINK)
                if st.shadowed:
                    self.recorder.ledger.warn_once(("shadowed", st.site.name), (
                        f"flashwatch: {st.site.name} has an instance attribute `forward` "
                        f"that is not callable ({type(own).__name__}); the layer is "
                        f"neither measured nor mitigated while it stays (a monitor error "
                        f"at every measured step; head modes set on it are reported "
                        f"unmitigable)"))
                return False
            d["forward"] = OwnForward(mod, own)
            place_link(d, link, OWN_LINK)
            log.info("flashwatch: %s has its own instance attribute `forward`; flashwatch "
                     "wraps it", st.site.name)
            return True
        except Exception as e:  # a __dict__ that refuses the write
            st.shadowed = True
            self.recorder.ledger.error(f"wrapping the forward of {st.site.name}", e)
            return False

    def check_forwards(self, states) -> None:
        """At the end of a measured step, before the next one is armed: wrap a forward
        set during the step (after `arm` looked), and count a monitor error for each
        layer the step could not measure because of its instance forward: not callable,
        or set during the step and, not calling the class forward, escaping it (no
        measured forward and no probed row)."""
        for st in states:
            late = self.adopt(st)
            if st.shadowed or (late and not (st.buf.forwards or st.buf.probe_rows)):
                why = ("its instance attribute `forward` is not callable" if st.shadowed
                       else "its forward was replaced by an instance attribute `forward` "
                            "during the step; wrapped now, measured from the next "
                            "monitored step")
                self.recorder.ledger.error(f"measuring {st.site.name}", RuntimeError(
                    f"{st.site.name} was not measured in this step: {why}"))

    def frames(self) -> list:
        """This thread's stack of [site, ContextVar token, mode pushed] for the watched
        modules now running (threads, e.g. nn.DataParallel replicas, never share one)."""
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    @property
    def current(self):
        frames = self.frames()
        return frames[-1][0] if frames else None

    def _run(self, st, module, original, args, kwargs):
        """The watched module's forward on measured or routed steps: mark it current for
        its attention calls, run it, unmark it."""
        rec = self.recorder
        if in_metadata_inference():  # shapes only, on empty tensors: nothing to measure
            return original(module, *args, **kwargs)
        if not recomputing():
            if st.routed:
                st.module_calls += 1
            if rec.cadence.measuring:
                st.buf.forwards += 1
        frame = [st, None, False]
        frames = self.frames()
        frames.append(frame)
        try:
            frame[1] = _dispatch_mod.INTERCEPT.set(rec.interceptor(st))
            self._mode.__enter__()
            frame[2] = True
        except Exception as e:
            rec.ledger.error(f"forward entry {st.site.name}", e)
        try:
            return original(module, *args, **kwargs)
        finally:
            if frames and frames[-1] is frame:  # else detach() already unwound it
                frames.pop()
                try:
                    if frame[2]:
                        self._mode.__exit__(None, None, None)
                    if frame[1] is not None:
                        _dispatch_mod.INTERCEPT.reset(frame[1])
                    st.buf.x = None
                except Exception as e:
                    rec.ledger.error(f"forward exit {st.site.name}", e)

    # --------------------------------------------------------------------- step hooks

    def arm(self, states) -> None:
        """Register the monitored step's hooks (X and ‖dW^Q‖²) on every layer that has a
        Q projection, after wrapping any instance forward a module got since (`adopt`).
        Idempotent."""
        for st in states:
            self.adopt(st)
        if self.armed:  # a weight replaced since (fully_shard after watch): hook it too
            for st in states:
                if st.site.q_module is not None:
                    self._hook_wq_grad(st)
            return
        self.armed = True
        for st in states:
            if st.site.q_module is not None:
                self._step_handles.append(
                    st.site.q_module.register_forward_pre_hook(self._x_hook(st)))
                st.wq_hooked.clear()  # their handles went with the last disarm
                self._hook_wq_grad(st)
                qc = st.q_check  # a hook on the layer's q norm, if it has one
                if qc is not None and not qc.done and not qc.failed:
                    self._step_handles += qc.arm()

    def disarm(self) -> None:
        for h in self._step_handles:
            h.remove()
        self._step_handles.clear()
        self.armed = False

    def _x_hook(self, st):
        rec = self.recorder

        def hook(module, args):
            if torch.compiler.is_compiling():
                return  # traced into a graph, X comes from flashwatch/monitor/traced.py's mode; an
                # assignment here would be replayed after the graph and outlive the step
            if rec.cadence.measuring and not rec.cadence.removed and args:
                x = args[0]  # a reference only; rows are taken at the attention call
                # a tensor-parallel q_proj's own hook made it a replicated DTensor
                if callable(getattr(x, "to_local", None)):
                    with outside_selective_checkpoint():
                        x = x.to_local()
                st.buf.x = x
                try:  # a weight replaced (fully_shard; FSDP2's unsharded one): hook it
                    self._hook_wq_grad(st)
                except Exception as e:
                    rec.ledger.error(f"W^Q gradient {st.site.name}", e)
        return hook

    def _hook_wq_grad(self, st) -> None:
        """Hook the Q projection's current weight for ‖dW^Q_h‖² (delta_error_share),
        unless it is hooked already. Under FSDP2 both the unsharded weight (forward) and
        the sharded one get hooked: the sharded one's hook fires last, with the averaged
        gradient (after the reduce-scatter), and its number is the one kept."""
        wq = getattr(st.site.q_module, "weight", None)
        known = st.wq_hooked.get(id(wq))
        if wq is None or (known is not None and known() is wq):
            return
        if isinstance(st.site.q_module, nn.Linear) and wq.requires_grad:
            self._step_handles.append(
                wq.register_post_accumulate_grad_hook(self.recorder.wq_grad_hook(st)))
            st.wq_hooked[id(wq)] = weakref.ref(wq)

    def force_eager(self, on: bool) -> None:
        """While a step is measured and some layer cannot take the traced probe
        (Watcher._traceable: e.g. not yet seen calling SDPA), every torch.compile'd
        function runs eagerly (Dynamo's "force_eager" stance), so compiled models are
        measured without a graph break. A graph break there would sit inside the
        model's loop over its layers, where Dynamo cannot resume: it then runs that
        whole frame eagerly on every later step too (a compiled GPT lost 2.7 % per
        unmonitored step after one monitored step: benchmarks/RESULTS.md). The stance
        is process-wide: it holds while any such watcher measures, and the user's own
        comes back when none does."""
        try:
            _measuring(id(self), on)
        except Exception as e:  # e.g. step() called inside a compiled region
            self.recorder.ledger.error("torch.compile stance", e)

    # ------------------------------------------------------------------------ detach

    def detach(self) -> None:
        """Undo everything: hooks, forwards, and any frame left by a forward that is
        still running (remove() called from inside the model)."""
        self.disarm()
        self.force_eager(False)
        for unwrap in self._unwraps:
            unwrap()
        self._unwraps.clear()
        for _, token, pushed in reversed(self.frames()):
            if pushed:
                self._mode.__exit__(None, None, None)
            if token is not None:
                _dispatch_mod.INTERCEPT.reset(token)
        self.frames().clear()
