"""Pipeline parallelism composed with what each stage's ranks run: optimizer offload to host memory and hybrid sharding
(``mics_shard_size``) over a stage's data-parallel ranks, graph mode per stage, ALST's tiled MLP. Parity with one
process training the same global batch (losses and global gradient norms every step, final parameters; [Note: parity
bounds]), on GPT with its head tied to the input embedding, so the norm across stages must count the tied weight once
([Note: the norm across stages])."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

from helpers.pipeline import CLIP, GAS, MICRO, STEPS, global_batches, make_model, make_optimizer


def _reference(dp: int) -> dict:
    batches = global_batches("gpt", dp)

    def run(dtype: torch.dtype) -> dict:
        model = make_model("gpt", tied=True).to(dtype)
        return train_one_process(model, make_optimizer(model), lambda m, i: m(*batches[i]), STEPS, GAS, CLIP)

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


def _pipeline_run(pp: int, zero: dict, extra: dict) -> dict:
    model = make_model("gpt", tied=True)
    config = {
        **extra,
        "pipeline_parallel_size": pp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage3_param_persistence_threshold": 0, **zero},
    }
    engine = shardtrain.initialize(model, config, optimizer=make_optimizer(model))
    t = engine.topology
    rows = slice(t.dp_rank * MICRO, (t.dp_rank + 1) * MICRO)
    batches = [(x[rows], y[rows]) for x, y in global_batches("gpt", t.dp)]
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    # where the optimizer's state lives, and the layout's groups: the feature ran, not a plain ZeRO run
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    offloaded = engine._optimizer.offload is not None
    layout = {"replicas": t.replicas, "shard": t.shard_size, "dp": t.dp, "offloaded": offloaded}
    layout["params"] = type(engine._param_offload).__name__  # where the units' shards wait (None: on the device)
    layout["state_devices"] = sorted({v.device.type for v in state})
    # graph mode per stage: each stage module's captures, and the calls served by a captured graph
    graphs = [p.captured.graph_stats() for p in engine._pipeline.parts if hasattr(p, "captured")]
    layout["graphs"] = [(g["captures"], g["reuses"], len(g["fallbacks"])) for g in graphs]
    # tiled_mlp_compute: this rank's MLPs run tiled
    layout["tiled"] = sum(getattr(m.forward, "__shardtrain_tiled__", False) for m in engine.module.modules())
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "layout": layout}
    if graphs:  # an evaluation through the stages' graphs (of the trained parameters)
        out["eval"] = float(engine.eval_batch(iter(batches[:GAS])))
        evaluated = [p.captured.graph_stats() for p in engine._pipeline.parts]
        layout["eval_fallbacks"] = sum(len(g["fallbacks"]) for g in evaluated)
        before = sum(g["captures"] + g["reuses"] for g in graphs)
        layout["eval_calls"] = sum(g["captures"] + g["reuses"] for g in evaluated) - before
    engine.close()
    return out


def _check(world: int, pp: int, zero: dict, extra: dict | None = None) -> list[dict]:
    results = run_distributed(_pipeline_run, world, pp, zero, extra or {})
    assert_parity(results, _reference(world // pp))
    return results


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.soak)])
def test_optimizer_offload_pp2(stage):
    for r in _check(2, 2, {"stage": stage, "offload_optimizer": {"device": "cpu"}}):
        assert r["layout"]["offloaded"] and r["layout"]["state_devices"] == ["cpu"], r["layout"]


def test_optimizer_offload_pp2_dp2_zero3():
    for r in _check(4, 2, {"stage": 3, "offload_optimizer": {"device": "cpu"}}):
        assert r["layout"]["offloaded"] and r["layout"]["dp"] == 2, r["layout"]


def test_optimizer_offload_to_nvme_pp2(tmp_path):
    """The gradients and optimizer state in swap files: the norm read from them still counts the tied weight once."""
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    for r in _check(2, 2, {"stage": 2, "offload_optimizer": offload}):
        assert r["layout"]["offloaded"], r["layout"]


def test_parameter_offload_to_nvme_pp2_dp2_zero3(tmp_path):
    """The units' shards in swap files, read before the schedule's one gather of the stage."""
    for r in _check(4, 2, {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}):
        assert r["layout"]["dp"] == 2 and r["layout"]["params"] != "NoneType", r["layout"]


def test_hybrid_sharding_pp2_two_replicas_zero3():
    """Each stage's two data-parallel ranks are two replicas of a shard of one (``mics_shard_size`` 1)."""
    for r in _check(4, 2, {"stage": 3, "mics_shard_size": 1}):
        assert (r["layout"]["replicas"], r["layout"]["shard"]) == (2, 1), r["layout"]


@pytest.mark.soak
@pytest.mark.parametrize("stage", [1, 2])
def test_hybrid_sharding_pp2_two_replicas_zero12(stage):
    for r in _check(4, 2, {"stage": stage, "mics_shard_size": 1}):
        assert (r["layout"]["replicas"], r["layout"]["shard"]) == (2, 1), r["layout"]


@pytest.mark.soak
def test_hybrid_sharding_pp2_two_replicas_of_shard_2_zero3():
    """World 8: each stage's four data-parallel ranks are two replicas of a shard of two."""
    for r in _check(8, 2, {"stage": 3, "mics_shard_size": 2}):
        assert (r["layout"]["replicas"], r["layout"]["shard"]) == (2, 2), r["layout"]


@pytest.mark.parametrize("stage", [1, 3])
def test_graph_mode_per_stage_pp2(stage):
    """Each stage module captured once (one schema: the same micro-batch shape every step), every later
    micro-batch's forward served by its graph, nothing run eagerly ([Note: graph mode per pipeline stage]); then
    ``eval_batch`` through the stages' graphs against one process's evaluation of the trained parameters."""
    calls = STEPS * GAS
    results = _check(2, 2, {"stage": stage}, {"graph": {"enabled": True, "compiler": "aot_eager", "strict": True}})
    trained = make_model("gpt", tied=True)
    trained.load_state_dict(results[0]["params"])
    with torch.no_grad():  # one process's evaluation of the first step's micro-batches, by the trained parameters
        expected = sum(float(trained(x, y)) for x, y in global_batches("gpt", 1)[:GAS]) / GAS
    for r in results:
        ((captures, reuses, fallbacks),) = r["layout"]["graphs"]  # this rank's one stage
        assert captures == 1 and reuses >= calls - 1 and fallbacks == 0, r["layout"]
        assert abs(r["eval"] - expected) <= 1e-5 * expected, (r["eval"], expected)
        assert r["layout"]["eval_calls"] >= GAS and r["layout"]["eval_fallbacks"] == 0, r["layout"]


def test_tiled_mlp_pp2():
    """Each stage's MLPs (two blocks of four per rank) run as ALST's tiled MLP, recomputed tile by tile in the
    schedule's backward."""
    for r in _check(2, 2, {"stage": 1}, {"tiled_mlp_compute": True, "tiled_mlp_shards": 2}):
        assert r["layout"]["tiled"] == 2, r["layout"]
