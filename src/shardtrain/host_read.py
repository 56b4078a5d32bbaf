"""Values a step computes on the device and the host needs a step later, read without waiting for the device.

[Note: reading device values a step later]
A steady-state step does not wait for the device: on CUDA the host queues the next forward while the device still
runs the step, and any read of a device value in between (``float(t)``, ``.item()``, a copy to pageable memory) would
stall the host until the device drained, idling the device while the host queues. So the step keeps its results on
the device: the gradient norm stays a tensor (``engine.get_global_grad_norm()`` and the monitor read it); the fp16
loss scale and its bookkeeping are device tensors (:class:`~shardtrain.precision.mixed.LossScaler`), the skip happening
in the optimizer's kernel (``found_inf``, as with ``torch.amp.GradScaler``). What the host must decide on (gradients
completed out of order on some rank, [Note: collective order]; an fp16 overflow, for ``skipped_steps``, the scheduler
and the minimum-scale error) is copied non-blocking into pinned memory behind a CUDA event and read at the next step
(:class:`HostRead`), when the event has long completed (else ``values`` waits on that event only). Every rank reads
the same all-reduced values at the same step, so decisions on them stay collective. On the CPU the copy is made at
once. The copy is read through numpy, a host-memory read and no device synchronization, which
``shardtrain.testing.count_host_syncs`` rightly does not count.
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
