"""DeepSpeed's LR schedulers as torch LR schedulers (same formulas, stepped per optimizer step).

[Note: DeepSpeed's step count]
A torch scheduler's ``last_epoch`` is the number of optimizer steps taken: the lr of step ``k`` (from 0) is
``get_lr()`` at ``last_epoch == k``. DeepSpeed's schedulers set an lr when built, then ``step()`` after every optimizer
step, so the lr of step ``k`` is their formula at ``last_batch_iteration == k - 1``, and step 0 runs at the lr they set
when built (WarmupCosineLR: 0; OneCycle: ``cycle_min_lr``). :class:`WarmupCosineLR` and :class:`OneCycle` evaluate
DeepSpeed's formulas at ``last_epoch - 1`` for that reason, so that every step's lr is DeepSpeed's.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from shardtrain.config import (
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    scheduler_params,
)

logger = logging.getLogger("shardtrain")


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


class WarmupCosineLR(LRScheduler):
    """DeepSpeed's WarmupCosineLR: each group's lr is its initial lr times a ratio that rises from
    ``warmup_min_ratio`` to 1 over ``warmup_num_steps`` (log or linear), then follows a cosine down to
    ``cos_min_ratio`` at ``total_num_steps``. Step 0 runs at lr 0 (see [Note: DeepSpeed's step count])."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.total_num_steps, self.warmup_min_ratio, self.cos_min_ratio = (
            total_num_steps,
            warmup_min_ratio,
            cos_min_ratio,
        )
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)  # as DeepSpeed: log(1) would divide by zero
        super().__init__(optimizer, last_epoch)

    def ratio(self, iteration: int) -> float:
        """DeepSpeed's ``get_lr_ratio`` at its ``last_batch_iteration == iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            rise = warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        progress = min(
            1.0, (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        )
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.ratio(self.last_epoch - 1)
        return [base * ratio for base in self.base_lrs]


class OneCycle(LRScheduler):
    """DeepSpeed's OneCycle: one cycle of the lr from ``cycle_min_lr`` up to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and back over ``cycle_second_step_size`` (in stairs when a stair count is given),
    then ``cycle_min_lr / (1 + decay_lr_rate * n / decay_step_size)`` ``n`` steps after the cycle (constant without
    decay). With ``cycle_momentum`` and an optimizer with ``betas`` (Adam), beta1 moves the other way between
    ``cycle_max_mom`` and ``cycle_min_mom`` and, as in DeepSpeed, beta2 is set to 0.99 while it does; other
    optimizers keep their momentum (DeepSpeed warns and does the same). Step 0 runs at ``cycle_min_lr`` (and
    ``cycle_min_mom``): see [Note: DeepSpeed's step count]."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            self.first_step_size if cycle_second_step_size is None else float(cycle_second_step_size)
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning(
                "scheduler OneCycle: cycle_momentum is off because %s has no betas (as in DeepSpeed); set "
                "cycle_momentum to false to silence this",
                type(optimizer).__name__,
            )
        super().__init__(optimizer, last_epoch)

    def _scale(self, iteration: int) -> float:
        """Where in the cycle DeepSpeed's ``last_batch_iteration == iteration`` is: 0 at the bottom, 1 at the top."""
        position = iteration + 1
        cycle = math.floor(1 + position / self.total_size)
        x = 1.0 + position / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            in_cycle = position % self.total_size
            if in_cycle <= self.first_step_size:
                stair = in_cycle * stairs / self.first_step_size
            else:
                stair = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decay_steps(self, iteration: int) -> float:
        """Decay intervals ``iteration`` is past the end of the cycle (a fraction: DeepSpeed does not round)."""
        return (iteration - self.total_size + 1) / self.decay_step_size

    def lr_at(self, iteration: int) -> float:
        """The lr at DeepSpeed's ``last_batch_iteration == iteration``."""
        if iteration < 0:
            return self.min_lr
        if iteration < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self._scale(iteration)
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return self.min_lr
        return self.min_lr / (1 + self.decay_lr_rate * self._decay_steps(iteration))

    def momentum_at(self, iteration: int) -> float:
        """Beta1 at DeepSpeed's ``last_batch_iteration == iteration``."""
        if iteration < 0:
            return self.min_mom
        if iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale(iteration)
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return self.max_mom
        return self.max_mom * (1 + self.decay_mom_rate * self._decay_steps(iteration))

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch - 1) for _ in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.momentum_at(self.last_epoch - 1), 0.99)


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    params = scheduler_params(cfg)
    assert params is not None  # "auto" is refused unless allow_auto
    kwargs = params.model_dump()
    if isinstance(params, OneCycleParams):
        return OneCycle(optimizer, **kwargs)
    if isinstance(params, WarmupCosineLRParams):
        return WarmupCosineLR(optimizer, **kwargs)
    if isinstance(params, WarmupDecayLRParams):
        return WarmupDecayLR(optimizer, **kwargs)
    return WarmupLR(optimizer, **kwargs)
