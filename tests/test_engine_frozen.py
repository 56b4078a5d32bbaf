"""A parameter frozen when ``initialize`` ran and unfrozen later is refused at the next step, naming it: the gradient
buckets and the optimizer state were built without it, so it would never be reduced nor stepped (before, it trained
silently as if still frozen). Freezing after ``initialize`` and unfreezing again is supported
(tests/test_runtime_modes.py)."""

from __future__ import annotations

import torch
from torch import nn

import shardtrain
from shardtrain.errors import OptimizerError
from shardtrain.testing import run_distributed


def _unfreeze_after_initialize(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine = shardtrain.initialize(model, config, optimizer)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        engine.backward(engine(x).square().mean())
        engine.step()  # frozen as at initialize: fine
        model[0].weight.requires_grad_(True)
        engine.backward(engine(x).square().mean())
        try:
            engine.step()
        except OptimizerError as err:
            out["error"] = str(err)
        out["steps"] = engine.global_step
    finally:
        engine.close()
    return out


def test_a_parameter_unfrozen_after_initialize_is_refused_at_the_step():
    for stage in (0, 3):
        for r in run_distributed(_unfreeze_after_initialize, 2, stage):
            assert r["steps"] == 1, (stage, r)
            assert "0.weight: frozen (requires_grad=False) when initialize built" in r.get("error", ""), (stage, r)
            assert "Make it trainable before initialize" in r["error"]


def _freeze_mid_run(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine = shardtrain.initialize(model, config, optimizer)
    g = torch.Generator().manual_seed(1)
    values = []
    try:
        for step in range(4):
            model[0].weight.requires_grad_(step not in (1, 2))  # trains at step 0, frozen at 1-2, trains at 3
            engine.backward(engine(torch.randn(2, 8, generator=g)).square().mean())
            engine.step()
            values.append(model[0].weight.detach().clone())
    finally:
        engine.close()
    return {"values": values}


def test_a_parameter_frozen_mid_run_is_not_stepped_at_any_stage():
    """AdamW with weight decay would move a frozen parameter by its moments and decay it when stepped with the zero
    gradient its bucket holds; torch.optim skips a parameter without a gradient, and so must every stage (stage 0 in
    fp32, where the parameters hold their gradients, stepped it)."""
    for stage in (0, 1, 3):
        for r in run_distributed(_freeze_mid_run, 2, stage):
            v = r["values"]
            assert torch.equal(v[1], v[0]) and torch.equal(v[2], v[0]), f"stage {stage}: frozen but moved"
            assert not torch.equal(v[3], v[2]), f"stage {stage}: unfrozen but not trained"
