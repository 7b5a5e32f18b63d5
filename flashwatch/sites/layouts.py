"""Where W^Q sits in a fused or gated projection's output, and a check against the q the
layer actually hands its attention call.

A site's Q channels are `q_index` ([H * head_dim] int64, head-major: channel
q_index[h * D + i] of the projection's output is dim i of query head h). Layouts of
Hugging Face transformers (modeling_*.py, v5):

  "q"             [Q] or [Q | K | V], Q first and contiguous: q_proj, nanoGPT c_attn,
                  GPT-2 Conv1D c_attn, Phi-3 qkv_proj ([Q | K | V] with GQA widths),
                  Falcon multi_query ([Q | K | V], one K/V head).
  "per_head_qkv"  GPT-NeoX/Pythia, Bloom, Falcon (classic): view(..., H, 3, D), so head h
                  owns rows [3Dh, 3Dh + 3D) = [q_h | k_h | v_h].
  "per_group_qkv" Falcon new_decoder_architecture: view(..., Hkv, H/Hkv + 2, D), each
                  K/V group [q_g0 .. q_g(r-1) | k_g | v_g], query head h = g·r + j.
  "per_head_q_gate"  Qwen3-Next gated attention: q_proj has 2·H·D outputs, view(..., H,
                  2D).chunk(2): head h owns [q_h | gate_h].

`QCheck` compares, once per site, the Q channels of the projection's output with the q
that reaches SDPA, so a wrong slice of an explicit site is refused with its layer name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flashwatch.sites.weights import autocast_off, plain_call

LAYOUTS = ("q", "per_head_qkv", "per_group_qkv", "per_head_q_gate")
# Children holding a norm applied to q (QK-norm): Qwen3, Gemma3, OLMo2, Qwen3-Next
# (q_norm), Cohere/StableLM/Persimmon style (q_layernorm, query_layernorm).
Q_NORM_NAMES = ("q_norm", "q_layernorm", "query_layernorm", "q_ln", "norm_q")
K_NORM_NAMES = ("k_norm", "k_layernorm", "key_layernorm", "k_ln", "norm_k")
# Relative error allowed between the projection's Q channels and the q at SDPA. BF16
# rounding of either is ≈ 2^-8 = 0.004 per element; a wrong slice (K or V or gate rows,
# another head) gives unrelated numbers: per-position norm ratios of two independent
# projections vary by ≈ 1/sqrt(2·D) ≈ 0.18 at D = 16.
QCHECK_RTOL = 0.05
QCHECK_ROWS = 64  # positions of batch element 0 compared (all of them up to this)


def q_index(layout: str, num_heads: int, num_kv_heads: int, head_dim: int,
            start: int = 0) -> torch.Tensor:
    """The Q channels of a projection's output for `layout` (module docstring), [H * D]
    int64, head-major. start: offset of the first Q channel, layout "q" only."""
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    heads = torch.arange(H)
    if layout == "q":
        first = start + heads * D
    elif layout == "per_head_qkv":
        first = heads * 3 * D
    elif layout == "per_group_qkv":
        r = H // Hkv
        first = (heads // r) * (r + 2) * D + (heads % r) * D
    elif layout == "per_head_q_gate":
        first = heads * 2 * D
    else:
        raise ValueError(f"q_layout must be one of {LAYOUTS}, got {layout!r}")
    return (first[:, None] + torch.arange(D)).flatten()


def k_index(layout: str, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The K channels of a fused q, k, v projection's output for `layout`, [Hkv * D]
    int64, head-major ("q": [Q | K | V], K right after the H·D Q channels)."""
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    heads = torch.arange(Hkv)
    if layout == "q":
        first = H * D + heads * D
    elif layout == "per_head_qkv":
        first = heads * 3 * D + D
    elif layout == "per_group_qkv":
        r = H // Hkv
        first = heads * (r + 2) * D + r * D
    else:
        raise ValueError(f"layout {layout!r} has no K channels (fused q, k, v layouts: "
                         f"'q', 'per_head_qkv', 'per_group_qkv')")
    return (first[:, None] + torch.arange(D)).flatten()


def fused_layout(module: nn.Module, qkv: nn.Linear, H: int, Hkv: int | None
                 ) -> tuple[str, int, int] | str:
    """(layout, num_kv_heads, head_dim) of a `query_key_value` Linear, by the attention
    class that owns it, or the reason it is refused (a str)."""
    cls = type(module).__name__
    out = qkv.out_features
    if cls.startswith(("GPTNeoX", "Bloom")) and not cls.startswith("GPTNeoXJapanese"):
        if out % (3 * H):
            return f"query_key_value has {out} outputs, not a multiple of 3 × {H} heads"
        return "per_head_qkv", H, out // (3 * H)
    if cls.startswith("Falcon"):
        D = getattr(module, "head_dim", None)
        if not isinstance(D, int):
            return "FalconAttention without an int head_dim"
        if getattr(module, "new_decoder_architecture", False):
            Hkv = getattr(module, "num_kv_heads", Hkv)
            return ("per_group_qkv", Hkv, D) if out == (H + 2 * Hkv) * D else (
                f"query_key_value has {out} outputs, expected (H + 2·Hkv)·D = {(H + 2 * Hkv) * D}")
        if getattr(module, "multi_query", False):
            return ("q", 1, D) if out == (H + 2) * D else (
                f"query_key_value has {out} outputs, expected (H + 2)·D = {(H + 2) * D}")
        return ("per_head_qkv", H, D) if out == 3 * H * D else (
            f"query_key_value has {out} outputs, expected 3·H·D = {3 * H * D}")
    return (f"its fused `query_key_value` ({qkv.in_features} -> {out}) belongs to {cls}, "
            "whose row layout flashwatch does not know (GPT-NeoX, Bloom and Falcon it "
            "does); pass the site with sites={name: dict(num_heads=..., "
            "q_module='query_key_value', q_layout=...)}, q_layout one of "
            f"{LAYOUTS}")


def known_layout(module: nn.Module, q_module: nn.Module | None, num_heads: int,
                 num_kv_heads: int, head_dim: int) -> str | None:
    """The layout discovery would give q_module as the site `module`'s projection, when
    it agrees with these head counts (an explicit site's default); else None."""
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    if not isinstance(q_module, nn.Linear):
        return None
    if q_module is module._modules.get("query_key_value"):
        found = fused_layout(module, q_module, H, Hkv)
        return found[0] if not isinstance(found, str) and found[1:] == (Hkv, D) else None
    if q_module is module._modules.get("q_proj") and q_module.out_features == 2 * H * D:
        return "per_head_q_gate"
    return None


def child(module: nn.Module, names) -> nn.Module | None:
    """The first direct child of `module` named in `names`."""
    for n in names:
        m = module._modules.get(n)
        if m is not None:
            return m
    return None


class QCheck:
    """One check per site: the Q channels (site.q_index) of q_module(X) against the query
    the layer hands SDPA, X being q_module's input of the same call.

    Rotary embeddings rotate each head's q per position, and some layers pre-scale q by
    a constant: both keep ‖q_h[t]‖ up to one global factor, so without a QK-norm the
    check compares per (position, head) norms after fitting that factor. A QK-norm
    (child named in Q_NORM_NAMES) makes every norm equal, so its input is compared
    instead, elementwise: `arm()` hooks the norm to keep its input. Calls whose q and X
    do not line up (a KV-cached decode call, another batch) are left for the next one.
    """

    def __init__(self, site) -> None:
        self.site = site
        self.norm = child(site.module, Q_NORM_NAMES)
        self.pre: torch.Tensor | None = None  # the norm's input of the last call
        self.done = False  # checked and passed
        self.failed = False  # checked and refused (raised once; never checked again)

    def arm(self) -> list:
        """Hooks to remove after the check (a forward pre-hook on the q norm, if any)."""
        if self.norm is None or self.done or self.failed:
            return []

        def keep(module, args):
            if args and isinstance(args[0], torch.Tensor):
                self.pre = args[0].detach()
        return [self.norm.register_forward_pre_hook(keep)]

    @torch.no_grad()
    def __call__(self, x: torch.Tensor | None, q: torch.Tensor) -> bool:
        """True once checked; False when this call cannot be checked (no X, shapes that
        do not line up); RuntimeError naming the layer and layout when Q does not match."""
        site = self.site
        if self.done or self.failed or x is None or site.q_index is None or q.dim() != 4:
            return self.done
        B, H, N, D = q.shape
        if x.dim() != 3 or x.shape[:2] != (B, N) or (H, D) != (site.num_heads, site.head_dim):
            return False
        n = min(N, QCHECK_ROWS)
        with autocast_off(x.device.type):
            # .forward, not __call__: no hooks, so the watcher's own X hook keeps the
            # layer's X (a sharded q_module needs its gathered weights: hooks and all)
            out = _call(site.q_module)(x[:1, :n])
        if not isinstance(out, torch.Tensor):
            return False
        want = out.float().index_select(-1, site.q_index.to(out.device)).view(n, H, D)
        if self.norm is not None:
            pre = self.pre
            if pre is None or pre.numel() != B * N * H * D:
                return False
            # [B, N, H, D] (Qwen3) or [B, N, H·D] (OLMo2), or after the transpose to
            # [B, H, N, D] (Gemma3): the one closer to want (the same when H == N)
            views = [pre.reshape(B, N, H, D)]
            if pre.dim() == 4 and tuple(pre.shape[1:3]) == (H, N):
                views.append(pre.transpose(1, 2))
            err = min((v[0, :n].float() - want).norm() for v in views)
            ref = want.norm()
            what = "the input of its q norm"
        else:
            a, g = want.norm(dim=-1), q[0, :, :n].float().norm(dim=-1).transpose(0, 1)
            s = (a * g).sum() / (a * a).sum().clamp_min(1e-30)  # least-squares factor
            err, ref = (g - s * a).norm(), g.norm()
            what = "the q it hands SDPA (per-position norms, rotary-invariant)"
        if not bool(err <= QCHECK_RTOL * ref):  # `not <=` so that NaN fails too
            self.failed, self.pre = True, None
            given = ("" if site.q_slice_of_output is None
                     else f"q_slice_of_output={tuple(site.q_slice_of_output)}, ")
            raise RuntimeError(
                f"site {site.name!r}: its W^Q slice ({given}{site.layout} layout, "
                f"{site.num_heads} heads × {site.head_dim} of {type(site.q_module).__name__}"
                f"'s outputs) does not give {what}: relative error "
                f"{float(err / ref.clamp_min(1e-30)):.3g} > {QCHECK_RTOL}. The projection's Q "
                f"rows are laid out differently; pass the site with q_layout= one of "
                f"{LAYOUTS} (GPT-NeoX, Bloom: 'per_head_qkv'; Qwen3-Next gated q_proj: "
                f"'per_head_q_gate') or q_channels= the Q output channels, head-major")
        self.done, self.pre = True, None
        return True


def _call(module: nn.Module):
    plain = plain_call(module)
    return module.forward if plain is module else plain


@dataclass(frozen=True)
class TrainerLayout:
    """Where one trainer's attention module keeps its Q, K, V projections, declared by
    that trainer's module (flashwatch/sites/torchtitan.py, olmo_core.py, megatron.py) and
    read by discovery alone: supporting a trainer is one such declaration.

    trainer: its name, for messages. holder: the child holding the projections
      (torchtitan 0.3: `qkv_linear`), None when they are the module's own children.
    requires: children the attention module must also have (torchtitan: the sibling
      `inner_attention` that makes the call), so a bare projection holder is never
      taken for the layer. separate: the Q, K, V Linears' names; fused: the one fused
      Linear's name, its rows in `fused_layout` (LAYOUTS). heads: (H, Hkv, D) read
      from the module when the usual attributes (discovery.HEAD_ATTRS) do not hold them.
      tensor_parallel: (rank, size) of a projection the trainer split by tensor
      parallelism without DTensors (plain local weights), else None.
      context_parallel: (rank, size) of an attention module whose heads the trainer's
      context parallelism hands out over ranks (Ulysses: an all-to-all gives rank r
      head chunk r over the whole sequence; the weights stay whole), else None.
      dtensor_tensor_parallel: the TP size (> 1) of a projection whose DTensor weight
      the trainer split as it declares in its own terms (torchtitan: a ShardingConfig
      and a mesh dim named "tp"), else None.
    """

    trainer: str
    holder: str | None = None
    requires: tuple[str, ...] = ()
    separate: tuple[str, str, str] | None = None
    fused: str | None = None
    fused_layout: str = "q"
    heads: Callable[[nn.Module], tuple[int | None, int | None, int | None]] | None = None
    tensor_parallel: Callable[[nn.Module], tuple[int, int] | None] | None = None
    context_parallel: Callable[[nn.Module], tuple[int, int] | None] | None = None
    dtensor_tensor_parallel: Callable[[nn.Module], int | None] | None = None

    def projections(self, module: nn.Module) -> nn.Module | None:
        """The module holding this layout's projections when `module` is one of this
        trainer's attention modules, else None."""
        if any(module._modules.get(c) is None for c in self.requires):
            return None
        holder = module if self.holder is None else module._modules.get(self.holder)
        if holder is None:
            return None
        names = self.separate or (self.fused,)
        return holder if all(holder._modules.get(n) is not None for n in names) else None
