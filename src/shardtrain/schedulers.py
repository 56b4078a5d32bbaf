"""DeepSpeed's WarmupLR and WarmupDecayLR as torch LR schedulers (same formulas, stepped per optimizer step)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from shardtrain.config import SchedulerConfig, WarmupDecayLRParams, scheduler_params


def warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    """Warm-up fraction at ``step``: log(step+1)/log(warmup) or step/warmup, then 1."""
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


class WarmupLR(LRScheduler):
    """lr = min + (max - min) * gamma(step), for every param group; constant at max after warm-up."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.min_lr, self.max_lr, self.warmup_type = warmup_min_lr, warmup_max_lr, warmup_type
        # as in DeepSpeed: log warm-up over one step would divide by log(1) = 0
        self.warmup_num_steps = max(2, warmup_num_steps) if warmup_type == "log" else warmup_num_steps
        super().__init__(optimizer, last_epoch)

    def _gamma(self) -> float:
        return warmup_gamma(self.last_epoch, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma()
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, **kwargs) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, **kwargs)

    def _gamma(self) -> float:
        if self.last_epoch < self.warmup_num_steps:
            return super()._gamma()
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - self.last_epoch) / span)


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    params = scheduler_params(cfg)
    assert params is not None  # "auto" is refused unless allow_auto
    kwargs = params.model_dump()
    if isinstance(params, WarmupDecayLRParams):
        return WarmupDecayLR(optimizer, **kwargs)
    return WarmupLR(optimizer, **kwargs)
