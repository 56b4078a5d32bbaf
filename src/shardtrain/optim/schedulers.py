"""DeepSpeed's LR schedulers as torch LR schedulers (same formulas, stepped per optimizer step).

[Note: DeepSpeed's step count]
A torch scheduler's ``last_epoch`` is the number of optimizer steps taken: the lr of step ``k`` (from 0) is
``get_lr()`` at ``last_epoch == k``. DeepSpeed's schedulers set an lr when built, then ``step()`` after every optimizer
step, so the lr of step ``k`` is their formula at ``last_batch_iteration == k - 1``, and step 0 runs at the lr they set
when built (WarmupLR, WarmupDecayLR: ``warmup_min_lr``, and step 1 too, the formula's value at iteration 0;
WarmupCosineLR: 0; OneCycle: ``cycle_min_lr``; LRRangeTest: ``lr_range_test_min_lr``). Every scheduler here
evaluates DeepSpeed's formula at ``last_epoch - 1`` for that reason, so that every step's lr is DeepSpeed's;
``tests/optim/test_schedulers.py`` compares them with DeepSpeed's own classes step by step.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from shardtrain.config.sections import (
    LRRangeTestParams,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    scheduler_params,
)

logger = logging.getLogger("shardtrain")


def warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    """Warm-up fraction at DeepSpeed's ``last_batch_iteration == step``: log(step+1)/log(warmup) or step/warmup,
    then 1 (computed in DeepSpeed's order of operations, so that the lrs are equal to the last bit)."""
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return (1.0 / math.log(warmup_steps)) * math.log(step + 1)
    return step / warmup_steps


def _per_group(optimizer: torch.optim.Optimizer, value: float | list | tuple, name: str) -> list[float]:
    """One value per param group: a scalar for all of them, or a list with one per group (as DeepSpeed takes)."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(
                f"{name}: expected {len(optimizer.param_groups)} values (one per param group), got {value}"
            )
        return list(value)
    return [value] * len(optimizer.param_groups)


class DeepSpeedStateMixin:
    """What DeepSpeed's schedulers offer beyond torch's, for the schedulers named after them.

    ``last_batch_iteration`` is DeepSpeed's count: steps taken minus one (see [Note: DeepSpeed's step count]).
    ``load_state_dict`` also takes DeepSpeed's own state dict, ``{"last_batch_iteration": k}`` (what a DeepSpeed
    checkpoint stores), and continues as DeepSpeed would: the next step runs at the lr DeepSpeed's scheduler set
    after its ``k + 1``-th step. DeepSpeed keeps that lr in the optimizer's param groups, which a resume may or may
    not restore (a fresh optimizer, ``load_optimizer_states=False``); it is written into the groups here so that the
    resumed lr does not depend on that."""

    last_epoch: int
    optimizer: torch.optim.Optimizer

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def load_state_dict(self, state_dict: dict) -> None:
        if "last_epoch" in state_dict or "last_batch_iteration" not in state_dict:
            super().load_state_dict(state_dict)  # torch's form (ours)
            return
        unknown = sorted(set(state_dict) - {"last_batch_iteration"})
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: a DeepSpeed scheduler state has only 'last_batch_iteration'; "
                f"got also {unknown}"
            )
        iteration = state_dict["last_batch_iteration"]
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < -1:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: last_batch_iteration must be an integer >= -1, got "
                f"{iteration!r}"
            )
        self.last_epoch = iteration + 1
        self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class WarmupLR(DeepSpeedStateMixin, LRScheduler):
    """lr = min + (max - min) * gamma, for every param group; constant at max after warm-up. Steps 0 and 1 both run
    at ``warmup_min_lr``, as in DeepSpeed (see [Note: DeepSpeed's step count]). ``warmup_max_lr=None``: each
    group's own lr (DeepSpeed's default for WarmupLR)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.min_lr, self.max_lr = self.min_lrs[0], self.max_lrs[0]
        self.warmup_type = warmup_type
        # as in DeepSpeed, whatever the type: log warm-up over one step would divide by log(1) = 0
        self.warmup_num_steps = max(2, warmup_num_steps)
        super().__init__(optimizer, last_epoch)

    def _gamma(self, iteration: int) -> float:
        return warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        iteration = self.last_epoch - 1
        if iteration < 0:  # the lr DeepSpeed sets when built
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``. ``warmup_max_lr`` defaults to 0.001 here, as in
    DeepSpeed."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = 0.001,
        **kwargs,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr, **kwargs)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super()._gamma(iteration)
        return max(
            0.0, float(self.total_num_steps - iteration) / float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        )


class WarmupCosineLR(DeepSpeedStateMixin, LRScheduler):
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


class OneCycle(DeepSpeedStateMixin, LRScheduler):
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
        self._set_momentum()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if "last_epoch" not in state_dict:  # DeepSpeed's form: its scheduler set beta1 with the lr
            self._set_momentum()

    def _set_momentum(self) -> None:
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.momentum_at(self.last_epoch - 1), 0.99)


class LRRangeTest(DeepSpeedStateMixin, LRScheduler):
    """DeepSpeed's LRRangeTest: ``lr = lr_range_test_min_lr * (1 + step_rate * interval)``, where ``interval`` is
    the steps taken divided by ``lr_range_test_step_size`` (rounded down with ``lr_range_test_staircase``): the lr
    grows without bound, to find the largest one that still trains. Step 0 runs at ``lr_range_test_min_lr``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate, self.staircase = (
            lr_range_test_step_size,
            lr_range_test_step_rate,
            lr_range_test_staircase,
        )
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        taken = float(self.last_epoch)  # DeepSpeed's last_batch_iteration + 1
        interval = math.floor(taken / self.step_size) if self.staircase else taken / self.step_size
        return [lo * (1 + self.step_rate * interval) for lo in self.min_lrs]


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    params = scheduler_params(cfg)
    assert params is not None  # "auto" is refused unless allow_auto
    kwargs = params.model_dump()
    if isinstance(params, LRRangeTestParams):
        return LRRangeTest(optimizer, **kwargs)
    if isinstance(params, OneCycleParams):
        return OneCycle(optimizer, **kwargs)
    if isinstance(params, WarmupCosineLRParams):
        return WarmupCosineLR(optimizer, **kwargs)
    if isinstance(params, WarmupDecayLRParams):
        return WarmupDecayLR(optimizer, **kwargs)
    return WarmupLR(optimizer, **kwargs)
