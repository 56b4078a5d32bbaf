"""One vocabulary for reductions (issue 34 item 4): ``Reduce`` is what every reducing collective of the communicator
takes; a name outside it is refused before any rank sends anything."""

import pytest
import torch
import torch.distributed as dist

from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.testing import run_distributed


def _reductions() -> dict:
    comm = Communicator(dist.group.WORLD, 30.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for op in Reduce:
        t = torch.tensor([float(rank + 1), 2.0 * rank])
        comm.all_reduce(t, op, what=f"test {op}")
        out[op.value] = t.tolist()
    chunk = torch.empty(2)
    comm.reduce_scatter(chunk, torch.arange(2.0 * world) * (rank + 1), Reduce.AVG, what="test avg")
    out["scatter"] = chunk.tolist()
    try:
        comm.all_reduce(torch.zeros(1), "mean", what="a name torch does not have")
    except ValueError as err:
        out["refused"] = str(err)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_reduction_and_a_name_outside_them(world):
    ranks = range(1, world + 1)
    for r, got in enumerate(run_distributed(_reductions, world)):
        assert got["sum"] == [float(sum(ranks)), 2.0 * sum(range(world))]
        assert got["avg"] == pytest.approx([sum(ranks) / world, 2.0 * sum(range(world)) / world])
        assert got["max"] == [float(world), 2.0 * (world - 1)]
        mean_factor = sum(ranks) / world  # rank k sent arange * (k + 1): the average is arange * mean(k + 1)
        assert got["scatter"] == pytest.approx([(2 * r) * mean_factor, (2 * r + 1) * mean_factor])
        assert got["refused"] == "unknown reduction 'mean': one of sum, avg, max"
