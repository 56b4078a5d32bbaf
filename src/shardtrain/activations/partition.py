"""The inputs a checkpointed block keeps, partitioned over the tensor-parallel group (DeepSpeed's
``partition_activations``): each of the ``tp`` ranks keeps ``1/tp`` of them between forward and backward, and they
are all-gathered before the block runs again.

[Note: partitioned block inputs]
Under tensor parallelism a block's input (the residual stream) is the same on every rank of the tensor-parallel
group: a row-parallel layer's output is all-reduced before it leaves a block, and the project's plans shard no
hidden state along the sequence. Saved-tensor hooks pushed around the block's forward, outside the checkpoint
([Note: the order of a checkpointed block's hooks]), see exactly what the checkpoint keeps (the block's inputs):
each floating tensor is flattened, padded to a multiple of ``tp`` and only this rank's chunk is cloned and kept; the
whole tensor is freed by autograd. Unpacking in backward all-gathers the chunks over the group (every rank of the
group runs the same backward, so the gathers meet in the same order) and gives back the first ``numel`` elements in
the saved shape: the same values, bit for bit, so the recompute and the gradients are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardtrain.activations.block_hooks import BlockInputHooks


@dataclass(eq=False)
class _Chunk:
    """This rank's share of one saved input, and what rebuilds it."""

    chunk: torch.Tensor
    shape: torch.Size
    numel: int


@dataclass
class TPPartition(BlockInputHooks):
    """Saved-tensor hooks keeping ``1/size`` of each checkpointed block's inputs ([Note: partitioned block
    inputs]); installed on each block by :func:`shardtrain.activations.apply_checkpointing`."""

    rank: int
    size: int
    gather: Callable[[torch.Tensor], torch.Tensor]
    """Every rank's equal-sized 1-D chunk, concatenated in rank order (the tensor-parallel group's all-gather)."""
    partitioned: int = 0
    """Inputs kept partitioned since the engine was made (tests read it)."""

    def __post_init__(self) -> None:
        self._open: list[Any] = []

    def _pack(self, t: torch.Tensor) -> _Chunk | torch.Tensor:
        if not t.is_floating_point() or t.numel() < self.size:
            return t
        numel = t.numel()
        per_rank = -(-numel // self.size)
        flat = F.pad(t.detach().reshape(-1), (0, per_rank * self.size - numel))  # [size * per_rank]
        self.partitioned += 1
        return _Chunk(flat[self.rank * per_rank : (self.rank + 1) * per_rank].clone(), t.shape, numel)

    def _unpack(self, packed: _Chunk | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return self.gather(packed.chunk)[: packed.numel].view(packed.shape)  # [size * per_rank] -> the input
