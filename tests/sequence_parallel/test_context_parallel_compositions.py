"""Context parallelism (docs/context-parallel.md) composed with hybrid sharding, ZeRO++ hpZ and the tiled loss and
MLP: parity with one process on the same global batches (losses every step, gradient norms, final parameters)."""

from __future__ import annotations

from functools import partial

import pytest

from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_params_near, engine_run, reference_run
from test_context_parallel import GAS, STEPS, _batches, _check_parity, _length, _llama

from helpers.sp_cases import keyword_recipe


def _groups(engine) -> dict:
    """Where this rank sits on ZeRO's axis, and the sizes of its shard, replicate and hpZ groups."""
    topo = engine.topology
    size = lambda group: None if group is None else group.size()  # noqa: E731
    return {
        "axes": (topo.cp_rank, topo.dp_rank, topo.zero_rank, topo.shard_size, topo.replicas),
        "groups": (size(topo.groups.shard), size(topo.replicate_group), size(topo.hpz_group)),
        "hpz_gathers": engine._runtime.hpz.gathers if engine._runtime.hpz is not None else 0,
    }


def _tiles(engine) -> dict:
    """Whether the model's loss and every MLP's forward were replaced by the tiled ones."""
    model = engine.module
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    tiled = [getattr(m.forward, "__shardtrain_tiled__", False) for m in (model, *mlps)]
    return {"tiled": tiled}


def _parity(world: int, cp: int, config: dict, packed: bool = True, inspect=_groups, sp: int = 1) -> list[dict]:
    dp = world // (cp * sp)
    config = {"context_parallel_size": cp, "sequence_parallel_size": sp, **config}
    recipe = keyword_recipe(_llama, partial(_batches, dp, packed, _length(cp * sp)), GAS, config)
    results = run_distributed(engine_run, world, recipe, inspect, init_process_group=False)
    ref = reference_run(recipe, dp)
    losses = [sum(r["losses"][s] for r in results[:: cp * sp]) / dp for s in range(STEPS)]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
    for r in results:
        for s, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(got - want) <= 1e-4 * want, f"step {s}: gradient norm {got} vs one process {want}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)
    return results


@pytest.mark.parametrize("stage", [3, pytest.param(1, marks=pytest.mark.soak)])
def test_hybrid_sharding_parity(stage):
    """cp 2 x dp 2 (world 4) with mics_shard_size 2: ZeRO's axis is zero_rank = dp_rank * cp + cp_rank, so a shard
    group is one sequence's two cp ranks (adjacent) and the replicate group the ranks of the same cp rank in the
    other dp rank; the gradient still averaged over all four."""
    results = _parity(4, 2, {"zero_optimization": {"stage": stage, "mics_shard_size": 2}})
    assert [r["axes"] for r in results] == [(i % 2, i // 2, i, 2, 2) for i in range(4)]
    assert all(r["groups"] == (2, 2, None) for r in results)


@pytest.mark.soak
def test_hybrid_sharding_with_ulysses_parity():
    """sp 2 x cp 2 x dp 2 (world 8) with mics_shard_size 4: a shard group is one sequence's four ranks, replicated
    across the two dp ranks."""
    results = _parity(8, 2, {"zero_optimization": {"stage": 3, "mics_shard_size": 4}}, sp=2)
    assert [r["axes"] for r in results] == [(i // 2 % 2, i // 4, i, 4, 2) for i in range(8)]
    assert all(r["groups"] == (4, 2, None) for r in results)


@pytest.mark.parametrize("world", [4, pytest.param(3, marks=pytest.mark.soak)])
def test_hpz_parity(world):
    """ZeRO-3 with zero_hpz_partition_size 2 at cp 2 x dp 2 (world 4): an hpZ group is two adjacent ranks of ZeRO's
    dp * cp axis, one sequence's cp ranks, and backward gathers every unit from its secondary shards there; the
    values are plain ZeRO-3's. World 3 (cp 3, hpz 3 = every ZeRO rank): plain ZeRO-3, no hpZ group."""
    cp, hpz = (2, 2) if world == 4 else (3, 3)
    # no parameter persistent (DeepSpeed's threshold, 1e5 elements, would keep every one of this tiny Llama whole)
    zero = {"stage": 3, "zero_hpz_partition_size": hpz, "stage3_param_persistence_threshold": 0}
    results = _parity(world, cp, {"zero_optimization": zero})
    if world == 4:
        assert all(r["groups"] == (None, None, 2) for r in results)
        # backward's unit gathers served from the secondary shards, inside the group
        assert all(r["hpz_gathers"] > 0 for r in results), [r["hpz_gathers"] for r in results]
    else:
        assert all(r["groups"][2] is None and r["hpz_gathers"] == 0 for r in results)


def test_an_hpz_group_that_does_not_divide_zeros_axis_is_refused():
    from shardtrain.errors import LayoutError
    from shardtrain.plan.dims import ParallelDims

    with pytest.raises(LayoutError, match=r"zero_hpz_partition_size 3 does not divide the 4 ranks ZeRO shards over"):
        ParallelDims(4, cp=2, hpz_size=3)
    assert ParallelDims(4, cp=2, hpz_size=2).hpz == 2
    assert ParallelDims(8, cp=2, sp=2, hpz_size=2).hpz == 1  # beside Ulysses: refused by the plan


_TILED = {"tiled_logits_loss": True, "tiled_logits_loss_shards": 3, "tiled_mlp_compute": True, "tiled_mlp_shards": 2}


@pytest.mark.parametrize(("world", "cp", "stage"), [(2, 2, 3), (3, 3, 2)])
def test_tiled_loss_and_mlp_parity(world, cp, stage):
    """The tiled loss (3 tiles) and MLP (2 tiles) at cp 2 (ZeRO-3: the head and MLPs gathered for the recompute) and
    cp 3, packed documents, a fifth of the labels -100: each rank tiles its own two chunks, and the
    loss is the whole sequence's mean over its real tokens, counted over the cp group (the chunks hold different
    counts) as without tiling ([Note: the loss over a sequence-parallel group])."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    results = _parity(world, cp, {"zero_optimization": zero, **_TILED}, inspect=_tiles)
    assert all(r["tiled"] == [True, True, True] for r in results), results


@pytest.mark.soak
@pytest.mark.parametrize(
    ("sp", "cp", "tp", "stage", "packed", "attn"),
    [(2, 2, 2, 1, True, "sdpa"), (2, 2, 1, 3, True, "sdpa"), (2, 4, 1, 2, True, "sdpa")],
    ids=["sp2-cp2-tp2", "sp2-cp2-dp2", "gqa-sp2-cp4"],
)
def test_world_8_parity(sp, cp, tp, stage, packed, attn):
    """World 8, packed documents: sp 2 x cp 2 x tp 2 (the Llama's 4 query heads and 2 key/value heads: 2 and 1 per
    tp rank, that one repeated for Ulysses' 2 sp ranks, each going around its cp group); the issue's sp 2 x cp 2 x
    dp 2 at ZeRO-3 (ZeRO over all 8 ranks); the Llama at sp 2 x cp 4, one sequence over 8 ranks, which Ulysses
    alone cannot reach (its 4 query heads must divide by sequence_parallel_size, [Note: key/value heads under
    Ulysses]): 16 tokens in 8 chunks of two, each rank holding two tokens."""
    _check_parity(8, cp, stage, packed, attn, sp=sp, tp=tp)
