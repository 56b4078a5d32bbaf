"""Pinned host buffers allocated once, and the copies between them and the GPU of an optimizer stepped on the host
(``offload_optimizer.device: cpu`` or ``nvme`` on CUDA), overlapped with the GPU.

[Note: overlapped offload]
Gradients down, the CPU update and parameters back overlap instead of idling the GPU in series (details and timings:
docs/offload.md, "Overlapped copies on CUDA"). The orderings that keep it correct:

* Gradients: once the reducer folded a bucket at the accumulation boundary, side stream ``d2h`` copies the shard's
  host-stepped span into a pinned buffer after a compute-stream event. At the end of backward the compute stream waits
  for ``d2h``, so nothing after it (unscale, clip, ``zero_grad``, next accumulation) writes a shard being copied. The
  copies are raw; the host unscales and clips them in the same order, so the numbers are the in-memory path's.
* Host step: sub-group k waits on the host for its own buckets' events only. Buckets backward did not copy (no boundary
  backward, graph mode's reductions, hybrid sharding) are copied at the step, all before the first sub-group steps.
* Parameters back: fp32 masters go up on side stream ``h2d`` and are rounded there (unpinned or ``nvme`` masters go
  through a pinned compute-dtype buffer, rounded on the CPU). A master or buffer is rewritten only after the host waited
  for its sub-group's event; the compute stream waits for both side streams before the all-gathers.

No ``synchronize``: the host waits only for copy events and, once a step, the clip coefficient. Host buffers view flat
blocks page-locked at exact size with ``cudaHostRegister`` (CUDA's caching host allocator rounds up to a power of two).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

PIN_BLOCK = 1 << 28  # bytes: host buffers are views into blocks of at most this size (a larger one alone)
HOST_ALIGN = 64  # bytes: each view starts on a cache line


def pack_blocks(
    nbytes: list[int], breaks: set[int] = frozenset(), block: int = PIN_BLOCK, align: int = HOST_ALIGN
) -> tuple[list[int], list[tuple[int, int]]]:
    """Lay tensors of ``nbytes`` bytes out, in order, in blocks of at most ``block`` bytes (a tensor larger than
    that in a block of its own), each at an ``align``-ed offset, starting a new block at each index in ``breaks``:
    the size of every block, and (block, byte offset) of every tensor."""
    sizes: list[int] = []
    where: list[tuple[int, int]] = []
    used = block  # no open block yet
    for i, n in enumerate(nbytes):
        start = -(-used // align) * align
        if i in breaks or not sizes or start + n > block:
            sizes.append(0)
            start = 0
        where.append((len(sizes) - 1, start))
        used = start + n
        sizes[-1] = max(sizes[-1], used)
    return sizes, where


def _unregister(ptr: int) -> None:
    # the CUDA runtime may be torn down already (interpreter exit): the process gives it all back then
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(ptr)


def host_block(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` bytes of host memory, page-locked with ``pin`` (CUDA) at exactly that size: registered with
    ``cudaHostRegister``, not taken from the caching host allocator (see [Note: overlapped offload]). The memory is
    unregistered when its last view is gone, before it is freed."""
    if not (pin and nbytes and torch.cuda.is_available()):
        return torch.empty(nbytes, dtype=torch.uint8)
    array = np.empty(nbytes, dtype=np.uint8)
    ptr = array.ctypes.data
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) != 0:  # not supported here: torch's own pinning
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # numpy clears an array's weak references before it frees the data: unregistered while still mapped
    weakref.finalize(array, _unregister, ptr).atexit = False
    return torch.from_numpy(array)  # the tensor's storage keeps the array alive


class HostArena:
    """Host tensors of the given sizes, each a view into one of a few flat blocks allocated once (pinned with
    ``pin``); ``breaks``: indices that start a new block."""

    def __init__(self, nbytes: list[int], pin: bool, breaks: set[int] = frozenset(), block: int = PIN_BLOCK) -> None:
        self.pinned = pin
        """Whether the blocks were asked to be page-locked (they are where CUDA is available)."""
        sizes, self._where = pack_blocks(nbytes, breaks, block)
        self.blocks = [host_block(n, pin) for n in sizes]
        self._nbytes = nbytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of host memory the blocks hold."""
        return sum(b.numel() for b in self.blocks)

    def view(self, index: int, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        b, offset = self._where[index]
        return self.blocks[b][offset : offset + self._nbytes[index]].view(dtype).view(shape)


# -- the copy streams (the seam the tests drive) ---------------------------------------------------


class CopyStreams(Protocol):
    """The two side streams and their events (see [Note: overlapped offload]). An event is opaque to the caller."""

    pins: bool
    """Whether host buffers are page-locked (CUDA)."""

    def mark(self) -> Any:
        """An event recorded on the compute stream now."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Copy device ``src`` into host ``dst`` on the ``d2h`` stream once ``after`` has completed."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Copy host ``src`` into device ``dst`` on the ``h2d`` stream once ``after`` has completed, rounding to
        ``dst``'s dtype on the device."""

    def record(self, stream: str) -> Any:
        """An event recorded on side stream ``stream`` (``"d2h"`` or ``"h2d"``) now."""

    def wait(self, event: Any) -> None:
        """The host waits until ``event`` has completed."""

    def join(self) -> None:
        """The compute stream waits (on the device) for everything issued on both side streams."""

    def host_scalar(self, t: torch.Tensor) -> torch.Tensor:
        """A device scalar's value on the host (waits for it alone)."""


class CudaStreams:
    """:class:`CopyStreams` on a CUDA device."""

    pins = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {"d2h": torch.cuda.Stream(device), "h2d": torch.cuda.Stream(device)}
        self._scalar = torch.empty((), dtype=torch.float32, pin_memory=True)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event) -> None:
        stream = self.streams["d2h"]
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(stream)  # a temporary source is not handed out again before the copy has read it

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event) -> None:
        stream = self.streams["h2d"]
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            if src.dtype == dst.dtype:
                dst.copy_(src, non_blocking=True)
            else:  # rounded to the compute dtype on the GPU (copy_ across both would round on the CPU, blocking)
                staged = torch.empty(src.shape, dtype=src.dtype, device=dst.device)  # freed in this stream's order
                staged.copy_(src, non_blocking=True)
                dst.copy_(staged)
        dst.record_stream(stream)

    def record(self, stream: str) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.streams[stream])
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def join(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        for stream in self.streams.values():
            compute.wait_stream(stream)

    def host_scalar(self, t: torch.Tensor) -> torch.Tensor:
        self._scalar.copy_(t, non_blocking=True)
        self.mark().synchronize()
        return self._scalar.clone()


def copy_streams(device: torch.device) -> CopyStreams | None:
    """The copy streams of a run on ``device``: None where the host is the device (nothing to copy)."""
    return CudaStreams(device) if device.type == "cuda" else None


# -- the copies of one optimizer ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Span:
    """The part of one bucket's gradient shard that host-stepped fragments cover, and its host buffer."""

    position: int  # the bucket's position in the reducer's list
    lo: int  # element range in the bucket's gradient shard
    hi: int
    host: torch.Tensor  # fp32 host buffer of ``hi - lo`` elements


class HostCopies:
    """The gradient and parameter copies of an optimizer stepping host masters for device fragments (see [Note:
    overlapped offload]). Built before the reducer, which is handed it and calls its hooks with each complete
    gradient shard. ``where[i]``: the bucket position (in the reducer's list), shard offset and length of member
    ``i``'s fragment; ``host[i]``: whether member ``i`` is stepped on the host."""

    def __init__(
        self,
        streams: CopyStreams,
        where: list[tuple[int, int, int]],
        host: list[bool],
        stepped: list[torch.Tensor],
        fragments: list[torch.Tensor],
        direct: list[bool],
        host_fragments: bool = False,
        pin_memory: bool = True,
    ) -> None:
        """``direct[i]``: the fragment is sent back from the master itself (page-locked, not a swap buffer); else
        through a compute-dtype buffer. ``host_fragments``: the fragments are host shards (parameter offload on the
        device, [Note: parameter uploads] in :mod:`shardtrain.offload.param_uploads`): the step writes them itself,
        rounding on the host, and nothing goes back to the device. ``pin_memory``: ``offload_optimizer.pin_memory``;
        the host buffers are page-locked where it and ``streams.pins`` are both true."""
        self.streams, self.where, self.host = streams, where, host
        self.pins = streams.pins and pin_memory
        self.host_fragments = host_fragments
        self.stepped, self.fragments = stepped, fragments
        spans: dict[int, list[int]] = {}
        for i, (position, offset, n) in enumerate(where):
            if host[i] and n:
                lo, hi = spans.get(position, [offset, offset + n])
                spans[position] = [min(lo, offset), max(hi, offset + n)]
        positions = sorted(spans)
        self.grad_arena = HostArena([(spans[p][1] - spans[p][0]) * 4 for p in positions], self.pins)
        self.spans = {
            p: _Span(p, spans[p][0], spans[p][1], self.grad_arena.view(k, torch.float32, (spans[p][1] - spans[p][0],)))
            for k, p in enumerate(positions)
        }
        self._empty = torch.empty(0, dtype=torch.float32)
        self.grads = [  # each host member's gradient: a view into its bucket's span
            self._empty
            if not (host[i] and where[i][2])
            else self.spans[where[i][0]].host[where[i][1] - self.spans[where[i][0]].lo :][: where[i][2]]
            for i in range(len(where))
        ]
        back = [i for i in range(len(where)) if host[i] and where[i][2] and not (direct[i] or host_fragments)]
        self.back_arena = HostArena(
            [where[i][2] * fragments[i].element_size() for i in back], self.pins, block=PIN_BLOCK
        )
        self.sources: dict[int, torch.Tensor] = {
            i: self.back_arena.view(k, fragments[i].dtype, fragments[i].shape) for k, i in enumerate(back)
        }
        self.direct = direct
        # per bucket position: the event of its copy this step, and whether the copy is of the raw reduced shard
        self._event: dict[int, Any] = {}
        self._raw: dict[int, bool] = {}
        # per sub-group (its first member): the event of its last copy back
        self._returned: dict[int, Any] = {}
        # per bucket position: its host members (the copies at a step that backward did not make)
        self._members_of: dict[int, list[int]] = {p: [] for p in positions}
        for i, (position, _, n) in enumerate(where):
            if host[i] and n:
                self._members_of[position].append(i)

    @property
    def allocated_bytes(self) -> int:
        """Host bytes of the gradient and copy-back buffers (what this adds to the host masters)."""
        return self.grad_arena.allocated_bytes + self.back_arena.allocated_bytes

    def covers(self, members: tuple[int, ...]) -> bool:
        """Whether the sub-group of ``members`` is stepped on the host with these copies."""
        return any(self.host[i] for i in members)

    # -- the reducer's hooks (backward) --
    def invalidate(self) -> None:
        """A backward begins or the gradients are zeroed: what the host buffers hold is no longer the step's."""
        self._event.clear()
        self._raw.clear()

    def bucket_reduced(self, position: int, shard: torch.Tensor) -> None:
        """At the boundary: bucket ``position``'s gradient ``shard`` is complete on the compute stream; copy its
        span."""
        span = self.spans.get(position)
        if span is None:
            return
        self.streams.to_host(span.host, shard[span.lo : span.hi], self.streams.mark())
        self._event[position] = self.streams.record("d2h")
        self._raw[position] = True

    def backward_done(self, shards: dict[int, torch.Tensor]) -> None:
        """The end of a boundary backward: copy the buckets of ``shards`` (each complete gradient shard, by bucket
        position) not copied yet (complete only now) and keep the compute stream from writing a shard still being
        copied."""
        for position, shard in shards.items():
            if position not in self._event:
                self.bucket_reduced(position, shard)
        self.streams.join()

    # -- the step --
    def host_scalar(self, t: torch.Tensor) -> torch.Tensor:
        """A device scalar (the clip coefficient) on the host, for the host-stepped gradients (waits for it alone)."""
        return self.streams.host_scalar(t)

    def prepare(self, grads: list[torch.Tensor | None]) -> Any:
        """Start of a step: copy the buckets not copied in backward from the step's gradients ``grads`` (already
        unscaled and clipped). Returns the compute-stream event the copies back wait for."""
        start = self.streams.mark()
        for position in self.spans:
            if position in self._event:
                continue
            for i in self._members_of[position]:
                if grads[i] is not None:
                    self.streams.to_host(self.grads[i], grads[i], start)
            self._event[position] = self.streams.record("d2h")
            self._raw[position] = False
        return start

    def host_grads(self, members: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The host gradients of ``members`` (after waiting for their buckets' copies), and those of them still to
        be unscaled and clipped (raw copies)."""
        waited = set()
        raw = []
        for i in members:
            position, _, n = self.where[i]
            if not n:
                continue
            if position not in waited:
                self.streams.wait(self._event[position])
                waited.add(position)
            if self._raw[position]:
                raw.append(self.grads[i])
        return [self.grads[i] for i in members], raw

    def before_step(self, members: tuple[int, ...]) -> None:
        """The sub-group's pinned sources may be rewritten once its last copy back has completed."""
        event = self._returned.pop(members[0], None)
        if event is not None:
            self.streams.wait(event)

    def staged(self, i: int) -> torch.Tensor | None:
        """The host tensor member ``i``'s updated values are rounded into on the host before they go back (its
        compute-dtype buffer, or with ``host_fragments`` the fragment itself); None where the master goes itself.
        The one pass writes it block by block ([Note: one pass over a sub-group] in
        :mod:`shardtrain.offload.one_pass`), after :meth:`before_step`."""
        if not (self.host[i] and self.where[i][2]):
            return None
        if self.host_fragments:
            return self.fragments[i]
        return None if self.direct[i] else self.sources[i]

    def send_back(self, members: tuple[int, ...], after: Any, staged: set[int] = frozenset()) -> None:
        """The sub-group's updated values to its device fragments, non-blocking, on the ``h2d`` stream;
        ``staged``: members whose :meth:`staged` tensor the step has written already."""
        with torch.no_grad():
            for i in members:
                if not (self.host[i] and self.where[i][2]):
                    continue
                master = self.stepped[i].view_as(self.fragments[i])
                if self.host_fragments:  # the shard's home is on the host: the next gather uploads it
                    if i not in staged:
                        self.fragments[i].copy_(master)
                    continue
                source = master if self.direct[i] else self.sources[i]
                if source is not master and i not in staged:
                    source.copy_(master)  # rounded to the compute dtype on the CPU, as copy_ rounds
                self.streams.to_device(self.fragments[i], source, after)
        if not self.host_fragments:
            self._returned[members[0]] = self.streams.record("h2d")

    def finish(self) -> None:
        """End of a step: the compute stream (the all-gathers, the next forward) waits for every copy; the host
        gradients are spent (a step without a backward before it copies its own)."""
        self.streams.join()
        self.invalidate()
