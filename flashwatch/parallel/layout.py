"""The global head table: every watched head of the job once, keyed by (layer name, head).

A layer is known by its fully qualified name in the user's model, never by its position
in one rank's list: under pipeline parallelism stage 0 holds `layers.0` and `layers.1`,
stage 1 `layers.2` and `layers.3`, and a reduction by position would add stage 1's
numbers to stage 0's heads. So at attach every rank sends the names and head counts of
the layers it holds (one all_gather_object on the monitor's group), and every rank builds
the same table from them:

- the layers in the order they are first held (rank 0's in its order, then the names
  only rank 1 holds, ...): the model's order under PP, a rank's own order under DP;
- for each layer, its global head count and the ranks that hold it (`holders`): every
  rank under DDP and FSDP2 (replicas: their numbers are summed and scaled by the holder
  count), one stage under PP (placed: the other ranks contribute fills);
- a name held by two ranks must have the same head count on both, or attach fails on
  every rank with the names and counts (never a silent mix).

Every monitored step then exchanges arrays over the whole table (flashwatch/parallel/
reduce.py): each rank places its layers' numbers at their global offsets, and every
rank ends the step with the same table. A rank that holds no attention layer (an
embedding-only pipeline stage) holds an empty part and still joins every collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadTable:
    """The job's watched layers: `layers[i] = (name, num_heads)`, `holders[i]` = how many
    ranks hold layer i. The same object on every rank."""

    layers: tuple[tuple[str, int], ...]
    holders: tuple[int, ...]

    @property
    def n(self) -> int:
        return sum(h for _, h in self.layers)

    @property
    def keys(self) -> list[tuple[str, int]]:
        """(layer name, head) of every global head, in table order."""
        return [(name, h) for name, heads in self.layers for h in range(heads)]

    def offset(self, name: str) -> int:
        """Index of `name`'s head 0 in the table's per-head arrays."""
        at = 0
        for layer, heads in self.layers:
            if layer == name:
                return at
            at += heads
        raise KeyError(f"layer {name!r} is not in the head table")

    def index(self, name: str) -> int:
        return [layer for layer, _ in self.layers].index(name)

    def head_holders(self) -> torch.Tensor:
        """[n] float64: how many ranks hold each head (its replica count)."""
        return torch.tensor([float(r) for (_, h), r in zip(self.layers, self.holders,
                                                           strict=True) for _ in range(h)],
                            dtype=torch.float64)


def build(per_rank: list[list[tuple[str, int]]]) -> HeadTable:
    """The table from every rank's [(layer name, num_heads)] (rank order). Raises
    ValueError, naming the layer and the ranks, where ranks disagree on a layer's heads
    or a rank lists a layer twice."""
    order: list[str] = []
    heads: dict[str, int] = {}
    held_by: dict[str, list[int]] = {}
    for rank, layers in enumerate(per_rank):
        seen = set()
        for name, h in layers:
            if name in seen:
                raise ValueError(f"flashwatch.watch: rank {rank} watches layer {name!r} "
                                 f"twice; list each attention module once")
            seen.add(name)
            if name not in heads:
                order.append(name)
                heads[name] = h
            elif heads[name] != h:
                raise ValueError(
                    f"flashwatch.watch: layer {name!r} has {heads[name]} heads on rank "
                    f"{held_by[name][0]} but {h} on rank {rank}; ranks that hold the same "
                    f"layer must watch it with the same head count (under tensor "
                    f"parallelism, give each rank's local heads)")
            held_by.setdefault(name, []).append(rank)
    return HeadTable(layers=tuple((name, heads[name]) for name in order),
                     holders=tuple(len(held_by[name]) for name in order))


def gather(monitor, local: list[tuple[str, int]]) -> HeadTable:
    """Every rank's layers through the monitor's group (one all_gather_object at attach;
    none without torch.distributed or with one rank)."""
    if not monitor.distributed:
        return build([local])
    import torch.distributed as dist

    per_rank: list = [None] * monitor.world
    dist.all_gather_object(per_rank, list(local), group=monitor.group)
    return build([[(str(n), int(h)) for n, h in layers] for layers in per_rank])
