"""Stall-free offload on a GPU: [Note: the ZenFlow rule] with ``S``, the selected columns and their Adam state on
the device and ``H``, ``A`` and the host twin in host memory, the copies between them on side streams.

[Note: ZenFlow on the device]
``S`` (the fp32 masters the model's parameters are refreshed from, as without offload), the compact selected
elements and the device twin's state live on the device; the device twin steps there on the compute stream. What
the host keeps: ``H`` and the host twin's Adam state, ``A`` and its double buffer, and two staging buffers the
gradients come down into (all page-locked where the device pins). The orderings:

* Gradients down (every step after warm-up): the compute stream snapshots each gradient (the reducer rewrites it at
  the next backward); side stream ``d2h`` copies the snapshots into staging buffer ``t % 2`` after a compute-stream
  event; the accumulating thread waits (on the host) for that copy's event, then adds the buffer to ``A``. A
  staging buffer is rewritten only after the thread added what the copy before last brought down.
* ``H = S`` (a selection): ``d2h`` copies ``S`` into ``H`` after a compute-stream event; the host update waits for it.
* Landing: the main thread waits for the host update (the one host wait of the rule: ``update_interval`` steps
  after it was submitted with ``overlap_step``, at once without it); side stream ``h2d`` copies ``H`` into a device
  buffer; the compute stream waits for that copy's event before it writes the unselected elements of ``S``; the next
  host update waits for it too before it rewrites ``H``.
* Warm-up (plain offload): the host waits for each step's gradients to come down, steps, and ``S = H`` goes up as a
  landing does.
Besides, a selection step reads the device once (``nonzero``: how many elements the chosen columns hold), and
"auto" reads its decision's sums every step ([Note: update_interval "auto"] in :mod:`shardtrain.offload.zenflow`);
nothing else makes the host wait for the device. The numbers are the CPU path's: the same tensors meet the same
operations.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from shardtrain.distributed.communicator import Communicator
from shardtrain.offload.host_copies import CudaStreams, HostArena
from shardtrain.offload.zenflow import ZenFlowStep, _twin
from shardtrain.plan.policies import ZenFlowPolicy


class ZenFlowStreams(Protocol):
    """The side streams of [Note: ZenFlow on the device] and their events; an event is opaque to the caller."""

    pins: bool
    """Whether host buffers are page-locked (CUDA)."""

    def mark(self) -> Any:
        """An event recorded on the compute stream now."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Copy device ``src`` into host ``dst`` on ``d2h`` once ``after`` has completed."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Copy host ``src`` into device ``dst`` on ``h2d`` once ``after`` has completed."""

    def record(self, stream: str) -> Any:
        """An event recorded on side stream ``stream`` (``"d2h"`` or ``"h2d"``) now."""

    def wait(self, event: Any) -> None:
        """The host (the calling thread) waits until ``event`` has completed."""

    def device_wait(self, event: Any) -> None:
        """The compute stream waits (on the device) for ``event``; the host does not."""


class CudaZenFlowStreams(CudaStreams):
    """:class:`ZenFlowStreams` on a CUDA device."""

    def device_wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


def zenflow_streams(device: torch.device) -> ZenFlowStreams | None:
    """The streams of ZenFlow on ``device``: None where the host is the device (the CPU path of
    :class:`~shardtrain.offload.zenflow.ZenFlowStep`). The seam the tests fake the device at."""
    return CudaZenFlowStreams(device) if device.type == "cuda" else None


class DeviceZenFlowStep(ZenFlowStep):
    """:class:`~shardtrain.offload.zenflow.ZenFlowStep` for ``stepped`` tensors on a GPU (see [Note: ZenFlow on the
    device])."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stepped: list[torch.Tensor],
        shapes: list[torch.Size],
        starts: list[int],
        policy: ZenFlowPolicy,
        comm: Communicator,
        streams: ZenFlowStreams,
        pin_memory: bool = True,
    ) -> None:
        self.streams = streams
        sizes = [s.numel() * s.element_size() for s in stepped]  # H, A and A's twin, in the masters' dtype
        pins = streams.pins and pin_memory
        self.host_arena = HostArena(sizes * 3, pins)
        super().__init__(optimizer, stepped, shapes, starts, policy, comm)
        n = len(stepped)
        views = [self.host_arena.view(i, s.dtype, (s.numel(),)) for i, s in enumerate(stepped * 3)]
        self.masters, self.accum, self.spare = views[:n], views[n : 2 * n], views[2 * n :]
        for m, s in zip(self.masters, stepped):
            m.copy_(s.detach().view(-1))
        for t in self.accum + self.spare:
            t.zero_()
        self.host = _twin(optimizer, self._by_group(self.masters))  # the host twin over the host masters
        self._pins = pins
        self._staging: list[list[torch.Tensor] | None] = [None, None]  # made at the first step, in the grads' dtype
        self._staged: list[Future | None] = [None, None]  # the accumulation that reads each staging buffer
        self._parity = 0
        self._accumulating = ThreadPoolExecutor(1, thread_name_prefix="zenflow-accumulate")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zenflow-host")  # the host update, waited for
        self._before_host_write: list[Any] = []  # events the next host update waits for before it writes H

    # -- gradients down --------------------------------------------------------------------------------------------

    def _stage(self, grads: list[torch.Tensor | None]) -> tuple[int, list[torch.Tensor], Any]:
        """This step's gradients copied down into a staging buffer; returns its slot, it and the copy's event."""
        slot = self._parity
        self._parity ^= 1
        if self._staging[slot] is None:
            dtypes = [g.dtype if g is not None else f.dtype for g, f in zip(grads, self.flat)]
            sizes = [f.numel() * torch.empty(0, dtype=d).element_size() for f, d in zip(self.flat, dtypes)]
            arena = HostArena(sizes, self._pins)
            self._staging[slot] = [arena.view(k, d, (f.numel(),)) for k, (f, d) in enumerate(zip(self.flat, dtypes))]
        pending = self._staged[slot]
        if pending is not None:  # the thread has added what the copy before last brought down (a host-side wait)
            pending.result()
        staging = self._staging[slot]
        snapshots = [None if g is None else g.clone() for g in grads]  # the reducer rewrites g at the next backward
        after = self.streams.mark()
        for k, g in enumerate(snapshots):
            if g is not None:
                self.streams.to_host(staging[k], g, after)
        return slot, staging, self.streams.record("d2h")

    def _accumulate(self, grads: list[torch.Tensor | None]) -> None:
        slot, staging, copied = self._stage(grads)
        present = [g is not None for g in grads]

        def add() -> None:
            self.streams.wait(copied)
            for k, here in enumerate(present):
                if here:
                    self.accum[k].add_(staging[k])

        self._staged[slot] = self._accumulating.submit(add)
        for k, here in enumerate(present):
            self.touched[k] = self.touched[k] or here

    def _warm_up(self, grads: list[torch.Tensor | None]) -> None:
        slot, staging, copied = self._stage(grads)
        self.streams.wait(copied)  # plain offload: the host steps this step's gradients now
        self._staged[slot] = None
        self._write_host(
            lambda: self._host_update([s if g is not None else None for s, g in zip(staging, grads)], self.steps)
        )
        self._up(keep_selected=False, only=[g is not None for g in grads])

    # -- H and S ---------------------------------------------------------------------------------------------------

    def _masters_from_stepped(self) -> None:
        after = self.streams.mark()
        for m, f in zip(self.masters, self.flat):
            self.streams.to_host(m, f, after)
        self._before_host_write.append(self.streams.record("d2h"))

    def _write_host(self, update) -> None:
        """Run ``update`` (which writes ``H``) on the host after the copies that read or write ``H``."""
        for event in self._before_host_write:
            self.streams.wait(event)
        self._before_host_write.clear()
        update()

    def _up(self, keep_selected: bool, only: list[bool] | None = None) -> None:
        """``S = H`` on the device (``keep_selected``: the selected elements keep their device values)."""
        after = self.streams.mark()
        buffers = []
        for k, (m, f) in enumerate(zip(self.masters, self.flat)):
            if only is not None and not only[k]:
                buffers.append(None)
                continue
            buffer = torch.empty_like(f)
            self.streams.to_device(buffer, m.view_as(f), after)
            buffers.append(buffer)
        landed = self.streams.record("h2d")
        self.streams.device_wait(landed)  # the compute stream reads the buffers only after the copies
        self._before_host_write.append(landed)  # the next host update rewrites H only after they read it
        for k, (buffer, f) in enumerate(zip(buffers, self.flat)):
            if buffer is None:
                continue
            sel = self.selected[k] if keep_selected else None
            kept = f[sel].clone() if sel is not None else None
            f.copy_(buffer)
            if sel is not None:
                f[sel] = kept

    # -- the host update -------------------------------------------------------------------------------------------

    def _launch_host_update(self) -> None:
        touched, count = self.touched, self.accumulated
        self.touched, self.accumulated = [False] * len(self.flat), 0

        def close() -> list[torch.Tensor | None]:  # on the accumulating thread: after this interval's additions
            self.accum, self.spare = self.spare, self.accum
            interval = [s.div_(count) if t else None for s, t in zip(self.spare, touched)]
            for a in self.accum:
                a.zero_()
            return interval

        interval = self._accumulating.submit(close)
        waits, self._before_host_write = list(self._before_host_write), []
        step_id = self.steps

        def update() -> None:
            for event in waits:
                self.streams.wait(event)
            self._host_update(interval.result(), step_id)

        self._future = self._pool.submit(update)
        if not self.policy.overlap_step:
            self.settle(land=True)

    def settle(self, land: bool) -> None:
        if self._future is not None:
            future, self._future = self._future, None
            future.result()  # [Note: ZenFlow on the device]: the rule's one host wait
        if land and self.landing:
            self._up(keep_selected=True)
            self.landing = False

    def _flush(self) -> None:
        """Every accumulation issued so far has been added (checkpoints read ``A``)."""
        self._accumulating.submit(lambda: None).result()
        for event in self._before_host_write:
            self.streams.wait(event)

    def state_of(self, stepped: torch.Tensor) -> dict[str, torch.Tensor]:
        self.settle(land=False)
        self._flush()
        return super().state_of(stepped)

    def set_state(self, stepped: torch.Tensor, state: dict) -> None:
        self.settle(land=False)
        self._flush()
        super().set_state(stepped, state)

    def close(self) -> None:
        super().close()
        self._accumulating.shutdown()
