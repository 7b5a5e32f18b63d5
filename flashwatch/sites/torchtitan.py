"""torchtitan 0.3's attention (torchtitan/models/common/attention.py `GQAttention`): the
projections sit one level down, in `qkv_linear`, and the attention call is made by the
sibling `inner_attention` (SDPA, FlexAttention or varlen), so the site is the attention
module itself, e.g. "layers.0.attention". Heads: n_heads, n_kv_heads, head_dim on it.

- `fuse_qkv=True` (the default since 0.3): one Linear `qkv_linear.wqkv`, rows
  [n_kv_heads, heads_per_kv + 2, head_dim]: per K/V group its query heads, then k, then
  v — the "per_group_qkv" layout (flashwatch/sites/layouts.py).
- `fuse_qkv=False`: `qkv_linear.wq`, `wk`, `wv`.
Older torchtitan (wq, wk, wv directly on the attention module) is discovery's generic
separate-projection layout.

Tensor parallelism: with parallelism.spmd_backend "partial_dtensor" or "full_dtensor"
the projections' weights are DTensors (discovery reads their placements); with the
default "spmd_types" they are plain tensors holding this rank's rows, the split declared
only in the Linear's `_sharding_config` (TP: Shard(0) on the weight). Its TP rank is
then the global rank modulo the TP size: ParallelDims.build_mesh puts "tp" innermost
in every mesh it builds (["pp", "dp", "cp", "tp"] and the others).
"""

import torch.distributed as dist
from torch import nn

from flashwatch.sites.layouts import TrainerLayout
from flashwatch.sites.weights import mark_tensor_parallel


def declares_tensor_parallel(linear: nn.Module) -> bool:
    """torchtitan's ShardingConfig on `linear` shards its weight on dim 0 over "tp"
    (ColwiseParallel), whichever backend applied it."""
    config = getattr(linear, "_sharding_config", None)
    layout = getattr(config, "state_shardings", None) or {}
    axes = getattr(layout.get("weight"), "axis_types", None) or {}
    tp = {str(getattr(k, "value", k)): v for k, v in axes.items()}.get("tp")
    return getattr(tp, "dim", None) == 0


def declared_tp_size(linear: nn.Module) -> int | None:
    """The TP size of a Linear whose DTensor weight torchtitan split as it declares: its
    mesh's "tp" dim; None where it declares no TP, or TP of 1 — torchtitan's trainer
    declares the split whatever the TP degree, and an FSDP-only weight sits on a
    ("dp_shard",) mesh: read as TP of that size, every σ and δ share was NaN."""
    w = getattr(linear, "weight", None)
    names = getattr(getattr(w, "device_mesh", None), "mesh_dim_names", None) or ()
    if not declares_tensor_parallel(linear) or "tp" not in names:
        return None
    size = w.device_mesh.size(names.index("tp"))
    return size if size > 1 else None


def spmd_tensor_parallel(linear: nn.Module) -> tuple[int, int] | None:
    """(TP rank, TP size) of a Linear split on dim 0 by the spmd_types backend, else None."""
    w = getattr(linear, "weight", None)
    out = getattr(linear, "out_features", None)
    if (w is None or callable(getattr(w, "to_local", None)) or not isinstance(out, int)
            or not declares_tensor_parallel(linear) or not dist.is_available()
            or not dist.is_initialized()):
        return None
    rows = w.shape[0]
    if rows >= out or out % rows:
        return None
    size = out // rows
    mark_tensor_parallel(linear)
    return dist.get_rank() % size, size


FUSED = TrainerLayout(trainer="torchtitan", holder="qkv_linear", requires=("inner_attention",),
                      fused="wqkv", fused_layout="per_group_qkv",
                      tensor_parallel=spmd_tensor_parallel,
                      dtensor_tensor_parallel=declared_tp_size)
SEPARATE = TrainerLayout(trainer="torchtitan", holder="qkv_linear",
                         requires=("inner_attention",), separate=("wq", "wk", "wv"),
                         tensor_parallel=spmd_tensor_parallel,
                         dtensor_tensor_parallel=declared_tp_size)
LAYOUTS = (FUSED, SEPARATE)
