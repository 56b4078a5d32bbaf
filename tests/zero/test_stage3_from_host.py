"""[Note: stage 3 from the host]: at stage 3, ``initialize`` moves to the device only what stays whole there (buffers,
parameters below the persistence threshold); each unit's parameters reach the device when the unit is laid out, one
unit at a time. The target device is ``meta`` here (a machine without a GPU has one device): what moved is what is on
it."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from shardtrain.engine.parallelize import move_whole_parts
from shardtrain.plan.policies import ZeroPolicy
from shardtrain.zero.layout import build_buckets

META = torch.device("meta")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(64, 64)  # weight 4096 elements: a unit's; bias 64: below the threshold
        self.norm = nn.BatchNorm1d(64)  # running statistics: buffers
        self.head = nn.Linear(64, 64)
        self.head.weight.requires_grad_(False)  # frozen and unit-sized: in a unit too


def _where(model: nn.Module) -> dict[str, str]:
    return {n: t.device.type for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_moves_what_stays_whole_and_leaves_units_to_the_layout(stage):
    model = Net()
    optimizer_holds = list(model.parameters())
    zero = ZeroPolicy.for_stage(stage, persistence_threshold=1000)
    move_whole_parts(model, zero, types.SimpleNamespace(device=META, tp=1))
    where = _where(model)
    unit_sized = {"big.weight", "head.weight"}
    for name, device in where.items():
        expected = "cpu" if stage == 3 and name in unit_sized else "meta"
        assert device == expected, (name, device)
    if stage == 3:  # the same Parameter objects, the optimizer holds them (stages 0-2: nn.Module.to's own move)
        assert all(a is b for a, b in zip(model.parameters(), optimizer_holds, strict=True))


def test_with_tensor_parallelism_the_whole_model_moves_first():
    model = Net()
    move_whole_parts(model, ZeroPolicy.for_stage(3), types.SimpleNamespace(device=META, tp=2))
    assert set(_where(model).values()) == {"meta"}


def test_a_unit_laid_out_on_the_device_copies_its_parameters_in():
    torch.manual_seed(0)
    values = [torch.randn(3, 5), torch.randn(7)]
    (bucket,) = build_buckets(
        [[("a", nn.Parameter(values[0].clone())), ("b", nn.Parameter(values[1].clone()))]],
        world=4,
        rank=1,
        own_shard=True,
        device=torch.device("cpu"),
    )
    flat = torch.cat([v.flatten() for v in values])
    assert torch.equal(bucket.flat_param[:22], flat) and torch.equal(bucket.shard, bucket.flat_param[6:12])
    assert all(s.param.data_ptr() == bucket.flat_param[s.offset :].data_ptr() for s in bucket.slots)
