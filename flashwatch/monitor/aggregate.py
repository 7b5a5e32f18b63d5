"""A monitored step's numbers, from the layers' buffers to named per-head arrays.

    gather       the layers' buffers (device tensors, host counts) → named tensors over
                 all layers, each where it was accumulated
    to_host      every device tensor of them in ONE device-to-host copy (a host sync on
                 CUDA: the only one of a monitored step besides the reduction)
    contribution this rank's named per-head sums and maxes (host)
    reduce.exchange  one SUM and one MAX over the ranks (flashwatch/parallel/reduce.py)
    finish       reduced sums → `HeadArrays`: per-head numpy arrays, scaled for the world
                 size, NaN where a quantity was not measured. Pure: the same inputs give
                 the same outputs on every rank, so every rank decides the same thing.

The layout (`shapes`) comes from the watched model alone (heads, sketch_dim), never from
what a rank measured, so every rank reduces the same shapes whatever failed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

# Summed over ranks: counts and sums per head (G: the k×k sketch per head).
SUM_FIELDS = ("tied", "rows", "delta_sum", "grad_rows", "delta_sq", "delta_rows",
              "delta_missed", "share_num", "share_rows", "wq_grad_sq", "guarded")
# Maxed over ranks (a rank that has no value contributes -inf). wq_spectral_norm is the
# same on every rank that computed it (replicated or sharded-and-reduced weights); the max
# makes it the same on every rank even where one rank failed to compute it. sampled and
# averaged are 0/1 flags: "any rank"; so is refused (the layer's W^Q slice failed
# layouts.QCheck: its norm and share are not the layer's). divisor: what FSDP2 divided
# the reduced W^Q gradient by where the trainer set it (torchtitan: 1, a sum), 0 for its
# default mean over the ranks; the same on every rank that has it.
MAX_FIELDS = ("max_logit", "wq_spectral_norm", "sampled", "averaged", "divisor", "refused")
# Also maxed, for the heads a rank holds (-inf elsewhere): the modes it has set and the
# modes its kernel ran (so every rank knows the modes of heads held elsewhere, e.g. by
# another pipeline stage), 1 where the user set a head's mode by hand since the last
# exchange (every rank restarts that head's signals and policy), and what the rank saw
# of the head's modes (0 nothing, 1 ran, 2 failed: every rank settles the head's
# pending mode events). flashwatch/monitor/head_modes.py.
MODE_FIELDS = ("mode", "ran", "user_set", "seen")
# Summed, 1 for each head a rank holds, sent even where its measurement failed: how many
# ranks hold each head this step (the replica count `finish` divides by). Exchanged, not
# fixed at attach, because a layer split by tensor parallelism after attach changes
# which heads a rank holds (flashwatch/monitor/head_modes.py).
HOLDERS = "holders"


def shapes(n_heads: int, k: int) -> dict[str, tuple]:
    """The exchange layout of a watcher with n_heads heads and sketch_dim k."""
    out = {f: (n_heads,) for f in (*SUM_FIELDS, HOLDERS)}
    out["G"] = (n_heads, k, k)
    out.update({f"max:{f}": (n_heads,) for f in MAX_FIELDS + MODE_FIELDS})
    return out


@dataclass
class LayerBuffers:
    """What one layer accumulated over a monitored step (flashwatch/watcher.py), in the
    form `local` reads: device tensors stay on the device."""

    num_heads: int
    tied_rows: torch.Tensor  # [H] kernel counters of the calls it counted (device)
    rows: torch.Tensor
    guarded_rows: torch.Tensor
    max_logit: torch.Tensor
    wq_grad_sq: torch.Tensor  # [H] ‖dW^Q_h‖² (device; NaN without a gradient)
    grad_rows: int  # host counts
    delta_rows: int
    delta_missed: int
    share_rows: int
    sampled: bool
    averaged: bool
    divisor: float = 0.0  # FSDP2's gradient divisor where set (0: the mean over ranks)
    refused: bool = False  # its W^Q slice failed layouts.QCheck


def gather(layers: list[LayerBuffers], totals: dict[str, torch.Tensor],
           sigma: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The step's raw buffers over all layers, as named lists of pieces (one per layer,
    or one for all) left where they are, device or host: nothing here moves data.
    totals: samples.totals of the step; sigma: each layer's W^Q spectral norms [H] (NaN
    where unknown)."""
    none = [torch.zeros(0, dtype=torch.float64)]  # a rank that holds no layer

    def per_layer(name):
        return _runs([getattr(b, name) for b in layers]) or none

    def per_head(f):  # a host count per layer, repeated over its heads
        return [torch.tensor([float(f(b)) for b in layers for _ in range(b.num_heads)],
                             dtype=torch.float64)]

    raw = {f"probe_{k}": [v] for k, v in totals.items()}
    raw.update(kernel_tied=per_layer("tied_rows"), kernel_rows=per_layer("rows"),
               kernel_max=per_layer("max_logit"), guarded=per_layer("guarded_rows"),
               wq_grad_sq=per_layer("wq_grad_sq"), sigma=_runs(sigma) or none,
               grad_rows=per_head(lambda b: b.grad_rows),
               delta_rows=per_head(lambda b: b.delta_rows),
               delta_missed=per_head(lambda b: b.delta_missed),
               share_rows=per_head(lambda b: b.share_rows),
               sampled=per_head(lambda b: b.sampled), averaged=per_head(lambda b: b.averaged),
               divisor=per_head(lambda b: b.divisor), refused=per_head(lambda b: b.refused))
    return raw


def _runs(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer pieces joined, one cat per run of layers on one device (in order): an
    op per quantity, not per layer."""
    return [torch.cat(list(ts)).double()
            for _, ts in itertools.groupby(pieces, key=lambda t: t.device)]


_HOST = torch.device("cpu")


def to_host(pieces: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """float64 CPU tensors, each key's pieces concatenated (along dim 0), with every
    piece that is not on the CPU moved in ONE copy per device."""
    by_device: dict = {}
    for key, parts in pieces.items():
        for i, t in enumerate(parts):
            if t.device != _HOST:  # (a device's tensor: cuda:0, or a counted cpu:0)
                by_device.setdefault(t.device, []).append((key, i))
    moved = {}
    for where in by_device.values():
        flat = torch.cat([pieces[k][i].detach().double().reshape(-1) for k, i in where]).cpu()
        at = 0
        for k, i in where:
            t = pieces[k][i]
            moved[(k, i)] = flat[at:at + t.numel()].view(t.shape)
            at += t.numel()
    return {k: torch.cat([moved.get((k, i), t.detach().double()) for i, t in enumerate(parts)])
            for k, parts in pieces.items()}


# samples.totals' keys in `gather`'s output: kept over the whole head table by the probe
PROBE_TOTALS = tuple(f"probe_{k}" for k in ("tied", "rows", "row_max", "G", "delta_sum",
                                             "delta_sq", "share_num"))
# Fills of the heads a rank does not hold (another pipeline stage's): nothing to add or
# to win a max. The probe's totals are kept over the whole table already.
_FILL = {"kernel_max": -math.inf, "sigma": math.nan}


def place(raw: dict[str, torch.Tensor], positions: torch.Tensor, n: int
          ) -> dict[str, torch.Tensor]:
    """The per-layer pieces of `raw` (this rank's heads, in its layers' order) placed at
    their global head indices `positions` of an [n] table; fills elsewhere."""
    out = {}
    for k, t in raw.items():
        if k in PROBE_TOTALS:
            out[k] = t  # the probe's totals span the table already
            continue
        full = torch.full((n, *t.shape[1:]), _FILL.get(k, 0.0), dtype=torch.float64)
        out[k] = full.index_copy_(0, positions, t)
    return out


def fills(n_heads: int, k: int) -> dict[str, torch.Tensor]:
    """The measured part of the exchange of a rank whose measurement failed: nothing to
    add (0) or to win a max (-inf); its mode fields still go out (head_modes.py)."""
    return {f.removeprefix("max:"): torch.full(shape, -math.inf if f.startswith("max:")
                                               else 0.0, dtype=torch.float64)
            for f, shape in shapes(n_heads, k).items()
            if f.removeprefix("max:") not in (*MODE_FIELDS, HOLDERS)}


def contribution(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of the exchange (host tensors from `place(to_host(gather(...)))`),
    named as `shapes` names it without the "max:" prefix. Tie and row counts cover every
    real row of every call: the kernel's counters for the calls it counted, the probe's
    for the others (flashwatch/monitor/probe.py)."""
    return dict(
        tied=raw["kernel_tied"] + raw["probe_tied"], rows=raw["kernel_rows"] + raw["probe_rows"],
        delta_sum=raw["probe_delta_sum"], grad_rows=raw["grad_rows"],
        delta_sq=raw["probe_delta_sq"], delta_rows=raw["delta_rows"],
        delta_missed=raw["delta_missed"], share_num=raw["probe_share_num"],
        share_rows=raw["share_rows"], wq_grad_sq=raw["wq_grad_sq"], guarded=raw["guarded"],
        G=raw["probe_G"], max_logit=torch.maximum(raw["kernel_max"], raw["probe_row_max"]),
        wq_spectral_norm=torch.where(torch.isnan(raw["sigma"]), -math.inf, raw["sigma"]),
        sampled=raw["sampled"], averaged=raw["averaged"], divisor=raw["divisor"],
        refused=raw["refused"])


@dataclass
class HeadArrays:
    """The step's per-head numbers after the reduction, identical on every rank. numpy
    float64 [n] unless noted; NaN = not measured this step."""

    tie_ratio: np.ndarray
    max_logit: np.ndarray
    delta_sum: np.ndarray  # Σc (÷W, sampled rows ÷W²: a per-process scale)
    delta_sum_w: np.ndarray  # Σc ÷W and Σc² ÷W²: what the sign statistic reads
    delta_sq_w: np.ndarray
    delta_rows: np.ndarray
    delta_missed: np.ndarray
    G: np.ndarray  # [n, k, k]
    share: np.ndarray
    wq_grad_sq: np.ndarray
    guarded: np.ndarray
    sigma: np.ndarray
    refused: np.ndarray  # bool: the layer's W^Q slice failed the check on some rank


def finish(sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor],
           holders) -> HeadArrays:
    """Reduced sums and maxes → HeadArrays. holders: how many ranks hold each head (W,
    an int or [n]: the world size under DDP and FSDP2, 1 for a pipeline stage's own
    layers). Sums over rows keep their size whatever W: each replica's dO is that of its
    own mean loss, W times its rows' share of the averaged gradient DDP and FSDP step on
    (÷W); sampled rows: every replica samples rows_per_head rows, W times one process's
    count (÷W again: a mean over replicas). Where FSDP2 divides the reduced gradient by
    a divisor D the trainer set instead of averaging (torchtitan: D = 1, its losses
    already divided by the global token count), the step is the ranks' sum ÷ D, and D
    takes W's place as the gradient's scale (the replica count stays W). The sign
    statistics get the sums ÷W only (Σc²: ÷W²): scale-free, with every replica's rows."""
    s = {k: v if isinstance(v, np.ndarray) else v.numpy() for k, v in sums.items()}
    m = {k: v if isinstance(v, np.ndarray) else v.numpy() for k, v in maxes.items()}
    W = np.asarray(holders, dtype=np.float64)
    D = np.where(m["divisor"] > 0, m["divisor"], W)  # the reduced gradient's ÷ (scale)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN where it is dropped
        sampled, averaged = m["sampled"] > 0, m["averaged"] > 0
        row_sampled = s["delta_missed"] > 0  # Σc from sampled rows (not every row)
        delta_sum = s["delta_sum"] / np.where(row_sampled, W * D, D)
        G = s["G"] / np.where(sampled, W * W, W)[:, None, None]
        no_grad = s["grad_rows"] == 0
        # Across ranks: ratio of the rank sums (‖E_r‖², ‖dW^Q_r‖² of the local
        # gradients). Under FSDP2 the denominator is the reduced gradient's (each rank
        # its shard), the ranks' sum ÷ D: the numerator, every rank's error at its own
        # loss's scale, ÷D² (D = W: the average; torchtitan's sum, D = 1: half the share
        # on 2 ranks before D was read).
        share_num = np.where(averaged, s["share_num"] / (D * D), s["share_num"])
        share = np.sqrt(share_num / s["wq_grad_sq"])
        refused = m["refused"] > 0
        share = np.where((s["share_rows"] == 0) | ~(s["wq_grad_sq"] > 0) | refused, np.nan,
                         share)
        return HeadArrays(
            tie_ratio=np.where(s["rows"] == 0, np.nan, s["tied"] / np.maximum(s["rows"], 1.0)),
            max_logit=np.where(np.isneginf(m["max_logit"]), np.nan, m["max_logit"]),
            delta_sum=np.where(no_grad, np.nan, delta_sum),
            delta_sum_w=s["delta_sum"] / W, delta_sq_w=s["delta_sq"] / (W * W),
            delta_rows=s["delta_rows"], delta_missed=s["delta_missed"],
            G=np.where(no_grad[:, None, None], np.nan, G), share=share,
            wq_grad_sq=s["wq_grad_sq"], guarded=s["guarded"],
            sigma=np.where(np.isneginf(m["wq_spectral_norm"]) | refused, np.nan,
                           m["wq_spectral_norm"]), refused=refused)
