"""The user's optimizer and learning-rate scheduler, taken as given or built from the config's sections, checked
before the model is touched (``initialize``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shardtrain.config.sections import Config, optimizer_class_and_kwargs
from shardtrain.errors import ConfigError, OptimizerError
from shardtrain.optim.deepspeed_muon import DeepSpeedMuon
from shardtrain.optim.schedulers import build_scheduler

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None
SchedulerArg = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler] | None


FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Config-built optimizers made with ``fused=True`` on CUDA (unless the section says ``fused`` or ``foreach``), as
DeepSpeed builds its fused Adam there: one kernel per step, and an fp16 overflow skipped in the kernel (see [Note: an
overflow learned a step later] in :mod:`shardtrain.engine.engine`)."""


def build_optimizer(
    model: nn.Module, cfg: Config, optimizer: OptimizerArg, device: torch.device | None = None
) -> torch.optim.Optimizer:
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' section; keep one of them"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise OptimizerError(f"the optimizer callable returned {type(built).__name__}, not a torch optimizer")
        return built
    if optimizer is not None:
        raise OptimizerError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
    if cfg.optimizer is None:
        raise ConfigError("no optimizer: pass initialize(optimizer=...) or add an 'optimizer' section to the config")
    cls, kwargs = optimizer_class_and_kwargs(cfg.optimizer)
    if cls is DeepSpeedMuon:  # splits the parameters by their names, as DeepSpeed does
        return DeepSpeedMuon.from_config(model, None, kwargs)
    if device is not None and device.type == "cuda" and cls in FUSED_ON_CUDA and not {"fused", "foreach"} & {*kwargs}:
        kwargs["fused"] = True
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def refuse_deepspeed_muon_clipping(optimizer: torch.optim.Optimizer, stage: int, clipping: float) -> None:
    """DeepSpeed's Muon type at ZeRO 1-3 clips by another norm than shardtrain's: refused by name while it is not
    built ([Note: DeepSpeed's Muon is not torch's] in optim/deepspeed_muon.py)."""
    if isinstance(optimizer, DeepSpeedMuon) and stage > 0 and clipping:
        raise ConfigError(
            f"DeepSpeed's Muon optimizer type at ZeRO stage {stage} with gradient_clipping {clipping}: DeepSpeed "
            "0.19.8 writes the orthogonalized Muon updates into the gradient partitions at stages 1-3 and clips by "
            "their norm (with the Adam gradients'), not by the gradients' norm, and that is not built here. Set "
            '"gradient_clipping": 0 (DeepSpeed\'s default is 1.0), or use ZeRO stage 0, where DeepSpeed clips the '
            "gradients as shardtrain does"
        )


def build_lr_scheduler(cfg: Config, opt: torch.optim.Optimizer, lr_scheduler: SchedulerArg) -> LRScheduler | None:
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' section; keep one of them"
        )
    if isinstance(lr_scheduler, LRScheduler):
        if lr_scheduler.optimizer is not opt:
            raise OptimizerError(
                "lr_scheduler was built on a different optimizer than the one passed to initialize(); "
                "build it on that optimizer, or pass a callable optimizer -> scheduler"
            )
        return lr_scheduler
    if callable(lr_scheduler):
        built = lr_scheduler(opt)
        if not isinstance(built, LRScheduler):
            raise OptimizerError(f"the lr_scheduler callable returned {type(built).__name__}, not a torch LRScheduler")
        return built
    if lr_scheduler is not None:
        raise OptimizerError(f"lr_scheduler must be an LRScheduler or a callable, got {type(lr_scheduler).__name__}")
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler, opt)
    return None
