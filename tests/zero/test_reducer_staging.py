"""Stage 2-3 staging buffers are not zeroed when allocated (each slot's first gradient overwrites it): a
parameter without a gradient in a backward must still reduce as zero, not as what the memory held before.

A two-layer model whose second layer is used on even steps only, both layers in one bucket; SGD without
momentum, so a stale gradient would move the skipped layer. Compared with one process on the global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.testing import run_distributed

STEPS, MICRO, WIDTH = 4, 3, 24


class Skipping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        if step % 2 == 0:
            y = self.b(y)
        return (y**2).mean()


def _data(world: int, step: int) -> torch.Tensor:
    return torch.randn(world * MICRO, WIDTH, generator=torch.Generator().manual_seed(step))


def _reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Skipping()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        x = _data(world, step)
        # the engine averages each rank's mean loss: the mean of the per-rank means
        loss = torch.stack([model(x[r * MICRO : (r + 1) * MICRO], step) for r in range(world)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # the unused layer gets no update
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_run(stage: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Skipping()
    zero = {"stage": stage, "reduce_bucket_size": 10_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(STEPS):
        x = _data(world, step)[rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(x, step))
        engine.step()
    return {"params": engine.full_state_dict(), "reference": _reference(world)}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_a_parameter_without_gradient_reduces_as_zero(stage, world):
    r = run_distributed(_engine_run, world, stage)[0]
    for name, want in r["reference"].items():
        torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
