"""``deepspeed.runtime.lr_schedules``: DeepSpeed's learning-rate schedulers (shardtrain's own implementations, with
DeepSpeed's arguments and values: :mod:`shardtrain.optim.schedulers`) and ``VALID_LR_SCHEDULES``, the names of
their classes, which accelerate reads to tell a DeepSpeed scheduler from a torch one in ``accelerator.prepare``."""

from __future__ import annotations

from shardtrain.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
)
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""As DeepSpeed 0.19.8's list, in its order."""

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
