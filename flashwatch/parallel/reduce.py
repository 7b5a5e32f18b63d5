"""Cross-rank reduction of the watcher's per-head numbers, on the monitor's own group.

Every rank sums (or maxes) the same named tensors; each kind is packed into one float64
tensor and reduced by one `all_reduce`, so one monitored step costs a fixed number of
small collectives whose payload depends on the model (heads, sketch_dim), never on the
number of ranks. With n heads and k = sketch_dim the watcher packs
  SUM  n · (12 + k²) values + 1 (the step's sums, how many ranks hold each head, and
       how many ranks failed locally)
  MAX  9 · n + 2 values (max logit, W^Q spectral norm, three flags, the four mode
       fields of flashwatch/monitor/head_modes.py, the step count and its negative)
i.e. about 8 · n · (21 + k²) bytes; a ring or tree all_reduce sends and receives about
twice that per rank whatever the world size (n = 5,120, k = 8: 3.5 MB, ≈ 7.0 MB each
way). An all_gather would receive (world_size − 1) times that per rank.

Fault symmetry. A collective that one rank skips is paired by the backend with the next
collective of any other rank on the same group. On the training's group that is DDP's
gradient bucket: the job hangs, aborts ("collective mismatch"), or silently adds monitor
numbers to gradients. So:
  - the monitor talks on its own group (`MonitorGroup`), created once, collectively, when
    the watcher attaches: nothing of ours can ever pair with a training collective;
  - every rank issues the same collectives in the same order with the same shapes
    whatever failed locally: a failed local stage contributes zeros (sums) or -inf
    (maxes) and counts itself in `failed_ranks`, which the SUM carries, so every rank
    knows and decides the same thing;
  - the step count travels in the MAX (as +step and -step): ranks that reached different
    monitored steps (a state loaded on one rank only, an extra step() call) learn it
    and say so instead of mixing two steps' numbers;
  - a collective that raises (the group's timeout: a rank that never entered the step)
    marks the group broken: the monitor never communicates again in this process (a
    late partner would pair with a later collective of a different size, which gloo
    answers by aborting the process), and the watcher stops deciding.

Backend: gloo. The payload is a few MB of float64 that the watcher has already moved to
the host in its one device-to-host copy of the step; gloo reduces it there without a
second copy back to the GPU, without touching the GPU stream, and without an NCCL
communicator (which reserves GPU memory on every rank). `timeout` bounds how long a rank
waits for a partner that never comes; it must stay below the training's own collective
timeout (NCCL's default is 10 minutes), so that ours fires first and training goes on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from flashwatch._checks import check_float

log = logging.getLogger("flashwatch")

DEFAULT_TIMEOUT_S = 300.0  # WatchConfig.collective_timeout_s's default


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class MonitorGroup:
    """The monitor's own gloo process group over every rank of the default group.

    Create it on every rank at the same point (it is a collective: `dist.new_group`).
    Without torch.distributed, or with one rank, it holds no group and its collectives
    return their inputs."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = check_float("timeout_s", timeout_s, above=0,
                                     hint=f"seconds, default {DEFAULT_TIMEOUT_S:g}")
        self.broken: str | None = None  # why the group may no longer be used
        dist = _dist()
        self.world = dist.get_world_size() if dist else 1
        self.rank = dist.get_rank() if dist else 0
        self.group = None
        self._subgroups: dict = {}  # ranks -> a gloo group of ours (`subgroup`)
        if self.world > 1:
            self.group = dist.new_group(backend="gloo",
                                        timeout=timedelta(seconds=self.timeout_s))

    def check_same(self, **values: int) -> None:
        """At attach, on every rank (one MAX all_reduce of ±each value): raise
        ValueError on every rank if the ranks watch different layouts (head counts,
        sketch size, cadence), whose per-step collectives would not match. Bounded cost:
        once per watcher."""
        if self.group is None:
            return
        names = list(values)
        t = torch.tensor([s * float(values[k]) for k in names for s in (1, -1)],
                         dtype=torch.float64)
        self.all_reduce_(t, "max")
        differ = {k: (int(-t[2 * i + 1]), int(t[2 * i])) for i, k in enumerate(names)
                  if -t[2 * i + 1] != t[2 * i]}
        if differ:
            raise ValueError(
                "flashwatch.watch: the ranks watch different things: "
                + ", ".join(f"{k} ranges over {lo}..{hi}" for k, (lo, hi) in differ.items())
                + "; attach it on every rank to the same model with the same WatchConfig")

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def subgroup(self, group):
        """A gloo group of the monitor's own over the ranks of `group` (e.g. the dp group
        a tensor-parallel rank's rows are sharded over, or a pipeline stage's FSDP2
        mesh): made once, on first use, by those ranks only (use_local_synchronization),
        so the host power iteration can run there without touching the training's own
        group. The monitor's group itself where `group` spans every rank."""
        if self.covers(group):
            return self.group
        dist = _dist()
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        got = self._subgroups.get(ranks)
        if got is None:
            got = self._subgroups[ranks] = dist.new_group(
                list(ranks), backend="gloo", timeout=timedelta(seconds=self.timeout_s),
                use_local_synchronization=True)
        return got

    def covers(self, group) -> bool:
        """Whether `group` (e.g. an FSDP2 mesh's) spans the same ranks as ours, so a
        collective meant for it can run on ours instead."""
        dist = _dist()
        if dist is None or self.group is None:
            return False
        return sorted(dist.get_process_group_ranks(group)) == list(range(self.world))

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place over every rank, on the host. Raises RuntimeError once the group is
        broken; a failing collective breaks it (see the module docstring)."""
        if self.group is None:
            return
        if self.broken is not None:
            raise RuntimeError(f"flashwatch's process group is unusable since {self.broken}")
        dist = _dist()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        try:
            dist.all_reduce(t, op=ops[op], group=self.group)
        except Exception as e:
            self.broken = f"a collective failed ({type(e).__name__}: {e})"
            raise


@dataclass
class Reduced:
    """What every rank gets back from `exchange`, identical on every rank: numpy float64
    arrays, read from the memory the collectives wrote (see `Buffers`)."""

    sums: dict[str, np.ndarray]
    maxes: dict[str, np.ndarray]
    failed_ranks: int  # ranks whose local stage failed (their numbers are missing)
    steps: tuple[int, int]  # (lowest, highest) step count among the ranks
    local_error: Exception | None = None  # this rank's packing failed (it sent fills)

    @property
    def in_step(self) -> bool:
        return self.steps[0] == self.steps[1]


class Buffers:
    """The exchange's host vectors, allocated once per watcher: numpy arrays whose memory
    the collectives' tensors share. Between two collectives of a monitored step every
    rank fills and reads them with numpy alone, so no torch call that fails on one rank
    can change which collective it issues next (a failed pack writes numpy fills)."""

    def __init__(self, shapes: dict[str, tuple]):
        self.shapes = dict(shapes)
        self.sum_keys = [k for k in shapes if not k.startswith("max:")]
        self.max_keys = [k for k in shapes if k.startswith("max:")]
        size = {k: math.prod(v) for k, v in shapes.items()}
        self.sums = np.zeros(sum(size[k] for k in self.sum_keys) + 1)  # + failed ranks
        self.maxes = np.zeros(sum(size[k] for k in self.max_keys) + 2)  # + ±step
        self.vote = np.zeros(4)  # StepPipeline's vote: [failed, hash, -hash, -source]
        self.flag = np.zeros(1)  # QK-clip's commit: [some rank failed to prepare]
        self.sums_t, self.maxes_t, self.vote_t, self.flag_t = (torch.from_numpy(a) for a in (
            self.sums, self.maxes, self.vote, self.flag))


def exchange(monitor: MonitorGroup | None, sums: dict[str, torch.Tensor] | None,
             maxes: dict[str, torch.Tensor] | None, shapes: dict[str, tuple], *,
             step: int, buffers: Buffers | None = None, failed: bool = False) -> Reduced:
    """One SUM and one MAX all_reduce of a monitored step, issued whatever failed.

    `shapes` names every summed and maxed tensor and its shape (the same on every rank:
    it comes from the watched model, never from what was measured). `sums`/`maxes` None
    means this rank's local stage failed: it contributes zeros and -inf and counts
    itself in `failed_ranks`; `failed` counts it there too while it sends what it gives
    (fills for what it failed to measure, and facts that must still go out, e.g. the
    watcher's head modes). `buffers`: the watcher's (new ones if None)."""
    buf = buffers if buffers is not None else Buffers(shapes)
    error = None
    counted = failed or sums is None or maxes is None
    packed = sums is not None and maxes is not None
    if packed:
        try:
            buf.sums[:-1] = _pack(sums, buf.sum_keys, shapes, strip="").numpy()
            buf.maxes[:-2] = _pack(maxes, buf.max_keys, shapes, strip="max:").numpy()
        except Exception as e:  # still take part, with the fills of a failed rank
            packed, counted, error = False, True, e
    if not packed:
        buf.sums[:-1], buf.maxes[:-2] = 0.0, -math.inf
    buf.sums[-1] = float(counted)
    buf.maxes[-2:] = (float(step), -float(step))
    if monitor is not None:
        monitor.all_reduce_(buf.sums_t, "sum")
        monitor.all_reduce_(buf.maxes_t, "max")
    return Reduced(sums=_unpack(buf.sums, buf.sum_keys, shapes, strip=""),
                   maxes=_unpack(buf.maxes, buf.max_keys, shapes, strip="max:"),
                   failed_ranks=int(buf.sums[-1]),
                   steps=(int(-buf.maxes[-1]), int(buf.maxes[-2])), local_error=error)


def _pack(values, keys, shapes, strip) -> torch.Tensor:
    parts = []
    for k in keys:
        t = values[k.removeprefix(strip) if strip else k]
        if tuple(t.shape) != tuple(shapes[k]):
            raise ValueError(f"{k} has shape {tuple(t.shape)}, expected {shapes[k]}")
        parts.append(t.detach().to("cpu", torch.float64).reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _unpack(vec: np.ndarray, keys, shapes, strip) -> dict[str, np.ndarray]:
    """Copies (numpy only): the buffers are reused by the next exchange."""
    out, i = {}, 0
    for k in keys:
        n = math.prod(shapes[k])
        out[k.removeprefix(strip) if strip else k] = vec[i:i + n].reshape(shapes[k]).copy()
        i += n
    return out


def all_reduce(sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor],
               monitor: MonitorGroup | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Sum every tensor of `sums` and max every tensor of `maxes` over all ranks of
    `monitor` (no group or one rank: float64 copies of the inputs).

    Returns new dicts with the same keys, shapes and float64 CPU tensors. Every rank must
    pass the same keys with the same shapes, in the same order."""
    for name, group in (("sums", sums), ("maxes", maxes)):
        if not isinstance(group, dict):
            raise TypeError(f"{name} must be a dict of name -> tensor, got "
                            f"{type(group).__name__}")
        for key, t in group.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got "
                                f"{type(t).__name__}")
    out = []
    for group, op in ((sums, "sum"), (maxes, "max")):
        shapes = {k: tuple(t.shape) for k, t in group.items()}
        vec = _pack(group, list(group), shapes, strip="") if group else None
        if vec is not None and monitor is not None:
            monitor.all_reduce_(vec, op)
        out.append({} if vec is None else {k: torch.from_numpy(v) for k, v in _unpack(
            vec.numpy(), list(group), shapes, strip="").items()})
    return out[0], out[1]
