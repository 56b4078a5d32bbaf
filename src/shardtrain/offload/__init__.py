"""Offload: what ZeRO keeps off the device, by what it moves: optimizer state stepped one sub-group at a time
(:mod:`.optimizer_state`), gradient shards in swap files (:mod:`.gradients`), stage-3 parameter shards in swap
files (:mod:`.parameters`), and the swap files and scratch directories they share (:mod:`.swap`)."""

from shardtrain.offload.gradients import GradOffload
from shardtrain.offload.optimizer_state import OptimizerOffload
from shardtrain.offload.parameters import ParamOffload
from shardtrain.offload.swap import OffloadError, ScratchDir, on_every_rank, prepare_scratch

__all__ = [
    "GradOffload",
    "OffloadError",
    "OptimizerOffload",
    "ParamOffload",
    "ScratchDir",
    "on_every_rank",
    "prepare_scratch",
]
