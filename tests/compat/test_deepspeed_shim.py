"""``import shardtrain.deepspeed as deepspeed`` runs a DeepSpeed script unchanged.

The same script (tests/helpers/ds_script.py, written against DeepSpeed's API only) runs with real DeepSpeed (its CPU
accelerator, gloo, ``torch_adam: true``) and with the shim, at each ZeRO stage: every micro-step's loss and learning
rates, the counters, a run resumed from a checkpoint and the gathered parameters must agree. Stages 1 and 3 at world 2
run by default (DeepSpeed, then the shim, in one pair of processes); stages 0 and 2, and world 3, under ``-m soak``.
The rest checks what the shim refuses, by name, without DeepSpeed.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardtrain.testing import run_distributed

from helpers import ds_script

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the ranks: DeepSpeed's CPU accelerator, no GPU probing

# fp32 on both sides, the same torch optimizer: what differs is the order of a few floating-point sums (gradient
# reduction, the clipping norm)
LOSS = {"rtol": 1e-5, "atol": 1e-6}


def _compare_run(ours: dict, theirs: dict, what: str) -> None:
    torch.testing.assert_close(ours["loss"], theirs["loss"], **LOSS, msg=lambda m: f"{what} losses: {m}")
    for key in ("lr", "lr_after"):  # every micro-step, every param group
        torch.testing.assert_close(
            torch.tensor(ours[key], dtype=torch.float64), torch.tensor(theirs[key], dtype=torch.float64),
            rtol=1e-12, atol=0, msg=lambda m: f"{what} learning rates: {m}",
        )  # fmt: skip
    for key in ("boundary", "global_steps", "global_samples"):
        assert ours[key] == theirs[key], f"{what} {key}"
    for step, (mine, ds) in enumerate(zip(ours["grad_norm"], theirs["grad_norm"], strict=True)):
        if ds is not None:  # DeepSpeed's stage 0 in fp32 does not record the norm
            assert mine == pytest.approx(ds, rel=1e-5), f"{what} gradient norm at micro-step {step}"
    assert ours["params"].keys() == theirs["params"].keys()
    for name, value in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], value, **LOSS, msg=lambda m, n=name: f"{what} {n}: {m}")


def _script_both_ways(tmp_path, stages: list[int], world: int = 2) -> None:
    # real DeepSpeed first, then the shim, in the same two processes (DeepSpeed's process group is reused)
    both = run_distributed(
        ds_script.run_in_test_worker, world, ["deepspeed", "shardtrain.deepspeed"], stages, str(tmp_path),
        init_process_group=False, timeout=400,
    )  # fmt: skip
    theirs, ours = [r["deepspeed"] for r in both], [r["shardtrain.deepspeed"] for r in both]
    for rank in range(world):
        for stage in stages:
            mine, ds = ours[rank][stage], theirs[rank][stage]
            where = f"rank {rank} stage {stage}"
            _compare_run(mine["first"], ds["first"], f"{where}, first run:")
            _compare_run(mine["resumed"], ds["resumed"], f"{where}, resumed run:")
            for key in ("sizes", "optimizer_lrs", "scheduler_lrs"):
                assert mine["first"][key] == pytest.approx(ds["first"][key], rel=1e-12), f"{where} {key}"
            assert mine["first"]["sizes"] == (4 * world, 2, 2)
            # a resumed run continues the first exactly (DeepSpeed's own continuation, compared above, does too)
            n = ds_script.SAVE_AFTER
            torch.testing.assert_close(mine["resumed"]["loss"], mine["first"]["loss"][n:], rtol=0, atol=0)
            assert mine["resumed"]["lr"] == mine["first"]["lr"][n:]
            assert mine["resumed"]["client_state"] == {"seen": n}
            assert ds["resumed"]["client_state"]["seen"] == n  # DeepSpeed adds its own keys to the client state
            assert mine["resumed"]["path"] == ds["resumed"]["path"] == "ckpt/global_step4"
            assert mine["resumed"]["missing"] == ds["resumed"]["missing"] == (None, None)
            for name, value in mine["first"]["params"].items():  # gathered: every rank holds the same tensors
                torch.testing.assert_close(value, ours[0][stage]["first"]["params"][name], rtol=0, atol=0)
    if 3 in stages and 1 in stages:
        # the change made inside GatheredParameters(modifier_rank=1) took effect at stage 3 only (at stages 0-2
        # DeepSpeed gathers nothing and initialize broadcasts rank 0's model): the test can tell it happened
        assert theirs[0][3]["first"]["loss"][0] != pytest.approx(theirs[0][1]["first"]["loss"][0], rel=1e-3)


def test_deepspeed_script_unchanged_stages_1_and_3(tmp_path):
    _script_both_ways(tmp_path, [1, 3])


@pytest.mark.soak
def test_deepspeed_script_unchanged_stages_0_and_2(tmp_path):
    _script_both_ways(tmp_path, [0, 2])


@pytest.mark.soak
def test_deepspeed_script_unchanged_world_3(tmp_path):
    _script_both_ways(tmp_path, [1, 3], world=3)


# -- the shim alone: refusals by name, checkpoint options, GatheredParameters after initialize ------------------------


def _raises(fn, *names: str) -> str:
    import shardtrain.deepspeed as deepspeed

    try:
        fn()
    except deepspeed.NotProvidedError as err:
        message = str(err)
        assert all(n in message for n in names), message
        assert "docs/migration-deepspeed.md" in message
        return message
    raise AssertionError(f"no NotProvidedError naming {names}")


def _shim_api(workdir: str) -> dict:
    import shardtrain.deepspeed as deepspeed

    rank = dist.get_rank()
    out = {}
    # the module: names of DeepSpeed's API that are not provided
    _raises(lambda: deepspeed.comm.reduce_scatter_coalesced, "deepspeed.comm.reduce_scatter_coalesced", "torch.dist")
    _raises(lambda: deepspeed.zero.TiledLinear, "deepspeed.zero.TiledLinear")
    out["hasattr"] = hasattr(deepspeed, "moe"), hasattr(deepspeed, "initialize")
    _raises(lambda: deepspeed.zero.Init(remote_device="nvme"), "deepspeed.zero.Init(remote_device=...)")
    _raises(lambda: deepspeed.zero.GatheredParameters([], fwd_module=nn.Linear(1, 1)), "fwd_module")

    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", "x.json"])
    config = ds_script.config_for(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"both in args\.deepspeed_config and as config"):
        deepspeed.initialize(args=args, model=model, config=config)
    with pytest.raises(ValueError, match="no config"):
        deepspeed.initialize(model=model)
    _raises(lambda: deepspeed.initialize(model=model, config=config, mpu=object()), "initialize(mpu=...)")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config_params=config
    )
    assert loader is None and optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and engine.zero_optimization_stage() == 3
    _raises(lambda: engine.save_fp16_model, "DeepSpeedEngine.save_fp16_model", "save_16bit_model()")
    _raises(lambda: engine.no_such_method, "DeepSpeedEngine.no_such_method", "engine.shardtrain_engine")
    _raises(lambda: engine.backward(torch.ones(()), retain_graph=True), "retain_graph=True")
    _raises(lambda: engine.step(lr_kwargs={"x": 1}), "lr_kwargs")
    _raises(lambda: engine.save_checkpoint(workdir, save_latest=False), "save_latest=False")
    _raises(lambda: engine.load_checkpoint(workdir, load_module_strict=False), "load_module_strict=False")
    out["local_rank"], out["device"] = engine.local_rank, str(engine.device)

    # GatheredParameters after initialize: the value rank 1 writes reaches every rank's shard and the optimizer's
    # masters (a step with lr 0 at the first step of WarmupCosineLR leaves it as written)
    weight = engine.module[0].weight
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                weight.fill_(0.25)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # one optimizer step (gradient_accumulation_steps 2)
        engine.backward(engine(x).square().mean())
        engine.step()
        out.setdefault("applied", []).append(engine.was_step_applied())
    with deepspeed.zero.GatheredParameters(weight):
        out["weight"] = weight.detach().clone()

    # checkpoint options: module only / without the scheduler keep the counters and the scheduler as they are
    engine.save_checkpoint(workdir, tag="t1", client_state={"k": 1})
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    lr_now, steps_now = engine.get_lr(), engine.global_steps
    path, client = engine.load_checkpoint(workdir, load_module_only=True)
    out["module_only"] = (os.path.basename(path), client, engine.global_steps == steps_now, engine.get_lr() == lr_now)
    path, client = engine.load_checkpoint(workdir, tag="t1", load_lr_scheduler_states=False)
    out["no_scheduler"] = (client, engine.global_steps, engine.get_lr() == lr_now)
    path, client = engine.load_checkpoint(workdir, tag="t1")
    out["full"] = (engine.global_steps, engine.lr_scheduler.last_epoch)
    engine.zero_grad()

    # GatheredParameters on several parameters still under zero.Init construction, modified at rank 1
    with deepspeed.zero.Init():
        built = nn.Linear(3, 5)
    with deepspeed.zero.GatheredParameters([built.weight, built.bias], modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                built.weight.fill_(2.0)
                built.bias.fill_(-1.0)
    with deepspeed.zero.GatheredParameters(list(built.parameters())):
        out["built"] = (built.weight.detach().clone(), built.bias.detach().clone())

    # the data loader: this rank's share of the dataset in micro-batches; dataloader_drop_last drops the short one
    _, _, loader, _ = deepspeed.initialize(
        model=nn.Linear(6, 3), config={**ds_script.config_for(0), "dataloader_drop_last": True},
        training_data=ds_script.Points(10),
    )  # fmt: skip
    out["batches"] = [tuple(x.shape) for x, _ in loader]
    return out


def test_shim_refusals_options_and_gathered_after_initialize(tmp_path):
    results = run_distributed(_shim_api, 2, str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        assert out["hasattr"] == (False, True)  # NotProvidedError is an AttributeError: hasattr() probes still work
        assert out["local_rank"] == rank and out["device"] == "cpu"
        assert out["applied"] == [False, True]
        # rank 1's value reached rank 0's shard and the masters: the step at lr 0 left it (weight decay x lr = 0)
        torch.testing.assert_close(out["weight"], torch.full((8, 4), 0.25), rtol=0, atol=0)
        assert out["module_only"] == ("t1", {"k": 1}, True, True)
        assert out["no_scheduler"] == ({"k": 1}, 1, True)
        assert out["full"] == (1, 1)
        torch.testing.assert_close(out["built"][0], torch.full((5, 3), 2.0), rtol=0, atol=0)
        torch.testing.assert_close(out["built"][1], torch.full((5,), -1.0), rtol=0, atol=0)
        assert out["batches"] == [(2, 6), (2, 6)]  # 5 samples per rank: the fifth is dropped
