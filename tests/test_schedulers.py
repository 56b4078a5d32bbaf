"""WarmupLR / WarmupDecayLR follow DeepSpeed's formulas."""

import math

import pytest
import torch

from shardtrain.config import SchedulerConfig
from shardtrain.schedulers import WarmupDecayLR, WarmupLR, build_scheduler


def _opt():
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)


def _lrs(sched, n):
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return out


def test_warmup_log_and_linear():
    log = _lrs(WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), 12)
    assert log[0] == 0.0
    assert log[3] == pytest.approx(math.log(4) / math.log(10))
    assert log[10:] == [1.0, 1.0]
    lin = _lrs(WarmupLR(_opt(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4, warmup_type="linear"), 6)
    assert lin == pytest.approx([0.1, 0.35, 0.6, 0.85, 1.1, 1.1])


def test_warmup_decay_reaches_zero():
    lrs = _lrs(
        WarmupDecayLR(_opt(), total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear"), 12
    )
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert lrs[6] == pytest.approx(0.5)  # (10 - 6) / (10 - 2)
    assert lrs[10:] == [0.0, 0.0]


def test_build_from_config():
    sched = build_scheduler(
        SchedulerConfig(type="WarmupDecayLR", params={"total_num_steps": 5, "warmup_num_steps": 1}), _opt()
    )
    assert isinstance(sched, WarmupDecayLR)
    assert sched.total_num_steps == 5
