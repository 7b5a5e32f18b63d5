"""OLMo-core 3's attention (olmo_core/nn/attention `Attention`): Linears `w_q`, `w_k`,
`w_v` (and `w_out`) on the module, heads in n_heads, n_kv_heads, head_dim; the call is
the module's own (its attention backend calls SDPA on the torch backend). QK-norm:
`q_norm`/`k_norm` over the whole width (applied before the head split) or per head
(`use_head_qk_norm`, after it); flashwatch/sites/layouts.py's QCheck reads either.

Tensor parallelism (`apply_tp`: ColwiseParallel w_q/w_k/w_v) is discovery's DTensor
case. Ulysses context parallelism (`apply_cp(uly=...)`: the backend's `cp_pg` and
`uly` set) exchanges heads all-to-all (olmo_core/distributed/parallel/context_parallel.py
all_to_all_single_cp2hp: [B, T/CP, H, D] -> [B, T, H/CP, D], rank r receiving head
chunk r): each rank measures its H/CP heads over the whole sequence, placed like TP's,
while W^Q and W^K stay whole on every rank."""

import torch.distributed as dist
from torch import nn

from flashwatch.sites.layouts import TrainerLayout


def ulysses(module: nn.Module) -> tuple[int, int] | None:
    """(CP rank, CP size) when Ulysses context parallelism splits `module`'s heads."""
    backend = getattr(module, "backend", None)
    pg, uly = getattr(backend, "cp_pg", None), getattr(backend, "uly", None)
    if pg is None or uly is None or not dist.is_initialized():
        return None
    size = dist.get_world_size(pg)
    return (dist.get_rank(pg), size) if size > 1 else None


LAYOUTS = (TrainerLayout(trainer="OLMo-core", separate=("w_q", "w_k", "w_v"),
                         context_parallel=ulysses),)
