"""The runtime state of one watched layer, in three named pieces.

    LayerState      what lives as long as the watcher: the site, its head modes and what
                    is known about applying them, the sketch matrices, the power
                    iteration's warm start
      .buf          StepBuffers: what one monitored step accumulates (reset by step())
      .compiled     CompileFacts: what eager monitored steps saw the layer do, which
                    decides whether its compiled forward can run the traced probe

Fields the forward wrapper reads first (LayerState.routed, CompileFacts.traced) are
plain Python bools: torch.compile guards on them (one recompile when one flips) instead
of tracing watcher code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flashwatch.kernels.common import AttentionStats
from flashwatch.sites.layouts import QCheck
from flashwatch.sites.site import AttentionSite


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: non_blocking (cudaMemcpyAsync
    stages a pageable source at once and does not wait for the stream; a blocking copy
    synchronises it)."""
    return t.to(device, non_blocking=True)


@dataclass
class StepBuffers:
    """One monitored step's accumulators of one layer. Device tensors stay where the
    calls ran: the step moves them to the host once (flashwatch/monitor/aggregate.py)."""

    stats: AttentionStats  # exact counters of routed calls
    wq_grad_sq: torch.Tensor  # [H] float64 ‖dW^Q_h‖²_F of the step's gradient (NaN: none)
    kernel_counted: bool = False  # the current routed call's rows are in `stats`
    samples: list = field(default_factory=list)  # samples.Sample of each probed call
    probe_rows: int = 0
    grad_rows: int = 0  # sampled rows whose gradient arrived
    # rows c covered, rows it missed (sampled calls), sampled rows with X (no X: no share)
    delta_rows: int = 0
    delta_missed: int = 0
    share_rows: int = 0
    wq_grad_averaged: bool = False  # wq_grad_sq from FSDP2's shard of the averaged gradient
    wq_grad_divisor: float = 0.0  # ... which FSDP2 divided by that (0: the mean over ranks)
    sampled: bool = False  # a probed call of this step measured only some of its rows
    o32: torch.Tensor | None = None  # the current routed call's FP32 O, every head
    o32_paper: bool = False  # ... made by backend="paper", whose δ is a BF16 rowsum
    # probing.ProbedCall of calls made without grad, for a reentrant checkpoint's
    # recompute to hook
    no_grad_samples: list = field(default_factory=list)
    # probing.ProbedCall (every_row None) of the step's traced calls by call id, until
    # their gradient
    traced_pending: dict = field(default_factory=dict)
    x: torch.Tensor | None = None  # input of the Q projection during the current call
    forwards: int = 0  # measured eager forwards of the module (flashwatch/monitor/attach.py)
    calls: int = 0  # attention calls of ours measured in them (SDPA or flashwatch.attention)
    unmeasured: str | None = None  # why a call of the layer seen this step was not measured
    # why the layer, split by tensor parallelism after attach, could not be narrowed this
    # step (tried once a step: flashwatch/monitor/capture.py)
    split_refused: str | None = None
    split_failed: bool = False  # ... because narrowing raised here (not a refusal)

    @classmethod
    def fresh(cls, num_heads: int, device) -> StepBuffers:
        return cls(stats=AttentionStats.zeros(num_heads, device=device),
                   wq_grad_sq=torch.full((num_heads,), math.nan, dtype=torch.float64,
                                         device=device))


@dataclass
class CompileFacts:
    """Compiled monitored steps (flashwatch/monitor/traced.py): the layer's key for the probe ops
    and what eager monitored steps saw it do."""

    key: int = -1  # in traced's registry
    key_t: torch.Tensor | None = None  # the same as a 0-dim tensor: a graph input, not a
    # constant each block's graph would specialise on
    q_path: str | None = None  # the nn.Linear Q projection inside the module (traced.q_path)
    sdpa_seen: bool = False  # made an F.scaled_dot_product_attention call while measured
    checkpointed: bool = False  # its forward was recomputed (activation checkpointing)
    dropout_seen: bool = False  # called SDPA with attention dropout while measured
    fw_seen: bool = False  # made a flashwatch.attention call while measured
    flex_seen: bool = False  # made a FlexAttention or varlen call (flashwatch/monitor/flex.py):
    # measured where it runs eagerly, so measured and routed steps stay eager
    traced: bool = False  # its compiled forward runs the traced probe on measured steps


@dataclass(frozen=True, eq=False)
class DeviceConstants:
    """A layer's sketch matrices and head indices on one device (`LayerState.on_device`)."""

    omega_x: torch.Tensor  # [d_model, k]
    omega_a: torch.Tensor  # [d_head, k]
    omega_q: torch.Tensor  # [d_head, k]
    heads: torch.Tensor  # [H] int64


@dataclass
class LayerState:
    """One watched layer: modes, sketch matrices, and its step buffers."""

    site: AttentionSite
    offset: int  # index of head 0 in the watcher's flat head arrays
    modes: torch.Tensor  # int32 [H], applied modes, read at every call
    omega_x: torch.Tensor  # [d_model, k]
    omega_a: torch.Tensor  # [d_head, k]
    omega_q: torch.Tensor  # [d_head, k], for q-space terms when X is not available
    heads: torch.Tensor  # [H] int64: offset + arange(H), for samples.totals
    power_v: torch.Tensor | None = None  # warm start of the W^Q power iteration
    unmitigable: str | None = None  # why its modes could not be applied, last known
    shadowed: bool = False  # its instance attribute `forward` is not callable: nothing
    # to wrap (a callable one is wrapped: flashwatch/monitor/attach.py Attachment.adopt)
    routed: bool = False  # route_all or a non-STANDARD head: its calls go to our kernel
    # Since the last report: forwards of the module while routed, calls of ours that
    # ran its modes, and attention calls made with modes set that ran the original
    # kernel. Modes count as applied only if the first two are > 0 and the last is 0.
    module_calls: int = 0
    routed_calls: int = 0
    fallback_calls: int = 0
    # id -> weakref of each Q weight whose gradient hook is registered: under FSDP2 the
    # unsharded weight of the forward and the sharded one outside it are both hooked
    wq_hooked: dict = field(default_factory=dict)
    q_check: object = None  # layouts.QCheck of its W^Q slice, until it passed or failed
    wq_refused: str | None = None  # why its W^Q slice is not the layer's Q (QCheck)
    silent_reported: bool = False  # "no attention call seen" was reported
    fused_failed: bool = False  # its flex call failed compiled on a measured step: it runs
    # the op eagerly there (flashwatch/monitor/flex_capture.py FlexCapture._run_flex)
    flex_refused: str | None = None  # why its last flex or varlen call, with modes set,
    # ran its own kernel (None: it ran flashwatch's): such a layer does not hold the
    # process's compiled code eager on unmeasured steps (Watcher._stance)
    lse_gradient: bool = False  # a gradient reached the log-sum-exp of a routed flex or
    # varlen call (flashwatch/monitor/flex_capture.py): never routed again
    device_cache: dict = field(default_factory=dict)  # device -> DeviceConstants
    buf: StepBuffers | None = None
    compiled: CompileFacts = field(default_factory=CompileFacts)

    def on_device(self, device) -> DeviceConstants:
        """Ω_x, Ω_a, Ω_q and heads on `device`, moved once per run, not once per call."""
        got = self.device_cache.get(device)
        if got is None:
            got = DeviceConstants(omega_x=to_device(self.omega_x, device),
                                  omega_a=to_device(self.omega_a, device),
                                  omega_q=to_device(self.omega_q, device),
                                  heads=to_device(self.heads, device))
            self.device_cache[device] = got
        return got

    def traceable(self) -> bool:
        """Its compiled forward can run the traced probe (flashwatch/monitor/traced.py): seen
        measured (eagerly) making SDPA calls only, no head modes, never recomputed by
        activation checkpointing (Dynamo cannot enter the mode inside a checkpoint region:
        the graph break would cost the layer loop's frame its graph for good), and X from
        an nn.Linear Q projection inside the module, or none: what the traced probe
        measures like the eager one."""
        from flashwatch.monitor import traced

        c = self.compiled
        return (traced.SUPPORTED and c.sdpa_seen and not c.fw_seen and not c.flex_seen
                and not c.checkpointed
                and not c.dropout_seen and not self.routed and not self.shadowed
                and (self.site.q_module is None or c.q_path is not None))

    def not_applied(self) -> str | None:
        """Why its non-STANDARD modes did not run since the last report, if they
        did not; None if they ran or the layer had no call to judge by."""
        if not bool(self.modes.any()):
            return None
        if self.shadowed:
            return ("its instance attribute `forward` is not callable, so flashwatch "
                    "has nothing to wrap and its attention calls never reach flashwatch")
        if self.fallback_calls > 0:
            return self.unmitigable
        if self.module_calls > 0 and self.routed_calls == 0:
            return (f"its module ran {self.module_calls} time(s) with head modes set but made "
                    f"no attention call flashwatch could route (F.scaled_dot_product_"
                    f"attention, flex_attention, varlen_attn or flashwatch.attention)")
        if self.module_calls == 0 and self.routed_calls == 0:
            return self.unmitigable  # not called since: the last thing known
        return None

    def narrowed(self, site: AttentionSite, offset: int) -> dict:
        """The layer, watched whole, now split by tensor parallelism: `site` is this
        rank's part of it (heads [site.head_offset, + site.num_heads) of the ones it
        held), at `offset` in the head table. Returns the fields `narrow` sets, made
        here (a failure changes nothing): modes keep each head's own; the step's buffers
        restart for the local heads, keeping what the current forward already recorded
        (the call's X, the forward count)."""
        lo, h = site.head_offset, site.num_heads
        old = self.buf
        buf = StepBuffers.fresh(h, old.stats.rows.device if old is not None else "cpu")
        if old is not None:
            buf.x, buf.forwards, buf.calls = old.x, old.forwards, old.calls
        return dict(site=site, offset=offset, modes=self.modes[lo:lo + h].clone(),
                    heads=torch.arange(offset, offset + h), buf=buf, power_v=None,
                    q_check=QCheck(site) if site.q_module is not None else None,
                    device_cache={})

    def narrow(self, fields: dict) -> None:
        """Take the fields `narrowed` made (plain assignments)."""
        for name, value in fields.items():
            setattr(self, name, value)

    def reset(self) -> None:
        """Fresh step buffers, on the device the last step's calls ran on."""
        dev = self.buf.stats.rows.device if self.buf is not None else "cpu"
        self.buf = StepBuffers.fresh(self.site.num_heads, dev)
