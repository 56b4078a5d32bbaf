"""Gradient shards in swap files while a step accumulates, and the step that reads them back (DeepSpeed's
ZeRO-Infinity for gradients).

[Note: gradient offload]
At stages 2-3 the reducer keeps this rank's fp32 gradient shard per bucket for the whole step, as much memory as the
fp32 parameters. With the optimizer state on ``nvme`` the shards go to files too, as ZeRO-Infinity swaps gradient
partitions: a completed reduce-scatter is handed to :meth:`GradOffload.fold`, which writes ``bucket<i>.grad.bin`` on
an I/O thread (one write in flight, overlapped by the next reduction); the reducer keeps no in-memory shard for the
bucket (:class:`~shardtrain.zero.reducer.GradientFiles`). Later micro-steps read, ``add_`` and write back. Fragment
norms are taken at the last micro-step while the result is in memory (under a loss scale each file is read once more,
one bucket at a time, for the unscaled norms). The step is the in-memory one ([Note: the one step] in
:mod:`shardtrain.zero.optimizer`) with these gradients *deferred*: this rank's I/O failure rides on the norm's
all-reduce (so every rank raises), and each sub-group's gradients are read into its swap buffer with its state and
unscaled and clipped there by the same multiplications, so the numbers are bitwise the in-memory ones. A rank holds
one bucket's reduced gradient on its way out plus ``buffer_count`` sub-groups of gradients with their state. Not
built (gradients stay in memory) on CUDA, with tensor parallelism or hybrid sharding (their norm and replica
all-reduce read the shards), or for buckets graph mode reduced; decided before the reducer exists
(:func:`~shardtrain.offload.optimizer_state.build_gradient_sinks`).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from shardtrain.distributed.communicator import Communicator
from shardtrain.offload.swap import GRAD, OffloadError, SwapFiles

if TYPE_CHECKING:
    from shardtrain.zero.layout import Bucket


# -- gradients in swap files ----------------------------------------------------------------------


class GradOffload:
    """The reducer's fp32 gradient shards in swap files, one per bucket, read back one sub-group at a time with
    the optimizer state (see [Note: gradient offload]). Built before the reducer, which is handed it: ``buckets``
    are the reducer's (a bucket's *position* is its index in this list), ``where[i]`` the bucket position, element
    offset in the bucket's shard, length and fragment index of member ``i`` (the stepped tensors, in the optimizer
    wrapper's order: :func:`~shardtrain.zero.layout.fragment_places`)."""

    def __init__(self, files: SwapFiles, buckets: list[Bucket], where: list[tuple[int, int, int, int]]) -> None:
        self.files, self.buckets, self.where = files, buckets, where
        # every bucket's gradient shard is in its file from the start: the reducer makes no in-memory shard for them
        # (as much memory as the rank's fp32 parameters)
        self.on_disk: set[int] = set(range(len(buckets)))  # bucket positions whose gradient shard is in its file
        self._zeroed = True  # no backward reached the gradients since they were zeroed (told at each step: deferred)
        self._norms: dict[int, list[torch.Tensor | None]] = {}  # position -> each fragment's gradient norm
        self._writes: deque[Future] = deque()
        self._error: str | None = None  # the first I/O failure since the last step (raised there, on every rank)
        self.bytes_in_flight = 0  # gradient bytes in memory on their way to or from the files
        self.peak_bytes = 0  # the most of them at once (tests read it)
        self._lock = threading.Lock()

    def _name(self, position: int) -> str:
        return f"bucket{self.buckets[position].index}"

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_in_flight += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_flight)

    def _wait(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` writes are in flight; a failure is kept for the step to report."""
        while len(self._writes) > keep:
            try:
                self._writes.popleft().result()
            except OffloadError as err:
                self._error = self._error or str(err)

    def _write(self, position: int, g: torch.Tensor) -> None:
        nbytes = g.numel() * g.element_size()
        self._count(nbytes)

        def write() -> None:
            try:
                self.files.write(self._name(position), GRAD, g)
            finally:
                self._count(-nbytes)

        self._wait(keep=0)  # one shard on its way at a time: the next bucket's reduction overlaps it
        self._writes.append(self.files.submit(write))

    def fold(self, position: int, bucket: Bucket, out: torch.Tensor, fresh: bool, boundary: bool) -> None:
        """The reducer's hook: ``out``, this rank's reduced gradient of ``bucket`` for one micro-step, goes to the
        bucket's file (``fresh``: the first micro-step since the gradients were zeroed, else added to what the file
        holds). ``boundary``: the last micro-step: each fragment's norm is taken now, while it is in memory.
        Never raises (a failure on one rank would leave the others waiting in backward's next collective): the
        step reports it on every rank."""
        if bucket.shard_numel == 0:
            return
        if fresh:
            g = out if out.dtype == torch.float32 else out.to(torch.float32)
        else:  # gradient accumulation: what earlier micro-steps left, plus this one (the in-memory add_)
            self._wait()
            g = torch.empty(bucket.shard_numel, dtype=torch.float32)
            try:
                self.files.read(self._name(position), GRAD, g)
            except OffloadError as err:
                self._error = self._error or str(err)
            g.add_(out)
        if boundary:
            self._norms[position] = self._fragment_norms(bucket, g)
        self._write(position, g)

    def keep_in_memory(self, positions: list[int]) -> list[int]:
        """The reducer's hook when graph mode takes over these buckets' reductions (it adds into the in-memory
        shards itself): they never go to files again. Returns those that were in files, which the reducer gives
        zeroed in-memory shards."""
        moved = [p for p in positions if p in self.on_disk]
        self.on_disk.difference_update(moved)
        return moved

    @staticmethod
    def _fragment_norms(bucket: Bucket, g: torch.Tensor) -> list[torch.Tensor | None]:
        """Each fragment's norm as the in-memory step takes it (``torch._foreach_norm``, tensor by tensor)."""
        parts = [g[f.shard_offset : f.shard_offset + f.length] for f in bucket.fragments if f.length]
        norms = iter(torch._foreach_norm(parts) if parts else [])
        return [next(norms) if f.length else None for f in bucket.fragments]

    def read(self, member: int, out: torch.Tensor) -> None:
        """Member ``member``'s gradient into ``out`` (1-D): zeros when no backward ran since they were zeroed."""
        position, offset, _, _ = self.where[member]
        if self._zeroed:
            out.zero_()
            return
        self.files.read(self._name(position), GRAD, out, offset * out.element_size())

    def load(self, member: int) -> torch.Tensor:
        """Member ``member``'s gradient in new memory (a sub-group whose state stays in memory)."""
        out = torch.empty(self.where[member][2], dtype=torch.float32)
        self.read(member, out)
        return out

    def _reread_norms(self, position: int, scale: float) -> list[torch.Tensor | None]:
        """Fragment norms of the unscaled gradients (a loss scale): the shard is read once more for them."""
        bucket = self.buckets[position]
        g = torch.empty(bucket.shard_numel, dtype=torch.float32)
        self.files.read(self._name(position), GRAD, g)
        parts = [g[f.shard_offset : f.shard_offset + f.length] for f in bucket.fragments if f.length]
        if parts:
            torch._foreach_mul_(parts, scale)
        return self._fragment_norms(bucket, g)

    # -- what the one step asks of swapped gradients ([Note: the one step] in shardtrain.zero.optimizer) --
    @property
    def failed(self) -> bool:
        return self._error is not None

    def deferred(self, stepped: list[bool], zeroed: bool) -> frozenset[int]:
        """The members stepped now (``stepped[i]``) whose gradient is in a file, once the writes in flight are done:
        read with their sub-group's state. The others are in memory: a bucket graph mode reduces, or an empty
        fragment (stepped like any other: its scalar state counts the step). ``zeroed``: no backward reached the
        gradients since they were zeroed: this step reads them as zeros."""
        self._wait()
        self._zeroed = zeroed
        return frozenset(
            i
            for i, (position, _, n, _) in enumerate(self.where)
            if stepped[i] and n and position in self.on_disk  # frozen for this whole step: not read nor counted
        )

    def deferred_norms(self, deferred: frozenset[int], inv_scale: float | None) -> dict[int, torch.Tensor]:
        """Each deferred member's norm: taken at the last micro-step's write (``fold``), or, under a loss scale,
        from the unscaled gradients read once more (one bucket held at a time). An I/O failure is kept for the
        norm's all-reduce to report on every rank (the norms are then zeros: the step raises)."""
        norms: dict[int, torch.Tensor] = {}
        reread: dict[int, list[torch.Tensor | None]] = {}
        try:
            for i in sorted(deferred):
                position, _, _, j = self.where[i]
                if self._zeroed:
                    norms[i] = torch.zeros((), dtype=torch.float32)
                elif inv_scale is None:
                    norms[i] = self._norms[position][j]
                else:
                    if position not in reread:
                        reread = {position: self._reread_norms(position, inv_scale)}
                    norms[i] = reread[position][j]
        except OffloadError as err:
            self._error = self._error or str(err)
            norms = {i: torch.zeros((), dtype=torch.float32) for i in deferred}
        self._norms.clear()
        return norms

    def raise_failure(self, comm: Communicator) -> None:
        errors = comm.all_gather_object(self._error, what="gradient swap outcome")
        self._error = None
        raise OffloadError("offloaded optimizer step failed: " + "; ".join(e for e in errors if e is not None))

    def close(self) -> None:
        self._wait()
