"""Engine checkpoints: exact resume, loading into another layout, consolidation, corruption."""

import warnings

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import shardtrain
from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed

from helpers.parity import VOCAB, Recipe, assert_params_near, make_model, make_optimizer

GLOBAL_ROWS, SEQ, STEPS = 12, 16, 10  # 12 rows split evenly over 1, 2, 3 or 4 ranks


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _engine(stage: int, dtype: str = "fp32", model_kind: str = "tied"):
    recipe = Recipe(model=model_kind)
    model = make_model(recipe)
    world = dist.get_world_size()
    zero = {"stage": stage, "reduce_bucket_size": 3000}
    if stage == 3:
        zero = {"stage": 3, "stage3_param_persistence_threshold": 100}
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // world,
        "gradient_clipping": 0.5,
        "zero_optimization": zero,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))


def _train(engine, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_ROWS // world
    losses = []
    for s in steps:
        x = _batches()[s][rank * rows : (rank + 1) * rows]
        loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(loss)
        engine.step()
        # the global mean loss, so that runs at different world sizes compare
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def _run(stage: int, dtype: str, save_dir: str | None, load_dir: str | None, steps: tuple[int, int]) -> dict:
    engine = _engine(stage, dtype)
    client = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if load_dir is not None:
            client = engine.load_checkpoint(load_dir)
    losses = _train(engine, range(*steps))
    if save_dir is not None:
        engine.save_checkpoint(save_dir, client_state={"next_step": steps[1], "note": "hello"})
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "client": client,
        "global_step": engine.global_step,
        "lr": engine.get_lr(),
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.parametrize(
    ("stage", "world", "dtype"), [(0, 2, "fp32"), (1, 3, "fp32"), (2, 2, "fp32"), (3, 3, "fp32"), (2, 2, "bf16")]
)
def test_exact_resume(tmp_path, stage, world, dtype):
    straight = run_distributed(_run, world, stage, dtype, None, None, (0, STEPS))[0]
    first = run_distributed(_run, world, stage, dtype, str(tmp_path), None, (0, 5))[0]
    second = run_distributed(_run, world, stage, dtype, None, str(tmp_path), (5, STEPS))[0]
    assert first["losses"] == straight["losses"][:5]
    assert second["losses"] == straight["losses"][5:]  # bitwise: new processes, loaded state
    assert second["client"] == {"next_step": 5, "note": "hello"}
    assert second["global_step"] == STEPS and second["lr"] == straight["lr"]
    for k, v in straight["state"].items():
        assert torch.equal(second["state"][k], v), k


LAYOUTS = [  # (saving world, stage) -> (loading world, stage)
    ((2, 0), (3, 3)),
    ((3, 3), (1, 0)),
    ((4, 1), (2, 2)),
    ((1, 2), (4, 3)),
    ((3, 2), (2, 1)),
]


@pytest.mark.parametrize(("saved", "loaded"), LAYOUTS)
def test_any_layout_load_continues_like_an_unchanged_run(tmp_path, saved, loaded):
    straight = run_distributed(_run, 2, 0, "fp32", None, None, (0, STEPS))[0]
    run_distributed(_run, saved[0], saved[1], "fp32", str(tmp_path), None, (0, 5))
    second = run_distributed(_run, loaded[0], loaded[1], "fp32", None, str(tmp_path), (5, STEPS))[0]
    rng_warned = any("RNG states are not restored" in w for w in second["warnings"])
    assert rng_warned == (saved[0] != loaded[0])
    for a, b in zip(second["losses"], straight["losses"][5:]):
        assert abs(a - b) <= 1e-5 * abs(b), (second["losses"], straight["losses"][5:])
    init = {k: v.clone() for k, v in make_model(Recipe(model="tied")).state_dict().items()}
    assert_params_near(second["state"], straight["state"], init)


def test_consolidated_engine_checkpoint_loads_into_the_plain_model(tmp_path):
    result = run_distributed(_run, 3, 3, "fp32", str(tmp_path / "ckpt"), None, (0, 3))[0]
    consolidate(open_checkpoint(tmp_path / "ckpt"), tmp_path / "hf", progress=False)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    model = make_model(Recipe(model="tied"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert missing == ["head.weight"] and unexpected == []  # the tied head is stored once, as HF does
    for k, v in model.state_dict().items():
        assert torch.equal(v, result["state"][k]), k


def _load_corrupted(path: str) -> str:
    engine = _engine(2)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as err:
        return str(err)
    return "no error"


def test_corrupted_checkpoint_fails_naming_file_and_tensor(tmp_path):
    run_distributed(_run, 2, 2, "fp32", str(tmp_path), None, (0, 2))
    victim = tmp_path / "global_step2" / "rank00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    for message in run_distributed(_load_corrupted, 2, str(tmp_path)):
        assert victim.name in message and "checksum" in message
