"""Per-tensor sums across a shard group, for optimizers whose step reads a norm of the whole tensor (LAMB's trust
ratio: [Note: LAMB's norms across shards] in optim/lamb.py)."""

from __future__ import annotations

import torch

from shardtrain.distributed.communicator import Communicator, Reduce


class ShardSums:
    """The ``tensor_norms`` of :class:`shardtrain.optim.lamb.Lamb` under ZeRO 1-3: each rank's partial sums of its
    fragments, added over the shard group (one all-reduce per param group, in group order on every rank)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        self.comm.all_reduce(partial, Reduce.SUM, what="LAMB's per-tensor squared sums across shards")
        return partial
