"""bf16's overflow skip (DeepSpeed's ``bf16.check_grad_overflow``, on by default): a step whose gradients hold inf or
NaN on any rank is skipped everywhere, parameters, fp32 masters and optimizer state bitwise untouched, and training
goes on; ``false`` applies it at stages 1-2 as DeepSpeed's ZeRO optimizer does (and the weights become NaN)."""

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer

PLANT_STEP = 2
RECIPE = Recipe(steps=5, gas=1, micro=2)


def _bf16_nan(stage: int, check: bool | None, fused: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(RECIPE)
    bf16 = {"enabled": True} if check is None else {"enabled": True, "check_grad_overflow": check}
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": bf16, "zero_optimization": zero}
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE.lr, fused=True) if fused else None
    engine = shardtrain.initialize(model, config=config, optimizer=optimizer or make_optimizer(model, RECIPE))
    plant = {"on": False}

    def poison(grad):  # a NaN in one element of the last rank's gradient
        if plant["on"] and rank == world - 1:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad

    model.blocks[0].mlp[0].weight.register_hook(poison)
    batches = global_micro_batches(RECIPE, world)
    out = {"skipped": [], "losses": []}

    def snapshot() -> dict:
        masters = [t.clone() for g in engine.optimizer.param_groups for t in g["params"]]
        moments = [v.clone() for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"params": engine.full_state_dict(), "masters": masters, "moments": moments}

    for step in range(RECIPE.steps):
        x, y = batches[step]
        x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
        plant["on"] = step == PLANT_STEP
        if step == PLANT_STEP:
            out["before"] = snapshot()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if step == PLANT_STEP:
            out["after"] = snapshot()
        out["skipped"].append(engine.skipped_steps)
        out["losses"].append(loss.float().item())
    out["final"] = engine.full_state_dict()
    return out


@pytest.mark.parametrize(
    ("stage", "world", "fused"), [(0, 2, False), (1, 3, False), (2, 2, True), (3, 3, False), (3, 2, True)]
)
def test_bf16_nan_step_is_skipped_by_default(stage, world, fused):
    results = run_distributed(_bf16_nan, world, stage, None, fused)
    for r in results:
        assert r["skipped"] == [0, 0, 1, 1, 1]  # the poisoned step, and only it, on every rank
        assert all(torch.isfinite(torch.tensor(r["losses"])))  # training went on
        for key in ("masters", "moments"):
            for a, b in zip(r["before"][key], r["after"][key]):
                assert torch.equal(a, b), key  # bitwise untouched by the skipped step
    before, after = results[0]["before"]["params"], results[0]["after"]["params"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v.float()).all() for v in results[0]["final"].values())


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_check_grad_overflow_false_applies_the_step_as_deepspeed_does(stage):
    r = run_distributed(_bf16_nan, 2, stage, False, False)[0]
    assert r["skipped"] == [0] * RECIPE.steps
    assert not all(torch.isfinite(v.float()).all() for v in r["final"].values())  # the NaN reached the weights


def test_bf16_check_grad_overflow_false_is_ignored_at_stage_3_as_in_deepspeed():
    r = run_distributed(_bf16_nan, 2, 3, False, False)[0]
    assert r["skipped"] == [0, 0, 1, 1, 1]
