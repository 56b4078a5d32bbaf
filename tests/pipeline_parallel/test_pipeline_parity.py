"""Pipeline parallelism against one process on the same global batch: each step's loss and global gradient norm, and
the final parameters (tolerances of [Note: parity bounds]), for shardtrain's GPT and a tiny Hugging Face Llama."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardtrain
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

from helpers.pipeline import CLIP, GAS, MICRO, STEPS, global_batches, make_model, make_optimizer


def model_loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y) if kind == "gpt" else model(input_ids=x, labels=y).loss


def reference(kind: str, dp: int) -> dict:
    batches = global_batches(kind, dp)

    def run(dtype: torch.dtype) -> dict:
        model = make_model(kind).to(dtype)
        return train_one_process(
            model, make_optimizer(model), lambda m, i: model_loss(kind, m, *batches[i]), STEPS, GAS, CLIP
        )

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


def pipeline_run(kind: str, pp: int, schedule: str, stages_per_rank: int, stage: int) -> dict:
    model = make_model(kind)
    world = torch.distributed.get_world_size()
    config = {
        "pipeline_parallel_size": pp,
        "pipeline": {"schedule": schedule, "stages_per_rank": stages_per_rank},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        # at stage 3 every parameter in a unit, none kept whole for being small
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine = shardtrain.initialize(model, config, optimizer=make_optimizer(model))
    t = engine.topology
    assert (t.pp, t.dp, t.pp_rank) == (pp, world // pp, torch.distributed.get_rank() // (world // pp))
    rows = slice(t.dp_rank * MICRO, (t.dp_rank + 1) * MICRO)
    batches = [(x[rows], y[rows]) for x, y in global_batches(kind, t.dp)]
    if kind == "llama":  # the dict form, as transformers' collators make it
        batches = [{"input_ids": x, "labels": y} for x, y in batches]
    losses, norms = [], []
    for step in range(STEPS):
        loss = engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))
        losses.append(float(loss))
        norms.append(engine.get_global_grad_norm())
    names = sorted(n for n, _ in engine.module.named_parameters())
    # ZeRO-3's all-gathers of unit parameters and reduce-scatters of gradient buckets over the training steps
    calls = {k: v["calls"] for k, v in engine.comm_stats().items()}
    units = {"units": len(engine._runtime.units), "gathers": sorted({u.gathers for u in engine._runtime.units})}
    units |= {"all_gather": calls.get("all_gather", 0), "reduce_scatter": calls.get("reduce_scatter", 0)}
    units["buckets"] = len(engine.layout.buckets)
    whole = [b.flat_param.untyped_storage().size() for u in engine._runtime.units for b in u.buckets]
    units["released"] = not any(whole)  # between steps only the shards are kept
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "names": names, "zero": units}
    engine.close()
    return out


def check(
    kind: str, pp: int, world: int, schedule: str = "1F1B", stages_per_rank: int = 1, stage: int = 0
) -> list[dict]:
    results = run_distributed(pipeline_run, world, kind, pp, schedule, stages_per_rank, stage)
    ref = reference(kind, world // pp)
    assert_parity(results, ref)
    # each stage rank holds only its own layers, under the whole model's names
    held = [set(r["names"]) for r in results[:: world // pp]]
    assert all(a.isdisjoint(b) for i, a in enumerate(held) for b in held[i + 1 :])
    assert set().union(*held) == set(ref["params"])
    return results


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_gpt_pp2(schedule):
    check("gpt", pp=2, world=2, schedule=schedule)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_gpt_pp3(schedule):
    check("gpt", pp=3, world=3, schedule=schedule)


def test_llama_pp2_1f1b():
    check("llama", pp=2, world=2)


@pytest.mark.soak
def test_llama_pp3_gpipe():
    check("llama", pp=3, world=3, schedule="GPipe")


def test_gpt_interleaved_two_stages_per_rank():
    check("gpt", pp=2, world=2, schedule="Interleaved1F1B", stages_per_rank=2)


def test_gpt_pp2_dp2_zero1():
    check("gpt", pp=2, world=4, stage=1)


@pytest.mark.soak
def test_llama_interleaved_two_stages_per_rank():
    check("llama", pp=2, world=2, schedule="Interleaved1F1B", stages_per_rank=2)


@pytest.mark.soak
@pytest.mark.parametrize("stage", [0, 1])
def test_llama_pp2_dp2(stage):
    check("llama", pp=2, world=4, stage=stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_pp2_dp2_zero23(stage):
    # the reduction is deferred to the step's last micro-batch: one reduce-scatter per bucket per step (GAS of 4
    # micro-batches would give four); at stage 3 each unit is gathered once per step, for the whole schedule, and
    # released after it ([Note: a stage gathered for its schedule])
    for r in check("gpt", pp=2, world=4, stage=stage):
        zero = r["zero"]
        assert zero["reduce_scatter"] == STEPS * zero["buckets"], zero
        if stage == 3:
            assert zero["units"] >= 1 and zero["gathers"] == [STEPS] and zero["released"], zero
            assert zero["all_gather"] == STEPS * zero["units"], zero
        else:
            assert zero["units"] == 0, zero


def test_gpt_pp3_zero3():
    check("gpt", pp=3, world=3, stage=3)


def test_gpt_interleaved_zero3():
    """Two stages per rank: both stage modules' units gathered for the schedule, once per step."""
    for r in check("gpt", pp=2, world=2, schedule="Interleaved1F1B", stages_per_rank=2, stage=3):
        assert r["zero"]["gathers"] == [STEPS] and r["zero"]["released"], r["zero"]


@pytest.mark.soak
def test_llama_pp2_dp2_zero3():
    check("llama", pp=2, world=4, stage=3)
