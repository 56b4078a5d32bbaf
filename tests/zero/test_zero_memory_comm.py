"""State bytes and communication bytes per step follow the ZeRO formulas."""

import functools

import pytest
import torch.distributed as dist

from shardtrain.testing import run_distributed

from helpers.parity import Recipe, engine_run


def _run_with_layout(recipe: Recipe, stage: int, world: int, bucket: int) -> dict:
    result = engine_run(recipe, stage, world, bucket=bucket)
    result["rank"] = dist.get_rank()
    return result


@functools.cache
def _results(stage: int, world: int) -> dict:
    recipe = Recipe(steps=2)
    return run_distributed(_run_with_layout, world, recipe, stage, world, 2000)[0]


def _padded_param_bytes(world: int, bucket: int = 2000) -> int:
    """Bytes of the padded flat buffers for the parity model, computed independently of the engine."""
    from helpers.parity import make_model

    model = make_model(Recipe())
    sizes = [p.numel() for p in model.parameters() if p.requires_grad][::-1]
    total, current = 0, 0
    for n in sizes:  # greedy buckets in reverse order, as documented in [Note: bucket layout]
        if current and current + n > bucket:
            total += -(-current // world) * world
            current = 0
        current += n
    total += -(-current // world) * world
    return total * 4


@pytest.mark.parametrize("world", [2, 3])
def test_comm_bytes_per_step_match_formulas(world):
    p = _padded_param_bytes(world)
    ring = lambda size: size * (world - 1) // world  # noqa: E731
    gas = Recipe().gas
    s0, s1, s2 = (_results(stage, world)["comm"][-1] for stage in (0, 1, 2))
    # stage 0: one all-reduce of every gradient at the boundary, nothing else
    assert set(s0) == {"all_reduce"}
    assert s0["all_reduce"]["bytes"] == 2 * ring(p)
    # stage 1: reduce-scatter at the boundary, all-gather after the step, one scalar all-reduce for the norm
    assert s1["reduce_scatter"]["bytes"] == ring(p)
    assert s1["all_gather"]["bytes"] == ring(p)
    assert s1["all_reduce"] == {"calls": 1, "bytes": 2 * 4 * (world - 1) // world, "sent": 2 * 4 * (world - 1) // world}
    # stage 2: reduce-scatter every micro-step
    assert s2["reduce_scatter"]["bytes"] == gas * ring(p)
    assert s2["reduce_scatter"]["calls"] == gas * s1["reduce_scatter"]["calls"]
    assert s2["all_gather"]["bytes"] == ring(p)
    # on the wire (gloo): the reduce-scatter is the pairwise exchange, which sends the theoretical bytes, not
    # gloo's own, which sends an all-reduce's (see [Note: bytes on the wire]; tests/distributed/test_comm_ring.py
    # measures it)
    for s in (s0, s1, s2):
        assert all(c["sent"] == c["bytes"] for c in s.values()), s
    # bucketing: more than one collective per kind for this bucket size
    assert s0["all_reduce"]["calls"] == s1["reduce_scatter"]["calls"] > 1


def test_state_bytes_halve_at_world_2():
    b0, b1, b2 = (_results(stage, 2)["state_bytes"] for stage in (0, 1, 2))
    p = _padded_param_bytes(2)
    from helpers.parity import make_model

    n_params = sum(1 for q in make_model(Recipe()).parameters() if q.requires_grad)
    step_scalars = n_params * 4  # AdamW keeps a scalar 'step' per parameter on every rank
    # every rank holds full parameters at stages 0-2
    assert b0["params"] == b1["params"] == b2["params"] == p
    # stage 0: full gradients, two full moments (+ step scalars)
    assert b0["grads"] == p
    assert b0["optimizer"] == 2 * p + step_scalars
    # stage 1: optimizer state halves (moments only for this rank's fragment)
    assert b1["optimizer"] == p + step_scalars
    assert b1["grads"] == p
    # stage 2: gradients halve too
    assert b2["grads"] == p // 2
    assert b2["optimizer"] == p + step_scalars
