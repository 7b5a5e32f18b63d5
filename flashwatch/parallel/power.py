"""W^Q spectral norms of plain and sharded weights (FSDP2 `fully_shard`, tensor parallel
DTensors), fault-symmetric where they are collectives (which rows a rank holds:
flashwatch/parallel/sharding.py).

`wq_spectral_norm` (docs/design.md §5) must be the unsharded W^Q's whatever the sharding,
and identical on every rank, since every rank's policy reads it.

The common case needs no gather. FSDP2 shards a Linear's weight [out, in] on dim 0, so
each rank holds whole rows of W^Q (a head's d_head rows may straddle two ranks). One power
iteration step on head h, with v replicated:

    u = W_h v          each rank: the entries of u for its own rows (local products)
    Wᵀ u = Σ_r W_rᵀ u_r   a sum of per-rank partial [d_model] vectors: one all_reduce
    ‖u‖² = Σ_r ‖u_r‖²     summed in the same all_reduce

so a step sends H·(d_model + 1) numbers per layer, d_head times less than W^Q itself,
and leaves σ and v bitwise identical on every rank (all ranks stop on the same step).

Other layouts (a Conv1D weight, whose W^Q columns are sharded; Shard(1); meshes of more
than one dimension) fall back to gathering the DTensor view of W^Q with `full_tensor()`
and the plain `spectral.gram_norm`: correct, but it moves the whole W^Q (and, where
DTensor must redistribute to slice it, the whole weight) every monitored step. Weights a
process holds whole use `gram_norm` (no iteration, no warm start).
"""

from __future__ import annotations

import numpy as np
import torch

from flashwatch.parallel.sharding import (
    _fsdp_tp_weight,
    is_dtensor,
    is_row_sharded,
    local_wq_rows,
    unnarrowed_tp,
)
from flashwatch.signals.spectral import (
    COLD_START_MAX_ITERS,
    DEFAULT_SEED,
    WARM_MAX_ITERS,
    gram_norm,
    iterate,
    start_vector,
)
from flashwatch.sites.site import AttentionSite
from flashwatch.sites.weights import dp_shard_dim, fsdp_x_tp


def spectral_norm(site: AttentionSite, v: torch.Tensor | None, iters: int, **kwargs
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ [H], v [H, d_model]) of site's W^Q for plain and sharded weights alike:
    `spectral.gram_norm` of a whole weight, the sharded power iteration (warm-started
    from v, `iters` steps at least, **kwargs) of rows spread over ranks. A sharded
    weight makes this a collective: every rank of the weight's mesh must call it for
    the same site in the same order."""
    rows = local_wq_rows(site)
    if rows is not None:
        local, head, group = rows
        return sharded_power_iteration(local, head, site.num_heads, v, iters, group=group,
                                       **kwargs)
    w = site.wq()
    if is_dtensor(w):  # fallback: gather the view of W^Q (module docstring)
        w = w.full_tensor()
    return gram_norm(w.float())


def spectral_norms(sites: list[AttentionSite], vs: list, iters: int, monitor=None,
                   **kwargs) -> list:
    """`spectral_norm` of many sites: [(σ [H], v [H, d_model]) or the exception raised
    for that site]. Plain weights of one shape (most models: every layer's) run as ONE
    batched `gram_norm` over all their heads, whose cost on small models is per-op
    overhead, not arithmetic. Sharded weights run site by site (each power-iteration
    step is a collective), fault-symmetrically: a rank that fails on a site still takes
    part in every iteration (`symmetric_sharded_norm`); `iters` and **kwargs are
    theirs, `monitor` the watcher's MonitorGroup (flashwatch/parallel/reduce.py)."""
    out: list = [None] * len(sites)
    groups: dict = {}
    for i, (site, v) in enumerate(zip(sites, vs, strict=True)):
        # Which collectives this site takes is its layout, the same on every rank: read
        # from metadata with torch functions off, so that no torch function mode (the
        # fault sweep's, tests/fault_sweep.py) can make one rank read it otherwise
        with torch._C.DisableTorchFunction():
            tp, row_sharded = unnarrowed_tp(site), is_row_sharded(site)
        broken = monitor is not None and monitor.broken is not None  # maybe by a site above
        if broken and (tp is not None or row_sharded):
            out[i] = RuntimeError(f"no sharded norm: the monitor's group is unusable since "
                                  f"{monitor.broken}")  # no collective any more
            continue
        if tp is not None:
            out[i] = _unnarrowed(site, tp, iters, monitor, **kwargs)
            continue
        if row_sharded:
            out[i] = symmetric_sharded_norm(site, v, iters, monitor, **kwargs)
            continue
        try:
            if is_dtensor(site.wq_source()):  # a sharded view, gathered (a collective)
                with torch.no_grad():
                    out[i] = spectral_norm(site, v, iters, **kwargs)
                continue
            w = site.wq()  # a view: upcast once per batch, in gram_norm
            groups.setdefault((tuple(w.shape), w.dtype, w.device), []).append((i, w))
        except Exception as e:
            out[i] = e
    for members in groups.values():
        # Batches of at most BATCH_BYTES of FP32 W^Q: all layers at once on small models,
        # one copy of a layer's W^Q at a time on large ones (the concatenation copies).
        per = max(1, BATCH_BYTES // (4 * members[0][1].numel()))
        for lo in range(0, len(members), per):
            batch = members[lo:lo + per]
            try:
                with torch.no_grad():
                    sigma, v = gram_norm(torch.cat([w for _, w in batch]))
                sizes = [w.shape[0] for _, w in batch]
                for (i, _), s_i, v_i in zip(batch, sigma.split(sizes), v.split(sizes),
                                            strict=True):
                    out[i] = (s_i, v_i)
            except Exception as e:
                for i, _ in batch:
                    out[i] = e
    return out


class NotNarrowed(RuntimeError):
    """A layer this rank has not narrowed to its tensor-parallel heads: said (or counted)
    where that happened, not counted again here."""


def _unnarrowed(site: AttentionSite, tp: int, iters: int, monitor, **kwargs) -> Exception:
    """A layer this rank failed to narrow after tensor parallelism split it
    (sharding.unnarrowed_tp): no norm here. Under FSDP2 × TP its narrowed peers of the dp
    group run the sharded power iteration of its local heads: this rank takes part with
    no rows and its failure flag up, so all of them stop together (RemoteFailure there);
    under TP alone they compute locally and nothing is issued."""
    w = site.q_module.weight
    if fsdp_x_tp(w) and monitor is not None and monitor.distributed:
        try:
            host_power_iteration(torch.zeros(0, site.d_model), torch.zeros(0, dtype=torch.int64),
                                 site.num_heads // tp, site.d_model, None, iters,
                                 group=monitor.subgroup(
                                     w.device_mesh.get_group(dp_shard_dim(w))),
                                 failed=True, **kwargs)
        except Exception as e:  # RemoteFailure: this rank's own flag, counted already
            _broken(monitor, e)
    return NotNarrowed(f"{site.name} was split by tensor parallelism after attach and is "
                       f"not narrowed on this rank: no W^Q norm here")


class CollectiveFailed(RuntimeError):
    """An all_reduce of the sharded power iteration raised (its timeout: a partner that
    never came). The monitor's groups are then broken for good (`_broken`): a late
    partner would pair a later collective of another size, which gloo answers by
    aborting the process."""


def _broken(monitor, error: Exception) -> None:
    if isinstance(error, CollectiveFailed) and monitor is not None and monitor.broken is None:
        monitor.broken = f"a collective failed in the sharded power iteration ({error})"


class RemoteFailure(RuntimeError):
    """Another rank failed inside a collective computation; every rank stops it."""


def symmetric_sharded_norm(site: AttentionSite, v, iters: int, monitor=None, **kwargs):
    """(σ, v) of a row-sharded W^Q, or the exception: every rank runs every iteration of
    the sharded power iteration whatever failed locally. A rank whose rows could not be
    read takes part with no rows and a failure flag that the iteration's own all_reduce
    carries, so every rank stops at the same iteration with a RemoteFailure. On the
    monitor's own group when it spans the mesh's ranks (the usual 1-D FSDP2 mesh), else
    on a gloo group of the monitor's over that group's ranks (MonitorGroup.subgroup:
    FSDP2 × TP's dp group, a pipeline stage's FSDP2 mesh); without a monitor (a direct
    call), on the mesh's own group."""
    fsdp_tp = _fsdp_tp_weight(site)
    if fsdp_tp is not None:  # the ranks holding this TP rank's rows: its dp shard group
        group = fsdp_tp.device_mesh.get_group(dp_shard_dim(fsdp_tp))
    else:
        group = site.wq_source.rows_of[0].weight.device_mesh.get_group(0)  # is_row_sharded
    error = None
    try:
        rows, head, _ = local_wq_rows(site)
    except Exception as e:  # take part with no rows and the failure flag up
        error = e
        rows, head = torch.zeros(0, site.d_model), torch.zeros(0, dtype=torch.int64)
    host = monitor is not None and monitor.distributed
    try:
        if host:  # every rank runs the same iterations, whatever raises between them
            got = host_power_iteration(rows, head, site.num_heads, site.d_model, v, iters,
                                       group=monitor.subgroup(group),
                                       failed=error is not None, **kwargs)
        else:
            got = sharded_power_iteration(rows, head, site.num_heads, v, iters,
                                          group=group, failed=error is not None, **kwargs)
    except Exception as e:
        got = e
        _broken(monitor, e)
    return error if error is not None else got


# The host vectors of host_power_iteration by (heads, d_model, seed): made on a site's
# first sharded norm, then reused, so that no torch call stands between two of its
# collectives (one site at a time: a monitored step computes its norms in turn).
_HOST_BUFFERS: dict = {}


def _host_buffers(H: int, b: int, seed: int):
    got = _HOST_BUFFERS.get((H, b, seed))
    if got is None:
        vec = np.zeros(H * b + H + 1)
        start = start_vector(H, b, seed=seed, dtype=torch.float64).numpy()
        got = _HOST_BUFFERS[(H, b, seed)] = (vec, torch.from_numpy(vec), start)
    return got


def host_power_iteration(rows: torch.Tensor, head: torch.Tensor, num_heads: int,
                         d_model: int, v: torch.Tensor | None, iters: int,
                         tol: float = 1e-6, *,
                         group, seed: int = DEFAULT_SEED, max_iters: int = WARM_MAX_ITERS,
                         failed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`sharded_power_iteration` on the monitor's gloo group, as a schedule no local
    failure can change: every step all_reduces one float64 host vector [Σ W_rᵀ u_r (H·b),
    ‖u‖² (H), failed ranks] that this rank fills with torch where it can (numpy zeros and
    its flag up where that raised), and everything that decides whether another step
    follows (the flag, σ, the stopping test, the next v) is numpy on the reduced vector:
    the same numbers, hence the same decision, on every rank. Raises this rank's own
    error, or RemoteFailure, once a step carried a flag: on every rank after the same
    step. Returns (σ [H], v [H, b]) like `spectral.power_iteration` (NaN: not finite)."""
    import torch.distributed as dist

    H, b = num_heads, d_model
    buf, buf_t, start = _host_buffers(H, b, seed)
    errors: list = []
    try:  # the warm start: v normalised, seeded where it is unusable
        with torch.no_grad():
            vn = start if v is None else v.detach().to("cpu", torch.float64).numpy().copy()
    except Exception as e:
        errors.append(e)
        vn = start
    norms = np.linalg.norm(vn, axis=1, keepdims=True)
    bad = ~np.isfinite(vn).all(axis=1) | (norms[:, 0] == 0)
    vn = np.where(bad[:, None], start, vn / np.maximum(norms, 1e-300))

    def step(vn):  # the reduced (WᵀW v [H, b], ‖W v‖² [H]); a flag stops every rank
        ok = not failed and not errors
        if ok:
            try:
                with torch.no_grad():
                    v_dev = torch.from_numpy(vn).to(rows.device, rows.dtype)
                    buf[:-1] = local_power_step(rows, head, v_dev, H).double().cpu().numpy()
            except Exception as e:
                errors.append(e)
                ok = False
        if not ok:
            buf[:] = 0.0
        buf[-1] = 0.0 if ok else 1.0
        try:
            dist.all_reduce(buf_t, group=group)
        except Exception as e:  # a timeout: a partner never came (callers mark the group)
            raise CollectiveFailed(f"{type(e).__name__}: {e}") from e
        if buf[-1] > 0:
            if errors:
                raise errors[0]
            raise RemoteFailure(f"{int(buf[-1])} rank(s) failed in the sharded power "
                                f"iteration")
        return buf[:H * b].reshape(H, b).copy(), buf[H * b:H * b + H].copy()

    cold = v is None
    sigma = np.zeros(H)
    for i in range(COLD_START_MAX_ITERS if cold else max(iters, max_iters)):
        w, usq = step(vn)
        new_sigma = np.sqrt(usq)
        w_norm = np.linalg.norm(w, axis=1, keepdims=True)
        vn = np.where(w_norm > 0, w / np.maximum(w_norm, 1e-300), vn)
        with np.errstate(divide="ignore", invalid="ignore"):
            change = np.abs(new_sigma - sigma) / np.maximum(new_sigma, 1e-300)
        sigma = new_sigma
        if (cold or i + 1 >= iters) and (change[np.isfinite(change)] < tol).all():
            break
    sigma = np.sqrt(step(vn)[1])  # the last v is a half-step ahead: its σ
    finite = np.isfinite(sigma) & np.isfinite(vn).all(axis=1)
    sigma = np.where(finite, sigma, np.nan)
    vn = np.where(finite[:, None], vn, start)
    return torch.from_numpy(sigma), torch.from_numpy(vn).float()


BATCH_BYTES = 64 << 20  # GPT-2 Small: all 12 layers' W^Q (28 MB) in one batch


def sharded_power_iteration(rows: torch.Tensor, head: torch.Tensor, num_heads: int,
                            v: torch.Tensor | None, iters: int, tol: float = 1e-6, *,
                            group=None, seed: int = DEFAULT_SEED,
                            max_iters: int = WARM_MAX_ITERS, failed: bool = False,
                            host: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`spectral.power_iteration` for a W^Q whose rows are spread over the ranks of
    `group`: rows [n, b] are this rank's rows, head [n] the head of each. Same warm and
    cold start rules, stopping test and arguments; returns (σ [H], v [H, b]), identical
    on every rank. Fault-symmetric: each step's all_reduce carries a failure flag (this
    rank's `failed`, or an exception in its local products, which then count as zeros);
    once any rank's flag is up every rank raises RemoteFailure after the same step.
    host: reduce on the CPU (a gloo group), moving the packed step there and back."""
    import torch.distributed as dist

    H, b = num_heads, rows.shape[1]
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    rows = rows.to(dtype)
    start = start_vector(H, b, seed=seed, dtype=dtype, device=rows.device)
    cold = v is None
    if cold:
        v = start
    else:
        v = v.detach().to(device=rows.device, dtype=dtype)
        bad = ~torch.isfinite(v).all(dim=1) | (v.norm(dim=1) == 0)
        v = torch.where(bad[:, None], start, v / v.norm(dim=1, keepdim=True).clamp_min(1e-300))

    local_error: list = []  # this rank's own failure, raised here instead of RemoteFailure

    def step(v):  # (Σ_r W_rᵀ u_r [H, b], ‖u‖² [H]) for u = W v, summed over ranks
        flag = 1.0 if failed else 0.0
        try:
            packed = torch.cat([local_power_step(rows, head, v, H),
                                torch.full((1,), flag, dtype=dtype, device=rows.device)])
        except Exception as e:
            local_error.append(e)
            packed = torch.zeros(H * b + H + 1, dtype=dtype, device=rows.device)
            packed[-1] = 1.0
        if host:  # the monitor's gloo group reduces on the CPU
            reduced = packed.cpu()
            dist.all_reduce(reduced, group=group)
            packed = reduced.to(rows.device)
        else:
            dist.all_reduce(packed, group=group)
        if float(packed[-1]) > 0:  # the same reduced flag on every rank
            if local_error:
                raise local_error[0]
            raise RemoteFailure(f"{int(packed[-1])} rank(s) failed in the sharded power "
                                f"iteration")
        return packed[:H * b].view(H, b), packed[H * b:H * b + H]

    return iterate(step, v, lambda: start, iters=iters, tol=tol, cold=cold,
                   max_iters=max_iters)


def local_power_step(rows: torch.Tensor, head: torch.Tensor, v: torch.Tensor, H: int
                     ) -> torch.Tensor:
    """This rank's part of one sharded power-iteration step, packed: [Σ W_rᵀ u_r (H·b),
    ‖u_r‖² (H)] for u = W v on its own rows."""
    b = rows.shape[1]
    u = (rows * v[head]).sum(1)
    return torch.cat([
        torch.zeros(H, b, dtype=rows.dtype, device=rows.device).index_add_(
            0, head, rows * u[:, None]).flatten(),
        torch.zeros(H, dtype=rows.dtype, device=rows.device).index_add_(0, head, u * u)])
