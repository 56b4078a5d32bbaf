"""A rank killed with SIGKILL (as the OOM killer does) in forward, backward, the optimizer step or a checkpoint save,
at every ZeRO stage: every survivor stops within seconds with a PeerLostError that names the killed rank and what
the survivor was doing, without calling it a timeout, and no process is left behind."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from reliability_helpers import arm, check_rank_death
from resume_helpers import make_engine, train
from shardtrain.testing import run_ranks

POINTS = ["forward", "backward", "step", "save"]


def _train_until_killed(stage: int, victim: int, point: str, root: str) -> None:
    engine = make_engine(0, stage, "adamw")
    train(engine, range(1))
    if dist.get_rank() == victim:
        arm(engine, "tensor_file_written" if point == "save" else point)
    train(engine, range(1, 3))
    engine.save_checkpoint(root)


# every stage and point once; worlds 2 and 3 alternate, so that each stage and each point meets both; the killed
# rank rotates over every rank (rank 0 hosts the rendezvous store here: the others must still name it)
CASES = [
    (stage, point, world, (stage + i // 2) % world)
    for stage in range(4)
    for i, point in enumerate(POINTS)
    for world in [3 if (stage + i) % 2 == 0 else 2]
]


@pytest.mark.parametrize(("stage", "point", "world", "victim"), CASES)
def test_survivors_name_the_killed_rank(tmp_path, stage, point, world, victim):
    outcomes = run_ranks(_train_until_killed, world, stage, victim, point, str(tmp_path), timeout=60)
    check_rank_death(outcomes, victim)
