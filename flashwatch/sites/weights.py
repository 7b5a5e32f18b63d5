"""Reading a q_module's weight: W^Q rows as getters that see every optimizer step
(contiguous runs as views, interleaved layouts gathered), sharded weights gathered, and
q_module called as the checks need it (autocast off, DTensor parameters gathered).

The lowest module of flashwatch/sites/: the site, the layouts and the checks read
weights through it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch import nn


def autocast_off(device_type: str):
    """Autocast off, so q_module runs in its weights' dtype even inside a user's autocast."""
    available = getattr(torch.amp, "is_autocast_available", lambda d: d in ("cpu", "cuda"))
    if available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def gathered(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value as a plain tensor (a collective); other tensors as they are."""
    return t.full_tensor() if callable(getattr(t, "full_tensor", None)) else t


def plain_call(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """module's forward, on gathered copies of its DTensor parameters if it has any:
    outside its FSDP2 forward a sharded module cannot mix them with a plain input. A
    tensor-parallel Linear gives this rank's channels, which its local W^Q rows describe
    (computed from its local shards, without its hooks)."""
    if module in _TP_LINEARS:  # its parameters read at the call (FSDP2 swaps them)
        return lambda x: torch.nn.functional.linear(
            x, tp_local(module.weight), None if module.bias is None else tp_local(module.bias))
    params = dict(module.named_parameters())
    if not any(callable(getattr(p, "full_tensor", None)) for p in params.values()):
        return module
    if isinstance(module, nn.Linear):  # without parallelize_module's hooks, which would
        # make X a DTensor beside the gathered plain weight (a packed [Q | K | V] split
        # by ColwiseParallel with its output gathered: every rank computes every head)
        return lambda x: torch.nn.functional.linear(
            x, gathered(module.weight.detach()),
            None if module.bias is None else gathered(module.bias.detach()))
    plain = {n: gathered(p.detach()) for n, p in params.items()}
    return lambda x: torch.func.functional_call(module, plain, (x,))


def weight_of(q_module: nn.Module) -> torch.Tensor | None:
    """The weight of an nn.Linear or Conv1D in nn.Linear orientation [out, in] (a view)."""
    if isinstance(q_module, nn.Linear):
        return q_module.weight
    if type(q_module).__name__ == "Conv1D":
        return q_module.weight.T  # Conv1D: y = x @ W + b with W [in, out]
    return None


def as_slice(index: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) when `index` is a contiguous ascending run, else None."""
    if index.numel() == 0:
        return None
    start = int(index[0])
    return (start, start + index.numel()) if torch.equal(
        index, torch.arange(start, start + index.numel())) else None


def rows_of(q_module: nn.Module, start: int, stop: int) -> Callable[[], torch.Tensor]:
    """Getter for output channels [start, stop) of a Linear/Conv1D weight as [out, in].

    It reads `q_module.weight` on every call, so a replaced Parameter is seen too. The
    getter carries `rows_of = (q_module, start, stop)`, so the spectral norm of a
    sharded weight can work on each rank's own rows (flashwatch/parallel/sharding.py).
    """
    def rows() -> torch.Tensor:
        return weight_of(q_module)[start:stop]

    rows.rows_of = (q_module, start, stop)
    return rows


def rows_at(q_module: nn.Module, index: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`rows_of` for output channels `index` ([n] int64): a contiguous run keeps the
    view (and `rows_of`); an interleaved one is gathered (a copy) on every call, from
    the whole weight when it is sharded (a DTensor: a collective, in the same order on
    every rank as every other read of W^Q)."""
    run = as_slice(index)
    if run is not None:
        return rows_of(q_module, *run)

    def rows() -> torch.Tensor:
        w = gathered(weight_of(q_module))
        return w.index_select(0, index.to(w.device))

    rows.rows_index = (q_module, index)
    return rows


# The Linears discovery found split by tensor parallelism (plain_call runs them on their
# local shards); weak, so a dropped model is not kept alive.
_TP_LINEARS: weakref.WeakSet = weakref.WeakSet()


def mark_tensor_parallel(linear: nn.Module) -> None:
    """Record `linear` as split by tensor parallelism (a trainer's own TP, whose local
    weight is a plain tensor: flashwatch/sites/torchtitan.py)."""
    _TP_LINEARS.add(linear)


def tensor_parallel(linear: nn.Module, under_fsdp: bool = False) -> tuple[int, int] | None:
    """(this rank's index, TP size) when `linear`'s weight is a DTensor sharded on dim 0
    by tensor parallelism (torch's ColwiseParallel, Hugging Face's tp_plan "colwise"):
    over a 1-D mesh, or on the tp dimension of FSDP2 × TP's 2-D mesh, whose placements
    are (_StridedShard(0), Shard(0)) on (dp, tp), or replicated over the dims before tp
    (`replicated_tp`); else None. Under FSDP2 (`under_fsdp`: the Linear sits inside a
    fully_shard module) a 1-D weight is FSDP2's own shard, not TP; a 2-D one is TP when
    its forward is hooked by torch's distribute_module. Other layouts are refused."""
    w = getattr(linear, "weight", None)
    if not (callable(getattr(w, "to_local", None)) and hasattr(w, "placements")):
        return None
    placements = tuple(w.placements)
    hooked = tp_hooked(linear)
    if len(placements) > 1 and (hooked or not under_fsdp):
        if not (fsdp_x_tp(w) or replicated_tp(w)):
            raise ValueError(
                f"flashwatch.watch: a tensor-parallel {type(linear).__name__} whose weight "
                f"is sharded on a {len(placements)}-D mesh as {placements} is not "
                f"supported; FSDP2 × TP on a (dp, tp) mesh is (placements "
                f"(_StridedShard(0), Shard(0))), HSDP × TP on (replicate, shard, tp) "
                f"(Replicate(), _StridedShard(0), Shard(0)), TP replicated over the other "
                f"dims (Replicate(), ..., Shard(0)), and TP on a 1-D mesh; or "
                f"leave these layers out with sites=... (docs/limits.md)")
        _TP_LINEARS.add(linear)
        tp = w.device_mesh.ndim - 1  # the tp dim: the last
        return w.device_mesh.get_local_rank(tp), w.device_mesh.size(tp)
    if under_fsdp or not placements[0].is_shard(0):
        return None
    _TP_LINEARS.add(linear)
    mesh = w.device_mesh
    return mesh.get_local_rank(0), mesh.size(0)


def tp_hooked(linear: nn.Module) -> bool:
    """torch's `parallelize_module` (distribute_module) hooked this module's forward: its
    DTensor weight is tensor parallelism's, not only FSDP2's shard."""
    return any("distribute_module" in getattr(h, "__qualname__", "")
               for h in getattr(linear, "_forward_pre_hooks", {}).values())


def fsdp_x_tp(w) -> bool:
    """`w` is a DTensor of FSDP2 × TP outside the forward: rows sharded over tp (the last
    mesh dim) and, within each tp shard, over FSDP2's shard dim (the one before it):
    placements (_StridedShard(0), Shard(0)); under HSDP × TP with replicate dims first,
    (Replicate(), _StridedShard(0), Shard(0))."""
    p = tuple(getattr(w, "placements", ()))
    return (len(p) >= 2 and all(x.is_replicate() for x in p[:-2])
            and type(p[-2]).__name__ == "_StridedShard" and p[-2].dim == 0
            and type(p[-1]).__name__ == "Shard" and p[-1].dim == 0)


def replicated_tp(w) -> bool:
    """`w` is split on dim 0 over the last mesh dim (tp) and the same on every rank of
    the others: placements (Replicate(), ..., Shard(0)). torchtitan's "full_dtensor"
    backend puts every weight on its whole SPMD mesh so; its local tensor is the TP
    shard itself, as on a 1-D mesh."""
    p = tuple(getattr(w, "placements", ()))
    return (len(p) >= 2 and all(x.is_replicate() for x in p[:-1])
            and type(p[-1]).__name__ == "Shard" and p[-1].dim == 0)


def dp_shard_dim(w) -> int:
    """The mesh dim over which FSDP2 shards an FSDP2 × TP weight's rows (fsdp_x_tp)."""
    return w.device_mesh.ndim - 2


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel weight's (or bias's) part on this TP rank, as a plain tensor:
    its local shard; under FSDP2 × TP, outside the forward, gathered over dp first (a
    collective on the dp groups: call it on every rank)."""
    if fsdp_x_tp(t):
        from torch.distributed.tensor import Replicate

        t = t.redistribute(t.device_mesh,
                           (Replicate(),) * (t.device_mesh.ndim - 1) + (t.placements[-1],))
    # a plain tensor is already this rank's part (torchtitan's spmd_types backend)
    return t.to_local() if callable(getattr(t, "to_local", None)) else t


def local_rows(linear: nn.Linear, stop: int) -> Callable[[], torch.Tensor]:
    """Getter for rows [0, stop) of this rank's shard of a tensor-parallel Linear's weight
    (its local heads' channels), read on every call (`tp_local`: under FSDP2 × TP,
    outside the forward, a collective)."""
    def rows() -> torch.Tensor:
        return tp_local(linear.weight)[:stop]
    return rows


def local_rows_at(linear: nn.Linear, index: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`local_rows` for rows `index` of this rank's shard (a fused projection's local
    heads, interleaved per K/V group): a copy, read on every call."""
    def rows() -> torch.Tensor:
        w = tp_local(linear.weight)
        return w.index_select(0, index.to(w.device))
    return rows
