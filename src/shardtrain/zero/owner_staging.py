"""The copies between a host step and the communicator's device for the collectives of whole-tensor optimizers
(Muon's owners, zero/muon_owners.py; LAMB's shard sums, zero/shard_sums.py) when the optimizer steps host masters
for device fragments (optimizer offload on a GPU, [Note: overlapped offload] in offload/host_copies.py).

[Note: the owners' collectives on the device]
NCCL takes only CUDA tensors, so a host step's collectives run on device copies: the host writes a bucket's chunk of
Muon updates (or a group's squared sums), ``up`` copies it into the device buffer the collective uses (a copy from
pageable host memory: it has read the source when it returns, so the host may reuse it at once), the collective runs
on the compute stream, and ``down`` queues the result's copy to a page-locked host tensor behind it; the host
``wait``s for that copy's event alone before it reads the values. That wait is the only host sync the owners add:
one per bucket holding Muon matrices (per sub-group, its buckets) and one per LAMB param group and step call, each
needed because the host step's next arithmetic reads the values. The offload's own copies need no new ordering:
the owners read the host masters' updates (not the device fragments the ``h2d`` stream writes) and their device
buffers are fresh allocations on the compute stream.

Newton-Schulz runs on the device, where the all-gather leaves the matrix anyway: a d x d fp32 matrix is 4d^2 bytes
each way over PCIe (d = 4096: 64 MiB, ~3 ms at ~25 GB/s, twice) while its five iterations are ~30 d^3 flops
(d = 4096: ~2 TFLOP, seconds on a host's cores, a few ms on an H100 in bf16). Its rounding is the device's matmuls':
a GPU run matches the CPU path within Muon's rounding spread ([Note: Muon's rounding spread] in
tests/zero/test_muon_owners.py), not bitwise; on the CPU with the device faked it is bitwise.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class OwnerStaging(Protocol):
    """Host <-> communicator-device copies around the owners' collectives ([Note: the owners' collectives on the
    device]). An event is opaque to the caller."""

    device: torch.device
    """The communicator's device: where the collectives' buffers are allocated."""

    def up(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host ``src`` into device ``dst``, ordered before the next collective; ``src`` may be rewritten on
        return."""

    def down(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A host tensor that will hold device ``src``'s values once the returned event has completed."""

    def wait(self, event: Any) -> None:
        """The host waits until ``event`` has completed."""


class CudaStaging:
    """:class:`OwnerStaging` on a CUDA device: the copies on the compute stream, behind the collectives."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def up(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # pageable source: returns once the source has been read

    def down(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return host, event

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()


def device_staging(device: torch.device) -> OwnerStaging | None:
    """The staging of a run whose communicator is on ``device``: None where the host is that device (the
    collectives take the host step's tensors as they are). The tests replace this function to fake a device."""
    return CudaStaging(device) if device.type == "cuda" else None
