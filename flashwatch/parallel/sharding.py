"""torch.distributed helpers for W^Q: the world size, and which rows of a sharded weight
(FSDP2 `fully_shard`, tensor-parallel DTensors, both on a 2-D mesh) this rank holds, for
its W^Q and for ‖dW^Q_h‖² of its gradient. The spectral norms computed from those rows,
fault-symmetric where they are collectives: flashwatch/parallel/power.py."""

from __future__ import annotations

import torch
from torch import nn

from flashwatch.sites.discovery import TRAINER_LAYOUTS
from flashwatch.sites.site import AttentionSite
from flashwatch.sites.weights import dp_shard_dim, fsdp_x_tp, tp_hooked


def world_size() -> int:
    """Ranks of the default process group; 1 without torch.distributed."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_dtensor(t) -> bool:
    return callable(getattr(t, "full_tensor", None)) and hasattr(t, "placements")


def sequence_sharded(t) -> bool:
    """`t` ([B, H, N, D]) is a DTensor split over its sequence dim: torch's ring context
    parallelism (context_parallel, or the _ContextParallel style torchtitan applies to
    its inner attention) hands SDPA such q, k and v, each rank its shard of the rows
    and of the keys, the other ranks' keys brought in blocks inside the op."""
    return is_dtensor(t) and any(p.is_shard() and p.dim == t.dim() - 2
                                 for p in t.placements)


def fsdp_grad_divisor(roots, param) -> float | None:
    """What FSDP2 divides `param`'s reduced gradient by when its module set one
    (`set_gradient_divide_factor`; torchtitan sets 1.0: its losses are already divided by
    the global token count, so the gradient is the ranks' sum), else None: FSDP2's
    default, the mean over its data-parallel ranks. Looked up in the fully_shard modules
    under `roots` (torch 2.13's FSDPParamGroup: fsdp_params, gradient_divide_factor)."""
    from torch.distributed.fsdp import FSDPModule

    for root in roots:
        for m in root.modules():
            if not isinstance(m, FSDPModule):
                continue
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None and any(fp.sharded_param is param
                                         for fp in group.fsdp_params):
                return group.gradient_divide_factor
    return None


def unnarrowed_tp(site: AttentionSite) -> int | None:
    """The tensor-parallel size of a layer watched whole whose Q Linear parallelize_module
    split after attach, where this rank has not narrowed it to its own heads yet (the
    watcher does at the layer's first call: flashwatch/watcher.py `_split`), else None.
    Its whole-layer W^Q is none of this rank's heads': its norms and gradient rows are
    not computed, and never by a collective its narrowed peers would not issue."""
    q = site.q_module
    if site.global_heads is not None or site.output_gathered or not isinstance(q, nn.Linear):
        return None
    for layout in TRAINER_LAYOUTS:  # heads split by a trainer's CP after attach (Ulysses)
        cp = layout.context_parallel(site.module) if layout.context_parallel else None
        if cp is not None:
            return cp[1]
    w = getattr(q, "weight", None)
    rows = w.shape[0] if w is not None and w.dim() == 2 else 0  # FSDP1's flat views: 0
    if rows and not is_dtensor(w) and rows < q.out_features and q.out_features % rows == 0:
        return q.out_features // rows  # a trainer's own split into plain local rows
    if not is_dtensor(w):
        return None
    if tp_hooked(q):  # torch's parallelize_module: the tp dim is the weight mesh's last
        return w.device_mesh.size(w.device_mesh.ndim - 1)
    for layout in TRAINER_LAYOUTS:  # a split the trainer declares (torchtitan)
        size = layout.dtensor_tensor_parallel(q) if layout.dtensor_tensor_parallel else None
        if size is not None:
            return size
    return None


def is_row_sharded(site: AttentionSite) -> bool:
    """W^Q is rows of an nn.Linear weight that is a DTensor sharded on dim 0 over a 1-D
    mesh, or over dp within each tp shard (FSDP2 × TP): the same answer on every rank
    (it reads the weight's placement, not data)."""
    from torch.distributed.tensor import Shard

    if _fsdp_tp_weight(site) is not None:
        return True
    source = getattr(site.wq_source, "rows_of", None)
    if source is None or not isinstance(source[0], nn.Linear):
        return False
    w = getattr(source[0], "weight", None)
    return (is_dtensor(w) and w.device_mesh.ndim == 1
            and tuple(w.placements) == (Shard(0),))


def _dim0_rows(t, start: int, stop: int, head_dim: int):
    """(rows, head [n] int64, mesh) of rows [start, stop) of `t` held by this rank, when
    `t` is a DTensor sharded on dim 0 over a 1-D mesh; else None. DTensor's Shard(0)
    splits like torch.chunk: ceil(out / world) rows per rank. n may be 0."""
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    if mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    out, world, rank = t.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-out // world)
    offset = min(rank * chunk, out)
    local = t.to_local().detach()
    if local.shape[0] != min(chunk, out - offset):
        raise RuntimeError(f"local shard of {tuple(t.shape)} has {local.shape[0]} rows on "
                           f"rank {rank} of {world}, expected {min(chunk, out - offset)} "
                           f"(torch.chunk layout)")
    a, b = max(start, offset), min(stop, offset + local.shape[0])
    rows = local[a - offset:max(a, b) - offset]
    head = (torch.arange(a, max(a, b), device=rows.device) - start) // head_dim
    return rows, head, mesh


def local_wq_rows(site: AttentionSite):
    """(rows [n, d_model], head [n] int64, process group) of W^Q held by this rank, when
    W^Q is rows [start, stop) of an nn.Linear weight that is a DTensor sharded on dim 0
    over a 1-D mesh, or a tensor-parallel site's rows sharded over dp (FSDP2 × TP: the
    group is the dp one); else None. n may be 0 (a rank holding only K and V rows)."""
    w = _fsdp_tp_weight(site)
    if w is not None:
        rows, head = _tp_rows(site, w)
        return rows, head, w.device_mesh.get_group(dp_shard_dim(w))
    source = getattr(site.wq_source, "rows_of", None)  # set by sites/weights.rows_of
    if source is None:
        return None
    q_module, start, stop = source
    w = getattr(q_module, "weight", None)
    if not isinstance(q_module, nn.Linear) or not is_dtensor(w):
        return None
    found = _dim0_rows(w, start, stop, site.head_dim)
    if found is None:
        return None
    rows, head, mesh = found
    return rows, head, mesh.get_group(0)


def wq_grad_sq(site: AttentionSite, grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(‖dW^Q_h‖²_F per head [H] (FP32 or FP64) on the gradient's device, averaged) from
    the Q projection's weight gradient `grad` (nn.Linear orientation). A plain tensor is
    this rank's own gradient (averaged=False). A DTensor is FSDP2's shard of the gradient
    averaged over ranks (averaged=True): sharded on dim 0 over a 1-D mesh, each rank sums
    its own rows, so that the cross-rank SUM of the watcher's reduction gives the averaged
    gradient's norm without a gather; any other layout is gathered and counted once, on
    the first rank of the weight's mesh (`first_rank`: under DP × PP, the stage's own)."""
    from flashwatch.sites.site import q_rows

    H, D = site.num_heads, site.head_dim
    if unnarrowed_tp(site) is not None:  # not this rank's heads: nothing to add
        return torch.zeros(H, dtype=torch.float64, device=grad.device), False
    if site.global_heads is not None and fsdp_x_tp(grad):  # FSDP2 × TP: rows over dp
        rows, head = _tp_rows(site, grad)
        out = torch.zeros(H, dtype=torch.float64, device=rows.device)
        out.index_add_(0, head, rows.double().square().sum(-1))
        # each row on one rank of the dp shard group (the SUM adds them), and on each
        # of HSDP's replicas of that group (counted once)
        mesh = grad.device_mesh
        replicas = 1
        for d in range(mesh.ndim - 2):
            replicas *= mesh.size(d)
        return (out / replicas if replicas > 1 else out), True
    if site.global_heads is not None and is_dtensor(grad):  # TP: this rank's own heads
        grad = grad.to_local()
    if not is_dtensor(grad):
        # one op on a monitored step's backward (FP32 dot products: ≈ 1e-6 relative,
        # plenty for a share); the FP64 conversion happens with every layer's at once
        g = q_rows(site, grad.detach()).reshape(H, -1)
        g = g if g.dtype == torch.float32 else g.float()
        return torch.matmul(g[:, None], g[:, :, None]).view(H), False  # bmm: one op
    found = (None if site.q_slice_of_output is None
             else _dim0_rows(grad, *site.q_slice_of_output, D))
    if found is not None:
        rows, head, _ = found
        out = torch.zeros(H, dtype=torch.float64, device=rows.device)
        out.index_add_(0, head, rows.double().square().sum(-1))
        return out, True
    full = grad.full_tensor().detach()  # every rank of its mesh holds it: count it once
    out = torch.zeros(H, dtype=torch.float64, device=full.device)
    if torch.distributed.get_rank() == first_rank(grad.device_mesh):
        out = q_rows(site, full).double().reshape(H, D, -1).square().sum((1, 2))
    return out, True


def _fsdp_tp_weight(site: AttentionSite):
    """The Q Linear's weight of a tensor-parallel site under FSDP2 × TP, outside the
    forward (sharded over dp within the TP shard); else None."""
    q = site.q_module
    w = getattr(q, "weight", None) if site.global_heads is not None else None
    return w if isinstance(q, nn.Linear) and fsdp_x_tp(w) else None


def _tp_rows(site: AttentionSite, t) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, head [n] int64) of this rank's local shard of an FSDP2 × TP weight (or its
    gradient) `t` that are W^Q rows of the site's local heads: the shard's global row
    offset (compute_local_shape_and_global_offset) less the TP rank's first row gives
    rows in the TP shard's numbering, where the site's Q channels are q_index (a slice
    of them when they are one run)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                          t.placements)
    tp = t.device_mesh.ndim - 1  # the tp dim: the last
    tp_rank, tp_size = t.device_mesh.get_local_rank(tp), t.device_mesh.size(tp)
    per_tp = -(-t.shape[0] // tp_size)
    local = t.to_local().detach()
    if local.shape[0] != shape[0]:
        raise RuntimeError(f"local shard of {tuple(t.shape)} has {local.shape[0]} rows, "
                           f"expected {shape[0]} ({t.placements})")
    first = offset[0] - tp_rank * per_tp  # in the TP shard's rows
    if site.q_slice_of_output is not None:  # one run of rows: a view
        start, stop = site.q_slice_of_output
        a, b = max(start, first), min(stop, first + shape[0])
        rows = local[a - first:max(a, b) - first]
        head = (torch.arange(a, max(a, b), device=rows.device) - start) // site.head_dim
        return rows, head
    # interleaved Q rows (a fused projection per K/V group): those this shard holds
    index = site.q_index
    held = ((index >= first) & (index < first + shape[0])).nonzero().flatten()
    rows = local.index_select(0, (index[held] - first).to(local.device))
    return rows, (held // site.head_dim).to(rows.device)


def first_rank(mesh) -> int:
    """The lowest global rank of a DeviceMesh: the one rank of the weight's holders that
    counts a gathered gradient (global rank 0 may hold another pipeline stage)."""
    return int(mesh.mesh.min())


