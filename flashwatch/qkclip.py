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
c_attn bias). Layouts (sites.py): nanoGPT c_attn (nn.Linear [3C, C]: Q rows [0, C),
K rows [C, 2C)), GPT-2 Conv1D c_attn ([C, 3C]: the same channels as columns) and HF
q_proj/k_proj (nn.Linear, grouped K allowed). Explicit sites are not supported (their
K weight is unknown) and are refused when the Watcher is built.

Which max logit: the watcher's reduced per-head `attention_max_logit` of the monitored
step, the max over all ranks, so every rank computes the same η without a second
reduction. It is exact (all rows) for layers that run flashwatch's op (a non-STANDARD
head, or `route_all=True`), else the max over the probe's sampled rows, a lower bound:
a clip then brings the sampled max to τ and the true max may stay above it. Clips happen
on monitored steps only; every_n_steps=1 clips at every step as Kimi and Megatron do.

Sharded weights (FSDP2 / DTensor) are scaled shard-locally: each rank multiplies the
channels of its local shard by their factors, no communication. Models that normalise
q and k after the projection (QK-norm) undo the scaling; QK-clip is pointless there.
"""

from __future__ import annotations

import torch
from torch import nn

from flashwatch.config import WatchConfig
from flashwatch.distributed import is_dtensor
from flashwatch.kernels.common import Mode
from flashwatch.report import Event
from flashwatch.sites import AttentionSite

SUPPORTED_KINDS = ("nanogpt", "gpt2_conv1d", "hf")


class QKClip:
    """Applies (mitigation "auto") or advises ("advise") QK-clip after a monitored step,
    counts the clips per head and logs them as Events of kind "qk_clip"."""

    def __init__(self, config: WatchConfig, sites: list[AttentionSite]) -> None:
        if config.qk_clip_threshold is not None:
            for site in sites:
                check_site(site)
        self.config = config
        self.sites = list(sites)
        self.offsets = [sum(s.num_heads for s in self.sites[:i]) for i in range(len(sites))]
        n = sum(s.num_heads for s in self.sites)
        self.clips = torch.zeros(n, dtype=torch.int64)  # applied clips per head

    @property
    def total(self) -> int:
        return int(self.clips.sum())

    def apply(self, step: int, max_logit: torch.Tensor, modes: torch.Tensor) -> list[Event]:
        """max_logit [n]: the step's rank-reduced max logit per head (identical on every
        rank, so is every factor). modes [n]: the heads' modes, for the events."""
        cfg = self.config
        tau, alpha = cfg.qk_clip_threshold, cfg.qk_clip_alpha
        if tau is None or cfg.mitigation == "off":
            return []
        apply = cfg.mitigation == "auto"
        eta = clip_factors(max_logit, tau)
        events = []
        for site, off in zip(self.sites, self.offsets, strict=True):
            e = eta[off:off + site.num_heads]
            if bool((e == 1).all()):
                continue
            if apply:
                scale_site(site, e, alpha)
            eta_k = kv_factors(e, site.num_kv_heads)
            group = site.num_heads // site.num_kv_heads
            for h in (e < 1).nonzero().flatten().tolist():
                mode = Mode(int(modes[off + h]))
                k_text = f"W^K × {_g(eta_k[h // group] ** (1 - alpha))}"
                if group > 1:
                    k_text += f" (K head {h // group} shared: its group's smallest η " \
                              f"{_g(eta_k[h // group])})"
                events.append(Event(
                    step=step, layer=site.name, head=h, from_mode=mode, to_mode=mode,
                    reason=(f"[qk_clip] max logit {_g(max_logit[off + h])} > τ {_g(tau)}: "
                            f"η = {_g(e[h])}, W^Q × η^{_g(alpha)} = {_g(e[h] ** alpha)}, "
                            f"{k_text}"),
                    applied=apply, kind="qk_clip"))
            if apply:
                self.clips[off:off + site.num_heads] += (e < 1).long()
        return events

    def state_dict(self) -> dict:
        return {"clips": self.clips.clone()}

    def load_state_dict(self, sd: dict) -> None:
        clips = sd.get("clips")
        if not isinstance(clips, torch.Tensor) or clips.shape != self.clips.shape:
            raise ValueError(f"QK-clip state must hold 'clips', an int64 tensor "
                             f"[{self.clips.numel()}], got {clips!r:.80}")
        self.clips = clips.to("cpu", torch.int64).clone()


def _g(x) -> str:
    return f"{float(x):.3g}"


def clip_factors(max_logit: torch.Tensor, tau: float) -> torch.Tensor:
    """η per head: τ / max logit where the max logit exceeds τ, else 1 (NaN and ±inf
    give 1: an unmeasured head is left alone, and an infinite logit would zero it)."""
    m = max_logit.detach().to("cpu", torch.float64)
    over = torch.isfinite(m) & (m > tau)
    return torch.where(over, tau / torch.where(over, m, 1.0), 1.0)


def kv_factors(eta: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The smallest η of each group of query heads sharing a K head ([Hkv]); query head
    h uses K head h // (H / Hkv), as repeat_interleave does."""
    return eta.view(num_kv_heads, -1).amin(1)


def check_site(site: AttentionSite) -> None:
    """Raise ValueError when QK-clip cannot scale this site's K weight."""
    if site.kind not in SUPPORTED_KINDS:
        raise ValueError(
            f"qk_clip_threshold is set but site {site.name!r} is {site.kind!r}: QK-clip "
            f"knows the K weight of {SUPPORTED_KINDS} layouts only; leave qk_clip_threshold "
            "None or watch only supported layers"
        )


def scale_site(site: AttentionSite, eta: torch.Tensor, alpha: float) -> None:
    """Scale the site's W^Q and W^K channels (and biases) in place for per-head η [H]."""
    H, Hkv, D = site.num_heads, site.num_kv_heads, site.head_dim
    q_rows = (eta ** alpha).repeat_interleave(D)  # [H * D], head-major channels
    k_rows = (kv_factors(eta, Hkv) ** (1 - alpha)).repeat_interleave(D)  # [Hkv * D]
    parent = site.module
    if site.kind == "hf":
        _scale(parent.q_proj, 0, q_rows)
        _scale(parent.k_proj, 0, k_rows)
    else:  # fused [q | k | v] in c_attn, nn.Linear or Conv1D
        _scale(parent.c_attn, 0, q_rows)
        _scale(parent.c_attn, H * D, k_rows)


def _scale(proj: nn.Module, start: int, factors: torch.Tensor) -> None:
    """Multiply output channels [start, start + len(factors)) of a Linear/Conv1D (weight
    and bias) by `factors`. Conv1D stores its weight [in, out]: channels are columns."""
    out_dim = 1 if type(proj).__name__ == "Conv1D" else 0
    _mul_channels(proj.weight, out_dim, start, factors)
    if getattr(proj, "bias", None) is not None:
        _mul_channels(proj.bias, 0, start, factors)


@torch.no_grad()
def _mul_channels(param: torch.Tensor, dim: int, start: int, factors: torch.Tensor) -> None:
    """param[..., start + i, ...] *= factors[i] along `dim`, on the local shard of a
    DTensor (its global offset along `dim` decides which factors it owns)."""
    local, offset, size = param, 0, param.shape[dim]
    if is_dtensor(param):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements)
        local, offset, size = param._local_tensor, offsets[dim], shape[dim]
    lo, hi = max(start, offset), min(start + len(factors), offset + size)
    if lo >= hi:
        return  # this rank holds none of these channels
    f = factors[lo - start:hi - start]
    if bool((f == 1).all()):
        return  # heads under τ stay bit-for-bit as they are
    view = [1] * local.dim()
    view[dim] = hi - lo
    # In the weight's dtype, as the optimizer's own update is; one rounding per element.
    local.narrow(dim, lo - offset, hi - lo).mul_(f.to(local.device, local.dtype).view(view))

