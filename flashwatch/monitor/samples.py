"""A probed call's record and the step's per-head sums on the device.

`Sample` keeps what flashwatch/monitor/probe.py measured of one call (every row's max and
ties, the sampled rows' FP32 output and PK, O_used, X) until its gradient arrives;
`totals` reduces the samples of a micro-batch for all layers at once:
    c[T] = rowsum(dO ∘ (O_used - O_fp32))[T]               (docs/design.md §5)
    z[T] = Ω_xᵀ X[T] (Ω_qᵀ q[T] without X), y[T] = Ω_aᵀ PK[T]
    G    = Σ_T c[T] z[T] y[T]ᵀ  (k×k per head): a sketch of dW^Q_hp - dW^Q_lp,
into a packed `Totals` on the device (one host transfer per step, in aggregate.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashwatch.monitor.probe import Rows


@dataclass(eq=False)
class Sample:
    """One probed call: every row's statistics and the sampled rows' terms, in the
    sample's grouped layout [E, H, w, ·] (`recompute`), kept until `totals` reduces them
    with the other calls whose shapes match (stacked: a few dozen ops for all layers
    instead of a few dozen per call; on a GPU one copy to the host instead of several
    per call). Memory: O(R·H·D) a call, until its micro-batch is reduced or, with
    retain_graph, until its graph is freed."""

    heads: torch.Tensor  # [H] int64 (the call's device): its heads in the watcher's table
    rows_at: Rows  # the sampled rows, host and device
    tied: torch.Tensor | None  # [H] int64 tied rows over every row (None: kernel counted)
    row_max: torch.Tensor | None  # [H] FP32 max score over every row
    rows: torch.Tensor | int  # real query rows counted: a host count, or on the device
    # ([] under padding, [H] where a mask can hide whole rows)
    o_used: torch.Tensor  # [E, H, w, Dv] the output the backward's δ reads
    o32: torch.Tensor  # [E, H, w, Dv] FP32 softmax(s) V
    pk: torch.Tensor  # [E, H, w, D] FP32 softmax(s) K
    x: torch.Tensor | None  # [E, w, d_model] the Q projection's input at the rows
    q: torch.Tensor | None  # [E, H, w, D] FP32 q at the rows, where there is no usable x
    weight: torch.Tensor | None  # [E, w] 1 for a real query, 0 for padding (None: all real)
    omegas: object  # the layer's DeviceConstants (Ω_x, Ω_a, Ω_q on the call's device)
    share_scale: float  # α²·B·Nq/R: each sampled row stands for B·Nq/R rows
    g: torch.Tensor | None = None  # [E, H, w, Dv] dO at the rows, set by the gradient hook
    c: torch.Tensor | None = None  # [E, H, w] float64 c where the kernel gave it
    c_all: torch.Tensor | None = None  # [2, H] float64 (Σc, Σc²) over every row of the
    # call, where flashwatch's kernel gave c on every row (else over the sample)
    shape: tuple = (0, 0)  # (B, Nq) of the call, on the host

    @property
    def has_grad(self) -> bool:
        return self.g is not None or self.c is not None

    @property
    def n_rows(self) -> int:
        return self.rows_at.t.numel()


def delta_error(do_rows, o_used, o32) -> torch.Tensor:
    """c[T] per head, [..., R, H] float64: Σ_d dO·(O_used - O_fp32), exact in FP64."""
    return (do_rows.double() * (o_used.double() - o32.double())).sum(-1)


def sketch(c, z, y) -> torch.Tensor:
    """G [..., H, k, k] = Σ_T c[T] z[T] y[T]ᵀ, over any leading batch dims. z is
    [..., R, k] (from X) or [..., R, H, k] (q-space); c [..., R, H], y [..., R, H, k]."""
    c, z, y = c.double(), z.double(), y.double()
    if z.dim() == c.dim():
        return torch.einsum("...rh,...rk,...rhl->...hkl", c, z, y)
    return torch.einsum("...rh,...rhk,...rhl->...hkl", c, z, y)


# The summed fields of Totals, in an order where those a group of samples has are
# contiguous: (tied, rows) when the probe counted every row, (delta_sum, delta_sq) with a
# gradient, share_num with X as well.
SUMS = ("tied", "rows", "delta_sum", "delta_sq", "share_num")


class Totals:
    """A step's per-head sums on the device, packed so that a micro-batch adds into them
    with one op per kind: `sums` [6, n] float64 (SUMS, then row_max: -inf if none) and
    G [n, k, k]. Read like a dict (`items()`, `[name]`)."""

    def __init__(self, n: int, k: int, device, sums=None, G=None):
        f64 = dict(dtype=torch.float64, device=device)
        if sums is None:
            sums = torch.zeros(len(SUMS) + 1, n, **f64)
            sums[-1] = -math.inf
            G = torch.zeros(n, k, k, **f64)
        self.sums, self.G = sums, G

    def copy(self) -> Totals:
        return Totals(0, 0, None, self.sums.clone(), self.G.clone())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "G":
            return self.G
        return self.sums[-1] if name == "row_max" else self.sums[SUMS.index(name)]

    def items(self):
        return [(name, self[name]) for name in (*SUMS, "row_max", "G")]


def totals(samples: list[Sample], n_heads: int, k: int, out: Totals | None = None,
           device: torch.device | str = "cpu") -> Totals:
    """Per-head sums over the samples, added into `out` (new if None, on `device`, where
    the samples are: nothing moves to the host here), float64: tied and rows (every row
    of the calls the probe counted), row_max (-inf if none), and from the samples with a
    gradient: G, delta_sum, delta_sq (Σc, Σc²: over every row where the kernel gave
    c_all, else over the sampled rows) and share_num (Σ ‖e_T‖²)."""
    if out is None:
        out = Totals(n_heads, k, device)
    groups: dict = {}
    for s in samples:
        key = (s.o32.shape, s.pk.shape, s.o32.device, s.tied is None, s.x is None,
               getattr(s.rows, "shape", None),
               None if s.x is None else s.x.shape, s.weight is None, s.g is None,
               s.c is None, s.c_all is None)
        groups.setdefault(key, []).append(s)
    for members in groups.values():
        _add_group(members, out)
    return out


def _add_group(ms: list[Sample], out: Totals) -> None:
    """`totals` of samples of one shape: each field stacked over the L samples."""
    def stack(name):
        return torch.stack([getattr(m, name) for m in ms])

    def flat_rows(x):  # [L, E, H, w, ...] -> [L, E·w, H, ...] (the order of probe.flat)
        return x.transpose(2, 3).flatten(1, 2)

    dev = out.G.device
    idx = torch.cat([m.heads for m in ms]).to(dev, non_blocking=True)  # [L·H]
    H = ms[0].o32.shape[1]
    parts = {}
    first = ms[0]
    if first.tied is not None:  # every row's statistics, counted by the probe
        parts["tied"], parts["row_max"] = stack("tied"), stack("row_max")
        rows = [m.rows for m in ms]
        if not isinstance(rows[0], torch.Tensor):  # host counts
            rows = torch.tensor(rows, dtype=torch.float64).to(dev, non_blocking=True)
        else:
            rows = torch.stack(rows)
        parts["rows"] = rows if rows.dim() == 2 else rows[:, None].expand(-1, H)
    if first.has_grad:  # no gradient reached these calls: no c
        if first.c is not None:
            c = stack("c")  # [L, E, H, w]
        else:
            c = delta_error(stack("g"), stack("o_used"), stack("o32"))
        if first.weight is not None:  # padding queries: no error of theirs counts
            c = c * stack("weight")[:, :, None]
        if first.c_all is not None:  # Σc, Σc² over every row came with it
            c_all = stack("c_all")
            parts["delta_sum"], parts["delta_sq"] = c_all[:, 0], c_all[:, 1]
        else:
            parts["delta_sum"], parts["delta_sq"] = c.sum((1, 3)), c.square().sum((1, 3))
        c, pk = flat_rows(c), flat_rows(stack("pk"))  # [L, R, H], [L, R, H, D]
        y = torch.matmul(pk, torch.stack([m.omegas.omega_a for m in ms])[:, None])
        if first.x is not None:
            x = stack("x").flatten(1, 2).float()  # [L, R, d_model]
            z = torch.matmul(x, torch.stack([m.omegas.omega_x for m in ms]))
            # Share of the W^Q gradient (docs/design.md §5): e_T = α c[T] PK[T] X[T]ᵀ is
            # rank 1, ‖e_T‖² = α² c² ‖PK‖² ‖X‖²; sampled rows stand for B·Nq / R rows each
            w = torch.tensor([m.share_scale for m in ms], dtype=torch.float64)
            norms = (torch.linalg.vecdot(x, x).double()[..., None]
                     * torch.linalg.vecdot(pk, pk).double())  # [L, R, H]
            parts["share_num"] = (norms * c.square()).sum(1) * w.to(dev, non_blocking=True)[
                :, None]
        else:
            z = torch.matmul(flat_rows(stack("q")),
                             torch.stack([m.omegas.omega_q for m in ms])[:, None])
        G = sketch(c, z, y)  # [L, H, k, k]
        out.G.index_add_(0, idx, G.reshape(-1, *G.shape[2:]))
    row_max = parts.pop("row_max", None)
    if row_max is not None:
        out.sums[-1].scatter_reduce_(0, idx, row_max.reshape(-1).double(), reduce="amax")
    if parts:  # a contiguous run of SUMS: one add for all of them
        lo = SUMS.index(next(iter(parts)))
        vals = torch.stack([parts[f] for f in SUMS[lo:lo + len(parts)]])
        out.sums[lo:lo + len(parts)].index_add_(1, idx, vals.reshape(len(parts), -1).double())
