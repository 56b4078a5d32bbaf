"""The parts of DeepSpeed's API that training scripts and integrations call besides the training loop, with
DeepSpeed's meaning (read from DeepSpeed 0.19.8's source): ``deepspeed.comm``, ``get_accelerator()``,
``__version__``, the engine's config queries, ``save_16bit_model`` and ``close``/``destroy``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version
from safetensors.torch import load_file
from torch import nn

from shardtrain.testing import run_distributed


def _comm_and_accelerator() -> dict:
    import shardtrain.deepspeed as deepspeed
    from shardtrain.deepspeed.accelerator import get_accelerator

    comm = deepspeed.comm
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"ids": (comm.is_initialized(), comm.get_rank(), comm.get_world_size(), comm.get_local_rank())}
    t = torch.full((2,), float(rank + 1))
    comm.all_reduce(t, prof=True, log_name="sum", debug="x")  # DeepSpeed's profiling arguments: accepted
    out["all_reduce"] = t.tolist()
    b = torch.full((1,), float(rank))
    comm.broadcast(b, src=world - 1)
    out["broadcast"] = b.item()
    parts = [torch.empty(1) for _ in range(world)]
    comm.all_gather(parts, torch.full((1,), float(rank) * 10))
    out["all_gather"] = [p.item() for p in parts]
    flat = torch.empty(world)
    comm.all_gather_into_tensor(flat, torch.full((1,), float(rank)))
    out["into_tensor"] = flat.tolist()
    mine = torch.empty(1)
    comm.reduce_scatter_tensor(mine, torch.arange(float(world)) + rank, op=comm.ReduceOp.SUM)
    out["reduce_scatter"] = mine.item()
    comm.barrier(prof=False)
    with pytest.raises(deepspeed.NotProvidedError, match=r"deepspeed\.comm\.inference_all_reduce"):
        _ = comm.inference_all_reduce
    acc = get_accelerator()
    out["accelerator"] = (
        acc.device_name(),
        acc.device_name(0),
        acc.current_device_name(),
        acc.communication_backend_name(),
        acc.device_count(),
        acc.is_available(),
        acc is get_accelerator(),
    )
    with pytest.raises(deepspeed.NotProvidedError, match=r"get_accelerator\(\)\.create_op_builder"):
        _ = acc.create_op_builder
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_deepspeed_comm_is_torch_distributed_with_deepspeeds_signatures(world):
    results = run_distributed(_comm_and_accelerator, world)
    total = sum(range(1, world + 1))
    for rank, r in enumerate(results):
        assert r["ids"] == (True, rank, world, rank)
        assert r["all_reduce"] == [total, total] and r["broadcast"] == world - 1
        assert r["all_gather"] == [10.0 * k for k in range(world)]
        assert r["into_tensor"] == list(map(float, range(world)))
        assert r["reduce_scatter"] == rank * world + sum(range(world))  # sum over ranks r' of (rank + r')
        # the suite trains on the CPU (SHARDTRAIN_DEVICE=cpu): DeepSpeed's CPU accelerator answers the same
        assert r["accelerator"] == ("cpu", "cpu", "cpu", "gloo", 1, True, True)


def _engine_queries(workdir: str) -> dict:
    import shardtrain.deepspeed as deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        # at stage 3 save_16bit_model writes only with this key, as DeepSpeed (without: False, tested in
        # tests/config/test_config_keys.py)
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "fp16": {"enabled": False, "loss_scale": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**6,
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    out = {
        "queries": (
            engine.fp16_enabled(),
            engine.bfloat16_enabled(),
            engine.bf16_enabled(),
            engine.zero_optimization(),
        ),
        "loss_scale": engine.loss_scale(),
        "config_is_given": engine.config is config,
    }
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).square().mean())
    engine.step()
    full = engine.shardtrain_engine.full_state_dict()
    out["bin"] = engine.save_16bit_model(workdir)
    out["safetensors"] = engine.save_16bit_model(workdir, "model.safetensors", exclude_frozen_parameters=True)
    out["full"] = full
    engine.close()
    engine.destroy()  # a second close does nothing
    return out


def test_engine_queries_save_16bit_model_and_close(tmp_path):
    import shardtrain.deepspeed as deepspeed

    assert isinstance(deepspeed.__version__, str) and Version(deepspeed.__version__) >= Version("0.16")
    results = run_distributed(_engine_queries, 2, str(tmp_path))
    for r in results:
        assert r["queries"] == (False, False, False, True)
        assert r["loss_scale"] == 0.0 and r["config_is_given"] and r["bin"] and r["safetensors"]
    full = results[0]["full"]
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)  # torch.save's format, as DeepSpeed's
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in full)
    weights = load_file(tmp_path / "model.safetensors")
    assert set(weights) == set(full) - {"2.bias"}  # the frozen parameter left out
    assert all(torch.equal(weights[k], full[k]) for k in weights)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "pytorch_model.bin"]


def _declared_boundary_runs() -> dict:
    """DeepSpeed's documented pattern for a declared boundary (``set_gradient_accumulation_boundary`` before each
    backward, ``step()`` after the last only, as accelerate drives it), an accumulation cut short by a declared
    boundary, and the count-driven loop (``step()`` after every backward) on the same micro-batches."""
    import shardtrain.deepspeed as deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
    }
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(2, 4, generator=g) for _ in range(8)]

    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def weights(e) -> list[torch.Tensor]:  # rank 0's (collective)
        return list((e.shardtrain_engine.full_state_dict() or {}).values())

    counted, declared = engine(), engine()
    # 3 + 3 + 2 micro-batches: the last accumulation is cut short (accelerate at the end of its loader)
    for i, x in enumerate(batches):
        end = i in (2, 5, 7)
        if i == 7:
            counted.shardtrain_engine.micro_steps += 1  # the count-driven loop skips to the boundary itself
        counted.backward(counted(x).square().mean())
        counted.step()
        declared.set_gradient_accumulation_boundary(end)
        declared.backward(declared(x).square().mean())
        if end:
            declared.step()
    out = {"steps": (counted.global_steps, declared.global_steps)}
    out["same"] = all(torch.equal(a, b) for a, b in zip(weights(counted), weights(declared), strict=True))
    out["micro_steps"] = (counted.micro_steps, declared.micro_steps)
    declared.set_gradient_accumulation_boundary(False)
    declared.backward(declared(batches[0]).square().mean())
    declared.backward(declared(batches[1]).square().mean())
    with pytest.raises(deepspeed.NotProvidedError, match=r"longer than gradient_accumulation_steps \(3\)"):
        declared.backward(declared(batches[2]).square().mean())  # still declared off a boundary: a 4th micro-batch
    counted.close(), declared.close()
    return out


def test_declared_accumulation_boundary_is_followed_as_deepspeed_follows_it():
    out = run_distributed(_declared_boundary_runs, 2)[0]
    assert out == {"steps": (3, 3), "same": True, "micro_steps": (9, 9)}
