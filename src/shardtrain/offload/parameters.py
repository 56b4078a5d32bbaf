"""Stage-3 parameter shards in swap files, mapped into memory and read whole before a unit is gathered
(DeepSpeed's ZeRO-Infinity for parameters).

[Note: parameter offload]
At stage 3 with ``offload_param: {device: nvme}`` each unit bucket's shard (compute dtype) becomes a tensor over a
shared mapping of its own file, preallocated with ``posix_fallocate`` (a full disk fails at ``initialize``, never
later as a SIGBUS), so every reader and writer of ``bucket.shard`` works on it unchanged. Gathers do not touch the
mapping, whose page faults are far slower than one read (docs/offload.md, "Parameter offload"): the gather service
([Note: one gather service] in :mod:`shardtrain.zero.gather`) calls ``will_need`` before a unit's all-gather
(prefetches too), which reads each shard with one positional read into a new buffer and points ``bucket.shard`` at
it; ``done_with``, after the all-gather, points it back at the mapping and frees the buffer. File and mapping share
one page cache, so the read sees every change made through the mapping. At most ``buffer_count`` units hold a read
buffer; a unit gathered past that (a deep prefetch) is read through its mapping (``MADV_WILLNEED``, page faults). The
optimizer step updates shards in place through the mapping, and as each sub-group is stepped the pages of its tensors
in a mapped shard are dropped (:func:`release_mapped`, ``MADV_DONTNEED``; changed pages stay in the page cache), so a
step holds one sub-group's pages, not every page it touched (in fp32 the whole shard: what the offload keeps out).
Units stay in ordinary memory, in unit order, while they fit in ``max_in_cpu`` elements.

Swap directories, files, the page-cache policy and :class:`OffloadError` are in :mod:`shardtrain.offload.swap`.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import weakref
from typing import TYPE_CHECKING

import torch

from shardtrain.offload.swap import (
    DROP_BYTES,
    OffloadError,
    ScratchDir,
)

if TYPE_CHECKING:
    from shardtrain.zero.layout import Bucket, UnitBuckets


# -- parameter offload (stage 3) ---------------------------------------------------------------------


_PARAM_OFFLOADS: weakref.WeakSet = weakref.WeakSet()  # live ParamOffloads, whose mappings release_mapped knows
PAGE = mmap.PAGESIZE


def release_mapped(tensors: list[torch.Tensor]) -> int:
    """Drop from this process the pages of ``tensors`` that lie in a parameter swap file's mapping (see [Note:
    parameter offload]); changed pages stay in the page cache until the kernel writes them back. A page shared
    with a neighbouring tensor is dropped too: its next use reads it again from the page cache. Tensors in
    ordinary memory are left alone. Returns the bytes of mapping advised."""
    released = 0
    for offload in list(_PARAM_OFFLOADS):
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes:
                released += offload.release_range(t.data_ptr(), nbytes)
    return released


class ParamOffload:
    """Stage-3 unit shards kept in files (see [Note: parameter offload]): each unit bucket's ``shard`` becomes
    a tensor over a shared mapping of its own preallocated file."""

    def __init__(
        self, units: list[UnitBuckets], scratch: ScratchDir, rank: int, max_in_cpu: int, buffer_count: int = 5
    ) -> None:
        """``units``: in unit order (a unit's index is its position), each with its ``buckets``: the layout's
        ``unit_buckets``, since this object is made before the unit runtime, which is handed it as its shards'
        source ([Note: one gather service] in :mod:`shardtrain.zero.gather`)."""

        self.rank, self.scratch, self.buffer_count = rank, scratch, buffer_count
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}  # bucket index -> (mapping, bytes)
        self.mapped_units: set[int] = set()
        self._held: dict[int, list[tuple[Bucket, torch.Tensor]]] = {}  # unit -> (bucket, its mapped shard) read
        self.most_ahead = 0  # the most units held in read buffers at once (tests read it)
        self.reads = 0  # shards read into a buffer with one call each (tests and the benchmark read these)
        self.bytes_read = 0
        self._bases: list[tuple[int, int]] = []  # sorted (address, bucket index) of every mapping
        kept = 0
        for index, unit in enumerate(units):  # the first units up to max_in_cpu elements stay in memory
            numel = sum(b.shard.numel() for b in unit.buckets)
            if kept + numel <= max_in_cpu:
                kept += numel
                continue
            self.mapped_units.add(index)
            for b in unit.buckets:
                self._map_bucket(b)
        _PARAM_OFFLOADS.add(self)

    def _map_bucket(self, b: Bucket) -> None:

        path = self.scratch.path / f"param-{b.index}.bin"
        nbytes = b.shard.numel() * b.shard.element_size()
        if nbytes == 0:
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # the blocks exist now: a full disk cannot surface later
                mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as err:
            raise OffloadError(
                f"rank {self.rank}: cannot make the parameter swap file {str(path)!r} ({nbytes} bytes): "
                f"{err.strerror or err}"
            ) from None
        shard = torch.frombuffer(mapping, dtype=b.shard.dtype, count=b.shard.numel())
        shard.copy_(b.shard)
        b.shard = shard
        self._maps[b.index] = (mapping, nbytes)
        bisect.insort(self._bases, (shard.data_ptr(), b.index))
        mapping.madvise(mmap.MADV_DONTNEED)

    def release_range(self, address: int, nbytes: int) -> int:
        """``MADV_DONTNEED`` on the whole pages of ``[address, address + nbytes)`` that lie in one of this
        object's mappings (a tensor is a view of one bucket's shard at most); the bytes advised."""
        k = bisect.bisect_right(self._bases, (address, float("inf"))) - 1
        if k < 0:
            return 0
        base, index = self._bases[k]
        mapping, size = self._maps[index]
        start, end = address - base, min(address - base + nbytes, size)
        if start >= size or end <= 0:
            return 0
        start = start // PAGE * PAGE  # madvise needs a page-aligned start; a shared edge page is read again
        end = min(-(-end // PAGE) * PAGE, size)
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
        return end - start

    def _advise(self, unit, advice: int) -> None:
        for b in unit.buckets:
            if b.index in self._maps:
                self._maps[b.index][0].madvise(advice)

    def read_shard(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s shard from its file into new memory, with one positional read (see [Note: parameter
        offload]): the disk's sequential speed, where touching the mapping read it by page faults."""
        path = self.scratch.path / f"param-{b.index}.bin"
        out = torch.empty_like(b.shard)
        data = memoryview(out.view(torch.uint8).numpy())
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                done = 0
                while done < len(data):
                    n = os.preadv(fd, [data[done:]], done)
                    if n <= 0:
                        raise OSError(0, f"the file ends after {done} of {len(data)} bytes")
                    done += n
                if done >= DROP_BYTES:  # see [Note: page cache] in shardtrain.offload.swap
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as err:
            raise OffloadError(
                f"rank {self.rank}: reading parameters from {str(path)!r} failed: {err.strerror or err}"
            ) from None
        self.reads += 1
        self.bytes_read += done
        return out

    def will_need(self, unit) -> None:
        """Just before a unit's all-gather is issued (in gather order, prefetches included): read its shards into
        buffers that the all-gather sends from, while fewer than ``buffer_count`` units hold one; a unit past that
        is gathered from its mapping (read by page faults) and its buffer-less shard asked for (``WILLNEED``)."""

        if unit.index not in self.mapped_units or unit.index in self._held:
            return
        if len(self._held) >= self.buffer_count:
            self._advise(unit, mmap.MADV_WILLNEED)
            return
        held = []
        for b in unit.buckets:
            if b.index in self._maps:
                held.append((b, b.shard))
                b.shard = self.read_shard(b)
        self._held[unit.index] = held
        self.most_ahead = max(self.most_ahead, len(self._held))

    def issuing(self, unit) -> contextlib.AbstractContextManager[None]:
        """The all-gathers send from host memory here: nothing to order them after."""
        return contextlib.nullcontext()

    def done_with(self, units) -> None:
        """Once gathered (or after the optimizer step, every unit): a read buffer is freed, the bucket's shard is
        its mapping again, and the mapping's pages leave this process (written back by the kernel when changed;
        read again on use)."""

        for unit in units:
            for b, mapped in self._held.pop(unit.index, []):
                b.shard = mapped
            self._advise(unit, mmap.MADV_DONTNEED)

    def mapped_bytes(self) -> int:
        return sum(n for _, n in self._maps.values())
