"""Parameter offload in graph mode: a unit's shard read from its swap file by an operation of the graph.

[Note: swapped shards in graphs]
With ``offload_param: {device: nvme}`` a unit bucket's ``shard`` is a tensor over a shared mapping of its swap file
([Note: parameter offload] in :mod:`shardtrain.offload.parameters`). Handing the graph the mappings as inputs would
let the all-gather read them by page faults (far slower than one read: docs/offload.md, "Parameter offload") and
leave every touched page resident until the next optimizer step: every shard by the end of forward. So the graph
reads the shard itself: :func:`read_shard` (``shardtrain::read_swapped_shard``) is an opaque custom operation whose
value is a copy of its input read from the file the input maps (one page cache, so it sees every update made through
the mapping); its input costs no memory, its output is the all-gather's send buffer. :mod:`shardtrain.graph.sharded`
treats it as part of its gather: the partitioner recomputes it (backward reads the file again before re-gathering,
except for the kept units: [Note: kept in the graph]) and the schedule issues it right before the all-gather, one
unit ahead. The buffer dies after the all-gather, so at most the current and the prefetched unit hold one, as in eager
ZeRO-3 and ZeRO-Infinity (at data-parallel size 1 the buffer is the gathered unit itself). :class:`SwappedShards`
counts the live buffers (``most_live``) for tests.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from shardtrain.offload.parameters import ParamOffload

_OWNERS: weakref.WeakSet = weakref.WeakSet()  # live SwappedShards; the operation finds a mapping's owner among them


class SwappedShards:
    """The unit buckets of ``offload`` whose shards are in swap files, found by their mapping's address."""

    def __init__(self, offload: ParamOffload, units: list) -> None:
        self.offload = offload
        self._by_address = {
            b.shard.data_ptr(): b
            for u in units
            if u.index in offload.mapped_units
            for b in u.buckets
            if b.shard.numel()
        }
        self.bucket_indices = frozenset(b.index for b in self._by_address.values())
        self._lock = threading.Lock()
        self.live = 0  # buffers read by the graph and not yet freed
        self.most_live = 0  # the most at once since the last reset_most_live()
        self.reads = 0
        _OWNERS.add(self)

    def read(self, mapped: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``mapped`` read from its swap file, or None if it is no shard of this object's."""
        b = self._by_address.get(mapped.data_ptr())
        if b is None or b.shard.data_ptr() != mapped.data_ptr():
            return None
        out = self.offload.read_shard(b)
        with self._lock:
            self.live += 1
            self.most_live = max(self.most_live, self.live)
            self.reads += 1
        # when the buffer's memory is freed: its storage, not the tensor, which a view or an alias without a base
        # reference (detach) can outlive (a storage's Python object lives as long as the storage)
        weakref.finalize(out.untyped_storage(), self._freed)
        return out

    def _freed(self) -> None:
        with self._lock:
            self.live -= 1

    def reset_most_live(self) -> None:
        with self._lock:
            self.most_live = self.live


@torch.library.custom_op("shardtrain::read_swapped_shard", mutates_args=())
def read_shard(mapped: torch.Tensor) -> torch.Tensor:
    """A copy of ``mapped``: read from the swap file it maps where it is a swapped shard (see [Note: swapped
    shards in graphs]), else copied."""
    for owner in list(_OWNERS):
        out = owner.read(mapped)
        if out is not None:
            return out
    return mapped.clone()


@read_shard.register_fake
def _(mapped: torch.Tensor) -> Any:
    return torch.empty_like(mapped)
