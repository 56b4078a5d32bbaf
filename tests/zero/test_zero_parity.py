"""ZeRO stages 0, 1, 2 train exactly like one process on the same global batch."""

import functools

import pytest
import torch

from shardtrain.testing import run_distributed

from helpers.parity import OPTIMIZERS, Recipe, assert_parity, engine_run, reference_run


@functools.cache
def reference(recipe: Recipe, world: int) -> dict:
    return reference_run(recipe, world)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gpt_parity(stage, world):
    recipe = Recipe()
    assert_parity(run_distributed(engine_run, world, recipe, stage, world), reference(recipe, world))


@pytest.mark.parametrize("stage", [2])
def test_gpt_parity_world4(stage):
    recipe = Recipe()
    assert_parity(run_distributed(engine_run, 4, recipe, stage, 4), reference(recipe, 4))


@pytest.mark.parametrize(("stage", "world"), [(0, 2), (1, 3), (2, 2), (2, 3)])
def test_tied_and_frozen_parity(stage, world):
    recipe = Recipe(model="tied")
    results = run_distributed(engine_run, world, recipe, stage, world)
    ref = reference(recipe, world)
    assert_parity(results, ref)  # tok.weight and head.weight each against the tied reference's values
    params = results[0]["params"]
    # the tied weight trained (moved from its initial value), the frozen one did not move at all
    assert not torch.equal(params["tok.weight"], ref["init"]["tok.weight"])
    assert torch.equal(params["pos.weight"], ref["init"]["pos.weight"])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parity_without_overlap_and_with_large_buckets(stage):
    """Reductions after backward (overlap_comm false) and one bucket for everything give the same numbers."""
    recipe = Recipe(steps=4)
    ref = reference(recipe, 3)
    assert_parity(run_distributed(engine_run, 3, recipe, stage, 3, 2000, {"overlap_comm": False}), ref)
    assert_parity(run_distributed(engine_run, 3, recipe, stage, 3, 10**9), ref)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage3_gpt_parity(world):
    recipe = Recipe()
    results = run_distributed(engine_run, world, recipe, 3, world, 2000, {"stage3_param_persistence_threshold": 0})
    assert_parity(results, reference(recipe, world))


@pytest.mark.parametrize("world", [2, 3])
def test_stage3_tied_frozen_persistent_parity(world):
    """Tied embedding/head, a frozen parameter, and small parameters kept whole (persistence threshold)."""
    recipe = Recipe(model="tied")
    results = run_distributed(engine_run, world, recipe, 3, world, 2000, {"stage3_param_persistence_threshold": 100})
    assert_parity(results, reference(recipe, world))


def _each_optimizer(recipes: list[Recipe], stage: int, world: int) -> list[dict]:
    return [engine_run(r, stage, world) for r in recipes]


@pytest.mark.parametrize("world", [2, 3])
def test_elementwise_optimizers_parity(world):
    """Every optimizer accepted at stages 1-3 gives one process's numbers at stage 2 (momentum, nesterov,
    amsgrad, centered, decoupled weight decay where the optimizer has them)."""
    recipes = [Recipe(optimizer=name, steps=3) for name in OPTIMIZERS]
    per_rank = run_distributed(_each_optimizer, world, recipes, 2, world)
    failures = []
    for i, recipe in enumerate(recipes):
        try:
            assert_parity([r[i] for r in per_rank], reference_run(recipe, world))
        except AssertionError as err:
            failures.append(f"{recipe.optimizer}: {err}")
    assert not failures, "\n".join(failures)
