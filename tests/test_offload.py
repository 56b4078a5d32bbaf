"""Optimizer offload (``zero_optimization.offload_optimizer``): training with state in swap files (``nvme``) or in
host memory (``cpu``) gives bitwise the numbers of training without offload, at stages 1-3 and worlds 1-3, and
equals one process; the memory held for optimizer state is ``buffer_count`` sub-groups, not the whole state."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain.testing import run_distributed

from parity import Recipe, assert_parity, global_micro_batches, make_model, make_optimizer, reference_run


@functools.cache
def reference(recipe: Recipe, world: int) -> dict:
    return reference_run(recipe, world)


def train(recipe: Recipe, stage: int, world: int, zero_extra: dict | None = None, bucket: int = 2000) -> dict:
    """Runs on every rank: this rank's losses, the final full weights (rank 0), what offload held and where."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = make_model(recipe)
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
            **(zero_extra or {}),
        },
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    offload = engine._optimizer.offload
    batches = global_micro_batches(recipe, world)
    lo, hi = rank * recipe.micro, (rank + 1) * recipe.micro
    losses, norms, resident = [], [], []
    for step in range(recipe.steps):
        step_loss = 0.0
        for m in range(recipe.gas):
            x, y = batches[step * recipe.gas + m]
            loss = engine(x[lo:hi], y[lo:hi])
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / recipe.gas
        losses.append(step_loss)
        norms.append(engine.get_global_grad_norm())
        resident.append(engine.state_bytes()["optimizer"])
    out = {
        "losses": losses,
        "norms": norms,
        "params": engine.full_state_dict(),
        "resident": resident,
        "scratch": [str(s.path) for s in engine._scratch.values()],
    }
    if offload is not None:
        out["groups"] = len(offload.groups)
        out["peak"] = offload.peak_held_bytes
        out["saved_files"] = sum(len(keys) for keys in offload._saved.values())
    engine.close()
    out["scratch_left"] = [p for p in out["scratch"] if Path(p).exists()]
    return out


def _bitwise_equal(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        assert ra["norms"] == rb["norms"]
    pa, pb = a[0]["params"], b[0]["params"]
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.mark.parametrize(("stage", "world"), [(1, 1), (1, 3), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)])
def test_nvme_offload_is_bitwise_in_memory_training(stage, world, tmp_path):
    recipe = Recipe(steps=4)
    nvme = {
        "sub_group_size": 1500,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3},
    }
    plain = run_distributed(train, world, recipe, stage, world)
    offloaded = run_distributed(train, world, recipe, stage, world, nvme)
    _bitwise_equal(offloaded, plain)
    assert_parity(offloaded, reference(recipe, world))
    for r in offloaded:
        assert r["groups"] > 3  # several sub-groups were swapped in and out
        assert r["saved_files"] > 0
        # between steps no element-wise state is resident: Adam's step counts only (8 bytes per tensor)
        assert max(r["resident"]) < 0.05 * max(max(p["resident"]) for p in plain)
        assert r["scratch_left"] == []  # close() removed the swap directory
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
def test_nvme_offload_other_optimizers(optimizer, tmp_path):
    """SGD's momentum, Adam's amsgrad maximum, Adagrad's sum made at construction: each goes through the files."""
    recipe = Recipe(steps=3, optimizer=optimizer)
    nvme = {"sub_group_size": 3000, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    plain = run_distributed(train, 2, recipe, 2, 2)
    _bitwise_equal(run_distributed(train, 2, recipe, 2, 2, nvme), plain)


def test_cpu_offload_on_a_cpu_machine_is_in_memory_training(tmp_path):
    """device cpu on a CPU-only machine: state stays in host memory (where it is), stepped per sub-group."""
    recipe = Recipe(steps=3)
    cpu = {"sub_group_size": 1000, "offload_optimizer": {"device": "cpu"}}
    plain = run_distributed(train, 2, recipe, 3, 2)
    offloaded = run_distributed(train, 2, recipe, 3, 2, cpu)
    _bitwise_equal(offloaded, plain)
    assert offloaded[0]["resident"] == plain[0]["resident"]
    assert offloaded[0]["scratch"] == []


def test_ratio_offloads_the_first_sub_groups_only(tmp_path):
    recipe = Recipe(steps=3)
    half = {
        "sub_group_size": 1500,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5},
    }
    plain = run_distributed(train, 2, recipe, 2, 2)
    offloaded = run_distributed(train, 2, recipe, 2, 2, half)
    _bitwise_equal(offloaded, plain)
    for r, p in zip(offloaded, plain):
        kept = r["resident"][-1] / p["resident"][-1]
        assert 0.3 < kept < 0.7, kept  # about half the state stays resident
