"""The global head table: every watched head of the job once, keyed by (layer name, head).

A layer is known by its fully qualified name in the user's model, never by its position
in one rank's list: under pipeline parallelism stage 0 holds `layers.0` and `layers.1`,
stage 1 `layers.2` and `layers.3`, and a reduction by position would add stage 1's
numbers to stage 0's heads. So at attach every rank sends the names and head counts of
the layers it holds (one all_gather_object on the monitor's group), and every rank builds
the same table from them:

- the layers in the order they are first held (rank 0's in its order, then the names
  only rank 1 holds, ...): the model's order under PP, a rank's own order under DP;
- for each layer, its global head count, and for each head the number of ranks that
  hold it at attach (`holders`): every rank under DDP and FSDP2 (replicas), one stage
  under PP (placed: the other ranks contribute fills); a rank may hold a range of a
  layer's heads (tensor parallelism: its heads sit at their global indices). The
  replica counts the numbers are scaled by travel in every exchange instead
  (flashwatch/monitor/aggregate.py HOLDERS): a layer split by tensor parallelism after
  attach changes them, never the table's keys;
- a name held by two ranks must have the same head count on both, or attach fails on
  every rank with the names and counts (never a silent mix).

Every monitored step then exchanges arrays over the whole table (flashwatch/parallel/
reduce.py): each rank places its layers' numbers at their global offsets, and every
rank ends the step with the same table. A rank that holds no attention layer (an
embedding-only pipeline stage) holds an empty part and still joins every collective.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadTable:
    """The job's watched layers: `layers[i] = (name, num_heads)` (global heads) and, per
    global head, how many ranks hold it (`holders`, in table order). The same object on
    every rank."""

    layers: tuple[tuple[str, int], ...]
    holders: tuple[int, ...]
    # per layer, what the first rank holding it said of it beyond its heads (a dict of
    # plain values, e.g. QK-clip's global K head count and QK-norm): ranks that do not
    # hold a layer still book its heads' clips (flashwatch/mitigation/qkclip.py)
    facts: tuple[dict, ...] = ()

    @property
    def n(self) -> int:
        return sum(h for _, h in self.layers)

    @property
    def keys(self) -> list[tuple[str, int]]:
        """(layer name, global head) of every head, in table order."""
        return [(name, h) for name, heads in self.layers for h in range(heads)]

    def offset(self, name: str, first_head: int = 0) -> int:
        """Index of `name`'s head `first_head` in the table's per-head arrays."""
        at = 0
        for layer, heads in self.layers:
            if layer == name:
                return at + first_head
            at += heads
        raise KeyError(f"layer {name!r} is not in the head table")

    def index(self, name: str) -> int:
        return [layer for layer, _ in self.layers].index(name)

    def layer_facts(self, name: str) -> dict:
        return self.facts[self.index(name)] if self.facts else {}


def build(per_rank: list[list[tuple]]) -> HeadTable:
    """The table from every rank's layers, in rank order: (name, num_heads) for a whole
    layer, or (name, num_heads, first_head, local_heads) for the heads [first_head,
    first_head + local_heads) of a layer of num_heads global heads that the rank holds
    (tensor parallelism: whole heads per rank), the latter optionally followed by a dict
    of facts about the layer (`HeadTable.facts`; the first holder's are kept). Raises
    ValueError, naming the layer and the ranks, where ranks disagree on a layer's global
    head count, a rank lists a layer twice, a range falls outside the layer, or some
    head is held by no rank."""
    order: list[str] = []
    heads: dict[str, int] = {}
    first_rank: dict[str, int] = {}
    held: dict[str, list[int]] = {}
    facts: dict[str, dict] = {}
    for rank, layers in enumerate(per_rank):
        seen = set()
        for entry in layers:
            name, h = entry[0], entry[1]
            first, count = (entry[2], entry[3]) if len(entry) >= 4 else (0, h)
            if len(entry) == 5:
                facts.setdefault(name, dict(entry[-1]))
            if name in seen:
                raise ValueError(f"flashwatch.watch: rank {rank} watches layer {name!r} "
                                 f"twice; list each attention module once")
            seen.add(name)
            if name not in heads:
                order.append(name)
                heads[name], first_rank[name] = h, rank
                held[name] = [0] * h
            elif heads[name] != h:
                raise ValueError(
                    f"flashwatch.watch: layer {name!r} has {heads[name]} heads on rank "
                    f"{first_rank[name]} but {h} on rank {rank}; ranks that hold the same "
                    f"layer must agree on its global head count (under tensor "
                    f"parallelism each rank holds a range of them)")
            if not 0 <= first < first + count <= h:
                raise ValueError(f"flashwatch.watch: rank {rank} holds heads "
                                 f"{first}..{first + count - 1} of layer {name!r}, which "
                                 f"has {h}")
            for j in range(first, first + count):
                held[name][j] += 1
    for name in order:
        missing = [j for j, r in enumerate(held[name]) if r == 0]
        if missing:
            raise ValueError(f"flashwatch.watch: heads {missing} of layer {name!r} are held "
                             f"by no rank; every rank that holds part of a layer must "
                             f"watch it")
    return HeadTable(layers=tuple((name, heads[name]) for name in order),
                     holders=tuple(r for name in order for r in held[name]),
                     facts=tuple(facts.get(name, {}) for name in order))


def gather(monitor, local: list[tuple]) -> HeadTable:
    """Every rank's layers through the monitor's group (one all_gather_object at attach;
    none without torch.distributed or with one rank)."""
    if not monitor.distributed:
        return build([local])
    import torch.distributed as dist

    per_rank: list = [None] * monitor.world
    dist.all_gather_object(per_rank, [tuple(e) for e in local], group=monitor.group)
    return build([[(str(e[0]), *map(int, e[1:4]), *e[4:]) for e in layers]
                  for layers in per_rank])
