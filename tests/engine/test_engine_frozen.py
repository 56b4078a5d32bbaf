"""Freezing parameters around ``initialize``.

A parameter frozen when ``initialize`` ran and unfrozen later is refused at the next step, naming it: the gradient
buckets and the optimizer state were built without it, so it would never be reduced nor stepped (before, it trained
silently as if still frozen). Freezing after ``initialize`` and unfreezing again is supported, between steps
(here and tests/engine/test_runtime_modes.py) and between the micro-steps of one step, as one process does it ([Note:
parameters frozen after initialize] in zero/optimizer.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardtrain
from shardtrain.errors import OptimizerError
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, assert_params_near, engine_run, reference_run


def _unfreeze_after_initialize(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine = shardtrain.initialize(model, config, optimizer)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        engine.backward(engine(x).square().mean())
        engine.step()  # frozen as at initialize: fine
        model[0].weight.requires_grad_(True)
        engine.backward(engine(x).square().mean())
        try:
            engine.step()
        except OptimizerError as err:
            out["error"] = str(err)
        out["steps"] = engine.global_step
    finally:
        engine.close()
    return out


def test_a_parameter_unfrozen_after_initialize_is_refused_at_the_step():
    for stage in (0, 3):
        for r in run_distributed(_unfreeze_after_initialize, 2, stage):
            assert r["steps"] == 1, (stage, r)
            assert "0.weight: frozen (requires_grad=False) when initialize built" in r.get("error", ""), (stage, r)
            assert "Make it trainable before initialize" in r["error"]


def _freeze_mid_run(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine = shardtrain.initialize(model, config, optimizer)
    g = torch.Generator().manual_seed(1)
    values = []
    try:
        for step in range(4):
            model[0].weight.requires_grad_(step not in (1, 2))  # trains at step 0, frozen at 1-2, trains at 3
            engine.backward(engine(torch.randn(2, 8, generator=g)).square().mean())
            engine.step()
            values.append(model[0].weight.detach().clone())
    finally:
        engine.close()
    return {"values": values}


def test_a_parameter_frozen_mid_run_is_not_stepped_at_any_stage():
    """AdamW with weight decay would move a frozen parameter by its moments and decay it when stepped with the zero
    gradient its bucket holds; torch.optim skips a parameter without a gradient, and so must every stage (stage 0 in
    fp32, where the parameters hold their gradients, stepped it)."""
    for stage in (0, 1, 3):
        for r in run_distributed(_freeze_mid_run, 2, stage):
            v = r["values"]
            assert torch.equal(v[1], v[0]) and torch.equal(v[2], v[0]), f"stage {stage}: frozen but moved"
            assert not torch.equal(v[3], v[2]), f"stage {stage}: unfrozen but not trained"


# frozen in the middle of a step: one decayed matrix inside a block (a ZeRO-3 unit) and one root vector without decay
MID_FROZEN = ("blocks.0.attn.qkv.weight", "ln_f.bias")
MID_RECIPE = Recipe(steps=4, gas=2)


def _freeze_within_steps(model: nn.Module, step: int, micro: int) -> None:
    """Step 0 trains; step 1 freezes before its second micro-step; step 2 is frozen throughout; step 3 unfreezes
    before its second micro-step."""
    frozen = (step, micro) in ((1, 1), (3, 0)) or step == 2
    params = dict(model.named_parameters())
    for name in MID_FROZEN:
        params[name].requires_grad_(not frozen)


def _frozen_within_steps_runs(world: int, modes: dict[str, tuple[int, dict]]) -> dict:
    """An engine run for each ``name: (stage, extra config)`` of ``modes``, in the same processes (one start of the
    ranks); every unit parameter sharded at stage 3."""
    return {
        name: engine_run(
            MID_RECIPE,
            stage,
            world,
            zero_extra={"stage3_param_persistence_threshold": 0, **extra.get("zero_optimization", {})},
            extra={k: v for k, v in extra.items() if k != "zero_optimization"},
            before_micro=_freeze_within_steps,
        )
        for name, (stage, extra) in modes.items()
    }


def _check_frozen_within_steps(modes: dict[str, tuple[int, dict]]) -> dict:
    ref = reference_run(MID_RECIPE, 2, before_micro=_freeze_within_steps)
    runs = run_distributed(_frozen_within_steps_runs, 2, 2, modes, timeout=600)[0]
    for name, run in runs.items():
        assert run["global_step"] == MID_RECIPE.steps, name
        assert_params_near(run["params"], ref["params"], ref["init"], exact=ref["exact"], what=f"{name}: ")
    return {"ref": ref, "runs": runs}


def test_a_parameter_frozen_within_a_step_gets_the_gradients_accumulated_before(tmp_path):
    """One process steps a parameter frozen between two micro-steps with the gradient of the first (its ``.grad``
    is set), and steps it no more while it stays frozen; unfrozen between two micro-steps, it steps with the
    gradient of the second. Every stage must match it (before, the step dropped the first micro-step's gradient of
    a parameter frozen at the second: 0.43 and 0.61 of the distance moved, here, at every stage), and so must the
    step with the gradients in swap files (stages 2 and 3 with ``offload_optimizer: nvme``), which stepped a frozen
    parameter as AdamW steps a zero gradient (0.23 and 0.28 of the distance moved)."""
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    modes = {f"stage {stage}": (stage, {}) for stage in (0, 1, 2, 3)}
    modes.update({f"stage {stage} nvme": (stage, nvme) for stage in (2, 3)})
    ref = _check_frozen_within_steps(modes)["ref"]
    # the schedule matters: the same run with the first micro-step of step 1 frozen too ends far from it
    dropped = reference_run(
        MID_RECIPE, 2, before_micro=lambda m, step, micro: _freeze_within_steps(m, step, 1 if step == 1 else micro)
    )
    for name in MID_FROZEN:
        moved = (ref["params"][name] - ref["init"][name]).norm()
        assert (dropped["params"][name] - ref["params"][name]).norm() > 0.1 * moved, name


@pytest.mark.soak
def test_a_parameter_frozen_within_a_step_in_graph_mode_zero3():
    """The same in graph-mode ZeRO-3 (a new graph for each trainable set), and bitwise-close to eager ZeRO-3 (the
    default run checks graph mode against eager in tests/engine/test_runtime_modes.py's battery)."""
    graph = {"graph": {"enabled": True, "strict": True}}
    runs = _check_frozen_within_steps({"eager": (3, {}), "graph": (3, graph)})["runs"]
    for k, v in runs["eager"]["params"].items():
        torch.testing.assert_close(runs["graph"]["params"][k], v, rtol=1e-6, atol=1e-7, msg=k)
