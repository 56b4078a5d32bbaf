"""Values a step computes on the device and the host needs a step later, read without waiting for the device.

[Note: reading device values a step later]
A steady-state step does not wait for the device: on CUDA the host queues the next forward while the device still
runs the step, and every read of a device value in between (``float(t)``, ``bool(t)``, ``.item()``, a copy to
pageable memory) would stall the host until the device drained, leaving the device idle while the host queues the
next kernels. So the step keeps what it computes on the device:

- the gradient norm stays a tensor (``engine.get_global_grad_norm()`` and the monitor's print steps read it);
- the fp16 loss scale and its overflow bookkeeping are device tensors (:class:`~shardtrain.precision.mixed.LossScaler`),
  and the skip itself happens in the optimizer's kernel (``found_inf``, as ``torch.amp.GradScaler`` hands it to the
  fused optimizers);
- what the host must decide on (whether any rank saw gradients complete out of order, see [Note: collective order];
  whether an fp16 step overflowed, for ``skipped_steps``, the scheduler and the minimum-scale error) is copied with a
  non-blocking copy into pinned host memory behind a CUDA event when the step computes it, and read at the next step
  (:class:`HostRead`). By then the device has run a forward and a backward since, so the event has completed and
  reading the pinned copy costs nothing; should the device still be behind, ``values`` waits on that event only.

Every rank reads the same all-reduced values at the same step, so decisions taken on them (an order exchange, a
scheduler step taken back) stay collective. On the CPU the copy is made at once. The host copy is read through numpy:
on CUDA that is a read of host memory the copy has filled, not a device synchronization, and the test suite's
counter of synchronizing operations (``shardtrain.testing.count_host_syncs``) does not see it, as it should not.
"""

from __future__ import annotations

import torch


class HostRead:
    """A device tensor's values, on their way to the host; :meth:`values` reads them."""

    def __init__(self, t: torch.Tensor) -> None:
        t = t.detach().reshape(-1)
        self._event: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t.to("cpu", copy=True)

    def ready(self) -> bool:
        """The values are on the host (reading them waits for nothing)."""
        return self._event is None or self._event.query()

    def values(self) -> list[float]:
        if self._event is not None and not self._event.query():
            self._event.synchronize()  # the device is more than a step behind: wait for this copy only
        return [float(v) for v in self._host.numpy().tolist()]
