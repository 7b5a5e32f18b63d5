"""Discovery: the attention layers of a model, recognised by the names of a module's
direct children (the layouts are listed in flashwatch/sites/site.py's docstring; their Q and
K channels in flashwatch/sites/layouts.py). `discover(model)` is `find_sites(model)` without
the checks that follow it there."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flashwatch.sites import layouts, megatron, olmo_core, torchtitan
from flashwatch.sites.site import AttentionSite
from flashwatch.sites.weights import local_rows, local_rows_at, rows_at, rows_of, tensor_parallel

# Where head counts live, in the order they are tried: on the module first, then on its
# `config`. The module wins because under tensor parallelism it holds the local (sharded)
# count while the config holds the global one.
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
HEAD_DIM_ATTRS = ("head_dim",)
# Direct children that are separate Q, K, V projections: most HF models, BERT/RoBERTa/ViT
# (query, key, value), T5 (q, k, v), torchtitan's Llama (wq, wk, wv with n_heads,
# n_kv_heads, head_dim on the module).
QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"),
             ("wq", "wk", "wv"))
# The trainers' own layouts, each declared in its module of flashwatch/sites/, tried
# before the generic ones above.
TRAINER_LAYOUTS = torchtitan.LAYOUTS + olmo_core.LAYOUTS + megatron.LAYOUTS


class NoAttentionLayers(ValueError):
    """Discovery found no attention layer in the model (or in this rank's part of it: a
    pipeline stage that holds only embeddings or the LM head)."""


def discover(model: nn.Module) -> list[AttentionSite]:
    found: list[AttentionSite] = []
    claimed: set[int] = set()  # ids of modules inside a found site
    rejected: list[str] = []  # near misses, named in the error if nothing is found
    searched = 0
    fsdp = _under_fsdp(model)
    for name, module in model.named_modules():  # pre-order: parents before children
        if id(module) in claimed:
            continue
        searched += 1
        site = _match(name, module, rejected, fsdp)
        if site is not None:
            found.append(site)
            claimed.update(id(m) for m in module.modules())
    if not found:
        raise NoAttentionLayers(_nothing_found(model, searched, rejected))
    return found


def _under_fsdp(model: nn.Module) -> set[int]:
    """ids of the modules inside (or being) an FSDP2 fully_shard module, whose DTensor
    weights are FSDP2's shards, not tensor parallelism's."""
    out: set[int] = set()
    for m in model.modules():
        if id(m) not in out and any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
            out.update(id(x) for x in m.modules())
    return out


def _match(name: str, module: nn.Module, rejected: list[str],
           fsdp: set[int] = frozenset()) -> AttentionSite | None:
    children = module._modules  # direct children only: a block is not its attention
    where = f"module {name or '<root>'!r} ({type(module).__name__})"
    for trainer in TRAINER_LAYOUTS:
        holder = trainer.projections(module)
        if holder is None:
            continue
        if trainer.fused is not None:
            return _match_fused(name, module, trainer.fused, where, rejected,
                                holder=holder, trainer=trainer,
                                under_fsdp=id(holder._modules[trainer.fused]) in fsdp)
        projs = [holder._modules[p] for p in trainer.separate]
        return _match_separate(name, module, trainer.separate, projs, where, rejected,
                               id(projs[0]) in fsdp, trainer)
    if children.get("c_attn") is not None:
        return _match_c_attn(name, module, where, rejected)
    for key in ("query_key_value", "qkv_proj"):
        if isinstance(children.get(key), nn.Linear):
            return _match_fused(name, module, key, where, rejected)
    for names in QKV_NAMES:
        projs = [children.get(p) for p in names]
        if any(p is not None for p in projs):
            return _match_separate(name, module, names, projs, where, rejected,
                                   id(projs[0]) in fsdp)
    return None


def _match_c_attn(name, module, where, rejected) -> AttentionSite | None:
    c_attn = module._modules["c_attn"]
    is_conv1d = type(c_attn).__name__ == "Conv1D"
    if isinstance(c_attn, nn.Linear):
        C, out = c_attn.in_features, c_attn.out_features
    elif is_conv1d and getattr(c_attn, "weight", None) is not None and c_attn.weight.dim() == 2:
        C, out = c_attn.weight.shape  # Conv1D stores [in, out]
    else:
        rejected.append(f"{where}: c_attn is {type(c_attn).__name__}, not nn.Linear or "
                        "Conv1D")
        return None
    if out != 3 * C:
        rejected.append(f"{where}: c_attn maps {C} -> {out} channels, expected 3*{C} = "
                        f"{3 * C} (fused q, k, v of equal width)")
        return None
    H = _lookup_int(module, HEAD_ATTRS)
    if H is None:
        raise ValueError(_no_heads(where, "c_attn", module))
    if C % H != 0:
        raise ValueError(f"{where}: width {C} is not a multiple of its head count {H}; "
                         "pass this site explicitly with sites=")
    return AttentionSite(
        name=name, module=module, num_heads=H, num_kv_heads=H, head_dim=C // H,
        d_model=C, q_module=c_attn, kind="gpt2_conv1d" if is_conv1d else "nanogpt",
        q_slice_of_output=(0, C), wq_source=rows_of(c_attn, 0, C),
        k_module=c_attn, k_index=torch.arange(C, 2 * C),
    )


def _match_fused(name, module, key, where, rejected, holder=None, trainer=None,
                 under_fsdp=False) -> AttentionSite | None:
    """One Linear computing q, k and v: GPT-NeoX/Pythia, Bloom, Falcon
    (`query_key_value`), Phi-3 (`qkv_proj`, [Q | K | V] with grouped K, V), and the
    trainers' fused projections (`trainer`: torchtitan's `wqkv`, Megatron's `linear_qkv`,
    per K/V group) in `holder` (the module itself unless the trainer nests them)."""
    qkv = (module if holder is None else holder)._modules[key]
    if not isinstance(qkv, nn.Linear):
        rejected.append(f"{where}: its fused `{key}` is {type(qkv).__name__}, not nn.Linear")
        return None
    if trainer is not None and trainer.heads is not None:
        H, Hkv, D = trainer.heads(module)
    else:
        H, Hkv = _lookup_int(module, HEAD_ATTRS), _lookup_int(module, KV_HEAD_ATTRS)
        D = _lookup_int(module, HEAD_DIM_ATTRS)
    if H is None:
        raise ValueError(_no_heads(where, key, module))
    if trainer is not None:
        layout, Hkv = trainer.fused_layout, Hkv or H
        D = D or qkv.in_features // H
        if qkv.out_features != (H + 2 * Hkv) * D:  # the global width, even under TP
            rejected.append(f"{where}: {trainer.trainer}'s `{key}` has {qkv.out_features} "
                            f"outputs, expected (H + 2·Hkv)·D = {(H + 2 * Hkv) * D} for "
                            f"H={H}, Hkv={Hkv}, D={D}")
            return None
        tp = _tensor_parallel(qkv, under_fsdp, trainer)
        if tp is not None:
            return _match_fused_tensor_parallel(name, module, qkv, layout, H, Hkv, D, tp,
                                                where)
    elif key == "query_key_value":
        found = layouts.fused_layout(module, qkv, H, Hkv)
        if isinstance(found, str):
            rejected.append(f"{where}: {found}")
            return None
        layout, Hkv, D = found
    else:
        D = D or qkv.in_features // H
        Hkv = Hkv or H
        layout = "q"
        if qkv.out_features != (H + 2 * Hkv) * D:
            rejected.append(f"{where}: qkv_proj has {qkv.out_features} outputs, expected "
                            f"[Q | K | V] = (H + 2·Hkv)·D = {(H + 2 * Hkv) * D}")
            return None
    q_idx = layouts.q_index(layout, H, Hkv, D)
    k_idx = layouts.k_index(layout, H, Hkv, D)
    return AttentionSite(
        name=name, module=module, num_heads=H, num_kv_heads=Hkv, head_dim=D,
        d_model=qkv.in_features, q_module=qkv, kind="fused_qkv",
        q_slice_of_output=None, wq_source=rows_at(qkv, q_idx), q_index=q_idx,
        layout=layout, k_module=qkv, k_index=k_idx,
    )


def _tensor_parallel(linear, under_fsdp, trainer=None) -> tuple[int, int] | None:
    """(rank, size) when tensor parallelism split `linear` on dim 0: a DTensor weight
    (weights.tensor_parallel), or the trainer's own split of plain weights."""
    tp = tensor_parallel(linear, under_fsdp)
    if tp is None and trainer is not None and trainer.tensor_parallel is not None:
        tp = trainer.tensor_parallel(linear)
    return tp


def _match_separate(name, module, names, projs, where, rejected, under_fsdp=False,
                    trainer=None) -> AttentionSite | None:
    """Separate Q, K, V Linears (HF q_proj/k_proj/v_proj, BERT's query/key/value, T5's
    q/k/v); q_proj with 2·H·D outputs is Qwen3-Next's gated [q_h | gate_h] per head."""
    if not all(isinstance(p, nn.Linear) for p in projs):
        kinds = ", ".join(f"{n}={type(p).__name__}" for n, p in zip(names, projs, strict=True))
        rejected.append(f"{where}: needs {', '.join(names)} all nn.Linear, has {kinds}")
        return None
    q_proj, k_proj, v_proj = projs
    cp = None if trainer is None or trainer.context_parallel is None else \
        trainer.context_parallel(module)
    if cp is not None:
        return _match_context_parallel(name, module, names, projs, where, cp)
    tp = _tensor_parallel(q_proj, under_fsdp, trainer)
    if tp is not None:
        _tensor_parallel(k_proj, under_fsdp, trainer)  # its local rows are QK-clip's K
        return _match_tensor_parallel(name, module, names, projs, where, tp)
    H = _lookup_int(module, HEAD_ATTRS)
    D = _lookup_int(module, HEAD_DIM_ATTRS)
    if H is None and D is not None and q_proj.out_features % D == 0:
        H = q_proj.out_features // D
    if H is None:
        raise ValueError(_no_heads(where, names[0], module))
    if D is None:
        D = q_proj.out_features // H
    Hkv = _lookup_int(module, KV_HEAD_ATTRS)
    if Hkv is None:
        Hkv = k_proj.out_features // D
    gated = q_proj.out_features == 2 * H * D
    if ((q_proj.out_features != H * D and not gated) or k_proj.out_features != Hkv * D
            or v_proj.out_features != Hkv * D or H % Hkv != 0):
        raise ValueError(
            f"{where}: head counts do not fit the projections: num_heads={H}, "
            f"num_kv_heads={Hkv}, head_dim={D}, but {names[0]} has {q_proj.out_features} "
            f"outputs, {names[1]} {k_proj.out_features}, {names[2]} {v_proj.out_features}; "
            "pass this site explicitly with sites={name: dict(num_heads=..., "
            f"num_kv_heads=..., head_dim=..., q_module={names[0]!r})}}"
        )
    layout = "per_head_q_gate" if gated else "q"
    q_idx = layouts.q_index(layout, H, Hkv, D)
    return AttentionSite(
        name=name, module=module, num_heads=H, num_kv_heads=Hkv, head_dim=D,
        d_model=q_proj.in_features, q_module=q_proj, kind="gated_q" if gated else "hf",
        q_slice_of_output=None, wq_source=rows_at(q_proj, q_idx), q_index=q_idx,
        layout=layout, k_module=k_proj, k_index=torch.arange(Hkv * D),
    )


def _match_tensor_parallel(name, module, names, projs, where, tp) -> AttentionSite:
    """Q, K, V Linears split by ColwiseParallel (torchtitan's and PyTorch's TP plans, HF
    tp_plan): this rank's site holds its whole local heads, global heads
    [rank · H_local, (rank + 1) · H_local). The module's head count may be the global or
    the local one (both styles exist): the channel width decides, with head_dim."""
    q_proj, k_proj, v_proj = projs
    rank, size = tp
    H_attr, D = _lookup_int(module, HEAD_ATTRS), _lookup_int(module, HEAD_DIM_ATTRS)
    channels = q_proj.out_features  # the global width (the Linear's own attribute)
    if D is None and H_attr is not None:
        D = channels // H_attr if channels % H_attr == 0 else None
    if D is None or channels % D or k_proj.out_features % D:
        raise ValueError(f"{where}: tensor-parallel {names[0]} ({channels} outputs over "
                         f"{size} ranks) needs the module's head_dim or head count; pass "
                         f"this site explicitly with sites={{name: dict(num_heads=..., "
                         f"head_dim=...)}}")
    H, Hkv = channels // D, k_proj.out_features // D
    if H % size or Hkv % size:
        raise ValueError(f"{where}: {H} query and {Hkv} key/value heads do not split into "
                         f"whole heads over {size} tensor-parallel ranks")
    h, hkv = H // size, Hkv // size
    return AttentionSite(
        name=name, module=module, num_heads=h, num_kv_heads=hkv, head_dim=D,
        d_model=q_proj.in_features, q_module=q_proj, kind="hf", q_slice_of_output=(0, h * D),
        wq_source=local_rows(q_proj, h * D), layout="q", k_module=k_proj,
        k_index=torch.arange(hkv * D), global_heads=H, head_offset=rank * h,
        channel_offsets=(rank * h * D, rank * hkv * D))


def _match_context_parallel(name, module, names, projs, where, cp) -> AttentionSite:
    """Separate Q, K, V Linears, whole on every rank, of an attention module whose heads
    context parallelism splits over ranks (Ulysses): this rank's site holds head chunk
    `rank` ([rank · H/size, ...) and their K/V heads), its W^Q rows of the whole weight.
    No K for QK-clip: W^Q and W^K are replicas on every rank, which a clip of this
    rank's heads alone would make differ."""
    q_proj, k_proj, _ = projs
    rank, size = cp
    H, D = _lookup_int(module, HEAD_ATTRS), _lookup_int(module, HEAD_DIM_ATTRS)
    if H is None:
        raise ValueError(_no_heads(where, names[0], module))
    D = D or q_proj.out_features // H
    Hkv = _lookup_int(module, KV_HEAD_ATTRS) or k_proj.out_features // D
    if H % size or Hkv % size:
        raise ValueError(f"{where}: {H} query and {Hkv} key/value heads do not split into "
                         f"whole heads over {size} context-parallel ranks")
    h, hkv = H // size, Hkv // size
    first = rank * h * D
    return AttentionSite(
        name=name, module=module, num_heads=h, num_kv_heads=hkv, head_dim=D,
        d_model=q_proj.in_features, q_module=q_proj, kind="hf",
        q_slice_of_output=(first, first + h * D), wq_source=rows_of(q_proj, first, first + h * D),
        layout="q", k_module=None, k_index=None, global_heads=H, head_offset=rank * h)


def _match_fused_tensor_parallel(name, module, qkv, layout, H, Hkv, D, tp, where
                                 ) -> AttentionSite:
    """A per-group fused projection split by ColwiseParallel (Megatron's linear_qkv and
    torchtitan's wqkv under their TP plans): its rows are whole K/V groups, so this rank
    holds groups [rank · Hkv/size, ...) with their query heads, in the same layout."""
    rank, size = tp
    if Hkv % size:
        raise ValueError(f"{where}: {Hkv} K/V groups of its fused projection do not split "
                         f"into whole groups over {size} tensor-parallel ranks")
    h, hkv = H // size, Hkv // size
    q_idx, k_idx = layouts.q_index(layout, h, hkv, D), layouts.k_index(layout, h, hkv, D)
    first = rank * (h + 2 * hkv) * D  # the global channel of this rank's first row
    return AttentionSite(
        name=name, module=module, num_heads=h, num_kv_heads=hkv, head_dim=D,
        d_model=qkv.in_features, q_module=qkv, kind="fused_qkv", q_slice_of_output=None,
        wq_source=local_rows_at(qkv, q_idx), q_index=q_idx, layout=layout, k_module=qkv,
        k_index=k_idx, global_heads=H, head_offset=rank * h, channel_offsets=(first, first))


def split_by_tensor_parallelism(site: AttentionSite) -> AttentionSite | str:
    """`site`, found whole, after torch's `parallelize_module` split its Q, K, V Linears
    on this rank (flashwatch.watch, then parallelize_module: the watcher attached in the
    model's constructor, before the training script parallelizes it): the site of this
    rank's heads, at their global indices, as discovery finds it on a model attached
    after parallelize_module; or why not (a str). Local: no collective, so it may run
    inside the forward on whichever rank sees it first."""
    if site.global_heads is not None:
        return "it was already split"
    try:  # discovery's own matcher, as on a model attached after parallelize_module
        new = _match(site.name, site.module, [])
    except ValueError as e:
        return str(e)
    if new is None or new.global_heads is None:
        return ("its Q, K, V projections are not split on dim 0 into whole heads (separate "
                "Linears, or a fused projection laid out per K/V group)")
    if new.global_heads != site.num_heads or new.head_dim != site.head_dim:
        return (f"its split does not keep its {site.num_heads} heads of width "
                f"{site.head_dim} whole")
    return new


def _lookup_int(module: nn.Module, attrs: Sequence[str]) -> int | None:
    """First positive int among module.<attr>, then module.config.<attr>."""
    holders = [module]
    config = getattr(module, "config", None)
    if config is not None:
        holders.append(config)
    for holder in holders:
        for attr in attrs:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _no_heads(where: str, proj: str, module: nn.Module) -> str:
    return (
        f"{where} has an attention projection `{proj}` but no head count: looked for "
        f"{', '.join(HEAD_ATTRS)} (and {', '.join(HEAD_DIM_ATTRS)}) on the module and on its "
        "`config`. Set one of them, or pass the site explicitly: "
        "find_sites(model, sites={name: dict(num_heads=..., q_module=...)})"
    )


def _nothing_found(model: nn.Module, searched: int, rejected: list[str]) -> str:
    lines = [
        f"found no attention layers in {type(model).__name__} ({searched} modules searched). "
        "flashwatch looks for modules with these direct children:",
        "  - nanoGPT: `c_attn` = nn.Linear(C, 3C) (fused q, k, v) and a head count",
        "  - Hugging Face: `q_proj`, `k_proj`, `v_proj` = nn.Linear, head count on the module "
        "or its `config`",
        "  - GPT-2 (transformers): `c_attn` = Conv1D with weight [C, 3C] and a head count",
        f"  head count attributes: {', '.join(HEAD_ATTRS + KV_HEAD_ATTRS + HEAD_DIM_ATTRS)}",
    ]
    if rejected:
        lines.append("Close matches that were rejected:")
        lines.extend(f"  - {r}" for r in rejected[:10])
    lines.append(
        "Pass the attention modules explicitly, e.g. sites={'blocks.0.attn': "
        "dict(num_heads=8, q_module='qkv')} (q_module: the Q projection, relative to the "
        "attention module; fused [q | k | v] works), or a list of "
        "flashwatch.make_site(...)"
    )
    return "\n".join(lines)
