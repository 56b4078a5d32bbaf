"""Hybrid sharding (``zero_optimization.mics_shard_size: S``): state sharded within groups of S adjacent data-parallel
ranks, replicated across the groups ([Note: the hybrid mesh] in src/shardtrain/mesh.py, [Note: hybrid gradient
reduction] in src/shardtrain/zero/reducer.py).

Parity with one process on the same global batch at world 4 = 2 replicas x 2 shards (stages 1-3, AdamW with
clipping, SGD without it: SGD's update is the gradient itself, so a replica average that summed, or a replica left
out, moves every tensor by the wrong amount), with optimizer and parameter offload, and with tensor parallelism
(world 4 = 2 replicas x shard 1 x tp 2); at world 3 the edge cases S=3 (one group: the plain layout, bit for bit) and
S=1 (every rank holds everything, gradients all-reduced across 3 replicas). Checkpoints move between the hybrid and
the plain layouts both ways, and layouts that cannot be built are refused with the numbers that fit.

One process group per world size runs every case (world-4 gloo runs are slow on two cores).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.checkpoint import open_checkpoint
from shardtrain.config.sections import load_config
from shardtrain.errors import ConfigError, LayoutError
from shardtrain.testing import run_distributed

from helpers import tp_cases
from helpers.parity import (
    Recipe,
    assert_parity,
    global_micro_batches,
    make_model,
    make_optimizer,
    reference_run,
    train_step,
)

RECIPE = Recipe(steps=3)
REVERSE = Recipe(model="reverse", steps=4)
BUCKET = 2000
_S3 = {"stage3_param_persistence_threshold": 0}


@functools.cache
def reference(recipe: Recipe, world: int) -> dict:
    return reference_run(recipe, world)


def _config(recipe: Recipe, stage: int, zero: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            **(_S3 if stage == 3 else {}),
            **zero,
        },
    }


def _engine(recipe: Recipe, stage: int, zero: dict, extra: dict | None = None, sharded_init: bool = False):
    if sharded_init:  # no rank holds the whole model while it is built
        with shardtrain.zero.Init():
            model = make_model(recipe)
    else:
        model = make_model(recipe)
    config = {**_config(recipe, stage, zero), **(extra or {})}
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))


def _train(engine, recipe: Recipe, steps: range) -> tuple[list[float], list[float]]:
    batches = global_micro_batches(recipe, engine.topology.dp)
    losses, norms = [], []
    for step in steps:
        losses.append(train_step(engine, recipe, batches, step, engine.topology.dp_rank))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _facts(engine) -> dict:
    """Where the engine put this rank and its state."""
    topo, layout = engine.topology, engine.layout
    return {
        "coords": (topo.dp, topo.dp_rank, topo.shard_size, topo.shard_rank, topo.replicas, topo.replica_rank),
        "group_ranks": {
            "shard": dist.get_process_group_ranks(topo.shard_group),
            "replicate": dist.get_process_group_ranks(topo.replicate_group) if topo.hybrid else None,
        },
        "bucket_worlds": {b.world for b in layout.buckets},
        "layout": (layout.dp, layout.dp_rank, layout.replicas),
        # per bucket: elements of this rank's gradient shard (what the replica all-reduce carries)
        "shard_numel": sum(b.shard_numel for b in layout.trainable_buckets),
        "shard_numels": [b.shard_numel for b in layout.trainable_buckets],
        "trainable_buckets": len(layout.trainable_buckets),
        "mesh": topo.mesh.mesh_dim_names,
    }


def _run(recipe: Recipe, stage: int, zero: dict, extra: dict | None = None, sharded_init: bool = False) -> dict:
    engine = _engine(recipe, stage, zero, extra, sharded_init)
    losses, norms = [], []
    by_group = []
    for step in range(recipe.steps):
        loss, norm = _train(engine, recipe, range(step, step + 1))
        losses += loss
        norms += norm
        by_group.append(engine.comm_stats(reset=True, by_group=True))
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "by_group": by_group}
    out.update(_facts(engine))
    engine.close()
    return out


def _resume(recipe: Recipe, stage: int, zero: dict, load_dir: Path, done: int) -> dict:
    """An engine of this layout loads the checkpoint taken after ``done`` steps and trains the remaining ones."""
    engine = _engine(recipe, stage, zero)
    engine.load_checkpoint(load_dir)
    assert engine.global_step == done
    _train(engine, recipe, range(done, recipe.steps))
    params = engine.full_state_dict()
    engine.close()
    return {"params": params}


def _save_after(recipe: Recipe, stage: int, zero: dict, save_dir: Path, steps: int) -> None:
    engine = _engine(recipe, stage, zero)
    _train(engine, recipe, range(steps))
    engine.save_checkpoint(save_dir)
    engine.close()


def _refused(build) -> str:
    try:
        build()
    except (LayoutError, ConfigError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _tp_case(case: tp_cases.Case, stage: int, zero: dict) -> dict:
    model = tp_cases.make_model(case)
    config = tp_cases.config_for(case, stage, tp=2)
    config["zero_optimization"].update(zero)
    engine = shardtrain.initialize(
        model,
        config=config,
        optimizer=tp_cases.make_optimizer(model, case.lr, case.optimizer),
        tp_plan=tp_cases.plan_for(case),
    )
    losses, norms = tp_cases.train(engine, case, tp_cases.global_batches(case, engine.topology.dp), range(case.steps))
    out = {
        "losses": losses,
        "norms": norms,
        "params": engine.full_state_dict(),
        "by_group": engine.comm_stats(by_group=True),
    }
    out.update(_facts(engine))
    out["tp_rank"] = engine.topology.tp_rank
    engine.close()
    return out


SGD = tp_cases.sgd_case(steps=3)
BF16 = tp_cases.Case(steps=3, dtype="bf16")
TP_CASES = [(tp_cases.Case(steps=3), 3, "adamw stage 3"), (SGD, 2, "sgd stage 2")]


def _world4(tmp: str) -> dict:
    tmp_path = Path(tmp)
    out: dict = {}
    hybrid = {"mics_shard_size": 2}
    out["parity"] = {stage: _run(RECIPE, stage, hybrid) for stage in (1, 2, 3)}
    # blocks run in reverse from the third step: gradients complete in another order, which every data-parallel rank
    # adopts together (the replicas' all-reduces must keep one order)
    out["reverse"] = {stage: _run(REVERSE, stage, hybrid) for stage in (2, 3)}
    # SGD without clipping: a gradient scaled wrongly (a replica sum for an average) moves each tensor by that factor
    model = tp_cases.make_model(SGD)
    config = tp_cases.config_for(SGD, 3, tp=1)
    config["zero_optimization"].update(hybrid)
    engine = shardtrain.initialize(model, config=config, optimizer=tp_cases.make_optimizer(model, SGD.lr, "sgd"))
    losses, norms = tp_cases.train(engine, SGD, tp_cases.global_batches(SGD, engine.topology.dp), range(SGD.steps))
    out["sgd"] = {"losses": losses, "norms": norms, "params": engine.full_state_dict()}
    engine.close()
    # bf16 with bf16 reductions: the fp32 gradient shards are all-reduced across the replicas in the wire dtype
    model = tp_cases.make_model(BF16)
    config = {**tp_cases.config_for(BF16, 2, tp=1), "communication_data_type": "bf16"}
    config["zero_optimization"].update(hybrid)
    engine = shardtrain.initialize(model, config=config, optimizer=tp_cases.make_optimizer(model, BF16.lr))
    losses, norms = tp_cases.train(engine, BF16, tp_cases.global_batches(BF16, engine.topology.dp), range(BF16.steps))
    out["bf16"] = {"losses": losses, "norms": norms, "params": engine.full_state_dict()}
    out["bf16_wire"] = engine.comm_stats(by_group=True)["replicate"]["all_reduce"]["bytes"]
    out["bf16_shard"] = sum(b.shard_numel for b in engine.layout.trainable_buckets)
    engine.close()
    # offload is per-rank state: optimizer state and parameter shards in swap files compose with the replicas
    (tmp_path / "swap").mkdir(exist_ok=True)
    offload = {
        **hybrid,
        "sub_group_size": 3000,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
    }
    out["offload"] = _run(RECIPE, 3, offload)
    # sharded construction (zero.Init shards over every rank while the model is built; the layout re-shards per group)
    out["zero_init"] = _run(RECIPE, 3, hybrid, sharded_init=True)
    # tensor parallelism: 2 replicas x shard 1 x tp 2
    out["tp"] = [_tp_case(case, stage, {"mics_shard_size": 1}) for case, stage, _ in TP_CASES]
    # checkpoints: hybrid -> plain and plain -> hybrid, each resumed for the last step
    _save_after(RECIPE, 3, hybrid, tmp_path / "hybrid", 2)
    out["hybrid_to_plain"] = _resume(RECIPE, 2, {}, tmp_path / "hybrid", 2)
    out["hybrid_checkpoint"] = str(tmp_path / "hybrid")
    _save_after(RECIPE, 1, {}, tmp_path / "plain", 2)
    out["plain_to_hybrid"] = _resume(RECIPE, 3, {"mics_shard_size": 2}, tmp_path / "plain", 2)
    # layouts that cannot be built
    out["refused"] = {
        "S=3 of dp 4": _refused(lambda: _engine(RECIPE, 2, {"mics_shard_size": 3})),
        "S=4 of dp 2 (tp 2)": _refused(
            lambda: shardtrain.initialize(
                make_model(RECIPE),
                config={**_config(RECIPE, 2, {"mics_shard_size": 4}), "tensor_parallel": {"size": 2}},
                optimizer=torch.optim.AdamW,
            )
        ),
    }
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    return run_distributed(_world4, 4, str(tmp_path_factory.mktemp("hybrid4")), timeout=400)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_replicas_of_two_shards_train_like_one_process(world4, stage):
    results = [r["parity"][stage] for r in world4]
    assert_parity(results, reference(RECIPE, 4))
    # rank = replica * 2 + shard: groups of 2 adjacent ranks shard, ranks 2 apart hold the same shard
    for rank, r in enumerate(results):
        assert r["coords"] == (4, rank, 2, rank % 2, 2, rank // 2)
        assert r["group_ranks"] == {
            "shard": [rank - rank % 2, rank - rank % 2 + 1],
            "replicate": [rank % 2, rank % 2 + 2],
        }
        assert r["bucket_worlds"] == {2} and r["layout"] == (4, rank, 2)
        assert r["mesh"] == ("replicate", "shard", "tp")
    # the bytes that leave a group per step (two micro-steps): one all-reduce of each bucket's gradient shard across
    # the 2 replicas at the boundary (fp32, 2 * shard * (R-1)/R), and at stages 2-3 the norm's 8 bytes over every
    # data-parallel rank (at stage 1 the norm stays in the group); nothing else
    for r in results:
        shard_bytes = 4 * r["shard_numel"]
        for step in r["by_group"]:
            reduced = {"calls": r["trainable_buckets"], "bytes": shard_bytes, "sent": shard_bytes}
            assert step["replicate"] == {"all_reduce": reduced}, step
            assert set(step["dp"]) <= {"all_reduce", "all_gather_object"}, step
            assert step["dp"].get("all_reduce", {"bytes": 0})["bytes"] <= 16, step
        assert "all_reduce" in r["by_group"][-1]["dp"] or stage == 1


@pytest.mark.parametrize("stage", [2, 3])
def test_a_new_gradient_order_is_adopted_by_every_replica(world4, stage):
    assert_parity([r["reverse"][stage] for r in world4], reference(REVERSE, 4))
    for r in world4:  # the observed orders were exchanged over every data-parallel rank
        assert any("all_gather_object" in step["dp"] for step in r["reverse"][stage]["by_group"])


def test_sgd_catches_a_wrongly_scaled_replica_reduction(world4):
    ref = tp_cases.reference_run(SGD, 4)
    tp_cases.assert_parity(world4[0]["sgd"], ref, "hybrid sgd stage 3")  # losses: the mean over every rank


def test_bf16_reduces_across_replicas_in_the_wire_dtype(world4):
    tp_cases.assert_parity(world4[0]["bf16"], tp_cases.reference_run(BF16, 4), "hybrid bf16 stage 2")
    for r in world4:  # 2 bytes per element of the gradient shard (2 * shard * (R-1)/R), for each of the 3 steps
        assert r["bf16_wire"] == 3 * 2 * r["bf16_shard"], (r["bf16_wire"], r["bf16_shard"])


def test_offload_composes_with_hybrid_sharding(world4):
    assert_parity([r["offload"] for r in world4], reference(RECIPE, 4))


def test_sharded_construction_composes_with_hybrid_sharding(world4):
    assert_parity([r["zero_init"] for r in world4], reference(RECIPE, 4))


@pytest.mark.parametrize("index", range(len(TP_CASES)))
def test_tensor_parallel_with_replicas(world4, index):
    case, _, what = TP_CASES[index]
    ref = tp_cases.reference_run(case, 2)
    for rank, r in enumerate(world4):
        result = r["tp"][index]
        # world 4 = 2 replicas x shard 1 x tp 2: dp rank = replica, the replicate group spans the two tp groups
        assert result["coords"] == (2, rank // 2, 1, 0, 2, rank // 2), result["coords"]
        assert result["group_ranks"] == {"shard": [rank], "replicate": [rank % 2, rank % 2 + 2]}
        assert result["bucket_worlds"] == {1}
        if rank == 0:
            tp_cases.assert_parity(result, ref, f"hybrid tp 2 {what}")


def test_checkpoints_move_between_hybrid_and_plain_layouts(world4):
    ref = reference(RECIPE, 4)
    from helpers.parity import assert_params_near

    for key in ("hybrid_to_plain", "plain_to_hybrid"):
        assert_params_near(world4[0][key]["params"], ref["params"], ref["init"], exact=ref["exact"], what=f"{key}: ")
    # the replicas' copies of each fragment are stored once, by the first replica (ranks 0 and 1); the second
    # replica's files hold no tensor piece
    manifest = open_checkpoint(world4[0]["hybrid_checkpoint"]).manifest
    writers = {piece.file for entry in manifest.tensors.values() for piece in entry.pieces}
    assert writers == {"rank00000.safetensors", "rank00001.safetensors"}, writers


def test_impossible_layouts_are_refused_with_what_fits(world4):
    refused = world4[0]["refused"]
    assert refused["S=3 of dp 4"].startswith("LayoutError"), refused
    assert "mics_shard_size 3 does not divide the data-parallel size 4" in refused["S=3 of dp 4"]
    assert "[1, 2, 4]" in refused["S=3 of dp 4"]
    assert "mics_shard_size 4 does not divide the data-parallel size 2" in refused["S=4 of dp 2 (tp 2)"]
    assert "tensor_parallel.size 2" in refused["S=4 of dp 2 (tp 2)"]


def test_config_refuses_a_group_size_that_is_not_one_and_stage_0():
    with pytest.raises(ConfigError, match="mics_shard_size 0 is not a group size"):
        load_config({"zero_optimization": {"stage": 2, "mics_shard_size": 0}})
    with pytest.raises(ConfigError, match="ZeRO stage 0 shards nothing"):
        load_config({"zero_optimization": {"stage": 0, "mics_shard_size": 2}})
    assert load_config({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}).zero_optimization.mics_shard_size == 8


def _world3() -> dict:
    out = {}
    # S=3 is the plain layout: the same numbers bit for bit, no replicate group
    out["S=3"] = _run(RECIPE, 3, {"mics_shard_size": 3})
    out["plain"] = _run(RECIPE, 3, {})
    # S=1: every rank holds everything, gradients all-reduced across 3 replicas
    out["S=1"] = {stage: _run(RECIPE, stage, {"mics_shard_size": 1}) for stage in (2, 3)}
    return out


@pytest.fixture(scope="module")
def world3() -> list[dict]:
    return run_distributed(_world3, 3, timeout=300)


def test_one_group_of_every_rank_is_the_plain_layout(world3):
    for r in world3:
        assert r["S=3"]["losses"] == r["plain"]["losses"] and r["S=3"]["norms"] == r["plain"]["norms"]
        assert r["S=3"]["coords"][4] == 1 and r["S=3"]["group_ranks"]["replicate"] is None
        assert r["S=3"]["mesh"] == ("dp", "tp")
        assert r["S=3"]["by_group"] == r["plain"]["by_group"]
    plain, same = world3[0]["plain"]["params"], world3[0]["S=3"]["params"]
    assert all(torch.equal(plain[k], same[k]) for k in plain)


@pytest.mark.parametrize("stage", [2, 3])
def test_shard_size_one_replicates_everything(world3, stage):
    results = [r["S=1"][stage] for r in world3]
    assert_parity(results, reference(RECIPE, 3))
    for rank, r in enumerate(results):
        assert r["coords"] == (3, rank, 1, 0, 3, rank)
        assert r["bucket_worlds"] == {1}
        last = r["by_group"][-1]
        assert "all_gather" not in last["shard"] or last["shard"]["all_gather"]["bytes"] == 0  # nothing to gather
        # the whole gradient leaves the rank: 2 * P * (R-1)/R bytes with R = 3 (counted per bucket, rounded down)
        assert last["replicate"]["all_reduce"]["bytes"] == sum(2 * 4 * n * 2 // 3 for n in r["shard_numels"])


def _graph_cases(recipe: Recipe) -> list[dict]:
    return [_run(recipe, stage, {"mics_shard_size": 2}, extra={"graph": {"enabled": True}}) for stage in (2, 3)]


@pytest.mark.soak
def test_graph_mode_uses_the_same_groups():
    """Graph mode (about two minutes of compilation at world 4 here): at stage 2 the reducer's hooks reduce as in eager
    mode; at stage 3 the captured graph gathers and reduce-scatters over the shard group and the reducer all-reduces
    the graph's gradient shards across the replicas after backward."""
    recipe = Recipe(steps=2)
    results = run_distributed(_graph_cases, 4, recipe, timeout=900)
    for i in range(2):
        assert_parity([r[i] for r in results], reference(recipe, 4))
        for r in results:
            assert r[i]["by_group"][-1]["replicate"]["all_reduce"]["calls"] == r[i]["trainable_buckets"]
