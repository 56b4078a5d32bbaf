"""ZeRO++ hpZ (``zero_optimization.zero_hpz_partition_size: H``) at stage 3: backward gathers from secondary shards
within groups of H adjacent ranks ([Note: secondary shards] in src/shardtrain/zero/hpz.py).

The default run, world 4 with H = 2 (two "nodes" of two ranks), one process group for every case:

* parity with one process on the same global batch (AdamW with clipping, two micro-steps per step);
* a battery run once with plain ZeRO-3 and once with hpZ, compared bit for bit (the backward gathers the same bytes,
  so nothing may differ): steps through ``engine(...)``; ``engine.module(...)`` and an eval forward without gradients;
  a forward that records gradients and is never followed by a backward; a whole step through ``engine.module(...)``;
  a unit's primary shard changed in place between a forward and its backward (the secondary shard is then stale and
  must not be used: the backward must see the changed values, as plain ZeRO-3's does);
* the bytes of one step by group against the formulas: forward gathers over every rank (they cross the groups),
  backward gathers over the hpZ group only (none cross), reduce-scatters over every rank;
* the secondary shards held at once: exactly the released units' full buffers divided by H, and none after backward.

Refusals (single process, before anything is built) and, in the soak run, world 6 with H = 3 and H = 2.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.config.sections import load_config
from shardtrain.errors import ConfigError, LayoutError
from shardtrain.estimate import estimate_memory
from shardtrain.testing import run_distributed

from helpers.parity import (
    Recipe,
    assert_parity,
    global_micro_batches,
    make_model,
    make_optimizer,
    reference_run,
    train_step,
)

RECIPE = Recipe(steps=2, gas=2)
BUCKET = 2000
FP32 = 4


@functools.cache
def reference(recipe: Recipe, world: int) -> dict:
    return reference_run(recipe, world)


def _config(recipe: Recipe, hpz: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "stage3_param_persistence_threshold": 0,
            "zero_hpz_partition_size": hpz,
        },
    }


def _engine(recipe: Recipe, hpz: int):
    model = make_model(recipe)
    config = _config(recipe, hpz)
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe)), model


def _ring(nbytes: int, n: int) -> int:
    return nbytes * (n - 1) // n


def _expected_bytes(engine, gas: int) -> dict:
    """One optimizer step's bytes per group and kind (see bench/bench_hybrid.py's formulas)."""
    topo, layout = engine.topology, engine.layout
    units = layout.unit_buckets  # backward order: the last block first, the root last; both stay gathered
    kept = {id(units[0].module), id(units[-1].module)}
    n, h = topo.dp, topo.hpz_size
    forward = sum(_ring(b.padded_numel * FP32, n) for u in units for b in u.buckets)
    backward = [b.padded_numel * FP32 for u in units if id(u.module) not in kept for b in u.buckets]
    reduce = sum(_ring(b.padded_numel * FP32, n) for b in layout.trainable_buckets)
    norm = _ring(2 * FP32, n) * 2  # the gradient norm's all-reduce (two floats: the norm and the order flag)
    if h == 1:
        return {
            "shard": {
                "all_gather": gas * (forward + sum(_ring(b, n) for b in backward)),
                "reduce_scatter": gas * reduce,
            }
        }, norm
    return {
        "shard": {"all_gather": gas * forward, "reduce_scatter": gas * reduce},
        "hpz": {"all_gather": gas * sum(_ring(b, h) for b in backward)},
    }, norm


def _battery(hpz: int) -> dict:
    """The phases of the module docstring; every loss and rank 0's full parameters after each phase."""
    engine, model = _engine(RECIPE, hpz)
    rank, dp = engine.topology.dp_rank, engine.topology.dp
    batches = global_micro_batches(Recipe(steps=6, gas=2), dp)
    lo, hi = rank * RECIPE.micro, (rank + 1) * RECIPE.micro
    out: dict = {"losses": {}, "params": {}}
    secondary = engine._runtime.hpz if hpz > 1 else None
    # parity with one process
    losses, norms = [], []
    for step in range(RECIPE.steps):
        losses.append(train_step(engine, RECIPE, batches, step, rank))
        norms.append(engine.get_global_grad_norm())
        if secondary is not None and step == 0:  # the first forward releases its last unit too (no order yet)
            out["first_max_held"], secondary.max_held_bytes = secondary.max_held_bytes, 0
        stats = engine.comm_stats(reset=True, by_group=True)  # the last step's: after the unit order is recorded
    # the unit-order check's 8-byte exchanges are counted apart (kind gather_check): parameter and gradient bytes only
    out["bytes"] = {g: {k: v["bytes"] for k, v in s.items() if k != "gather_check"} for g, s in stats.items()}
    out["expected_bytes"], out["norm_bytes"] = _expected_bytes(engine, RECIPE.gas)
    units = engine.layout.unit_buckets
    kept = {id(units[0].module), id(units[-1].module)}
    out["released_bytes"] = sum(b.padded_numel * FP32 for u in units if id(u.module) not in kept for b in u.buckets)
    out["non_root_bytes"] = sum(b.padded_numel * FP32 for u in units[:-1] for b in u.buckets)
    out["groups"] = dist.get_process_group_ranks(engine.topology.hpz_group) if hpz > 1 else None
    out["parity"] = {"losses": losses, "norms": norms, "params": engine.full_state_dict()}
    if secondary is not None:
        out["held_after_backward"] = secondary.held_bytes
        out["max_held"] = secondary.max_held_bytes
        out["served"] = secondary.gathers
    x, y = batches[4]
    with torch.no_grad():
        out["losses"]["module no_grad"] = engine.module(x[lo:hi], y[lo:hi]).item()
    engine.eval()
    with torch.no_grad():
        out["losses"]["eval no_grad"] = engine(x[lo:hi], y[lo:hi]).item()
    engine.train()
    out["losses"]["grad, no backward"] = engine(x[lo:hi], y[lo:hi]).item()  # evaluation with gradients on
    for m in range(RECIPE.gas):  # a whole step through engine.module
        x, y = batches[6 + m]
        loss = engine.module(x[lo:hi], y[lo:hi])
        engine.backward(loss)
        engine.step()
        out["losses"][f"module step {m}"] = loss.item()
    out["params"]["module step"] = engine.full_state_dict()
    # a primary shard changed in place between forward and backward: the secondary shard is stale
    x, y = batches[8]
    loss = engine(x[lo:hi], y[lo:hi])
    # the first block: released after forward, gathered again in backward (the last one stays gathered)
    (block,) = [u for u in engine._runtime.units if u.module is model.blocks[0]]
    with torch.no_grad():
        for b in block.buckets:
            b.shard.mul_(0.5)
    engine.backward(loss)
    engine.step()
    if secondary is not None:
        out["stale"] = secondary.stale
    x, y = batches[9]
    engine.backward(engine(x[lo:hi], y[lo:hi]))
    engine.step()
    assert engine.global_step == RECIPE.steps + 2
    out["params"]["stale"] = engine.full_state_dict()
    engine.close()
    return out


def _world4() -> tuple[dict, dict, dict]:
    return _battery(1), _battery(2), _refusals()


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4, 4, timeout=600)


def test_hpz_trains_like_one_process(world4):
    results = [hpz["parity"] for _, hpz, _ in world4]
    assert_parity(results, reference(RECIPE, 4))


def test_hpz_is_bitwise_plain_zero3(world4):
    for plain, hpz, _ in world4:
        assert plain["parity"]["losses"] == hpz["parity"]["losses"]
        assert plain["parity"]["norms"] == hpz["parity"]["norms"]
        assert plain["losses"] == hpz["losses"]
    plain, hpz, _ = world4[0]
    for phase in ("module step", "stale"):
        for k, v in plain["params"][phase].items():
            assert torch.equal(hpz["params"][phase][k], v), f"{phase}: {k}"
    for k, v in plain["parity"]["params"].items():
        assert torch.equal(hpz["parity"]["params"][k], v), k
    # the changed shard reached the backward in both runs: the stale secondary shard was refused, not used
    assert all(r["stale"] == 1 for _, r, _ in world4), [r["stale"] for _, r, _ in world4]
    # the groups are adjacent ranks (one node each)
    assert [r["groups"] for _, r, _ in world4] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_hpz_backward_gathers_stay_in_the_group(world4):
    for plain, hpz, _ in world4:
        for run in (plain, hpz):
            want = {g: dict(kinds) for g, kinds in run["expected_bytes"].items()}
            want["shard"]["all_reduce"] = run["norm_bytes"]
            assert run["bytes"] == want
        # what crosses the groups: every byte of plain ZeRO-3, all but the backward gathers under hpZ
        saved = plain["bytes"]["shard"]["all_gather"] - hpz["bytes"]["shard"]["all_gather"]
        assert saved == RECIPE.gas * _ring(hpz["released_bytes"], 4) > 0
        assert hpz["bytes"]["hpz"]["all_gather"] == RECIPE.gas * _ring(hpz["released_bytes"], 2)


def test_hpz_holds_the_released_units_secondary_shards_until_backward(world4):
    for _, hpz, _ in world4:
        # at the end of each forward: every released unit's share, 1/H of its full buffer; none after backward
        assert hpz["max_held"] == hpz["released_bytes"] // 2
        # on the first step, before the unit order is recorded, the last block is released and kept as well
        assert hpz["first_max_held"] == hpz["non_root_bytes"] // 2
        assert hpz["held_after_backward"] == 0
        # every backward gather of a released unit came from the secondary shards: both blocks in the first
        # micro-step, then the first block (the last one stays gathered) in each of the other three
        assert hpz["served"] == 2 + (RECIPE.gas * RECIPE.steps - 1)


def test_the_planner_models_the_secondary_shards(world4):
    """The estimate's hpZ row is the most secondary-shard bytes a rank held (the first step's: every unit but the
    root), and nothing else changes: the state is plain ZeRO-3's."""
    config = _config(RECIPE, 2)
    hpz = estimate_memory(lambda: make_model(RECIPE), config, world_size=4, device_type="cpu", activations=False)
    plain = estimate_memory(
        lambda: make_model(RECIPE), _config(RECIPE, 1), world_size=4, device_type="cpu", activations=False
    )
    (row,) = [r for r in hpz.rows if r.component.startswith("hpZ secondary shards")]
    assert row.transient and row.where == "device"
    assert row.nbytes == world4[0][1]["first_max_held"]
    assert [r for r in hpz.rows if r is not row] == plain.rows
    assert hpz.layout.hpz == 2 and "hpZ 2" in hpz.format()
    with pytest.raises(ConfigError, match="zero_hpz_partition_size 3 does not divide the data-parallel size 4"):
        estimate_memory(
            lambda: make_model(RECIPE), _config(RECIPE, 3), world_size=4, device_type="cpu", activations=False
        )


def _zero(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **extra}}


def test_hpz_with_mics_is_refused_when_loaded():
    with pytest.raises(ConfigError, match="zero_hpz_partition_size 2 with mics_shard_size 2"):
        load_config(_zero(zero_hpz_partition_size=2, mics_shard_size=2))
    # below stage 3 the key does nothing (as in DeepSpeed), so nothing conflicts
    load_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2, "mics_shard_size": 2}})


def _refusals() -> dict:
    """Every hpZ combination that is not built, refused at ``initialize`` before the model changes; sizes that mean
    plain ZeRO-3 (0 and 1: off, as in DeepSpeed; 4: one group of every rank)."""
    out = {}
    cases = {
        "not dividing": _zero(zero_hpz_partition_size=3),
        "tp": {**_zero(zero_hpz_partition_size=4), "tensor_parallel": {"size": 2}},
        "sp": {**_zero(zero_hpz_partition_size=2), "sequence_parallel_size": 2},
        "graph": {**_zero(zero_hpz_partition_size=2), "graph": {"enabled": True}},
        "offload_param": _zero(zero_hpz_partition_size=2, offload_param={"device": "cpu"}),
    }
    for name, config in cases.items():
        model = make_model(RECIPE)
        try:
            shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters()))
            out[name] = "built"
        except (ConfigError, LayoutError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    for size in (0, 4):
        engine = shardtrain.initialize(
            make_model(RECIPE), config=_zero(zero_hpz_partition_size=size), optimizer=torch.optim.AdamW
        )
        out[f"size {size}"] = (engine.topology.hpz_size, engine._runtime.hpz, list(engine.comm_stats(by_group=True)))
        engine.close()
    return out


def test_hpz_refusals_and_sizes_that_mean_off(world4):
    r = world4[0][2]
    assert r["not dividing"].startswith(
        "LayoutError: zero_optimization.zero_hpz_partition_size 3 does not divide the data-parallel size 4"
    ), r
    assert "choose one of [1, 2, 4]" in r["not dividing"]
    for name, what in (
        ("tp", "tensor parallelism (tensor_parallel.size 2)"),
        ("sp", "sequence parallelism (sequence_parallel_size 2)"),
        ("graph", "graph mode (graph.enabled)"),
        ("offload_param", "offload_param.device 'cpu'"),
    ):
        prefix = f"ConfigError: zero_optimization.zero_hpz_partition_size {4 if name == 'tp' else 2} (ZeRO++ hpZ)"
        assert r[name].startswith(f"{prefix} with {what} is not built"), r[name]
    for size in (0, 4):
        assert r[f"size {size}"] == (1, None, ["shard"])


def _world6(hpz: int) -> dict:
    recipe = Recipe(steps=2, gas=2)
    engine, _ = _engine(recipe, hpz)
    batches = global_micro_batches(recipe, engine.topology.dp)
    losses, norms = [], []
    for step in range(recipe.steps):
        losses.append(train_step(engine, recipe, batches, step, engine.topology.dp_rank))
        norms.append(engine.get_global_grad_norm())
    out = {
        "losses": losses,
        "norms": norms,
        "params": engine.full_state_dict(),
        "groups": dist.get_process_group_ranks(engine.topology.hpz_group),
        "served": engine._runtime.hpz.gathers,
    }
    engine.close()
    return out


@pytest.mark.soak
@pytest.mark.parametrize("hpz", [3, 2])
def test_hpz_at_world_6(hpz):
    results = run_distributed(_world6, 6, hpz, timeout=900)
    assert_parity(results, reference(Recipe(steps=2, gas=2), 6))
    assert results[0]["groups"] == list(range(hpz))
    assert results[-1]["groups"] == list(range(6 - hpz, 6))
    assert all(r["served"] > 0 for r in results)


def _twisted(model: str, bf16: bool) -> list[dict]:
    """Plain ZeRO-3 then hpZ 2 on a model that stresses the unit order; bf16: compute-dtype secondary shards."""
    recipe = Recipe(model=model, steps=6 if model == "reverse" else 2, gas=2)
    out = []
    for hpz in (1, 2):
        model_ = make_model(recipe)
        config = _config(recipe, hpz)
        if bf16:
            config["bf16"] = {"enabled": True}
        engine = shardtrain.initialize(model_, config=config, optimizer=make_optimizer(model_, recipe))
        batches = global_micro_batches(recipe, engine.topology.dp)
        losses = [train_step(engine, recipe, batches, s, engine.topology.dp_rank) for s in range(recipe.steps)]
        served = engine._runtime.hpz.gathers if hpz > 1 else 0
        out.append({"losses": losses, "params": engine.full_state_dict(), "served": served})
        engine.close()
    return out


@pytest.mark.soak
@pytest.mark.parametrize(("model", "bf16"), [("twice", False), ("outside", False), ("reverse", False), ("gpt", True)])
def test_hpz_matches_plain_zero3_on_twisted_models_and_in_bf16(model, bf16):
    """A block run twice, a parameter used outside its unit, the blocks reversed from the third step on (the order
    departs from the recording: nothing is kept gathered after forward, every unit is released and re-gathered from
    its secondary shard), and bf16 (secondary shards in the compute dtype): bit for bit plain ZeRO-3."""
    results = run_distributed(_twisted, 4, model, bf16, timeout=900)
    for plain, hpz in results:
        assert plain["losses"] == hpz["losses"]
        assert hpz["served"] > 0
    plain, hpz = results[0]
    for k, v in plain["params"].items():
        assert torch.equal(hpz["params"][k], v), k
