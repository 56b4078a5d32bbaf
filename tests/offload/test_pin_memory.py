"""``offload_optimizer.pin_memory`` and ``offload_param.pin_memory`` decide whether the host buffers of a GPU run are
page-locked. A CPU-only torch cannot pin (page-locking needs the CUDA driver), so the choice is checked where it is
made: the plan resolved for a CUDA machine, the buffers asked for (``HostArena.pinned``), and a run whose plan is the
CUDA one and whose streams are the CPU fakes of ``test_host_copies``/``test_param_uploads`` (with ``pins`` true, as
CUDA's streams are)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardtrain
from shardtrain.config import load_config
from shardtrain.config.plan import resolve_plan
from shardtrain.offload import host_copies, param_uploads
from shardtrain.offload.host_copies import HostCopies
from shardtrain.offload.param_uploads import ParamUploads
from shardtrain.testing import run_distributed
from test_host_copies import DeferredStreams
from test_param_uploads import DeferredUploads

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer, train_step


class PinningStreams(DeferredStreams):
    pins = True  # as CudaStreams


class PinningUploads(DeferredUploads):
    pins = True  # as CudaUploads


def _zero(opt_pin: bool | None, param_pin: bool | None) -> dict:
    opt, param = {"device": "cpu"}, {"device": "cpu"}
    if opt_pin is not None:
        opt["pin_memory"] = opt_pin
    if param_pin is not None:
        param["pin_memory"] = param_pin
    return {"stage": 3, "offload_optimizer": opt, "offload_param": param}


@pytest.mark.parametrize(("opt_pin", "param_pin"), [(None, None), (False, True), (True, False), (False, False)])
def test_the_plan_for_a_gpu_follows_each_key_and_pins_by_default(opt_pin, param_pin):
    plan = resolve_plan(load_config({"zero_optimization": _zero(opt_pin, param_pin)}), 2, "cuda")
    assert plan.offload.optimizer.pin_memory == (opt_pin is not False)
    assert plan.offload.param.pin_memory == (param_pin is not False)
    cpu = resolve_plan(load_config({"zero_optimization": _zero(True, True)}), 2, "cpu")
    assert not cpu.offload.optimizer.pin_memory and not cpu.offload.param.pin_memory  # nothing to copy to


@pytest.mark.parametrize("pin", [True, False])
def test_host_copies_and_uploads_ask_for_page_locked_buffers_only_with_the_key(pin):
    copies = HostCopies(
        PinningStreams(), [(0, 0, 4)], [True], [torch.zeros(4)], [torch.zeros(4, dtype=torch.bfloat16)], [False],
        pin_memory=pin,
    )  # fmt: skip
    assert copies.pins == copies.grad_arena.pinned == copies.back_arena.pinned == pin
    unit = type("Unit", (), {"buckets": [type("Bucket", (), {"shard": torch.randn(8)})()]})()
    uploads = ParamUploads([unit], PinningUploads([]), None, pin_memory=pin)
    assert uploads.arena.pinned == pin
    assert ParamUploads([unit], DeferredUploads([]), None, pin_memory=True).arena.pinned is False  # no device


def run_with_gpu_plan(opt_pin: bool, param_pin: bool) -> dict:
    """Runs on every rank: stage 3 with both offloads, the plan of a CUDA machine with these pins, the streams faked;
    what each host buffer asked for, after two steps."""
    import torch.distributed as dist

    from shardtrain.engine import engine as engine_module

    resolve = engine_module.resolve_plan

    def gpu_pins(*args, **kwargs):
        plan = resolve(*args, **kwargs)
        offload = dataclasses.replace(
            plan.offload,
            optimizer=dataclasses.replace(plan.offload.optimizer, pin_memory=opt_pin),
            param=dataclasses.replace(plan.offload.param, pin_memory=param_pin),
        )
        return dataclasses.replace(plan, offload=offload)

    engine_module.resolve_plan = gpu_pins  # this worker process only
    param_uploads.upload_streams = lambda device: PinningUploads([])
    host_copies.copy_streams = lambda device: PinningStreams()
    recipe = Recipe(steps=2)
    model = make_model(recipe)
    zero = {**_zero(opt_pin, param_pin), "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}
    config = {"train_micro_batch_size_per_gpu": recipe.micro, "gradient_accumulation_steps": recipe.gas}
    engine = shardtrain.initialize(
        model, config={**config, "zero_optimization": zero}, optimizer=make_optimizer(model, recipe)
    )
    batches = global_micro_batches(recipe, 1)
    losses = [train_step(engine, recipe, batches, s, dist.get_rank()) for s in range(recipe.steps)]
    copies = engine._optimizer.offload.copies
    out = {
        "losses": losses,
        "copies": (copies.pins, copies.grad_arena.pinned, copies.back_arena.pinned),
        "uploads": engine._param_offload.arena.pinned,
    }
    engine.close()
    return out


@pytest.mark.parametrize(("opt_pin", "param_pin"), [(True, False), (False, True)])
def test_initialize_hands_each_key_to_the_buffers_it_governs(opt_pin, param_pin):
    out = run_distributed(run_with_gpu_plan, 1, opt_pin, param_pin)[0]
    assert out["copies"] == (opt_pin, opt_pin, opt_pin)
    assert out["uploads"] == param_pin
    assert all(torch.isfinite(torch.tensor(x)) for x in out["losses"])
