"""Gradient shards in swap files while a step accumulates, and the step that reads them back (DeepSpeed's
ZeRO-Infinity for gradients).

[Note: gradient offload]
At stages 2-3 the reducer keeps, per bucket, this rank's fp32 gradient shard for the whole step: as much memory
as the rank's fp32 parameters. With the optimizer state in files (``device: nvme``) the shards go to files too,
as DeepSpeed's ZeRO-Infinity swaps gradient partitions out: when a bucket's reduce-scatter completes, the reducer
hands its result to :meth:`GradOffload.fold`, which writes it to ``bucket<i>.grad.bin`` on the I/O pool (one
write in flight: the next bucket's reduction overlaps it) and gives up the bucket's in-memory shard; a later
micro-step of the same step reads the file, adds (the in-memory ``add_``) and writes it back. At the last
micro-step each fragment's norm is taken from the result while it is in memory. The step is the in-memory step
([Note: the one step] in :mod:`shardtrain.zero.optimizer`), with these gradients *deferred*: their norms are the
per-fragment norms taken here (under a loss scale the unscaled norms need the unscaled gradients: each bucket's
file is read once more for them, one bucket at a time), this rank's I/O failure rides on the norm's all-reduce (so
every rank raises), and each sub-group's gradients are read into its swap buffer with its optimizer state,
unscaled and clipped there (the same multiplications) and stepped. So the numbers are bitwise those of in-memory
gradients, and a rank holds one bucket's reduced gradient on its way to the file and ``buffer_count`` sub-groups of
gradients with their state.
Where it is not built the gradients stay in memory: on CUDA (the shards are on the GPU), with tensor parallelism
or hybrid sharding (their norm and replica all-reduce read the shards), and buckets whose reduction graph mode
took over.

"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from shardtrain.offload.swap import (
    GRAD,
    OffloadError,
)

if TYPE_CHECKING:
    from shardtrain.zero.layout import Bucket

# ``optimizer: Any`` below is a zero.optimizer.ShardedOptimizer and ``offload: Any`` the OptimizerOffload that builds
# this: not imported, not even for typing, because both modules import this one (tests/test_architecture.py keeps the
# package free of import cycles)


# -- gradients in swap files ----------------------------------------------------------------------


class GradOffload:
    """The reducer's fp32 gradient shards in swap files, one per bucket, read back one sub-group at a time with
    the optimizer state (see [Note: gradient offload])."""

    def __init__(self, offload: Any, optimizer: Any) -> None:
        self.offload, self.reducer, self.files = offload, optimizer.reducer, offload.files
        positions = {b.index: k for k, b in enumerate(self.reducer.buckets)}
        # member (index into the stepped tensors) -> (bucket position, element offset in its shard, length,
        # fragment index); the wrapper lists its fragments bucket by bucket, slot by slot
        self.where = [
            (positions[b.index], b.fragments[j].shard_offset, b.fragments[j].length, j)
            for b, j in optimizer.fragment_places()
        ]
        # every bucket's gradient shard is in its file from now on: the reducer's zeroed in-memory shards (as much
        # memory as the rank's fp32 parameters) are freed before the first forward, not at each first reduction
        self.dtypes = [g.dtype for g in self.reducer.shard_grads]
        self.on_disk: set[int] = set(range(len(self.dtypes)))  # bucket positions whose gradient shard is in its file
        for position, dtype in enumerate(self.dtypes):
            self.reducer.shard_grads[position] = torch.empty(0, dtype=dtype)
        self._norms: dict[int, list[torch.Tensor | None]] = {}  # position -> each fragment's gradient norm
        self._writes: deque[Future] = deque()
        self._error: str | None = None  # the first I/O failure since the last step (raised there, on every rank)
        self.bytes_in_flight = 0  # gradient bytes in memory on their way to or from the files
        self.peak_bytes = 0  # the most of them at once (tests read it)
        self._lock = threading.Lock()

    def _name(self, position: int) -> str:
        return f"bucket{self.reducer.buckets[position].index}"

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
        self._writes.append(self.offload._pool.submit(write))

    def fold(self, position: int, bucket: Bucket, out: torch.Tensor, fresh: bool, boundary: bool) -> None:
        """The reducer's hook: ``out``, this rank's reduced gradient of ``bucket`` for one micro-step, goes to the
        bucket's file (``fresh``: the first micro-step since the gradients were zeroed, else added to what the file
        holds). ``boundary``: the last micro-step: each fragment's norm is taken now, while it is in memory.
        Never raises (a failure on one rank would leave the others waiting in backward's next collective): the
        step reports it on every rank."""
        dtype = self.dtypes[position]
        if bucket.shard_numel == 0:
            return
        if fresh:
            g = out if out.dtype == dtype else out.to(dtype)
        else:  # gradient accumulation: what earlier micro-steps left, plus this one (the in-memory add_)
            self._wait()
            g = torch.empty(bucket.shard_numel, dtype=dtype)
            try:
                self.files.read(self._name(position), GRAD, g)
            except OffloadError as err:
                self._error = self._error or str(err)
            g.add_(out)
        if boundary:
            self._norms[position] = self._fragment_norms(bucket, g)
        self._write(position, g)

    def keep_in_memory(self, positions: list[int]) -> None:
        """The reducer's hook when graph mode takes over these buckets' reductions (it adds into the in-memory
        shards itself): they get their zeroed in-memory shards back and never go to files."""
        for position in positions:
            if position in self.on_disk:
                self.on_disk.discard(position)
                numel = self.reducer.buckets[position].shard_numel
                self.reducer.shard_grads[position] = torch.zeros(numel, dtype=self.dtypes[position])

    @staticmethod
    def _fragment_norms(bucket: Bucket, g: torch.Tensor) -> list[torch.Tensor | None]:
        """Each fragment's norm as the in-memory step takes it (``torch._foreach_norm``, tensor by tensor)."""
        parts = [g[f.shard_offset : f.shard_offset + f.length] for f in bucket.fragments if f.length]
        norms = iter(torch._foreach_norm(parts) if parts else [])
        return [next(norms) if f.length else None for f in bucket.fragments]

    def read(self, member: int, out: torch.Tensor) -> None:
        """Member ``member``'s gradient into ``out`` (1-D): zeros when no backward ran since they were zeroed."""
        position, offset, _, _ = self.where[member]
        if self.reducer.grads_zeroed:
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
        bucket = self.reducer.buckets[position]
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

    def collect(self, stepped: list[bool]) -> tuple[list[torch.Tensor | None], frozenset[int]]:
        """Per stepped tensor: its gradient in memory (a bucket graph mode reduces, or an empty fragment), or None
        (frozen for this step, or in its file: deferred, read with the sub-group's state)."""
        self._wait()
        grads: list[torch.Tensor | None] = []
        on_disk = set()
        for i, (position, offset, n, _) in enumerate(self.where):
            if not stepped[i]:  # frozen for this whole step: not stepped, its zero gradient not read nor counted
                grads.append(None)
            elif position not in self.on_disk:  # never reduced here (graph mode hands some buckets over)
                grads.append(self.reducer.shard_grads[position][offset : offset + n])
            elif n:
                grads.append(None)
                on_disk.add(i)
            else:  # an empty fragment is stepped like any other (its scalar state counts the step)
                grads.append(torch.empty(0, dtype=torch.float32))
        return grads, frozenset(on_disk)

    def deferred_norms(self, deferred: frozenset[int], inv_scale: float | None) -> dict[int, torch.Tensor]:
        """Each deferred member's norm: taken at the last micro-step's write (``fold``), or, under a loss scale,
        from the unscaled gradients read once more (one bucket held at a time). An I/O failure is kept for the
        norm's all-reduce to report on every rank (the norms are then zeros: the step raises)."""
        norms: dict[int, torch.Tensor] = {}
        reread: dict[int, list[torch.Tensor | None]] = {}
        try:
            for i in sorted(deferred):
                position, _, _, j = self.where[i]
                if self.reducer.grads_zeroed:
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

    def raise_failure(self, comm: Any) -> None:
        errors = comm.all_gather_object(self._error, what="gradient swap outcome")
        self._error = None
        raise OffloadError("offloaded optimizer step failed: " + "; ".join(e for e in errors if e is not None))

    def close(self) -> None:
        self._wait()
