"""Stage-3 parameter shards at home in host memory on a GPU run (``offload_param`` ``cpu`` or ``nvme`` on CUDA): each
unit's shards are copied to the device on a side stream just before its all-gather, which sends from them, and freed
once it completed (DeepSpeed's ZeRO-Infinity for parameters).

[Note: parameter uploads]
Between gathers a unit bucket's ``shard`` is a host tensor: a view into a few page-locked blocks allocated once
(:class:`~shardtrain.offload.host_copies.HostArena`, ``cpu``), or its swap file's mapping or read buffer
(``nvme``, [Note: parameter offload] in :mod:`shardtrain.offload.parameters`). The gather service ([Note: one gather
service] in :mod:`shardtrain.zero.gather`) calls, per unit and in gather order (prefetches included, so a unit is
uploaded as far ahead of its use as ``stage3_prefetch_bucket_size`` gathers it):

* ``will_need``: side stream ``h2d`` waits for a compute-stream event (the device buffer may reuse memory the compute
  stream used before), allocates the device buffer, copies the host shard into it (non-blocking) and ``bucket.shard``
  points at the buffer;
* ``issuing``: the all-gather is issued with ``h2d`` as the current stream, so the collective waits for the copy on
  the device and the compute stream (the current unit's forward or backward) does not; an event is recorded on
  ``h2d`` after it (at one rank the "all-gather" is a copy on that stream);
* ``done_with`` (the gather waited for, just before the unit is used): the compute stream waits for that event, the
  buffer is recorded to the compute stream (its memory is not handed out again before the compute stream passed this
  point, hence after the collective read it), ``bucket.shard`` is its host home again and the buffer is dropped.

Gradients go the other way through the optimizer offload's copies ([Note: overlapped offload] in
:mod:`shardtrain.offload.host_copies`, required beside this: ``offload_optimizer``), and the host step writes the
updated values straight into the host shards (``host_fragments``). A sub-group is stepped only after the host waited
for the device-to-host copy of its buckets' gradients, which the compute stream issued after those units' backward,
hence after their uploads: no upload still reads a shard the host rewrites. Nothing here makes the host wait.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardtrain.offload.host_copies import HostArena

if TYPE_CHECKING:
    from shardtrain.offload.parameters import ParamOffload
    from shardtrain.zero.layout import Bucket, UnitBuckets


class UploadStreams(Protocol):
    """The side stream of parameter uploads and its events (see [Note: parameter uploads]); an event is opaque."""

    pins: bool
    """Whether host shards are page-locked (CUDA)."""

    def mark(self) -> Any:
        """An event recorded on the compute stream now."""

    def upload(self, host: torch.Tensor, after: Any) -> torch.Tensor:
        """A new device tensor that side stream ``h2d`` fills from ``host`` once ``after`` has completed."""

    def issuing(self) -> Any:
        """A context manager: work issued inside it runs on ``h2d``, after everything the compute stream issued
        before it. It yields an object whose ``done``, once the context exited, is an event on ``h2d`` after that
        work."""

    def use(self, event: Any, buffers: list[torch.Tensor]) -> None:
        """The compute stream waits (on the device) for ``event``; ``buffers`` are recorded to the compute stream."""


class CudaUploads:
    """:class:`UploadStreams` on a CUDA device."""

    pins = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d = torch.cuda.Stream(device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._compute())
        return event

    def upload(self, host: torch.Tensor, after: torch.cuda.Event) -> torch.Tensor:
        self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):  # allocated in h2d's pool: see use() for when it may be reused
            buffer = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            buffer.copy_(host, non_blocking=True)
        return buffer

    @contextmanager
    def issuing(self) -> Iterator[_Issued]:
        issued = _Issued()
        self.h2d.wait_stream(self._compute())  # the collective's output was allocated on the compute stream
        with torch.cuda.stream(self.h2d):
            yield issued
        issued.done = torch.cuda.Event()
        issued.done.record(self.h2d)

    def use(self, event: torch.cuda.Event, buffers: list[torch.Tensor]) -> None:
        self._compute().wait_event(event)
        for b in buffers:
            b.record_stream(self._compute())


class _Issued:
    """What :meth:`CudaUploads.issuing` yields: ``done`` is set when its context exits."""

    done: Any = None


def upload_streams(device: torch.device) -> UploadStreams | None:
    """The upload stream of a run on ``device``: None where the host is the device (parameter offload then keeps
    shards in files, or where they are: [Note: parameter offload] in :mod:`shardtrain.offload.parameters`)."""
    return CudaUploads(device) if device.type == "cuda" else None


class ParamUploads:
    """A :class:`~shardtrain.zero.gather.ShardSource`: unit shards at home on the host, uploaded per gather (see
    [Note: parameter uploads]). ``files``: the swap files of ``nvme`` (their units' shards are at home there);
    every other unit bucket's shard moves into host blocks here, leaving the device, page-locked where
    ``pin_memory`` (``offload_param.pin_memory``) and ``streams.pins`` are both true."""

    def __init__(
        self,
        units: list[UnitBuckets],
        streams: UploadStreams,
        files: ParamOffload | None = None,
        pin_memory: bool = True,
    ) -> None:
        self.streams, self.files = streams, files
        mapped = files.mapped_units if files is not None else set()
        resident = [b for i, u in enumerate(units) if i not in mapped for b in u.buckets]
        self.arena = HostArena(
            [b.shard.numel() * b.shard.element_size() for b in resident], streams.pins and pin_memory
        )
        for k, b in enumerate(resident):
            home = self.arena.view(k, b.shard.dtype, b.shard.shape)
            home.copy_(b.shard)
            b.shard = home
        self._inflight: dict[int, list[tuple[Bucket, torch.Tensor, torch.Tensor]]] = {}  # unit -> (b, home, buffer)
        self._issued: dict[int, list[Any]] = {}  # unit -> the h2d events after its all-gathers
        self.uploads = 0  # shards copied to the device (tests and the benchmark read these)
        self.bytes_uploaded = 0
        self.most_ahead = 0  # the most units uploaded and not yet used at once

    @property
    def mapped_units(self) -> set[int]:
        return self.files.mapped_units if self.files is not None else set()

    def will_need(self, unit: Any) -> None:
        if unit.index in self._inflight:
            return
        if self.files is not None:
            self.files.will_need(unit)  # a mapped shard is read into a host buffer first
        after = self.streams.mark()
        entries = []
        for b in unit.buckets:
            home = b.shard
            buffer = self.streams.upload(home, after)
            entries.append((b, home, buffer))
            b.shard = buffer
            self.uploads += 1
            self.bytes_uploaded += home.numel() * home.element_size()
        self._inflight[unit.index] = entries
        self._issued[unit.index] = []
        self.most_ahead = max(self.most_ahead, len(self._inflight))

    @contextmanager
    def issuing(self, unit: Any) -> Iterator[None]:
        """Around one of ``unit``'s all-gathers: issued on the upload stream, after its copy."""
        if unit.index not in self._inflight:
            yield
            return
        with self.streams.issuing() as issued:
            yield
        self._issued[unit.index].append(issued.done)

    def done_with(self, units: Iterable[Any]) -> None:
        for unit in units:
            entries = self._inflight.pop(unit.index, None)
            if entries is not None:
                events = self._issued.pop(unit.index)
                if events:  # h2d runs in order: its last all-gather's event covers the others
                    self.streams.use(events[-1], [buffer for _, _, buffer in entries])
                for b, home, _ in entries:
                    b.shard = home
            if self.files is not None:
                self.files.done_with([unit])

    def mapped_bytes(self) -> int:
        """Bytes of shards in swap files (not held in memory)."""
        return self.files.mapped_bytes() if self.files is not None else 0

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the resident shards' blocks hold."""
        return self.arena.allocated_bytes
