"""Sharded construction (shardtrain.zero.Init) and loading full weights into a sharded model."""

import ctypes

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import shardtrain
from shardtrain.errors import ShardtrainError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed
from shardtrain.zero.guarded import ShardedParameter, guard_of

from helpers.parity import Recipe, assert_parity, engine_run, make_model, make_optimizer, reference_run

ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _vm_hwm() -> int:
    """Peak resident set of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_hwm() -> None:
    # glibc's dynamic mmap threshold keeps freed large blocks in the heap, so RSS would measure the
    # allocator's retention rather than what is allocated; a fixed threshold returns them to the OS.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _build_under_init(stage: int) -> dict:
    with shardtrain.zero.Init():
        model = make_model(Recipe())
    sharded = [p for p in model.parameters() if isinstance(p, ShardedParameter)]
    freed = all(guard_of(p).unit.buckets[0].flat_param.untyped_storage().nbytes() == 0 for p in sharded)
    held = sum(guard_of(p).unit.buckets[0].shard.numel() for p in sharded)
    config = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "stage": stage}}
    if stage != 3:
        del config["zero_optimization"]["stage3_param_persistence_threshold"]
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, Recipe()))
    return {"n_sharded": len(sharded), "freed": freed, "held": held, "state": engine.full_state_dict()}


@pytest.mark.parametrize(("world", "stage"), [(2, 3), (3, 3), (2, 1)])
def test_init_builds_sharded_with_normal_values(world, stage):
    want = make_model(Recipe()).state_dict()
    results = run_distributed(_build_under_init, world, stage)
    n = sum(p.numel() for p in make_model(Recipe()).parameters())
    for r in results:
        assert r["n_sharded"] == len(list(make_model(Recipe()).parameters()))
        assert r["freed"]  # no full parameter storage survives construction
        assert r["held"] <= n / world + r["n_sharded"] * world  # only this rank's chunks (+ padding)
    state = results[0]["state"]
    assert state.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(state[k], v), k  # bit-identical to building normally with the same seed


def test_model_built_under_init_trains_with_parity():
    recipe = Recipe(steps=4)
    results = run_distributed(_train_built_under_init, 3, recipe)
    assert_parity(results, reference_run(recipe, 3))


def _train_built_under_init(recipe: Recipe) -> dict:
    from helpers import parity

    original = parity.make_model

    def make_sharded(r):
        with shardtrain.zero.Init():
            return original(r)

    parity.make_model = make_sharded
    try:
        return engine_run(recipe, 3, dist.get_world_size(), 2000, {"stage3_param_persistence_threshold": 0})
    finally:
        parity.make_model = original


def _construction_peak(use_init: bool) -> int:
    cfg = GPTConfig(vocab_size=4096, seq_len=64, d_model=512, n_layer=8, n_head=8)
    if use_init:  # a first sharded construction's one-time costs (~10 MB here) are not the model's: pay them first
        with shardtrain.zero.Init():
            torch.nn.Linear(8, 8)
    _reset_hwm()
    before = _vm_hwm()
    torch.manual_seed(0)
    if use_init:
        with shardtrain.zero.Init():
            GPT(cfg)
    else:
        GPT(cfg)
    return _vm_hwm() - before


def test_init_peak_memory_is_a_fraction_of_the_model():
    model_bytes = (
        sum(
            p.numel()
            for p in GPT(GPTConfig(vocab_size=4096, seq_len=64, d_model=512, n_layer=8, n_head=8)).parameters()
        )
        * 4
    )
    normal = max(run_distributed(_construction_peak, 2, False))
    sharded = max(run_distributed(_construction_peak, 4, True))
    assert normal >= 0.9 * model_bytes  # the measurement sees a normal build
    # at world 4: a quarter of the model plus one block (~12.6 MB) plus one touched tensor (~8 MB)
    assert sharded <= 0.25 * model_bytes + 30 * 2**20, (sharded, model_bytes)


def _load(source_kind: str, path: str, stage: int) -> dict:
    torch.manual_seed(1)  # different from the weights we load
    model = make_model(Recipe(model="tied"))
    config = {"zero_optimization": {"stage": stage}}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine = shardtrain.initialize(
        model, config=config, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    )
    if source_kind == "rank0":
        state = torch.load(path) if dist.get_rank() == 0 else None
        engine.load_full_state_dict(state)
    else:
        engine.load_full_state_dict(path)
    return {"state": engine.full_state_dict()}


@pytest.mark.parametrize("source_kind", ["rank0", "safetensors"])
@pytest.mark.parametrize(("world", "stage"), [(3, 3), (2, 2)])
def test_load_full_weights(tmp_path, source_kind, world, stage):
    torch.manual_seed(0)
    want = make_model(Recipe(model="tied")).state_dict()
    if source_kind == "rank0":
        path = tmp_path / "w.pt"
        torch.save(want, path)
    else:  # Hugging Face style: the tied head stored once
        path = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in want.items() if k != "head.weight"}, str(path))
    state = run_distributed(_load, world, source_kind, str(path), stage)[0]["state"]
    for k, v in want.items():
        assert torch.equal(state[k], v), k


def _load_mismatch(path: str, which: str) -> str:
    model = make_model(Recipe())
    engine = shardtrain.initialize(model, config=ZERO3, optimizer=make_optimizer(model, Recipe()))
    try:
        if which == "rank0":
            engine.load_full_state_dict(torch.load(path) if dist.get_rank() == 0 else None)
        else:
            engine.load_full_state_dict(path)
    except ShardtrainError as err:
        return str(err)
    return "no error"


def test_load_mismatches_fail_on_every_rank(tmp_path):
    state = make_model(Recipe()).state_dict()
    state["head.weight"] = torch.zeros(3, 3)
    state["extra.bias"] = torch.zeros(2)
    del state["ln_f.bias"]
    torch.save(state, tmp_path / "bad.pt")
    for message in run_distributed(_load_mismatch, 2, str(tmp_path / "bad.pt"), "rank0"):
        assert "missing: ln_f.bias" in message and "unexpected: extra.bias" in message
    del state["extra.bias"]
    state["ln_f.bias"] = torch.zeros(32)
    save_file(state, str(tmp_path / "model.safetensors"))
    for message in run_distributed(_load_mismatch, 2, str(tmp_path), "file"):
        assert "'head.weight': shape (3, 3) in model.safetensors, (64, 32) in the model" in message
