"""Per-tensor sums across a shard group, for optimizers whose step reads a norm of the whole tensor (LAMB's trust
ratio: [Note: LAMB's norms across shards] in optim/lamb.py)."""

from __future__ import annotations

import torch

from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.zero.owner_staging import OwnerStaging


class ShardSums:
    """The ``tensor_norms`` of :class:`shardtrain.optim.lamb.Lamb` under ZeRO 1-3: each rank's partial sums of its
    fragments, added over the shard group (one all-reduce per param group, in group order on every rank)."""

    def __init__(self, comm: Communicator, staging: OwnerStaging | None = None) -> None:
        """``staging``: where the communicator's device is not the host, the copies that put a host step's sums on
        it ([Note: the owners' collectives on the device] in zero/owner_staging.py)."""
        self.comm, self.staging = comm, staging

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        if self.staging is None or partial.device.type != "cpu":
            self.comm.all_reduce(partial, Reduce.SUM, what="LAMB's per-tensor squared sums across shards")
            return partial
        summed = torch.empty(partial.shape, dtype=partial.dtype, device=self.staging.device)
        self.staging.up(summed, partial)
        self.comm.all_reduce(summed, Reduce.SUM, what="LAMB's per-tensor squared sums across shards")
        host, event = self.staging.down(summed)
        self.staging.wait(event)  # the trust ratios are computed on the host from these sums next
        return host
