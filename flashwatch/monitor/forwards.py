"""The forwards of watched attention modules (flashwatch/monitor/attach.py says how they
are attached and undone): the class a watched module is given (`watched_class`), the
wrapper of a module's own instance `forward` (`OwnForward`), and the `Link` both read to
find the module's watcher and layer."""

from __future__ import annotations

import functools

import torch
from torch import nn

from flashwatch.monitor import traced as _traced

# Module attributes holding a watched attention module's Link: LINK, where the class
# forward reads it, or OWN_LINK while flashwatch's wrapper of the module's own instance
# forward (OwnForward) is its forward: the class forward, finding no Link, then passes
# straight through when that own forward calls it.
LINK = "_flashwatch_link"
OWN_LINK = "_flashwatch_own_link"
ABSENT = object()  # no instance attribute `forward`


class Link:
    """What a watched module's forward reads: its watcher, its layer's state and its
    class before it was watched. Deep copies and DataParallel replicas of the module
    share it (as they shared forward hooks): they are measured as the same layer."""

    __slots__ = ("recorder", "st", "base")

    def __init__(self, recorder, st, base: type):
        self.recorder, self.st, self.base = recorder, st, base

    def __deepcopy__(self, memo):
        return self


_WATCHED_CLASSES: dict[type, type] = {}


def watched_class(base: type) -> type:
    """One subclass per attention class (all layers of a model share it, so regional
    compilation, e.g. each block compiled on its own, still reuses one graph for every
    block) whose forward reads the module's Link. A subclass, not a forward in the
    module's __dict__, so that deep copies and replicas call it with themselves as
    `self`, never with the original module's weights."""
    cls = _WATCHED_CLASSES.get(base)
    if cls is None:
        original = base.forward

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            link = module.__dict__.get(LINK)
            rec = None if link is None else link.recorder
            # routed, or a measured step (read inline: this runs on every forward)
            if rec is not None and not rec.cadence.removed and (
                    link.st.routed or (rec.cadence.monitoring and not rec.cadence.paused)):
                if link.st.compiled.traced and torch.compiler.is_compiling():
                    return _traced.run(link.st, module, original, args, kwargs)
                return rec.attachment.run(link.st, module, original, args, kwargs)
            return original(module, *args, **kwargs)

        cls = _WATCHED_CLASSES[base] = type(base.__name__, (base,), {
            "forward": forward, "__module__": base.__module__,
            "__qualname__": base.__qualname__})
    return cls


class OwnForward:
    """What replaces a watched module's own instance attribute `forward`
    (`Attachment.adopt`): the class forward's logic around the module's own forward.
    An instance forward takes no `self` (it is never bound on lookup), so it is called
    as `own(*args)`; `Attachment.run` and `traced.run` pass the module first, hence
    `_call_own`.

    Only the module's current forward measures: a wrapper captured by a forward set
    since (accelerate's add_hook_to_module keeps `module.forward` and calls it) passes
    straight through once that forward is wrapped in turn, so a call is measured once.
    It holds its own forward, not the module's __dict__ entry: such a chain never loops.

    Deep copies: copy.deepcopy copies this object with the module, so `module` is the
    copy and `own` is copied as the module's own forward would be unwatched (a bound
    method rebound to the copy, a functools.partial with its arguments deep-copied, a
    function or closure shared: a closure over the original module, as torchtitan's,
    runs the original's weights in the copy, watched or not). The copy shares the Link
    and is measured as the same layer."""

    def __init__(self, module: nn.Module, own):
        self.module, self.own = module, own

    @property
    def __wrapped__(self):  # inspect.signature(module.forward) reads the own forward's
        return self.own

    def _call_own(self, _module, *args, **kwargs):
        return self.own(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        d = self.module.__dict__
        link = d.get(OWN_LINK)
        rec = None if link is None else link.recorder
        if rec is not None and not rec.cadence.removed and (
                link.st.routed or (rec.cadence.monitoring and not rec.cadence.paused)):
            current = d.get("forward")
            if current is self or not isinstance(current, OwnForward):
                if link.st.compiled.traced and torch.compiler.is_compiling():
                    return _traced.run(link.st, self.module, self._call_own, args, kwargs)
                return rec.attachment.run(link.st, self.module, self._call_own, args,
                                          kwargs)
        return self.own(*args, **kwargs)


def wrapped_here(forward, module) -> bool:
    """`forward` is flashwatch's wrapper of `module`'s own forward."""
    return isinstance(forward, OwnForward) and forward.module is module


def place_link(d: dict, link: Link, key: str) -> None:
    """The Link at `key` (LINK or OWN_LINK) and not at the other one. Written only when
    it moves: Dynamo guards on the module's attributes."""
    if d.get(key) is not link:
        d[key] = link
    d.pop(OWN_LINK if key == LINK else LINK, None)
