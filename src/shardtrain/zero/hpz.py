"""ZeRO++ hierarchical partitioning (hpZ): ``zero_optimization.zero_hpz_partition_size: H`` at stage 3.

[Note: secondary shards]
Plain ZeRO-3 gathers every unit over all data-parallel ranks twice per micro-step (forward, backward), both across
nodes. hpZ (ZeRO++, section 3.2) keeps the primary partition (all state sharded over all ``N`` ranks) and adds a
secondary one for backward: when a forward that records gradients releases a unit, each rank copies its ``1/H`` slice of
the just-gathered full buffer, the ``H`` ranks of a group being adjacent (one node). Backward gathers the unit from
those slices within the group: the same bytes, so the run is bit for bit plain ZeRO-3's.

A secondary shard lives until its unit's release in backward (or the end of backward, or the next forward), so each
micro-step's forward makes it again; units kept gathered for backward ([Note: kept after forward]) need none. It records
the primary shards it was cut from and their version counters: once an optimizer step, a checkpoint load or
``engine.gathered(modifier_rank=...)`` changed or replaced one, it is stale and the unit is gathered from the primary
shards instead. Memory, bytes and how DeepSpeed differs: docs/hybrid-sharding.md, "ZeRO++ hpZ".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardtrain.distributed.communicator import Communicator, Handle

if TYPE_CHECKING:
    from shardtrain.zero.layout import Bucket
    from shardtrain.zero.units import Unit


@dataclass
class _Secondary:
    """One unit's secondary shards, one per bucket, and the primary shards (with their versions) they came from."""

    slices: list[torch.Tensor]
    sources: list[tuple[torch.Tensor, int]]

    def fresh(self, buckets: list[Bucket]) -> bool:
        return all(b.shard is t and t._version == v for b, (t, v) in zip(buckets, self.sources, strict=True))

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slices)


class SecondaryShards:
    """The secondary shards of [Note: secondary shards] and the gathers served from them, over one hpZ group."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm  # the H adjacent data-parallel ranks of this rank's hpZ group
        self._held: dict[int, _Secondary] = {}  # by unit index
        self.held_bytes = 0
        self.max_held_bytes = 0  # most bytes held at once (tests and benchmarks read it)
        self.gathers = 0  # unit gathers served from secondary shards
        self.stale = 0  # secondary shards found stale when a gather wanted them

    def keep(self, unit: Unit) -> None:
        """Cut this rank's slice of ``unit``'s full buffers, which must hold the gathered values."""
        self.drop(unit)
        h, r = self.comm.size, self.comm.rank
        slices = []
        for b in unit.buckets:
            n = b.padded_numel // h  # padded_numel is a multiple of the data-parallel size, which H divides
            slices.append(b.flat_param.detach()[r * n : (r + 1) * n].clone())
        held = _Secondary(slices, [(b.shard, b.shard._version) for b in unit.buckets])
        self._held[unit.index] = held
        self.held_bytes += held.nbytes
        self.max_held_bytes = max(self.max_held_bytes, self.held_bytes)

    def usable(self, unit: Unit) -> bool:
        """Whether ``unit`` can be gathered from secondary shards (a stale one is dropped here)."""
        held = self._held.get(unit.index)
        if held is None:
            return False
        if not held.fresh(unit.buckets):
            self.stale += 1
            self.drop(unit)
            return False
        return True

    def all_gather(self, unit: Unit, position: int) -> Handle:
        """Issue the hpZ-group all-gather of ``unit``'s bucket ``position`` into its full buffer (storage in place)."""
        b = unit.buckets[position]
        if position == 0:
            self.gathers += 1
        return self.comm.all_gather(
            b.flat_param,
            self._held[unit.index].slices[position],
            what=f"parameters of unit {unit.name!r} from hpZ secondary shards",
            async_op=True,
        )

    def drop(self, unit: Unit) -> None:
        held = self._held.pop(unit.index, None)
        if held is not None:
            self.held_bytes -= held.nbytes

    def drop_all(self) -> None:
        self._held.clear()
        self.held_bytes = 0
