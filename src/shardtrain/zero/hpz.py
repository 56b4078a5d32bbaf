"""ZeRO++ hierarchical partitioning (hpZ): ``zero_optimization.zero_hpz_partition_size: H`` at stage 3.

[Note: secondary shards]
Plain ZeRO-3 gathers every unit twice per micro-step over every data-parallel rank: once for forward, once more for
backward. Across nodes both gathers cross the network. hpZ (ZeRO++, Wang et al. 2023, section 3.2) keeps the primary
partition as it is (parameters, gradients and optimizer state sharded over all ``N`` data-parallel ranks, so state
memory is still ``1/N``) and adds a *secondary* one for the backward gather: when a forward that records gradients
releases a unit, each rank first copies its ``1/H`` slice of the unit's full flat buffer (compute dtype, the values
just gathered), where the ``H`` ranks of an hpZ group are adjacent (one node). Backward then gathers the unit from
those slices within the group (``(H-1)/H`` of its bytes, none across nodes) instead of from the primary shards
over everyone. The values are the same bytes, so the run is bit for bit plain ZeRO-3's.

Lifetime. A secondary shard lives from the forward release of its unit to that unit's release in backward (or the
end of backward, or the next forward, whichever comes first): a rank holds at most the secondary shards of the units
between their forward and their backward, ``sum(unit bytes) / H`` when every unit is in that window (the end of a
forward). Units a forward keeps gathered for backward ([Note: kept after forward]) need none. Every forward makes
them again from its own gather, so gradient accumulation's micro-steps each refresh them. A secondary shard records
the primary shards it was cut from and their version counters: after an optimizer step, a checkpoint load or
``engine.gathered(modifier_rank=...)`` has changed a shard in place (or replaced it), it is stale, and the unit is
gathered from the primary shards instead (as plain ZeRO-3 would), never from the stale copy.

DeepSpeed differs in two ways that change bytes and memory, not values: it keeps the secondary tensors until the
optimizer step (memory ``P/H`` for the whole step), and then serves every gather from them, so the forwards of later
micro-steps also stay in the node. Here they are dropped after their unit's backward; the forward of every
micro-step gathers over all ranks.
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
