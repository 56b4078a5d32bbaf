"""A pipeline stage rank killed with SIGKILL in its stage's forward or backward: the other stages' ranks, waiting in
the schedule's sends and receives, stop within seconds with a PeerLostError that names the killed rank and the
exchange ([Note: guarded stage exchanges] in engine/engine.py), and no process is left behind."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import shardtrain
from shardtrain.testing import run_ranks

from helpers.pipeline import GAS, MICRO, global_batches, make_model, make_optimizer
from helpers.reliability import check_rank_death, die


def _train_until_killed(pp: int, victim: int, point: str) -> None:
    model = make_model("gpt")
    config = {"pipeline_parallel_size": pp, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS}
    engine = shardtrain.initialize(model, config, optimizer=make_optimizer(model))
    batches = global_batches("gpt", 1)
    engine.train_batch(iter(batches[:GAS]))
    if dist.get_rank() == victim:  # the first block of its stage, in the second step
        block = next(iter(engine.module.blocks.values()))
        if point == "forward":
            block.register_forward_pre_hook(die)
        else:
            block.register_full_backward_pre_hook(die)
    for step in (1, 2):
        engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))


# a middle stage dies in backward (both neighbours wait on it), the last stage in forward
@pytest.mark.parametrize(("pp", "victim", "point"), [(3, 1, "backward"), (2, 1, "forward")])
def test_survivors_name_the_killed_stage_rank(pp, victim, point):
    outcomes = run_ranks(_train_until_killed, pp, pp, victim, point, timeout=90)
    for survivor, (_, message) in check_rank_death(outcomes, victim).items():
        assert "send/recv of pipeline activations and gradients between stages" in message, (survivor, message)
