"""Per-head QK-clip (opt-in, `WatchConfig.qk_clip_threshold`): bound the attention logits.

Kimi K2's MuonClip and Megatron-LM's `--qk-clip`: after the optimizer
step, a head h whose max logit m_h of the step exceeds τ gets

    W^Q rows of h  × η_h^α,   W^K rows of h  × η_h^(1−α),   η_h = τ / m_h,

so every logit of the head, q·k·scale, is multiplied by η_h and the step's max becomes τ.
Grouped-query attention: a K head shared by a group of query heads is scaled by the
smallest η of its group (the largest reduction), each query head by its own η^α; a
clipped head's logits then shrink by η_h^α · η_min^(1−α) ≤ η_h.

Biases: q = W x + b is scaled by η^α only if b is scaled too, so the Q and K biases of
clipped heads are scaled with their rows (Qwen-style q/k biases, nanoGPT's and GPT-2's
c_attn bias). Layouts: every discovered site names its Q and K channels (sites/site.py:
q_index in q_module, k_index in k_module: nanoGPT and GPT-2 c_attn, HF q_proj/k_proj,
GPT-NeoX/Bloom/Falcon per-head interleaved query_key_value, Phi-3 qkv_proj, Qwen3-Next's
gated q_proj). Explicit sites are not supported (their K weight is unknown) and are
refused when the Watcher is built.

Which max logit: the watcher's reduced per-head `attention_max_logit` of the monitored
step, the max over all ranks, so every rank computes the same η without a second
reduction. It is exact (all rows) for layers that run flashwatch's op (a non-STANDARD
head, or `route_all=True`), else the max over the probe's sampled rows, a lower bound:
a clip then brings the sampled max to τ and the true max may stay above it. Clips happen
on monitored steps only; every_n_steps=1 clips at every step as Kimi and Megatron do.

Sharded weights (FSDP2 / DTensor) are scaled shard-locally: each rank multiplies the
channels of its local shard by their factors, no communication. `apply()` only plans
the scaling (`writes`); `commit()` writes it and `rollback()` undoes that, which a
monitored step uses to write it on every rank or on none (flashwatch/monitor/clipping.py),
so replicas keep equal weights.

QK-norm (a norm on q and k after the projection: Qwen3, Qwen3-Next, Gemma3 `q_norm`,
OLMo2, `q_layernorm`...) undoes any scaling of W^Q and W^K: the clip would shrink the
weights step after step and never move a logit. Such layers are refused, once per head
(an event applied=False, one log line per layer), and never scaled. The gain the norm
carries is what bounds the logits there; clipping it per head is impossible where one
gain vector [head_dim] is shared by every head (Qwen3, Gemma3: scaling it scales the
whole layer), and only OLMo2-style [H·head_dim] gains would allow it; not done.

Confirmation: a clip counts (`total`, `qk_clips_total`) only once the next measurement
of its head shows it: `confirm(max_logit)`, called at each monitored step before
`apply()`, confirms a pending clip when the head's new max logit m1 is at most τ or
dropped from its pre-clip m0 by at least CONFIRM_FRACTION of the intended reduction
m0 − τ, i.e. m1 ≤ m0 − ½(m0 − τ). Half: the next measurement is another batch after
another optimizer step (and, for sampled rows, a lower bound), so the full reduction
cannot be demanded; a clip that some part of the model undoes leaves m1 ≈ m0. A head
whose clip is not confirmed is logged once and never clipped again (an event
applied=False). An unmeasured head (NaN) keeps its clip pending.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from flashwatch.config import WatchConfig
from flashwatch.kernels.common import Mode
from flashwatch.parallel.sharding import is_dtensor
from flashwatch.report.records import Event
from flashwatch.sites.layouts import K_NORM_NAMES, Q_NORM_NAMES, child
from flashwatch.sites.site import AttentionSite

log = logging.getLogger("flashwatch")

CONFIRM_FRACTION = 0.5  # of the intended reduction m0 - τ (module docstring)
STOP_PRODUCT = 0.5  # a head stops after unconfirmed clips that halved its logits in all


# state_dict entries and their dtypes ("clips" only in states saved before confirmation)
STATE = {"clips": torch.int64, "pending": torch.float64, "pending_step": torch.int64,
         "pending_factor": torch.float64, "streak": torch.float64, "stopped": torch.bool}


class QKClip:
    """Applies (mitigation "auto") or advises ("advise") QK-clip after a monitored step,
    confirms each applied clip on the next measurement, counts the confirmed clips per
    head and logs them as Events of kind "qk_clip".

    The books (pending clips, confirmed counts, stops) and the events cover every head
    of the job's table and are kept alike on every rank: their inputs (the reduced max
    logits, the layers' facts) are the same everywhere, so rank 0 reports every
    stage's and every tensor-parallel rank's clips, once. Only the scaling is local:
    each rank scales the heads of the sites it holds."""

    def __init__(self, config: WatchConfig, sites: list[AttentionSite],
                 offsets: list[int] | None = None, n_heads: int | None = None,
                 layers: list[tuple] | None = None) -> None:
        """sites: the layers this rank holds; offsets: each one's head 0 in the per-head
        arrays of n_heads heads (the job's head table; default: these sites in order);
        layers: every layer of the table as (name, offset, heads, K heads, QK-norm or
        None), global heads (default: the sites')."""
        if config.qk_clip_threshold is not None:
            for site in sites:
                check_site(site)
        self.config = config
        self.sites = list(sites)
        self.offsets = (list(offsets) if offsets is not None else
                        [sum(s.num_heads for s in self.sites[:i]) for i in range(len(sites))])
        self.qk_norm = [qk_norm(s) for s in self.sites]
        self.layers = (list(layers) if layers is not None else [
            (s.name, off, s.num_heads, s.num_kv_heads, norm)
            for s, off, norm in zip(self.sites, self.offsets, self.qk_norm, strict=True)])
        n = sum(h for _, _, h, _, _ in self.layers) if n_heads is None else n_heads
        self.clips = torch.zeros(n, dtype=torch.int64)  # confirmed clips per head
        self.pending = torch.full((n,), math.nan, dtype=torch.float64)  # m0 of a clip
        self.pending_step = torch.full((n,), -1, dtype=torch.int64)
        self.pending_factor = torch.ones(n, dtype=torch.float64)  # its logits' factor
        # unconfirmed streak per head: (max logit where it began, product of factors)
        self.streak = torch.tensor([[math.nan, 1.0]], dtype=torch.float64).repeat(n, 1)
        self.stopped = torch.zeros(n, dtype=torch.bool)  # refused or unconfirmed: no clip
        self.scale_errors: list = []  # (site name, exception) of the last apply()
        self.writes: list = []  # the last apply()'s scaled channels, until commit()
        self.undo: list = []  # the last commit()'s channels as they were, for rollback()
        self._confirmed = False  # confirm() ran since the last apply()

    def site_norm(self, site: AttentionSite) -> str | None:
        """`site`'s QK-norm (`qk_norm`), once QK-clip checked it can scale it (ValueError
        where it cannot, with qk_clip_threshold set)."""
        if self.config.qk_clip_threshold is not None:
            check_site(site)
        return qk_norm(site)

    def replace_site(self, i: int, site: AttentionSite, offset: int, norm: str | None
                     ) -> None:
        """This rank's i-th layer, split by tensor parallelism after attach: from now on
        it scales the rows of `site`'s heads (at `offset` in the per-head arrays; `norm`:
        `site_norm(site)`). The books, kept per global head, are unchanged."""
        self.sites[i], self.offsets[i], self.qk_norm[i] = site, offset, norm

    @property
    def total(self) -> int:
        return int(self.clips.sum())

    def confirm(self, max_logit: torch.Tensor, step: int = -1
                ) -> tuple[list[Event], list[Event]]:
        """(confirmed, not confirmed) events for the clips pending from the last apply(),
        judged on this monitored step's max logit per head [n] (module docstring). Call
        it before apply(); `step` is the step the events carry."""
        self._confirmed = True
        tau = self.config.qk_clip_threshold
        heads = (~torch.isnan(self.pending)).nonzero().flatten().tolist()
        if tau is None or not heads:
            return [], []
        m1 = max_logit.detach().to("cpu", torch.float64)
        confirmed, failed = [], []
        for i in heads:
            now, m0 = float(m1[i]), float(self.pending[i])
            if math.isnan(now):
                continue  # not measured this step: still pending
            name, h = self._where(i)
            need = max(tau, m0 - CONFIRM_FRACTION * (m0 - tau))
            seen = (f"max logit {_g(m0)} -> {_g(now)} after the clip of step "
                    f"{int(self.pending_step[i])} (τ {_g(tau)}, needed ≤ {_g(need)})")
            ok = now <= need
            if ok:
                self.clips[i] += 1
                self.streak[i] = torch.tensor([math.nan, 1.0], dtype=torch.float64)
                reason = f"[qk_clip confirmed] {seen}"
            else:
                reason = f"[qk_clip not confirmed] {seen}: not counted" + self._judge(
                    i, name, h, m0, now)
            (confirmed if ok else failed).append(Event(
                step=step, layer=name, head=h, from_mode=Mode.STANDARD,
                to_mode=Mode.STANDARD, reason=reason, applied=ok, kind="qk_clip"))
            self.pending[i], self.pending_step[i] = math.nan, -1
        return confirmed, failed

    def _judge(self, i: int, name: str, h: int, m0: float, now: float) -> str:
        """An unconfirmed clip joins the head's streak; the head stops once the streak
        scaled its logits by P ≤ STOP_PRODUCT in all and its max logit kept more than
        sqrt(P) of where the streak began (less than half the intended log-reduction)."""
        start, product = self.streak[i].tolist()
        start = m0 if math.isnan(start) else start
        product *= float(self.pending_factor[i])
        self.streak[i] = torch.tensor([start, product], dtype=torch.float64)
        if not (product <= STOP_PRODUCT and now > math.sqrt(product) * start):
            return ""
        self.stopped[i] = True
        log.warning("flashwatch: QK-clip of %s head %d has no visible effect: its clips "
                    "scaled the logits by %s in all, yet the max logit went %s -> %s; "
                    "QK-clip stops clipping this head", name, h, _g(product),
                    _g(start), _g(now))
        return (f"; its clips since the max logit was {_g(start)} scaled the logits by "
                f"{_g(product)} in all without effect: QK-clip stops clipping this head")

    def apply(self, step: int, max_logit: torch.Tensor, modes: torch.Tensor) -> list[Event]:
        """max_logit [n]: the step's rank-reduced max logit per head (identical on every
        rank, so is every factor). modes [n]: the heads' modes, for the events. Runs
        confirm() first if the caller did not (its events lead the returned list). The
        books and events cover every layer; the channels of the sites this rank holds
        are scaled into `writes`, written to the weights by `commit()` (each site whose
        scaling raised is listed in `scale_errors`: then commit nowhere, so that
        replicas keep equal weights)."""
        events = []
        if not self._confirmed:
            done, failed = self.confirm(max_logit, step)
            events += done + failed
        self._confirmed = False
        self.scale_errors, self.writes = [], []
        cfg = self.config
        tau = cfg.qk_clip_threshold
        if tau is None or cfg.mitigation == "off":
            return events
        eta = torch.where(self.stopped, 1.0, clip_factors(max_logit, tau))
        for name, off, heads, kv, norm in self.layers:
            e = eta[off:off + heads]
            if bool((e == 1).all()):
                continue
            if norm is not None:
                events += self._refuse(step, name, off, e, modes, norm)
                continue
            if cfg.mitigation == "auto":
                over = (e < 1).nonzero().flatten() + off
                self.pending[over] = max_logit.detach().to("cpu", torch.float64)[over]
                self.pending_step[over] = step
                self.pending_factor[over] = logit_factors(e, kv, cfg.qk_clip_alpha)[
                    over - off]
            events += self._clip_events(step, name, off, kv, e, max_logit, modes)
        if cfg.mitigation == "auto":
            for site, off, norm in zip(self.sites, self.offsets, self.qk_norm, strict=True):
                e = eta[off:off + site.num_heads]
                if norm is None and not bool((e == 1).all()):
                    try:
                        self.writes += plan_scaling(site, e, cfg.qk_clip_alpha)
                    except Exception as err:  # the books stay the same on every rank
                        self.scale_errors.append((site.name, err))
        return events

    def commit(self) -> None:
        """Write the last apply()'s scaled channels into the weights, keeping the old
        values (a few rows a clipped head) for `rollback`."""
        writes, self.writes, self.undo = self.writes, [], []
        with torch.no_grad():
            self.undo = [(channels, channels.clone()) for channels, _ in writes]
        write(writes)

    def rollback(self) -> None:
        """Put back the channels the last commit() wrote (or began to)."""
        undo, self.undo = self.undo, []
        write(undo)

    def _clip_events(self, step, name, off, kv, e, max_logit, modes) -> list[Event]:
        tau, alpha = self.config.qk_clip_threshold, self.config.qk_clip_alpha
        eta_k = kv_factors(e, kv)
        group = e.numel() // kv
        events = []
        for h in (e < 1).nonzero().flatten().tolist():
            mode = Mode(int(modes[off + h]))
            k_text = f"W^K × {_g(eta_k[h // group] ** (1 - alpha))}"
            if group > 1:
                k_text += f" (K head {h // group} shared: its group's smallest η " \
                          f"{_g(eta_k[h // group])})"
            events.append(Event(
                step=step, layer=name, head=h, from_mode=mode, to_mode=mode,
                reason=(f"[qk_clip] max logit {_g(max_logit[off + h])} > τ {_g(tau)}: "
                        f"η = {_g(e[h])}, W^Q × η^{_g(alpha)} = {_g(e[h] ** alpha)}, "
                        f"{k_text}"),
                applied=self.config.mitigation == "auto", kind="qk_clip"))
        return events

    def _refuse(self, step, name, off, e, modes, norm) -> list[Event]:
        """A QK-norm layer: never scaled; one event applied=False per head, then quiet."""
        heads = (e < 1).nonzero().flatten().tolist()
        why = (f"[qk_clip] refused: {name} normalises q and k after the projection "
               f"({norm}), which undoes any scaling of W^Q and W^K; QK-clip cannot bound "
               "this head's logits (the norm's gain does) and leaves the layer alone")
        if not bool(self.stopped[off:off + e.numel()].any()):
            log.warning("flashwatch: %s", why)
        events = []
        for h in heads:
            self.stopped[off + h] = True
            mode = Mode(int(modes[off + h]))
            events.append(Event(step=step, layer=name, head=h, from_mode=mode, to_mode=mode,
                                reason=why, applied=False, kind="qk_clip"))
        return events

    def stop_layer(self, step: int, layer: str, reason: str,
                   heads: torch.Tensor | None = None) -> list[Event]:
        """Never clip `layer` again (e.g. its W^Q slice failed layouts.QCheck, so its K
        slice is not to be trusted either), or only its `heads` (bool [heads]: those of
        the tensor-parallel rank whose slice failed): one event applied=False per head
        newly stopped."""
        for name, off, count, _, _ in self.layers:
            if name != layer:
                continue
            stop = torch.ones(count, dtype=torch.bool) if heads is None else heads.bool()
            new = (stop & ~self.stopped[off:off + count]).nonzero().flatten().tolist()
            for h in new:
                self.stopped[off + h] = True
                self.pending[off + h] = math.nan
            return [Event(step=step, layer=layer, head=h, from_mode=Mode.STANDARD,
                          to_mode=Mode.STANDARD, reason=f"[qk_clip] stopped: {reason}",
                          applied=False, kind="qk_clip") for h in new]
        return []

    def _where(self, i: int) -> tuple[str, int]:
        """The layer holding table index i and the head's (global) index in it."""
        for name, off, heads, _, _ in self.layers:
            if off <= i < off + heads:
                return name, i - off
        raise IndexError(i)

    def state_dict(self) -> dict:
        return {key: getattr(self, key).clone() for key in STATE}

    def load_state_dict(self, sd: dict) -> None:
        got = {}
        for key, dtype in STATE.items():
            value, shape = sd.get(key), tuple(getattr(self, key).shape)
            if value is None and key != "clips":
                continue  # a state saved before confirmation existed: nothing pending
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                raise ValueError(f"QK-clip state must hold {key!r}, a {dtype} tensor "
                                 f"{list(shape)}, got {value!r:.80}")
            got[key] = value.to("cpu", dtype).clone()
        for key, value in got.items():
            setattr(self, key, value)


def _g(x) -> str:
    return f"{float(x):.3g}"


def qk_norm(site: AttentionSite) -> str | None:
    """The names of the norms the site applies to q or k after the projection, or None."""
    names = [n for n in Q_NORM_NAMES + K_NORM_NAMES if child(site.module, [n]) is not None]
    return " and ".join(f"`{n}`" for n in names) or None


def clip_factors(max_logit: torch.Tensor, tau: float) -> torch.Tensor:
    """η per head: τ / max logit where the max logit exceeds τ, else 1 (NaN and ±inf
    give 1: an unmeasured head is left alone, and an infinite logit would zero it)."""
    m = max_logit.detach().to("cpu", torch.float64)
    over = torch.isfinite(m) & (m > tau)
    return torch.where(over, tau / torch.where(over, m, 1.0), 1.0)


def logit_factors(eta: torch.Tensor, num_kv_heads: int, alpha: float) -> torch.Tensor:
    """What a clip multiplies each query head's logits by: η_h^α · η_K^(1−α), η_K its
    K head's factor (the smallest η of its group)."""
    group = eta.numel() // num_kv_heads
    return eta ** alpha * kv_factors(eta, num_kv_heads).repeat_interleave(group) ** (1 - alpha)


def kv_factors(eta: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The smallest η of each group of query heads sharing a K head ([Hkv]); query head
    h uses K head h // (H / Hkv), as repeat_interleave does."""
    return eta.view(num_kv_heads, -1).amin(1)


def check_site(site: AttentionSite) -> None:
    """Raise ValueError when QK-clip cannot scale this site's K weight."""
    if site.k_module is None and site.global_heads is not None:
        raise ValueError(
            f"qk_clip_threshold is set but site {site.name!r} has its heads split over "
            "ranks by context parallelism while its W^Q and W^K are whole on every rank: "
            "a clip of one rank's heads would make the replicas differ; QK-clip is not "
            "supported there yet, leave qk_clip_threshold None")
    if site.k_module is None or site.k_index is None or site.q_index is None:
        raise ValueError(
            f"qk_clip_threshold is set but site {site.name!r} is {site.kind!r} without "
            "its K weight, which QK-clip scales; name it: sites={name: dict(..., "
            "k_module='k_proj')} (k_channels= for a fused projection whose K rows "
            "q_layout does not give), or leave qk_clip_threshold None"
        )


def scale_site(site: AttentionSite, eta: torch.Tensor, alpha: float) -> None:
    """Scale the site's W^Q and W^K channels (and biases) in place for per-head η [H]."""
    write(plan_scaling(site, eta, alpha))


@torch.no_grad()
def write(writes: list) -> None:
    """Copy each planned (channels, scaled values) pair into its weight."""
    for channels, scaled in writes:
        channels.copy_(scaled)


def plan_scaling(site: AttentionSite, eta: torch.Tensor, alpha: float) -> list:
    """The site's W^Q and W^K channels (and biases) scaled for per-head η [H], as
    (view of the weight's channels, scaled values) pairs: computed, nothing written."""
    D = site.head_dim
    q_rows = (eta ** alpha).repeat_interleave(D)  # [H * D], head-major channels
    k_rows = (kv_factors(eta, site.num_kv_heads) ** (1 - alpha)).repeat_interleave(D)
    q_index, k_index = site.q_index, site.k_index
    if site.channel_offsets is not None:  # TP: local channels are global ones of this rank
        q_index, k_index = q_index + site.channel_offsets[0], k_index + site.channel_offsets[1]
    return _scale(site.q_module, q_index, q_rows) + _scale(site.k_module, k_index, k_rows)


def _scale(proj: nn.Module, index: torch.Tensor, factors: torch.Tensor) -> list:
    """Output channels `index` of a Linear/Conv1D (weight and bias) times `factors`,
    planned by contiguous run of channels. Conv1D stores its weight [in, out]:
    channels are columns."""
    out_dim = 1 if type(proj).__name__ == "Conv1D" else 0
    breaks = ((index[1:] - index[:-1]) != 1).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), len(index)]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        start = int(index[lo])
        out += _mul_channels(proj.weight, out_dim, start, factors[lo:hi])
        if getattr(proj, "bias", None) is not None:
            out += _mul_channels(proj.bias, 0, start, factors[lo:hi])
    return out


@torch.no_grad()
def _mul_channels(param: torch.Tensor, dim: int, start: int, factors: torch.Tensor) -> list:
    """[(param[..., start + i, ...] along `dim`, it times factors[i])] on the local shard
    of a DTensor (its global offset along `dim` decides which factors it owns); [] where
    this rank holds none of the channels or every factor is 1."""
    local, offset, size = param, 0, param.shape[dim]
    if is_dtensor(param):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements)
        local, offset, size = param._local_tensor, offsets[dim], shape[dim]
    lo, hi = max(start, offset), min(start + len(factors), offset + size)
    if lo >= hi:
        return []  # this rank holds none of these channels
    f = factors[lo - start:hi - start]
    if bool((f == 1).all()):
        return []  # heads under τ stay bit-for-bit as they are
    view = [1] * local.dim()
    view[dim] = hi - lo
    channels = local.narrow(dim, lo - offset, hi - lo)
    # In the weight's dtype, as the optimizer's own update is; one rounding per element.
    return [(channels, channels * f.to(local.device, local.dtype).view(view))]

